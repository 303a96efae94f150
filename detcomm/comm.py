"""The communicator: one per process group. It owns the group's sites, their route decisions, the startup
self-checks and the route backends, and validates every call before any communication happens.

Which calls are collective (every rank of the group must make them, in the same order):
  - construction (``detcomm.init``): runs the startup self-checks;
  - ``site(...)`` when it introduces a (route, collective, op, dtype, shape) whose self-check has not run
    yet (it runs it), and the first call of an undeclared site (which declares it);
  - every collective call (``all_reduce``, ``all_gather``, ...);
  - ``close()``.
``routes()`` and ``checks()`` are local.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import envelope as _env
from .backends import A2AFoldBackend, GatherFoldBackend, NativeBackend, RsAgFoldBackend
from .numerics.fold import BATCH_INVARIANT, FLOAT_DTYPES, Leaf, select_leaf
from .route import (
    DEFAULT_MAX_ROWS,
    DEFAULT_WORKSPACE_BYTES,  # defined beside the routing policy, torch-free (the static route view reads it)
    DEFAULT_WORKSPACE_MAX_ROWS,
    NO_ARGS,
    SUPPORTED_DTYPES,
    AutoBackend,
    BoundRoute,
    CallArgs,
    Capabilities,
    Collective,
    ReduceOp,
    Route,
    RouteBackend,
    RouteEntry,
    RouteTable,
    Site,
)
from .selfcheck import CheckResult, SelfChecks
from .topology import discover as discover_topology

if TYPE_CHECKING:
    from .workspace import Workspace
from .deadline import is_timeout, peer_timeout
from .errors import DetcommError, WorkspaceUnavailable
from .numerics import norm as _norm
from .verify import CallChecker
from .work import Work

__all__ = ["Communicator", "RouteTable", "RouteEntry"]

_log = logging.getLogger("detcomm")

# Width of the startup self-checks' rows: not a multiple of 8, so vectorized kernels' scalar tails run too.
_STARTUP_CHECK_SHAPE = (76,)


def _group_label(group: dist.ProcessGroup) -> str:
    return "default" if group is dist.group.WORLD else str(group.group_name)


def _device_for(backend: str, device: torch.device | str | None) -> torch.device:
    if device is None:
        if "nccl" in backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {dev}")
    if dev.type == "cpu" and backend == "nccl":
        raise ValueError("an NCCL group works on CUDA tensors; pass a CUDA device or use a gloo group")
    return dev


class Communicator:
    """detcomm's state for one process group. Create it with ``detcomm.init``."""

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        resolved: _env.Resolved,
        selfcheck: bool = True,
        default_max_rows: int = DEFAULT_MAX_ROWS,
        owns_group: bool = False,
        device: torch.device | str | None = None,
        workspace: bool | None = None,
        workspace_max_rows: int = DEFAULT_WORKSPACE_MAX_ROWS,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        check: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        for name, value in (("default_max_rows", default_max_rows), ("workspace_max_rows", workspace_max_rows),
                            ("workspace_bytes", workspace_bytes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.group = group
        self.group_label = _group_label(group)
        self.resolved = resolved
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend_name = dist.get_backend(group)
        self.device = _device_for(self.backend_name, device)
        self.selfcheck = selfcheck
        self.default_max_rows = default_max_rows
        self.owns_group = owns_group
        required = frozenset({BATCH_INVARIANT}) if resolved.switches.batch_invariant_collectives else frozenset()
        self.leaf: Leaf = select_leaf(device_type=self.device.type, required=required)
        self._native = NativeBackend(group, stage_through_host=self.device.type == "cuda" and "nccl" not in self.backend_name)
        self._backends: dict[Route, RouteBackend] = {
            Route.NATIVE: self._native,
            Route.GATHER_FOLD: GatherFoldBackend(self._native, self.leaf),
            Route.A2A_FOLD: A2AFoldBackend(self._native, self.leaf),
            Route.RS_AG_FOLD: RsAgFoldBackend(self._native, self.leaf),
        }
        self._workspace: Workspace | None = None
        t0 = time.perf_counter()
        self.caps = self._discover_capabilities(workspace, workspace_max_rows, workspace_bytes, timeout_s)
        # Cross-rank call verification (detcomm/verify.py); timeout_s only names the group's timeout in its errors.
        self._verifier = (CallChecker(native=self._native, device=self.device, rank=self.rank,
                                      world_size=self.world_size, timeout_s=timeout_s) if check else None)
        self._selfchecks = SelfChecks(native=self._native, device=self.device)
        self.auto = AutoBackend(resolved, self.caps, backends=self._backends,
                                checker=self._selfchecks if selfcheck else None, leaf=self.leaf.name)
        self._sites: dict[str, Site] = {}
        self._bound: dict[str, BoundRoute] = {}
        self._hot: dict[str, _HotSite] = {}  # declared sites' facts for the per-call fast path (_HotSite)
        self._in_place: set[str] = set()  # sites whose bound route writes in place (route.BoundRoute.in_place)
        self._calls = 0  # collective calls made on this communicator (named in timeout errors)
        self._closed = False
        if selfcheck:
            try:
                self._startup_checks()
            except BaseException:
                if self._workspace is not None:  # local release: the peers are failing the same check
                    self._workspace.abort()
                raise
        self._log_summary(time.perf_counter() - t0)

    def _log_summary(self, seconds: float) -> None:
        checks = self.checks()
        failed = [c for c in checks if not c.passed]
        routes = sorted({e.decision.route.value for e in self.auto.table(self.auto.bound_sites()).entries})
        _log.info(
            "detcomm: init on %s W=%d rank=%d device=%s (%s) numerics=%s fold leaf=%s routes in use=%s; "
            "workspace: %s; %d self-checks (%d failed) in %.3f s; init took %.3f s",
            self.backend_name, self.world_size, self.rank, self.device, self.caps.topology, self.resolved.numerics,
            self.leaf.name, ",".join(routes) or "-", self.caps.workspace_reason, len(checks), len(failed),
            self._selfchecks.seconds(), seconds)

    # -- startup ------------------------------------------------------------------------------------
    def _discover_capabilities(self, workspace: bool | None, max_rows: int, capacity: int,
                               timeout_s: float | None) -> Capabilities:
        allowed, mc_why = _env.multicast_allowed(self.resolved, hardware_supports=False)
        if allowed:  # pragma: no cover - unreachable until a multicast route exists
            mc_why = "no multicast route in this build"
        topo = discover_topology(self.group, self.device)
        if not topo.same_host:
            armed, ws_why = False, "ranks on several hosts: CUDA IPC does not cross hosts"
        else:
            armed, ws_why = self._arm_workspace(workspace, max_rows, capacity, timeout_s)
        return Capabilities(
            backend=self.backend_name,
            device_type=self.device.type,
            world_size=self.world_size,
            workspace=armed,
            workspace_reason=ws_why,
            workspace_max_rows=self._workspace.max_rows_armed if self._workspace is not None else 0,
            workspace_bytes=capacity if armed else 0,
            topology=topo.describe(),
            hosts=topo.hosts,
            multicast=False,
            multicast_reason=mc_why,
        )

    def _arm_workspace(self, want: bool | None, max_rows: int, capacity: int,
                       timeout_s: float | None) -> tuple[bool, str]:
        """Arm the CUDA-IPC workspace (collective) where a route could use it: a CUDA group, and either a
        batch-invariant envelope (``want=None``) or an explicit ``workspace=True``. Every rank reaches the
        same verdict (Workspace.create raises on every rank when one cannot arm)."""
        sw = self.resolved.switches
        if self.device.type != "cuda":
            return False, "CPU group: no CUDA-IPC workspace"
        if sw.force_deterministic_rsag:
            return False, "force_deterministic_rsag: no symmetric-memory path"
        if want is False or (want is None and not sw.batch_invariant_collectives):
            return False, "workspace not armed (init(workspace=True) arms it)"
        from .backends.ipc_fold import IpcFoldBackend
        from .workspace import Workspace

        kw: dict[str, Any] = {} if timeout_s is None else {"timeout_s": timeout_s}
        try:
            ws = Workspace.create(self.group, device=self.device, capacity_bytes=capacity, max_rows_armed=max_rows,
                                  **kw)
        except WorkspaceUnavailable as e:
            # The envelope wanted the workspace: its sites now take gather_fold/a2a_fold (same bits, ~2x slower
            # at decode sizes). Say so once, loudly: the route table alone is easy to miss.
            _log.warning("detcomm: the CUDA-IPC workspace did not arm, so SUM sites take gather_fold/a2a_fold "
                         "instead of ipc_fold (same bits, slower): %s", e)
            return False, f"workspace unavailable: {e}"
        self._workspace = ws
        self._backends[Route.IPC_FOLD] = IpcFoldBackend(ws, resolved=self.resolved)
        store = (f"one-store kernel up to {ws.lamport_max_bytes // 1024} KiB" if ws.lamport_max_bytes
                 else "no one-store kernel (one rank, or more than two ranks on one GPU)")
        return True, f"armed: {capacity // 1024} KiB per launch, sites up to {max_rows} rows, {store}"

    def _startup_checks(self) -> None:
        """Check, on a small payload of each float dtype, the SUM routes this group would use for a bitwise
        claim. Other claims (MAX/MIN keys, argmax, other shapes) are checked when a site first needs them."""
        for dtype in FLOAT_DTYPES:
            for coll in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER):
                # A one-row site reaches an armed workspace; a DEFAULT_MAX_ROWS one the gather/all-to-all
                # fold. Where both land on one route the second check is the first's cached result.
                for max_rows in (1, DEFAULT_MAX_ROWS):
                    self.auto.route(Site("<startup>", coll, dtype, _STARTUP_CHECK_SHAPE, max_rows, ReduceOp.SUM,
                                         self.group_label))

    # -- sites --------------------------------------------------------------------------------------
    def site(
        self,
        name: str,
        *,
        collective: str | Collective,
        dtype: torch.dtype,
        shape: int | Sequence[int],
        max_rows: int,
        op: str | ReduceOp = "sum",
        route: str | Route | None = None,
        virtual_shards: int | None = None,
    ) -> Site:
        """Declare a call site (see ``detcomm.site``). Collective when it runs a new self-check."""
        self._check_open()
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)  # one trailing dimension, as torch accepts an int for a 1-D size
        coll = _enum(Collective, collective, "collective", name)
        rop = ReduceOp.MAX if coll is Collective.ARGMAX and op == "sum" else _enum(ReduceOp, op, "op", name)
        s = Site(
            name=name,
            collective=coll,
            dtype=dtype,
            shape=tuple(shape),  # type: ignore[arg-type]  # a bool shape raises TypeError here
            max_rows=max_rows,
            op=rop,
            group=self.group_label,
            route=None if route is None else _enum(Route, route, "route", name),
            virtual_shards=virtual_shards,
        )
        return self._declare(s)

    def _declare(self, s: Site) -> Site:
        existing = self._sites.get(s.name)
        if existing is not None:
            if existing != s:
                raise ValueError(
                    f"site {s.name!r} is already declared as {existing.describe()}"
                    f"{' (route=' + existing.route.value + ')' if existing.route else ''}; the new declaration "
                    f"{s.describe()} contradicts it. A site is static: use another name for the other call."
                )
            return existing
        bound = self._bound[s.name] = self.auto.route(s)
        self._sites[s.name] = s
        if bound.in_place:
            self._in_place.add(s.name)
        if s.collective in _HOT_COLLECTIVES and self._verifier is None and s.virtual_shards is None:
            self._hot[s.name] = _HotSite(s, bound.in_place, self.device, self.world_size)
        return s

    def _site_for_call(self, site: str | Site, collective: Collective, x: torch.Tensor, op: ReduceOp, *,
                       rows_per_rank: Sequence[int] | None = None, uneven: bool = False) -> Site:
        if isinstance(site, Site):
            declared = self._sites.get(site.name)
            if site.group != self.group_label or (declared is not site and declared != site):
                raise ValueError(
                    f"site {site.name!r} was not declared on this communicator's group ({self.group_label!r}); "
                    "declare it with detcomm.site(..., group=...) on the group that runs the call"
                )
            name = site.name
        elif isinstance(site, str):
            name = site
        else:
            raise TypeError(f"site must be a site name (str) or a detcomm Site, got {type(site).__name__}")
        self._check_tensor(name, x)
        declared = self._sites.get(name)
        # The most rows a rank carries: a token_all_gather's largest rows_per_rank entry, else this tensor's.
        rows = max(rows_per_rank) if rows_per_rank is not None else x.shape[0]
        if declared is None:
            if rows > self.default_max_rows:
                raise ValueError(
                    f"site {name!r}: first call carries {rows} rows, more than the default max_rows "
                    f"{self.default_max_rows} of an undeclared site; declare it with detcomm.site({name!r}, ..., "
                    f"max_rows=N) or raise init(default_max_rows=...)"
                )
            # Before the implicit declaration: it may run a self-check, itself collective.
            self._agree(name, collective, op, x, rows_per_rank, uneven)
            implicit = Site(name, collective, x.dtype, tuple(x.shape[1:]), self.default_max_rows, op,
                            self.group_label, implicit=True)
            return self._declare(implicit)
        problems = []
        if declared.collective is not collective:
            problems.append(f"collective {collective.value} != {declared.collective.value}")
        if declared.op is not op:
            problems.append(f"op {op.value} != {declared.op.value}")
        if x.dtype != declared.dtype:
            problems.append(f"dtype {str(x.dtype).replace('torch.', '')} != {str(declared.dtype).replace('torch.', '')}")
        if tuple(x.shape[1:]) != declared.shape:
            problems.append(f"trailing shape {tuple(x.shape[1:])} != {declared.shape}")
        if problems:
            raise ValueError(
                f"site {name!r} was declared as {declared.describe()}; this call contradicts it: "
                f"{'; '.join(problems)}. A site is static: declare another site for this call (or cast/reshape "
                "the input)."
            )
        if rows > declared.max_rows:
            raise ValueError(
                f"site {name!r}: {rows} rows exceed the declared max_rows={declared.max_rows}; declare the "
                f"site with a larger max_rows (the most rows it will ever carry)"
            )
        self._agree(name, collective, op, x, rows_per_rank, uneven)
        return declared

    def _agree(self, name: str, collective: Collective, op: ReduceOp, x: torch.Tensor,
               rows_per_rank: Sequence[int] | None, uneven: bool) -> None:
        # After every local validation (a caller error never costs a message), before any collective work.
        if self._verifier is not None:
            self._verifier.agree(name, collective, op, x, rows_per_rank=rows_per_rank, uneven=uneven)

    def _check_tensor(self, name: str, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"site {name!r}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"site {name!r}: dtype {x.dtype} is not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}"
            )
        if x.dim() < 1:
            raise ValueError(f"site {name!r}: expected a tensor of rows (at least 1-D, dim 0 = rows), got a 0-d tensor")
        if x.device != self.device:
            raise ValueError(
                f"site {name!r}: tensor is on {x.device}, but this communicator ({self.backend_name}) works on "
                f"{self.device}; move it with x.to({str(self.device)!r})"
            )
        if not x.is_contiguous():
            # Refused, not copied: a hidden copy on the hot path costs a full pass over the data, and for a
            # transposed view "row = dim 0" would be ambiguous.
            raise ValueError(f"site {name!r}: tensor is not contiguous; pass x.contiguous()")

    # -- collectives --------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, site: str | Site, *, op: str = "sum", out: torch.Tensor | None = None,
                   async_op: bool = False) -> torch.Tensor | Work:
        """Reduce every rank's ``x`` (sum, avg, max or min); identical bits on every rank.

        Returns a new tensor, or ``out`` when given (``out=x`` reduces in place). ``async_op=True`` returns a
        ``detcomm.Work`` handle instead (``.wait()``, ``.result()``). Collective.

        On a virtual-shard site ``x`` is this rank's [V/W, rows, *shape] fp32 partial sums and the result is
        [rows, *shape] in the site's dtype (see ``_virtual``)."""
        done = self._fast(Collective.ALL_REDUCE, x, site, op, out, async_op)
        if done is not _REFUSED:
            return done  # type: ignore[return-value]
        self._check_open()
        vs = self._virtual_site(site)
        if vs is not None:
            return self._virtual(vs, Collective.ALL_REDUCE, x, op, out, async_op)
        s = self._site_for_call(site, Collective.ALL_REDUCE, x, _enum(ReduceOp, op, "op", site))
        self._check_out(s.name, out, x, tuple(x.shape))
        return self._finish(self._call(s, x, CallArgs(out=_separate(out, x, s.name in self._in_place))), out, async_op)

    def reduce_scatter(self, x: torch.Tensor, site: str | Site, *, op: str = "sum", out: torch.Tensor | None = None,
                       async_op: bool = False) -> torch.Tensor | Work:
        """Rank r receives row block r of the reduction; ``x.shape[0]`` must divide by the world size.
        ``out`` (``x.shape[0] // W`` rows) and ``async_op`` as for ``all_reduce``. Collective.

        On a virtual-shard site ``x`` is this rank's [V/W, rows, *shape] fp32 partial sums and rank r receives
        row block r of the folded [rows, *shape] result, in the site's dtype (see ``_virtual``)."""
        done = self._fast(Collective.REDUCE_SCATTER, x, site, op, out, async_op)
        if done is not _REFUSED:
            return done  # type: ignore[return-value]
        self._check_open()
        vs = self._virtual_site(site)
        if vs is not None:
            return self._virtual(vs, Collective.REDUCE_SCATTER, x, op, out, async_op)
        rop = _enum(ReduceOp, op, "op", site)
        name = site.name if isinstance(site, Site) else site
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] % self.world_size:
            raise ValueError(
                f"site {name!r}: reduce_scatter needs a row count divisible by the world size {self.world_size} "
                f"(rank r receives row block r); got {x.shape[0]} rows: pad to {-(-x.shape[0] // self.world_size) * self.world_size}"
            )
        s = self._site_for_call(site, Collective.REDUCE_SCATTER, x, rop)
        self._check_out(s.name, out, x, (x.shape[0] // self.world_size, *x.shape[1:]))
        return self._finish(self._call(s, x, CallArgs(out=_separate(out, x, s.name in self._in_place))), out, async_op)

    def _virtual_site(self, site: str | Site) -> Site | None:
        """The declared virtual-shard site a call names, or None (every other case takes the plain path, which
        reports unknown or foreign sites)."""
        declared = self._sites.get(site.name if isinstance(site, Site) else site) if isinstance(site, (str, Site)) else None
        if declared is None or declared.virtual_shards is None:
            return None
        if isinstance(site, Site) and site != declared:
            return None  # the plain path raises: declared differently on this group
        return declared

    def _virtual(self, s: Site, collective: Collective, partials: torch.Tensor, op: str, out: torch.Tensor | None,
                 async_op: bool) -> torch.Tensor | Work:
        """A call of a virtual-shard site (docs/spec.md §9.1), validated before any communication.

        ``partials``: float32 [V/W, rows, *shape], this rank's shards in order (slab j is global shard
        r*V/W + j, r this rank). Result: the canonical fold over shards 0..V-1 from +0.0 in fp32, rounded once to
        the site's dtype (``detcomm.numerics.fold.reference_fold`` of all V partials stacked): the same bits for every
        W that divides V, W = 1 included. A reduce-scatter returns row block r of it (rows divisible by W)."""
        name, v, w = s.name, s.virtual_shards, self.world_size
        assert v is not None
        k = v // w
        if _enum(ReduceOp, op, "op", name) is not ReduceOp.SUM:
            raise ValueError(f"site {name!r} folds {v} virtual shards: op must be 'sum', got {op!r}; divide the "
                             "result for a mean")
        if s.collective is not collective:
            raise ValueError(f"site {name!r} was declared as {s.describe()}; this call is a {collective.value}: "
                             "declare another site for it")
        self._check_tensor(name, partials)
        want = f"float32 [V/W={k}, rows, {', '.join(map(str, s.shape))}]"
        mine = f"this rank's {k} fp32 partial sums (shards {self.rank * k}..{self.rank * k + k - 1} of {v})"
        if partials.dtype != torch.float32:
            raise ValueError(f"site {name!r}: a virtual-shard call takes {mine} as {want}; got dtype "
                             f"{str(partials.dtype).replace('torch.', '')}: pass the GEMM's fp32 partials "
                             "(out_dtype=torch.float32), not values rounded to the output dtype")
        if partials.dim() != 2 + len(s.shape) or partials.shape[0] != k or tuple(partials.shape[2:]) != s.shape:
            raise ValueError(f"site {name!r}: a virtual-shard call takes {mine} as {want}; got shape "
                             f"{list(partials.shape)}: stack this rank's shards on dim 0 (V={v}, W={w})")
        rows = partials.shape[1]
        if rows > s.max_rows:
            raise ValueError(f"site {name!r}: {rows} rows exceed the declared max_rows={s.max_rows}; declare the "
                             "site with a larger max_rows (the most rows it will ever carry)")
        out_rows = rows
        if collective is Collective.REDUCE_SCATTER:
            if rows % w:
                raise ValueError(f"site {name!r}: reduce_scatter needs a row count divisible by the world size {w} "
                                 f"(rank r receives row block r); got {rows} rows: pad to {-(-rows // w) * w}")
            out_rows = rows // w
        self._check_out(name, out, partials, (out_rows, *s.shape), dtype=s.dtype)
        self._agree(name, collective, ReduceOp.SUM, partials, None, False)
        return self._finish(self._call(s, partials, NO_ARGS), out, async_op)

    def all_gather(self, x: torch.Tensor, site: str | Site, *, out: torch.Tensor | None = None,
                   async_op: bool = False) -> torch.Tensor | Work:
        """Every rank's ``x`` concatenated along dim 0 in rank order (``out``: ``W * rows`` rows). Collective."""
        done = self._fast(Collective.ALL_GATHER, x, site, ReduceOp.SUM, out, async_op)
        if done is not _REFUSED:
            return done  # type: ignore[return-value]
        self._check_open()
        s = self._site_for_call(site, Collective.ALL_GATHER, x, ReduceOp.SUM)
        self._check_out(s.name, out, x, (x.shape[0] * self.world_size, *x.shape[1:]))
        return self._finish(self._call(s, x, CallArgs(out=_separate(out, x, s.name in self._in_place))), out, async_op)

    def all_reduce_residual_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                                    eps: float, site: str | Site) -> tuple[torch.Tensor, torch.Tensor]:
        """s = the site's all-reduce of ``x``; r = round(residual + s); y = RMSNorm(r) in the canonical order
        (docs/spec.md §9). Returns ``(y, r)``. Arguments are checked before any communication. Collective."""
        self._check_open()
        name = site.name if isinstance(site, Site) else site
        _norm._check_add(f"site {name!r}: all_reduce_residual_rmsnorm", x, residual, weight)
        _norm.eps_fp32(eps)
        s = self._site_for_call(site, Collective.ALL_REDUCE_RMSNORM, x, ReduceOp.SUM)
        fused = getattr(self._bound[s.name], "fused", None)  # the workspace's fused kernel, where routing chose it
        if fused is not None:
            self._calls += 1
            return fused(x, residual, weight, eps)  # type: ignore[no-any-return]
        return _norm.add_rms_norm(self._call(s, x, NO_ARGS), residual, weight, eps=eps)

    def _fast(self, collective: Collective, x: torch.Tensor, site: str | Site, op: object, out: torch.Tensor | None,
              async_op: bool) -> object:
        """A declared site called as declared: one dict lookup and one comparison per cached fact
        (_HotSite.admits), then the route. Returns the call's result, or _REFUSED for anything else (a first
        call, a contradiction, a wrong type, a closed communicator: close() empties the cache), which the caller
        sends through the full checks, where the precise error is raised."""
        hot = self._hot.get(site) if type(site) is str else (self._hot.get(site.name) if type(site) is Site else None)
        if hot is None or hot.collective is not collective or (type(site) is not str and hot.site is not site) or op != hot.op:
            return _REFUSED
        target = hot.admits(x, out)
        if target is _REFUSED:
            return _REFUSED
        self._calls += 1
        try:
            # Through _bound, the one table of bound routes.
            result = self._bound[hot.site.name](x, NO_ARGS if target is None else _out_args(target))  # type: ignore[arg-type]
        except RuntimeError as e:  # as in _call
            if isinstance(e, DetcommError) or not is_timeout(e):
                raise
            raise peer_timeout(hot.site.name, self._calls, e, group=self.group, rank=self.rank) from e
        if out is not None and result is not out:
            out.copy_(result)
            result = out
        return Work(result) if async_op else result

    def _call(self, s: Site, x: torch.Tensor, args: CallArgs) -> torch.Tensor:
        """Every collective call goes through here: the site's bound route, with a timeout translated into a
        PeerTimeout that names the site, the call number and the ranks that never reached the call."""
        self._calls += 1
        try:
            return self._bound[s.name](x, args)
        except RuntimeError as e:  # torch.distributed.DistError derives from it
            if isinstance(e, DetcommError) or not is_timeout(e):
                raise
            raise peer_timeout(s.name, self._calls, e, group=self.group, rank=self.rank) from e

    def _check_out(self, name: str, out: torch.Tensor | None, x: torch.Tensor, shape: tuple[int, ...], *,
                   dtype: torch.dtype | None = None) -> None:
        """Validate a caller's output buffer before any communication (``dtype``: the result's, default x's)."""
        if out is None:
            return
        dtype = x.dtype if dtype is None else dtype
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"site {name!r}: out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != shape or out.dtype != dtype or out.device != x.device:
            raise ValueError(
                f"site {name!r}: out must be a {str(dtype).replace('torch.', '')} tensor of shape {list(shape)} on "
                f"{x.device}, got {str(out.dtype).replace('torch.', '')} {list(out.shape)} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(f"site {name!r}: out is not contiguous; pass a contiguous buffer")
        if out.data_ptr() != x.data_ptr() and _overlap(out, x):
            raise ValueError(f"site {name!r}: out partially overlaps the input; pass out=x (in place) or a "
                             "separate buffer")

    @staticmethod
    def _finish(result: torch.Tensor, out: torch.Tensor | None, async_op: bool) -> torch.Tensor | Work:
        if out is not None and result is not out:
            out.copy_(result)
            result = out
        return Work(result) if async_op else result

    def token_all_gather(self, x: torch.Tensor, site: str | Site, *, rows_per_rank: Sequence[int]) -> torch.Tensor:
        """Uneven all-gather: rank r contributes ``rows_per_rank[r]`` rows; concatenated in rank order."""
        self._check_open()
        name = site.name if isinstance(site, Site) else site
        counts = _int_list(rows_per_rank, name, "rows_per_rank")
        if len(counts) != self.world_size:
            raise ValueError(f"site {name!r}: rows_per_rank has {len(counts)} entries, the group has {self.world_size} ranks")
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] != counts[self.rank]:
            raise ValueError(
                f"site {name!r}: this rank ({self.rank}) passes {x.shape[0]} rows but rows_per_rank[{self.rank}] = "
                f"{counts[self.rank]}; every rank must pass the same rows_per_rank"
            )
        s = self._site_for_call(site, Collective.TOKEN_ALL_GATHER, x, ReduceOp.SUM, rows_per_rank=counts)
        return self._call(s, x, CallArgs(rows_per_rank=tuple(counts)))

    def all_to_all(self, x: torch.Tensor, site: str | Site, *, splits: Sequence[int] | None = None,
                   out_splits: Sequence[int] | None = None) -> torch.Tensor:
        """Rank r sends its row block q to rank q and receives, in rank order, every rank's block r.

        ``splits=None``: even blocks (rows divisible by W). Otherwise ``splits[q]`` rows go to rank q; the
        counts each rank receives are exchanged first (one small extra all-to-all), unless the caller already
        knows them: ``out_splits[q]`` = the rows rank q sends here (it must equal rank q's ``splits[r]``; a
        wrong count is the caller's bug and fails or hangs in the transport, as a wrong size does there).
        """
        self._check_open()
        name = site.name if isinstance(site, Site) else site
        if splits is None:
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] % self.world_size:
                raise ValueError(
                    f"site {name!r}: an even all_to_all needs rows divisible by {self.world_size}, got "
                    f"{x.shape[0]}; pass splits=[rows for each rank] for an uneven one"
                )
        else:
            in_splits = _int_list(splits, name, "splits")
            if len(in_splits) != self.world_size:
                raise ValueError(f"site {name!r}: splits has {len(in_splits)} entries, the group has {self.world_size} ranks")
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and sum(in_splits) != x.shape[0]:
                raise ValueError(f"site {name!r}: splits sum to {sum(in_splits)}, the tensor has {x.shape[0]} rows")
        known: list[int] | None = None
        if out_splits is not None:
            if splits is None:
                raise ValueError(f"site {name!r}: out_splits is for an uneven all_to_all; pass splits= too")
            known = _int_list(out_splits, name, "out_splits")
            if len(known) != self.world_size:
                raise ValueError(f"site {name!r}: out_splits has {len(known)} entries, the group has {self.world_size} ranks")
        s = self._site_for_call(site, Collective.ALL_TO_ALL, x, ReduceOp.SUM, uneven=splits is not None)
        if splits is None:
            n = x.shape[0] // self.world_size
            ins = outs = [n] * self.world_size
        else:
            ins = in_splits
            outs = self._native.exchange_splits(ins, self.device) if known is None else known
        return self._call(s, x, CallArgs(in_splits=tuple(ins), out_splits=tuple(outs)))

    def argmax(self, logits_shard: torch.Tensor, site: str | Site, *, vocab_start: int) -> torch.Tensor:
        """Vocabulary-parallel argmax: int64 global index per row; lowest index on exact ties; -0.0 == +0.0;
        NaN counts as the largest value (as torch.argmax)."""
        self._check_open()
        name = site.name if isinstance(site, Site) else site
        if isinstance(vocab_start, bool) or not isinstance(vocab_start, int):
            raise TypeError(f"site {name!r}: vocab_start must be an int, got {type(vocab_start).__name__}")
        if vocab_start < 0:
            raise ValueError(f"site {name!r}: vocab_start must be a non-negative int, got {vocab_start!r}")
        if isinstance(logits_shard, torch.Tensor):
            if logits_shard.dim() != 2:
                raise ValueError(f"site {name!r}: argmax takes [rows, vocab_shard] logits, got shape {tuple(logits_shard.shape)}")
            if logits_shard.dtype not in FLOAT_DTYPES:
                raise ValueError(f"site {name!r}: argmax takes floating-point logits, got {logits_shard.dtype}")
            if vocab_start + logits_shard.shape[1] > 2**31:
                raise ValueError(f"site {name!r}: global vocabulary indices must stay below 2**31")
        s = self._site_for_call(site, Collective.ARGMAX, logits_shard, ReduceOp.MAX)
        return self._call(s, logits_shard, CallArgs(vocab_start=vocab_start))

    # -- introspection and lifecycle ----------------------------------------------------------------
    def routes(self) -> RouteTable:
        """The route table of the declared sites (local; identical on every rank)."""
        return self.auto.table(list(self._sites.values()),
                               note=f"topology: {self.caps.topology}; workspace: {self.caps.workspace_reason}")

    def checks(self) -> list[CheckResult]:
        """Every self-check run on this group so far, in order (local)."""
        return list(self._selfchecks.results.values())

    def close(self) -> None:
        """Release this communicator's resources (collective). The process group is destroyed only if
        ``detcomm.init`` created it."""
        if self._closed:
            return
        self._closed = True
        self._hot.clear()
        if self._workspace is not None:
            self._workspace.close()
            self._workspace = None
        if self.owns_group and dist.is_initialized():
            # Every rank leaves its last collective before any rank tears its transport down; without this a
            # gloo rank can be torn down under a peer still draining the final message (abort at exit).
            dist.barrier(group=self.group)
            dist.destroy_process_group()
        # Drop every reference to the process group: a ProcessGroup object outliving destroy_process_group is
        # finalized at interpreter exit, where gloo's worker threads can abort the process.
        # Every holder of the native backend counts: the bound routes, the call checker, the self-checks, the router.
        self._backends.clear()
        self._bound.clear()
        self._verifier = None
        self._selfchecks = None  # type: ignore[assignment]
        self.auto.release()
        self._native = None  # type: ignore[assignment]
        self.group = None  # type: ignore[assignment]

    def _check_open(self) -> None:
        if self._closed:
            raise DetcommError("this detcomm communicator is shut down; call detcomm.init() again")


def _separate(out: torch.Tensor | None, x: torch.Tensor, in_place: bool) -> torch.Tensor | None:
    """``out`` when the route may write it directly: a separate buffer, or x itself (in place) where the site's
    route writes in place (route.BoundRoute.in_place); else None, and the communicator copies the finished
    result into x."""
    if out is None or (out.data_ptr() == x.data_ptr() and not in_place):
        return None
    return out


_REFUSED = object()  # _HotSite.admits: the call needs the full checks


def _out_args(out: torch.Tensor) -> CallArgs:
    """``CallArgs(out=out)`` at a third of the cost: a frozen dataclass's __init__ sets every field through
    object.__setattr__, while the other fields' defaults are class attributes a bare instance already reads."""
    args = object.__new__(CallArgs)
    object.__setattr__(args, "out", out)
    return args


# The collectives whose calls take the fast path (Communicator._fast); the others always take the full checks.
_HOT_COLLECTIVES = (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER)


class _HotSite:
    """A declared site's facts, cached at declaration for the per-call fast path (Communicator._fast): what a
    call must match (collective, op, dtype, trailing shape, rows, device, contiguity, the output's shape), each
    one comparison, and whether its route writes in place. Only sites without cross-rank call checking are
    cached (init(check=True) checks every call in full)."""

    __slots__ = ("site", "collective", "op", "dtype", "ndim", "tail", "width", "max_rows", "device", "in_place", "mul",
                 "div")

    def __init__(self, site: Site, in_place: bool, device: torch.device, world_size: int) -> None:
        self.site = site
        self.collective = site.collective
        self.op = site.op
        self.dtype = site.dtype
        self.ndim = 1 + len(site.shape)
        self.tail = site.shape
        # One trailing dimension (a hidden size: the usual site) is compared as an int: slicing a torch.Size builds
        # a new one on every call. None: compare the whole trailing shape.
        self.width = site.shape[0] if len(site.shape) == 1 else None
        self.max_rows = site.max_rows
        self.device = device
        self.in_place = in_place
        # The output's rows are the input's * mul // div; a reduce_scatter's input rows must divide by div.
        self.mul = world_size if site.collective is Collective.ALL_GATHER else 1
        self.div = world_size if site.collective is Collective.REDUCE_SCATTER else 1

    def admits(self, x: object, out: object) -> object:
        """What the route gets as ``CallArgs.out`` (None: allocate) when ``x`` and ``out`` pass every check the
        full path makes; ``_REFUSED`` otherwise (the full path then raises the precise error)."""
        if type(x) is not torch.Tensor:
            return _REFUSED
        sh = x.shape
        if (len(sh) != self.ndim or sh[0] > self.max_rows or x.dtype is not self.dtype
                or (sh[1] != self.width if self.width is not None else sh[1:] != self.tail)
                or x.device != self.device or not x.is_contiguous() or sh[0] % self.div):
            return _REFUSED
        if out is None:
            return None
        if out is x:
            return x if self.in_place else None
        if type(out) is not torch.Tensor or out.dtype is not self.dtype or out.device != self.device:
            return _REFUSED
        osh = out.shape
        if self.mul == self.div == 1:
            if osh != sh:
                return _REFUSED
        elif len(osh) != self.ndim or osh[0] != sh[0] * self.mul // self.div or osh[1:] != sh[1:]:
            return _REFUSED
        if not out.is_contiguous():
            return _REFUSED
        a, b = out.data_ptr(), x.data_ptr()
        if a == b:  # x's bytes (x itself, or another view of them): in place
            return out if self.in_place else None
        if a < b + x.nbytes and b < a + out.nbytes:  # a partial overlap: refused by the full path
            return _REFUSED
        return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _enum(cls, value, what: str, site: object = None):  # type: ignore[no-untyped-def]
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        where = f"site {site.name if isinstance(site, Site) else site!r}: " if site is not None else ""
        raise ValueError(f"{where}unknown {what} {value!r}; expected one of {[m.value for m in cls]}") from None


def _int_list(values: Sequence[int], site: str, what: str) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"site {site!r}: {what} must be ints, got {list(values)!r}")
        if v < 0:
            raise ValueError(f"site {site!r}: {what} must be non-negative, got {list(values)!r}")
        out.append(v)
    return out


def warn_missing_environment(resolved: _env.Resolved, backend: str) -> None:
    """Refuse (NCCL under a bitwise envelope) or warn when the group was created without the environment
    the envelope needs: NCCL reads it only when a communicator is created."""
    missing = _env.missing_environment(resolved, backend=backend)
    if not missing:
        return
    text = ", ".join(f"{k}={v}" for k, v in missing.items())
    fix = (
        f"launch with `detcomm-launch --numerics {resolved.numerics}` or call "
        f"detcomm.apply_environment({resolved.numerics!r}) before torch.distributed.init_process_group"
    )
    if resolved.bitwise and "NCCL_ALGO" in missing:
        raise DetcommError(
            f"numerics={resolved.numerics!r} needs {text} before the NCCL communicator is created, and the "
            f"process group already exists without it: {fix}"
        )
    warnings.warn(f"the process group was created without {text}; {fix}", RuntimeWarning, stacklevel=3)
