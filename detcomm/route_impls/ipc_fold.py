"""The workspace route: the CUDA-IPC workspace's one-shot / two-shot fold kernels (detcomm.workspace).

The communicator arms the workspace once at startup when the group is on CUDA and a batch-invariant route
could use it; the route carries all-reduce and reduce-scatter SUM of floats for sites whose max_rows is within
the armed rows. The kernels compute the canonical fold bit for bit (the startup self-checks prove it on the
group before a site is routed here); the row count only picks one-shot, two-shot or chunking.

A site binds by its layout (detcomm/layout.py): a virtual-shard all-reduce site (docs/spec.md §9.1) takes the
workspace's kernels of its layout (csrc/virtual_fold.cu: each rank copies its V/W fp32 slabs into its slot and the
fold runs over the V shards in global order; csrc/tree_fold.cu: each rank publishes its subtree's root). An
all_reduce_rmsnorm site binds the fused kernels of its layout where fusion is allowed (``_FUSED``: plain and tree,
docs/spec.md §9.2 "Tree sites"); a shard-order one binds its virtual all-reduce, and the communicator adds the
canonical norm (no fused kernel folds the shard order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..envelope import Resolved
from ..errors import RouteRefused, WorkspaceUnavailable
from ..invariance import bits_equal
from ..layout import Kind
from ..numerics import norm
from ..route import fusion_refusal
from ..sites import BoundRoute, Collective, ReduceOp, Route, Site
from ..workspace import Workspace
from .base import Bound, Call, bind_from

# (x, residual, weight, eps) -> (y, r): the fused all-reduce + residual add + RMSNorm of one site.
Fused = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
_CHECK_EPS = 1e-6
_log = logging.getLogger("detcomm")


@dataclass(frozen=True)
class FusedBound(Bound):
    """An all_reduce_residual_rmsnorm site bound to the workspace: ``fused`` serves its calls when set (the
    communicator calls it instead of the all-reduce + canonical norm); ``note`` tells the route table why not."""

    fused: Fused | None = None
    note: str = ""


def _plain_residual(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.flip(-1).contiguous()  # a function of the row's content: the same row gives the same residual


def _tree_residual(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x is this rank's [V/W, rows, H] fp32 partials: its own residual, a function of them, -0.0 on the even
    elements, where the tree payload places its cancellations and its -0.0 sums (selfcheck._tree_placed): -0.0 + s
    == s for every s, zeros' signs included, so r there is the fused kernel's own s bit for bit, and a fused kernel
    that folds the shard order, pairs other shards or drops the root's +0.0 gives another r, whatever the residual
    beside it."""
    residual = x[0].flip(-1).to(dtype)
    residual[..., 0::2] = -0.0
    return residual.contiguous()


@dataclass(frozen=True)
class _FusedFamily:
    """The workspace's fused all-reduce + residual add + RMSNorm kernels of one layout (csrc/fused_rmsnorm.cu: the
    plain fold and the tree; none folds the shard order, admission.fused_layout_refusal): their variants, their
    call, the composition's all-reduce they are proven against, the check's residual, and the route table's words."""

    variants: Callable[[Workspace, torch.dtype, int, int], list[str]]
    run: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (ws, x, residual, weight, eps_fp32, label=, **variant)
    all_reduce: Callable[[Workspace, torch.Tensor, torch.dtype, str], torch.Tensor]
    residual: Callable[[torch.Tensor, torch.dtype], torch.Tensor]
    row: str  # what one fused launch must hold
    name: str


_FUSED = {
    Kind.PLAIN: _FusedFamily(lambda ws, *a: ws.fused_norm_variants(*a),
                             lambda ws, *a, **kw: ws.all_reduce_rmsnorm(*a, **kw),
                             lambda ws, x, dtype, label: ws.all_reduce(x, label=label), _plain_residual, "a row",
                             "fused"),
    Kind.TREE: _FusedFamily(lambda ws, *a: ws.fused_norm_tree_variants(*a),
                            lambda ws, *a, **kw: ws.all_reduce_rmsnorm_tree(*a, **kw),
                            lambda ws, x, dtype, label: ws.all_reduce_tree(x, dtype=dtype, label=label),
                            _tree_residual, "an fp32 row", "fused tree"),
}


def _proving(ws: Workspace, run: Fused, label: str, dtype: torch.dtype, kind: Kind) -> Call:
    """A self-check call of a fused variant of a ``kind`` layout: it runs the fused kernel and the composition (the
    workspace's all-reduce of the layout, then detcomm.numerics.norm.add_rms_norm) on the check's payload, with a
    residual and a weight made from it, raises if (y, r) differ in any bit, and returns s so that the checks also
    hold the fold to its reference (the plain fold's, the tree's: detcomm.selfcheck). Every check call (repeats,
    offsets, batch sizes) thereby proves the fused bits."""
    family = _FUSED[kind]

    def call(x: torch.Tensor, _a: object) -> torch.Tensor:
        hidden = x.shape[-1]
        residual = family.residual(x, dtype)
        weight = (1 + torch.arange(hidden, device=x.device) % 7 / 8).to(dtype)
        y, r = run(x, residual, weight, _CHECK_EPS)
        s = family.all_reduce(ws, x, dtype, label)
        y_ref, r_ref = norm.add_rms_norm(s, residual, weight, eps=_CHECK_EPS)
        if not (bits_equal(y, y_ref) and bits_equal(r, r_ref)):
            # Caught by the self-check (selfcheck.run_check), which refuses the variant on every rank with this reason.
            raise RouteRefused(f"{family.name} (y, r) differ from the composition's (y: {int((y != y_ref).sum())}, "
                               f"r: {int((r != r_ref).sum())} elements)")
        return s

    return call


class IpcFoldRoute:
    route = Route.IPC_FOLD

    def __init__(self, workspace: Workspace, *, resolved: Resolved) -> None:
        self.workspace = workspace
        self.resolved = resolved

    def bind(self, site: Site) -> BoundRoute:
        bound = self._bind_virtual(site) if site.layout.virtual else self._bind_plain(site)
        if site.collective is Collective.ALL_REDUCE_RMSNORM and site.layout.kind in _FUSED:
            return self._bind_norm(site, bound)
        # A shard-order all_reduce_rmsnorm site binds its all-reduce alone: no fused kernel folds the shard order
        # (admission.fused_layout_refusal, the route table's reason), so the communicator runs the composition.
        return bound

    def _bind_plain(self, site: Site) -> Bound:
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
        return Bound(bound.route, bound.site, bound.call, forced, in_place=in_place)

    def _bind_virtual(self, site: Site) -> Bound:
        """A virtual-shard all-reduce site (of an all_reduce or all_reduce_rmsnorm site): calls pass this rank's
        [V/W, rows, *shape] fp32 partials to the workspace's kernels of the site's layout (csrc/virtual_fold.cu for
        the shard order, tree_fold.cu for the tree, whose launches are prepared once here:
        Workspace.bind_all_reduce_tree). Every kernel variant the site's rows can reach (Workspace.virtual_variants,
        tree_variants) is exposed forced, so the self-checks prove each against the layout's reference."""
        layout, ws, label, dtype = site.layout, self.workspace, site.name, site.dtype
        assert site.collective in (Collective.ALL_REDUCE, Collective.ALL_REDUCE_RMSNORM), site.collective
        shards = layout.per_rank(ws.world_size)
        if layout.kind is Kind.TREE:
            variants, run = ws.tree_variants, ws.all_reduce_tree
            fast = ws.bind_all_reduce_tree(dtype, site.row_numel, shards, label=label)
            call: Call = lambda x, a: fast(x, a.out)  # noqa: E731
        else:
            variants, run = ws.virtual_variants, ws.all_reduce_virtual
            call = lambda x, a: ws.all_reduce_virtual(x, dtype=dtype, label=label)  # noqa: E731
        forced: dict[str, Call] = {}
        for v in variants(dtype, site.row_numel, site.max_rows, shards):
            kw: dict[str, object] = {"chunk_rows": 1} if v == "chunked" else {"algo": v}
            forced[v] = lambda x, a, kw=kw: run(x, dtype=dtype, label=label, **kw)  # type: ignore[misc]
        return Bound(self.route, site, call, forced)

    def _bind_norm(self, site: Site, bound: Bound) -> FusedBound:
        """An all_reduce_rmsnorm site whose layout has fused kernels (plain, tree: docs/spec.md §9.2 "Tree sites";
        a tree site's calls pass this rank's [V/W, rows, H] fp32 partials). They serve it when fusion is allowed
        (route.fusion_refusal at this group's W, the rule the route table states) and a row fits a fused launch of
        this workspace; their variants join the all-reduce's, each proven against the composition (the layout's
        all-reduce, then the canonical add + norm) by the self-checks."""
        ws, label, dtype, family = self.workspace, site.name, site.dtype, _FUSED[site.layout.kind]
        forced = dict(bound.variants)
        if fusion_refusal(self.resolved, site, world_size=ws.world_size) is not None:
            return FusedBound(bound.route, bound.site, bound.call, forced)
        variants = family.variants(ws, dtype, site.shape[0], site.max_rows)
        if not variants:
            return FusedBound(bound.route, bound.site, bound.call, forced,
                              note=f" [not fused: {family.row} does not fit one fused launch of the workspace; "
                                   "composition]")
        for v in variants:
            kw: dict[str, object] = {"chunk_rows": 1} if v == "fused_chunked" else {"algo": v.removeprefix("fused_")}

            def run(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float,
                    kw: dict[str, object] = kw) -> tuple[torch.Tensor, torch.Tensor]:
                return family.run(ws, x, res, w, norm.eps_fp32(eps), label=label, **kw)

            forced[v] = _proving(ws, run, label, dtype, site.layout.kind)

        def fused(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = res.shape[-1]
            lead = x.shape[: x.dim() - res.dim()]  # a virtual layout's V/W slabs lead the partials
            y, r = family.run(ws, x.view(*lead, -1, hidden), res.view(-1, hidden), w, norm.eps_fp32(eps), label=label)
            return y.view(res.shape), r.view(res.shape)

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


def arm(group: dist.ProcessGroup, *, device: torch.device, resolved: Resolved, capacity: int, max_rows: int,
        timeout_s: float | None) -> tuple[IpcFoldRoute | None, str]:
    """Arm the CUDA-IPC workspace on ``group`` (collective) and the route over it, or None, with the reason the
    route table shows. Every rank reaches the same verdict (Workspace.create raises on every rank when one cannot
    arm); the communicator asks only where a route could use it (comm.Communicator._arm_workspace)."""
    kw: dict[str, Any] = {} if timeout_s is None else {"timeout_s": timeout_s}
    try:
        ws = Workspace.create(group, device=device, capacity_bytes=capacity, max_rows_armed=max_rows, **kw)
    except WorkspaceUnavailable as e:
        # The envelope wanted the workspace: its sites now take gather_fold/a2a_fold (same bits, ~2x slower
        # at decode sizes). Say so once, loudly: the route table alone is easy to miss.
        _log.warning("detcomm: the CUDA-IPC workspace did not arm, so SUM sites take gather_fold/a2a_fold "
                     "instead of ipc_fold (same bits, slower): %s", e)
        return None, f"workspace unavailable: {e}"
    store = (f"one-store kernel up to {ws.one_store_max_bytes // 1024} KiB" if ws.one_store_max_bytes
             else "no one-store kernel (one rank, or more than two ranks on one GPU)")
    return IpcFoldRoute(ws, resolved=resolved), (f"armed: {capacity // 1024} KiB per launch, sites up to "
                                                 f"{max_rows} rows, {store}")
