"""The workspace route: the CUDA-IPC workspace's one-shot / two-shot fold kernels (detcomm.workspace).

The communicator arms the workspace once at startup when the group is on CUDA and a batch-invariant route
could use it; the route carries all-reduce and reduce-scatter SUM of floats for sites whose max_rows is within
the armed rows. The kernels compute the canonical fold bit for bit (the startup self-checks prove it on the
group before a site is routed here); the row count only picks one-shot, two-shot or chunking.

A virtual-shard all-reduce site (docs/spec.md §9.1) takes the workspace's virtual kernels (csrc/virtual_fold.cu):
each rank copies its V/W fp32 slabs into its slot and the fold runs over the V shards in global order. A shard-order
all_reduce_rmsnorm site (docs/spec.md §9.2 "Tree sites") binds its virtual all-reduce, and the communicator adds the
canonical norm (no fused kernel folds the shard order); a tree-order one binds the fused tree kernels
(``_bind_tree_norm``) where fusion is allowed, as a plain site binds the fused kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..envelope import Resolved
from ..errors import RouteRefused
from ..invariance import bits_equal
from ..numerics import norm
from ..route import fusion_refusal
from ..sites import BoundRoute, Collective, ReduceOp, Route, Site
from ..workspace import Workspace
from .base import Bound, Call, bind_from

# (x, residual, weight, eps) -> (y, r): the fused all-reduce + residual add + RMSNorm of one site.
Fused = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
_CHECK_EPS = 1e-6


@dataclass(frozen=True)
class FusedBound(Bound):
    """An all_reduce_residual_rmsnorm site bound to the workspace: ``fused`` serves its calls when set (the
    communicator calls it instead of the all-reduce + canonical norm); ``note`` tells the route table why not."""

    fused: Fused | None = None
    note: str = ""


def _proving(ws: Workspace, run: Fused, label: str) -> Call:
    """A self-check call of a fused variant: it runs the fused kernel and the composition (the workspace's
    all-reduce, then detcomm.numerics.norm.add_rms_norm) on the check's payload, with a residual and a weight made from it,
    raises if (y, r) differ in any bit, and returns s so that the checks also hold the fold to its reference.
    Every check call (repeats, offsets, batch sizes) thereby proves the fused bits."""

    def call(x: torch.Tensor, _a: object) -> torch.Tensor:
        hidden = x.shape[-1]
        residual = x.flip(-1).contiguous()  # a function of the row's content: the same row gives the same residual
        weight = (1 + torch.arange(hidden, device=x.device) % 7 / 8).to(x.dtype)
        y, r = run(x, residual, weight, _CHECK_EPS)
        s = ws.all_reduce(x, label=label)
        y_ref, r_ref = norm.add_rms_norm(s, residual, weight, eps=_CHECK_EPS)
        if not (bits_equal(y, y_ref) and bits_equal(r, r_ref)):
            # Caught by the self-check (selfcheck.run_check), which refuses the variant on every rank with this reason.
            raise RouteRefused(f"fused (y, r) differ from the composition's (y: {int((y != y_ref).sum())}, "
                               f"r: {int((r != r_ref).sum())} elements)")
        return s

    return call


def _proving_tree(ws: Workspace, run: Fused, label: str, dtype: torch.dtype) -> Call:
    """_proving for a tree site's fused variant: x is this rank's [V/W, rows, H] fp32 partials; the composition is
    Workspace.all_reduce_tree, then detcomm.numerics.norm.add_rms_norm; returns s for the fold's checks (the tree's
    reference, detcomm.selfcheck). The residual is -0.0 on the even elements, where the tree payload places its
    cancellations and its -0.0 sums (selfcheck._tree_placed): -0.0 + s == s for every s, zeros' signs included, so
    r there is the fused kernel's own s bit for bit, and a fused kernel that folds the shard order, pairs other
    shards or drops the root's +0.0 gives another r, whatever the residual beside it."""

    def call(x: torch.Tensor, _a: object) -> torch.Tensor:
        hidden = x.shape[-1]
        residual = x[0].flip(-1).to(dtype)  # this rank's own residual, a function of its partials
        residual[..., 0::2] = -0.0
        residual = residual.contiguous()
        weight = (1 + torch.arange(hidden, device=x.device) % 7 / 8).to(dtype)
        y, r = run(x, residual, weight, _CHECK_EPS)
        s = ws.all_reduce_tree(x, dtype=dtype, label=label)
        y_ref, r_ref = norm.add_rms_norm(s, residual, weight, eps=_CHECK_EPS)
        if not (bits_equal(y, y_ref) and bits_equal(r, r_ref)):
            raise RouteRefused(f"fused tree (y, r) differ from the composition's (y: {int((y != y_ref).sum())}, "
                               f"r: {int((r != r_ref).sum())} elements)")
        return s

    return call


class IpcFoldRoute:
    route = Route.IPC_FOLD

    def __init__(self, workspace: Workspace, *, resolved: Resolved) -> None:
        self.workspace = workspace
        self.resolved = resolved

    def bind(self, site: Site) -> BoundRoute:
        if site.virtual_shards is not None:
            return self._bind_virtual(site)
        label = site.name
        coll = Collective.ALL_REDUCE if site.collective is Collective.ALL_REDUCE_RMSNORM else site.collective
        ws = self.workspace
        reachable = ws.variants(coll.value, site.dtype, site.row_numel, site.max_rows)
        in_place = False
        all_reduce: Call = lambda x, a: self.all_reduce(x, site.op, out=a.out, label=label)  # noqa: E731
        if coll is Collective.ALL_REDUCE and reachable:
            # The hot path of decode: everything that depends only on the site is prepared here, once.
            assert site.op is ReduceOp.SUM, "routing sends only floating-point SUM here"
            fast = ws.bind_all_reduce(site.dtype, site.row_numel, label=label)
            all_reduce = lambda x, a: fast(x, a.out)  # noqa: E731
            in_place = True  # the site-bound kernels write in place (Workspace.bind_all_reduce says why)
        bound = bind_from(self.route, site, {
            Collective.ALL_REDUCE: all_reduce,
            Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, site.op, out=a.out, label=label),
            Collective.ALL_GATHER: lambda x, a: self.all_gather(x, out=a.out, label=label),
        })
        forced: dict[str, Call] = {}
        for v in reachable:
            if coll is Collective.ALL_REDUCE:
                kw: dict[str, object] = {"chunk_rows": 1} if v == "chunked" else {"algo": v}
                forced[v] = lambda x, a, kw=kw: ws.all_reduce(x, label=label, **kw)  # type: ignore[misc]
            elif coll is Collective.REDUCE_SCATTER:
                kw = {"chunk_rows": 1} if v == "chunked" else {}
                forced[v] = lambda x, a, kw=kw: ws.reduce_scatter(x, label=label, **kw)  # type: ignore[misc]
            else:
                kw = {"chunk_rows": 1} if v == "chunked" else {}
                forced[v] = lambda x, a, kw=kw: ws.all_gather(x, label=label, **kw)  # type: ignore[misc]
        if site.collective is Collective.ALL_REDUCE_RMSNORM:
            return self._bind_norm(site, bound, forced)
        return Bound(bound.route, bound.site, bound.call, forced, in_place=in_place)

    def _bind_virtual(self, site: Site) -> Bound:
        """A virtual-shard all-reduce site: calls pass this rank's [V/W, rows, *shape] fp32 partials. Every kernel
        variant the site's rows can reach (Workspace.virtual_variants) is exposed forced, so the self-checks prove
        each against the reference fold of the V shards."""
        assert site.virtual_shards is not None
        ws, label, dtype = self.workspace, site.name, site.dtype
        shards = site.virtual_shards // ws.world_size
        forced: dict[str, Call] = {}
        if site.shard_fold == "tree":
            assert site.collective in (Collective.ALL_REDUCE, Collective.ALL_REDUCE_RMSNORM), site.collective
            bound = self._bind_tree(site, shards)
            if site.collective is Collective.ALL_REDUCE_RMSNORM:
                return self._bind_tree_norm(site, bound)
            return bound
        # A shard-order all_reduce_rmsnorm site binds its all-reduce alone: no fused kernel folds the shard order
        # (admission.fused_layout_refusal, the route table's reason), so the communicator runs the composition.
        assert site.collective in (Collective.ALL_REDUCE, Collective.ALL_REDUCE_RMSNORM), site.collective
        for v in ws.virtual_variants(dtype, site.row_numel, site.max_rows, shards):
            kw: dict[str, object] = {"chunk_rows": 1} if v == "chunked" else {"algo": v}
            forced[v] = lambda x, a, kw=kw: ws.all_reduce_virtual(  # type: ignore[misc]
                x, dtype=dtype, label=label, **kw)
        return Bound(self.route, site, lambda x, a: ws.all_reduce_virtual(x, dtype=dtype, label=label), forced)

    def _bind_tree(self, site: Site, shards: int) -> Bound:
        """A tree-order virtual-shard all-reduce site (shard_fold="tree", csrc/tree_fold.cu): calls pass this rank's
        [V/W, rows, *shape] fp32 partials; the site's launches are prepared once (Workspace.bind_all_reduce_tree).
        Every kernel variant its rows can reach (Workspace.tree_variants) is exposed forced, so the self-checks prove
        each against the tree's reference."""
        ws, label, dtype = self.workspace, site.name, site.dtype
        forced: dict[str, Call] = {}
        for v in ws.tree_variants(dtype, site.row_numel, site.max_rows, shards):
            kw: dict[str, object] = {"chunk_rows": 1} if v == "chunked" else {"algo": v}
            forced[v] = lambda x, a, kw=kw: ws.all_reduce_tree(  # type: ignore[misc]
                x, dtype=dtype, label=label, **kw)
        fast = ws.bind_all_reduce_tree(dtype, site.row_numel, shards, label=label)
        return Bound(self.route, site, lambda x, a: fast(x, a.out), forced)

    def _bind_tree_norm(self, site: Site, bound: Bound) -> FusedBound:
        """An all_reduce_rmsnorm site whose all-reduce is the tree (docs/spec.md §9.2 "Tree sites"): calls pass this
        rank's [V/W, rows, H] fp32 partials. The fused tree kernels (Workspace.all_reduce_rmsnorm_tree) serve it
        where fusion is allowed (route.fusion_refusal, as for plain sites) and an fp32 row fits a fused launch; each
        of their variants joins the all-reduce's, proven against the composition (all_reduce_tree, then the
        canonical add + norm) by the self-checks."""
        ws, label = self.workspace, site.name
        forced = dict(bound.variants)
        if fusion_refusal(self.resolved, site, world_size=ws.world_size) is not None:
            return FusedBound(bound.route, bound.site, bound.call, forced)
        variants = ws.fused_norm_tree_variants(site.dtype, site.shape[0], site.max_rows)
        if not variants:
            return FusedBound(bound.route, bound.site, bound.call, forced,
                              note=" [not fused: an fp32 row does not fit one fused launch of the workspace; "
                                   "composition]")
        dtype = site.dtype
        for v in variants:
            kw: dict[str, object] = {"chunk_rows": 1} if v == "fused_chunked" else {"algo": v.removeprefix("fused_")}

            def run(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float,
                    kw: dict[str, object] = kw) -> tuple[torch.Tensor, torch.Tensor]:
                return ws.all_reduce_rmsnorm_tree(x, res, w, norm.eps_fp32(eps), label=label,
                                                  **kw)  # type: ignore[arg-type]

            forced[v] = _proving_tree(ws, run, label, dtype)

        def fused(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = res.shape[-1]
            y, r = ws.all_reduce_rmsnorm_tree(x.view(x.shape[0], -1, hidden), res.view(-1, hidden), w,
                                              norm.eps_fp32(eps), label=label)
            return y.view(res.shape), r.view(res.shape)

        return FusedBound(bound.route, bound.site, bound.call, forced, fused=fused)

    def _bind_norm(self, site: Site, bound: Bound, forced: dict[str, Call]) -> FusedBound:
        """The fused kernel serves the site when fusion is allowed (route.fusion_refusal at this group's W, the rule
        the route table states) and its rows fit a launch of this workspace; its variants join the all-reduce's,
        each proven against the composition by the self-checks."""
        ws, label = self.workspace, site.name
        if fusion_refusal(self.resolved, site, world_size=ws.world_size) is not None:
            return FusedBound(bound.route, bound.site, bound.call, forced)
        variants = ws.fused_norm_variants(site.dtype, site.shape[0], site.max_rows)
        if not variants:
            return FusedBound(bound.route, bound.site, bound.call, forced,
                              note=" [not fused: a row does not fit one fused launch of the workspace; composition]")
        for v in variants:
            kw: dict[str, object] = {"chunk_rows": 1} if v == "fused_chunked" else {"algo": v.removeprefix("fused_")}

            def run(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float,
                    kw: dict[str, object] = kw) -> tuple[torch.Tensor, torch.Tensor]:
                return ws.all_reduce_rmsnorm(x, res, w, norm.eps_fp32(eps), label=label, **kw)  # type: ignore[arg-type]

            forced[v] = _proving(ws, run, label)

        def fused(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = x.shape[-1]
            y, r = ws.all_reduce_rmsnorm(x.view(-1, hidden), res.view(-1, hidden), w, norm.eps_fp32(eps), label=label)
            return y.view(x.shape), r.view(x.shape)

        return FusedBound(bound.route, bound.site, bound.call, forced, fused=fused)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp, *, out: torch.Tensor | None = None,
                   label: str | None = None) -> torch.Tensor:
        assert op is ReduceOp.SUM, "routing sends only floating-point SUM here"
        return self.workspace.all_reduce(x, out=out, label=label)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, *, out: torch.Tensor | None = None,
                       label: str | None = None) -> torch.Tensor:
        assert op is ReduceOp.SUM, "routing sends only floating-point SUM here"
        return self.workspace.reduce_scatter(x, out=out, label=label)

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None, label: str | None = None) -> torch.Tensor:
        return self.workspace.all_gather(x, out=out, label=label)

    def close(self) -> None:
        self.workspace.close()
