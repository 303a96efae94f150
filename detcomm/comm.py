"""The communicator: one per process group. It owns the group's sites, their route decisions, the startup
self-checks and the route backends, and validates every call before any communication happens.

Which calls are collective (every rank of the group must make them, in the same order):
  - construction (``detcomm.init``): runs the startup self-checks;
  - ``site(...)`` when it declares a new site (its declaration is compared across ranks, cached self-check or
    not, and a new (route, collective, op, dtype, shape) runs its self-check), and the first call of an
    undeclared site (which declares it);
  - every collective call (``all_reduce``, ``all_gather``, ...);
  - ``close()``.
``routes()`` and ``checks()`` are local.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import envelope as _env
from .backends import A2AFoldBackend, GatherFoldBackend, NativeBackend, RsAgFoldBackend
from .backends import guard as _guard
from .backends.guard import SHUTDOWN, CallHeader, shutdown_header
from .dtypes import SUPPORTED_DTYPES, from_name, name_of
from .numerics.fold import BATCH_INVARIANT, FLOAT_DTYPES, Leaf, select_leaf
from .route import AutoBackend, RouteEntry, RouteTable
from .selfcheck import CheckResult, SelfChecks, declaration
from .sites import (
    DEFAULT_MAX_ROWS,
    DEFAULT_WORKSPACE_BYTES,  # defined with the sites' vocabulary, torch-free (the static route view reads it)
    DEFAULT_WORKSPACE_MAX_ROWS,
    NO_ARGS,
    BoundRoute,
    CallArgs,
    Capabilities,
    Collective,
    ReduceOp,
    Route,
    RouteBackend,
    Site,
)
from .topology import discover as discover_topology

if TYPE_CHECKING:
    from .workspace import Workspace
from .deadline import DEFAULT_TIMEOUT_S, is_timeout, peer_timeout
from .errors import CollectiveFailed, CollectiveMismatch, ConcurrentCall, DetcommError, WorkspaceUnavailable
from .numerics import norm as _norm
from .verify import CallChecker
from .work import Work

__all__ = ["Communicator", "SiteCall", "RouteTable", "RouteEntry"]

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
        stage_through_host: bool | None = None,
        call_guard: str | None = None,
    ) -> None:
        """``stage_through_host``: whether CUDA tensors go through host memory to the library (None: a gloo
        group's do). ``call_guard`` replaces the call guard the group's kind picks (backends/guard.py): "header" or
        "in_message" (tests run the device groups' in-message guard on gloo), or "none", which the
        torch.distributed backend's CUDA communicator takes: the in-message guard reads each call's headers back
        on the host, and DDP / FSDP overlap their collectives with compute only while the host runs ahead."""
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
        # Whether CUDA tensors go through host memory to the library: a gloo group's do; a group that carries CUDA
        # tensors itself under another name (the "detcomm" torch.distributed backend over NCCL) says so.
        staged = (self.device.type == "cuda" and "nccl" not in self.backend_name if stage_through_host is None
                  else stage_through_host)
        # The one guard every call carries, from static facts (backends/guard.py): a separate header where the
        # messages live in host memory, the header inside each route's messages where they live on the device.
        self.call_guard = _guard.mode(world_size=self.world_size, messages_on_device=self.device.type == "cuda" and not staged,
                                      checking=check, forced=call_guard)
        self._native = NativeBackend(group, stage_through_host=staged, in_message=self.call_guard == _guard.IN_MESSAGE)
        self._backends: dict[Route, RouteBackend] = {
            Route.NATIVE: self._native,
            Route.GATHER_FOLD: GatherFoldBackend(self._native, self.leaf),
            Route.A2A_FOLD: A2AFoldBackend(self._native, self.leaf),
            Route.RS_AG_FOLD: RsAgFoldBackend(self._native, self.leaf),
        }
        self._workspace: Workspace | None = None
        # One collective call at a time per communicator (SiteCall.run): the ranks pair calls by their order.
        self._lock = threading.RLock()
        # The deadline in force, for the errors: init's timeout_s, detcomm's default on a group it creates,
        # else the group's own (unknown here: None).
        self.deadline_s: float | None = timeout_s if timeout_s is not None else (DEFAULT_TIMEOUT_S if owns_group else None)
        t0 = time.perf_counter()
        self._agree_at_init(check=check, selfcheck=selfcheck, default_max_rows=default_max_rows, workspace=workspace,
                            call_guard=self.call_guard)
        self.caps = self._discover_capabilities(workspace, workspace_max_rows, workspace_bytes, timeout_s)
        # Cross-rank call verification (detcomm/verify.py); timeout_s only names the group's timeout in its errors.
        self._verifier = (CallChecker(native=self._native, device=self.device, rank=self.rank,
                                      world_size=self.world_size, timeout_s=timeout_s) if check else None)
        self._selfchecks = SelfChecks(native=self._native, device=self.device)
        self.auto = AutoBackend(resolved, self.caps, backends=self._backends,
                                checker=self._selfchecks if selfcheck else None, leaf=self.leaf.name)
        self._sites: dict[str, Site] = {}
        self._site_calls: dict[str, SiteCall] = {}  # the declared sites' bound calls: every call goes through one
        self._implicit_where: dict[str, str] = {}  # site declared by its first call -> where that call came from
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
            "call guard=%s; workspace: %s; %d self-checks (%d failed) in %.3f s; init took %.3f s",
            self.backend_name, self.world_size, self.rank, self.device, self.caps.topology, self.resolved.numerics,
            self.leaf.name, ",".join(routes) or "-", self.call_guard, self.caps.workspace_reason, len(checks), len(failed),
            self._selfchecks.seconds(), seconds)

    # -- startup ------------------------------------------------------------------------------------
    def _agree_at_init(self, **options: object) -> None:
        """Before any other collective: every rank must run the same envelope, checking mode and options, or
        the group's calls would pair wrongly later (a self-check one rank skips, a fingerprint one rank does not
        send). One object all-gather; on a difference every rank raises ``CollectiveMismatch`` naming it."""
        mine = {**_env.fingerprint(self.resolved), **{k: repr(v) for k, v in options.items()},
                "device": self.device.type, "W": str(self.world_size)}
        everyone: list[dict[str, str]] = [{}] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)  # type: ignore[arg-type]
        differ = [k for k in mine if len({e.get(k) for e in everyone}) > 1]
        if differ:
            parts = "; ".join(f"{k}: " + ", ".join(f"rank {r}={e.get(k)}" for r, e in enumerate(everyone))
                              for k in differ)
            raise CollectiveMismatch(
                f"detcomm.init on rank {self.rank}: the ranks initialized differently ({parts}). Give every rank the "
                "same init arguments and environment (DETCOMM_NUMERICS, DETCOMM_CHECK): detcomm-launch exports "
                "them to every rank"
            )

    def _discover_capabilities(self, workspace: bool | None, max_rows: int, capacity: int,
                               timeout_s: float | None) -> Capabilities:
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
        store = (f"one-store kernel up to {ws.one_store_max_bytes // 1024} KiB" if ws.one_store_max_bytes
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
        dtype: torch.dtype | str,
        shape: int | Sequence[int],
        max_rows: int,
        op: str | ReduceOp = "sum",
        route: str | Route | None = None,
        virtual_shards: int | None = None,
        shard_fold: str = "order",
    ) -> Site:
        """Declare a call site (see ``detcomm.site``). Collective when the site is new (``_agree_declaration``)."""
        self._check_open()
        shape = _shape(shape, name)
        coll = _enum(Collective, collective, "collective", name)
        rop = ReduceOp.MAX if coll is Collective.ARGMAX and op == "sum" else _enum(ReduceOp, op, "op", name)
        s = Site(
            name=name,
            collective=coll,
            dtype=_dtype(dtype, name),
            shape=shape,
            max_rows=max_rows,
            op=rop,
            group=self.group_label,
            route=None if route is None else _enum(Route, route, "route", name),
            virtual_shards=virtual_shards,
            shard_fold=shard_fold,
        )
        return self._declare(s)

    def _declare(self, s: Site, *, where: str = "") -> Site:
        existing = self._sites.get(s.name)
        if existing is not None:
            if existing != s:
                raise ValueError(
                    f"site {s.name!r} is {self._declared_as(existing)}"
                    f"{' (route=' + existing.route.value + ')' if existing.route else ''}; the new declaration "
                    f"{s.describe()} contradicts it. A site is static: use another name for the other call."
                )
            return existing
        # A declaration the router refuses by itself (a forced route the envelope voids) is refused before the
        # exchange, on the rank that made it, as every other bad input is: it depends only on the declaration.
        self.auto.candidates(s)
        with self._exclusive(s.name):  # the declaration exchange and routing's self-check are collectives
            self._agree_declaration(s)
            bound = self.auto.route(s)
        self._sites[s.name] = s
        self._site_calls[s.name] = SiteCall(self, s, bound)
        if where:
            self._implicit_where[s.name] = where
        return s

    def _agree_declaration(self, s: Site) -> None:
        """Every new declaration is proven the same on every rank, whether or not its self-check is cached (a
        cached check runs no collective, so a rank whose declaration differs would otherwise wait alone in its
        own check), and every rank refuses a site too large for this device's memory before its self-check
        allocates (a check that ran out of memory would read as the route's failure). One header all-gather;
        on a difference every rank raises ``CollectiveMismatch`` naming each rank's declaration. Collective."""
        need, have = _site_bytes(s, self.world_size), _allocatable(self.device)
        fits = need <= have
        if self.world_size > 1:
            header, readable = declaration(s, "new site")
            if not fits:
                readable += f" (too large: {need} B > {have} B of {self.device.type} memory)"
            _guard.exchange(self._native, [*header, int(fits)], readable, device=self.device)
        if not fits:
            raise ValueError(
                f"site {s.name!r} ({s.describe()}, max_rows={s.max_rows}): one call at max_rows carries {need} bytes "
                f"(max_rows x {s.row_numel} elements per row), more than this {self.device.type} "
                f"device's {have} bytes of memory, so no route can serve it (nothing was self-checked or refused). "
                "Declare the real trailing shape and the most rows a call carries"
            )

    def _declared_as(self, s: Site) -> str:
        if s.name in self._implicit_where:
            return (f"declared implicitly by its first call ({self._implicit_where[s.name]}) as {s.describe()}, "
                    f"max_rows={s.max_rows} (init's default_max_rows); declare it with detcomm.site() before its "
                    "first call to choose its shape and rows")
        return f"declared as {s.describe()}"

    def _resolve(self, site: object, collective: Collective, x: object, op: object, *,
                 rows_per_rank: Sequence[int] | None = None, uneven: bool = False) -> SiteCall:
        """The bound call of the site a call names, declaring an undeclared site from its first call. Raises the
        precise error for a closed communicator, a foreign or unknown site, and a call that contradicts the site's
        collective or op (the tensor itself is checked by ``SiteCall.check``)."""
        self._check_open()
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
        rop = _enum(ReduceOp, op, "op", name)
        sc = self._site_calls.get(name)
        if sc is None:
            self._check_tensor(name, x)
            assert isinstance(x, torch.Tensor)
            rows = max(rows_per_rank) if rows_per_rank is not None else x.shape[0]
            if rows > self.default_max_rows:
                raise ValueError(
                    f"site {name!r}: first call carries {rows} rows, more than the default max_rows "
                    f"{self.default_max_rows} of an undeclared site; declare it with detcomm.site({name!r}, ..., "
                    f"max_rows=N) or raise init(default_max_rows=...)"
                )
            # A declaration that runs a self-check first proves that every rank declares the same site
            # (SelfChecks); the call itself is then proven by SiteCall.run as every call is. With checking on,
            # the call's fingerprint goes first instead (every rank's checker then counts the same calls, whether
            # or not this rank's declaration runs a self-check).
            implicit = Site(name, collective, x.dtype, tuple(x.shape[1:]), self.default_max_rows, rop,
                            self.group_label, implicit=True)
            if self._verifier is not None:
                with self._exclusive(name):
                    self._verifier.agree(name, collective, rop, x, rows_per_rank=rows_per_rank,
                                         uneven=uneven)
            self._declare(implicit, where=_caller())
            sc = self._site_calls[name]
            sc.agreed = self._verifier is not None
            return sc
        if sc.virtual and sc.collective is collective and rop is not ReduceOp.SUM:
            raise ValueError(f"site {name!r} folds {sc.site.virtual_shards} virtual shards: op must be 'sum', got "
                             f"{rop.value!r}; divide the result for a mean")
        problems = []
        if sc.collective is not collective:
            problems.append(f"collective {collective.value} != {sc.collective.value}")
        if sc.op is not rop:
            problems.append(f"op {rop.value} != {sc.op.value}")
        if problems:
            raise ValueError(f"site {name!r} was {self._declared_as(sc.site)}; this call contradicts it: "
                             f"{'; '.join(problems)}. A site is static: declare another site for this call.")
        return sc

    def _check_tensor(self, name: str, x: object) -> None:
        """What any call's tensor must be before its site is known (an undeclared site's first call)."""
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
        _check_grad(name, x)

    @contextlib.contextmanager
    def _exclusive(self, name: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise self._busy(name)
        try:
            yield
        finally:
            self._lock.release()

    def _busy(self, name: str) -> ConcurrentCall:
        return ConcurrentCall(
            f"site {name!r} on rank {self.rank}: another thread is inside a collective call of this communicator. "
            "The ranks pair calls by their order, which two threads cannot keep: make "
            "one thread issue the group's collectives, or give each thread its own process group and communicator "
            "(detcomm.init(group=torch.distributed.new_group(...)))"
        )

    def _failure(self, name: str, call: int, e: RuntimeError) -> DetcommError:
        """The error a route's library error becomes: it names the site, the call, this rank and the cause."""
        if is_timeout(e):
            return peer_timeout(name, call, e, group=self.group, rank=self.rank, timeout_s=self.deadline_s)
        return CollectiveFailed(
            f"site {name!r}, call #{call} on rank {self.rank} of {self.world_size}: the collective failed in "
            f"torch.distributed ({self.backend_name}): {e}. A peer died, closed its process group, or made another "
            "call; the first rank that failed is the one to look at (detcomm-launch names it)"
        )

    # -- collectives --------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, site: str | Site, *, op: str = "sum", out: torch.Tensor | None = None,
                   async_op: bool = False) -> torch.Tensor | Work:
        """Reduce every rank's ``x`` (sum, avg, max or min); identical bits on every rank.

        Returns a new tensor, or ``out`` when given (``out=x`` reduces in place). ``async_op=True`` returns a
        ``detcomm.Work`` handle instead (``.wait()``, ``.result()``). Collective.

        On a virtual-shard site ``x`` is this rank's [V/W, rows, *shape] fp32 partial sums and the result is
        [rows, *shape] in the site's dtype (docs/spec.md §9.1)."""
        sc = self._site_calls.get(site if type(site) is str else _name_of(site))  # the hot path: one lookup
        if sc is None or sc.collective is not Collective.ALL_REDUCE or op != sc.op or (type(site) is not str and site is not sc.site):
            sc = self._resolve(site, Collective.ALL_REDUCE, x, op)
        return sc.call(x, out, async_op)

    def reduce_scatter(self, x: torch.Tensor, site: str | Site, *, op: str = "sum", out: torch.Tensor | None = None,
                       async_op: bool = False) -> torch.Tensor | Work:
        """Rank r receives row block r of the reduction; ``x.shape[0]`` must divide by the world size.
        ``out`` (``x.shape[0] // W`` rows) and ``async_op`` as for ``all_reduce``. Collective.

        On a virtual-shard site ``x`` is this rank's [V/W, rows, *shape] fp32 partial sums and rank r receives
        row block r of the folded [rows, *shape] result, in the site's dtype (docs/spec.md §9.1)."""
        sc = self._site_calls.get(site if type(site) is str else _name_of(site))
        if sc is None or sc.collective is not Collective.REDUCE_SCATTER or op != sc.op or (type(site) is not str and site is not sc.site):
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] % self.world_size and not (
                    isinstance(site, (str, Site)) and self._is_virtual(site)):
                name = site.name if isinstance(site, Site) else site
                raise ValueError(_rs_rows(name, x.shape[0], self.world_size))
            sc = self._resolve(site, Collective.REDUCE_SCATTER, x, op)
        return sc.call(x, out, async_op)

    def _is_virtual(self, site: str | Site) -> bool:
        sc = self._site_calls.get(site.name if isinstance(site, Site) else site)
        return sc is not None and sc.site.virtual_shards is not None

    def all_gather(self, x: torch.Tensor, site: str | Site, *, out: torch.Tensor | None = None,
                   async_op: bool = False) -> torch.Tensor | Work:
        """Every rank's ``x`` concatenated along dim 0 in rank order (``out``: ``W * rows`` rows). Collective."""
        sc = self._site_calls.get(site if type(site) is str else _name_of(site))
        if sc is None or sc.collective is not Collective.ALL_GATHER or (type(site) is not str and site is not sc.site):
            sc = self._resolve(site, Collective.ALL_GATHER, x, ReduceOp.SUM)
        return sc.call(x, out, async_op)

    def all_reduce_residual_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                                    eps: float, site: str | Site) -> tuple[torch.Tensor, torch.Tensor]:
        """s = the site's all-reduce of ``x``; r = round(residual + s); y = RMSNorm(r) in the canonical order
        (docs/spec.md §9). Returns ``(y, r)``. Arguments are checked before any communication. Collective.

        On a virtual-shard site ``x`` is this rank's [V/W, rows, *shape] fp32 partial sums, s their virtual
        all-reduce (§9.1, the tree order where declared so), and ``residual`` the [rows, *shape] rows in the site's
        dtype (docs/spec.md §9.2 "Tree sites")."""
        self._check_open()
        name = site.name if isinstance(site, Site) else site
        if type(name) is str and name not in self._site_calls:
            # An undeclared site is declared from this call (a self-check is collective): its arguments first.
            _norm._check_add(f"site {name!r}: all_reduce_residual_rmsnorm", x, residual, weight)
            _norm.eps_fp32(eps)
        sc = self._resolve(site, Collective.ALL_REDUCE_RMSNORM, x, ReduceOp.SUM)
        sc.check_norm(x, residual, weight, eps)
        return sc.run_norm(x, residual, weight, eps)

    def token_all_gather(self, x: torch.Tensor, site: str | Site, *, rows_per_rank: Sequence[int]) -> torch.Tensor:
        """Uneven all-gather: rank r contributes ``rows_per_rank[r]`` rows; concatenated in rank order. Collective."""
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
        sc = self._resolve(site, Collective.TOKEN_ALL_GATHER, x, ReduceOp.SUM, rows_per_rank=counts)
        if max(counts) > sc.site.max_rows:
            raise ValueError(f"site {name!r}: rows_per_rank {counts} exceeds the declared max_rows="
                             f"{sc.site.max_rows}; declare the site with a larger max_rows")
        sc.check(x, None)
        return sc.run(x, CallArgs(rows_per_rank=tuple(counts)), rows_per_rank=counts)

    def all_to_all(self, x: torch.Tensor, site: str | Site, *, splits: Sequence[int] | None = None,
                   out_splits: Sequence[int] | None = None) -> torch.Tensor:
        """Rank r sends its row block q to rank q and receives, in rank order, every rank's block r. Collective.

        ``splits=None``: even blocks (rows divisible by W). Otherwise ``splits[q]`` rows go to rank q; the
        counts each rank receives are exchanged first (one small extra all-to-all), unless the caller already
        knows them: ``out_splits[q]`` = the rows rank q sends here (it must equal rank q's ``splits[r]``). Given
        counts are compared with what the peers send (one small all-gather of both count lists, after the call
        guard proved the call and before any row moves): a count that disagrees raises ``CollectiveMismatch``
        on every rank, naming the sender, the receiver and both counts, instead of a transport abort or rows
        read past a message.
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
        sc = self._resolve(site, Collective.ALL_TO_ALL, x, ReduceOp.SUM, uneven=splits is not None)
        sc.check(x, None)
        if splits is None:
            n = x.shape[0] // self.world_size
            return sc.run(x, CallArgs(in_splits=(n,) * self.world_size, out_splits=(n,) * self.world_size))
        def counts() -> CallArgs:  # under the call's lock, after its guard: one collective call
            outs = (self._native.exchange_splits(in_splits, self.device) if known is None
                    else self._agree_splits(name, in_splits, known))
            return CallArgs(in_splits=tuple(in_splits), out_splits=tuple(outs))

        return sc.run(x, NO_ARGS, uneven=True, prepare=counts)

    def _agree_splits(self, name: str, in_splits: list[int], out_splits: list[int]) -> list[int]:
        """``out_splits`` after proving that every rank's ``out_splits[q]`` equals rank q's ``splits[r]``: every rank
        gathers every rank's two count lists and checks the whole matrix, so every rank reaches the same verdict.
        Collective (the call guard already proved that every rank makes this call, so the gathers pair)."""
        w = self.world_size
        if w == 1:
            if out_splits != in_splits:
                raise ValueError(f"site {name!r}: out_splits {out_splits} != splits {in_splits} on one rank")
            return out_splits
        mine = torch.tensor([*in_splits, *out_splits], dtype=torch.int64, device=self.device)
        both = self._native.all_gather(mine).view(w, 2, w).tolist()
        wrong = [f"rank {r} expects out_splits[{q}]={both[r][1][q]} rows from rank {q}, which sends it "
                 f"splits[{r}]={both[q][0][r]}" for r in range(w) for q in range(w) if both[r][1][q] != both[q][0][r]]
        if wrong:
            raise CollectiveMismatch(
                f"site {name!r} on rank {self.rank}: the uneven all_to_all's counts disagree ({'; '.join(wrong)}); "
                "nothing was sent. Pass each rank the out_splits its peers send (rank r's out_splits[q] = rank q's "
                "splits[r]), or leave out_splits=None and the counts are exchanged"
            )
        return out_splits

    def argmax(self, logits_shard: torch.Tensor, site: str | Site, *, vocab_start: int) -> torch.Tensor:
        """Vocabulary-parallel argmax: int64 global index per row; lowest index on exact ties; -0.0 == +0.0;
        NaN counts as the largest value (as torch.argmax). Collective."""
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
        sc = self._resolve(site, Collective.ARGMAX, logits_shard, ReduceOp.MAX)
        sc.check(logits_shard, None)
        return sc.run(logits_shard, CallArgs(vocab_start=vocab_start))

    # -- introspection and lifecycle ----------------------------------------------------------------
    def routes(self) -> RouteTable:
        """The route table of the declared sites (local; identical on every rank)."""
        return self.auto.table(list(self._sites.values()),
                               note=f"topology: {self.caps.topology}; workspace: {self.caps.workspace_reason}")

    def checks(self) -> list[CheckResult]:
        """Every self-check run on this group so far, in order (local)."""
        return list(self._selfchecks.results.values())

    def synchronize(self) -> None:
        """Wait for this rank's device work and raise ``WorkspaceFailed`` if a workspace call failed (local).

        A workspace call returns once its kernel is enqueued; its failure is raised at this rank's next detcomm
        call or here. ``torch.cuda.synchronize()`` waits for the kernels but reads no failure record: call this
        before trusting the outputs of the last calls (docs/spec.md §9.3). A no-op on CPU groups."""
        self._check_open()
        if self._workspace is not None:
            self._workspace.synchronize()
        elif self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Release this communicator's resources (collective). The process group is destroyed only if
        ``detcomm.init`` created it.

        On a group init created, the ranks first exchange the call guard's shutdown header (host-memory groups;
        the call checker's fingerprint with checking on), so a rank that shuts down while its peers still call a
        site makes every rank raise ``CollectiveMismatch`` naming it at once, instead of leaving the group to the
        deadline; this rank's resources are released either way."""
        if self._closed:
            return
        self._closed = True
        calls = sum(sc.calls for sc in self._site_calls.values())
        self._site_calls.clear()
        failed: BaseException | None = None
        try:
            # Only where close is collective anyway (it ends with the barrier of the group it destroys); on a
            # caller's group closing a communicator stays local.
            if self.owns_group and self._verifier is not None:
                self._verifier.agree(SHUTDOWN, Collective.ALL_GATHER, ReduceOp.SUM,
                                     torch.empty(0, device=self.device))
            elif self.owns_group and self.call_guard == _guard.HEADER:
                shutdown_header(self._native, device=self.device, calls=calls)
        except RuntimeError as e:
            failed = e if isinstance(e, DetcommError) else self._failure(SHUTDOWN, 1, e)
        if self._workspace is not None:
            if failed is None:
                self._workspace.close()
            else:
                self._workspace.abort()
            self._workspace = None
        if self.owns_group and dist.is_initialized():
            # Every rank leaves its last collective before any rank tears its transport down; without this a
            # gloo rank can be torn down under a peer still draining the final message (abort at exit).
            if failed is None:
                dist.barrier(group=self.group)
            dist.destroy_process_group()
        # Drop every reference to the process group: a ProcessGroup object outliving destroy_process_group is
        # finalized at interpreter exit, where gloo's worker threads can abort the process.
        # Every holder of the native backend counts: the bound calls, the call checker, the self-checks, the router.
        self._backends.clear()
        self._verifier = None
        self._selfchecks = None  # type: ignore[assignment]
        self.auto.release()
        self._native = None  # type: ignore[assignment]
        self.group = None  # type: ignore[assignment]
        if failed is not None:
            raise failed

    def _check_open(self) -> None:
        if self._closed:
            raise DetcommError("this detcomm communicator was shut down (detcomm.shutdown() or close()); call "
                               "detcomm.init() again for a new one")

    @property
    def _bound(self) -> dict[str, BoundRoute]:
        """The declared sites' bound routes, by name (read-only view; ``SiteCall.bound`` is the one a call uses)."""
        return {name: sc.bound for name, sc in self._site_calls.items()}


class SiteCall:
    """One declared site's call path, built once at declaration; every entry (eager, ``out=``, async, the fused
    norm, graph capture) goes through it.

    ``check(x, out)`` is the site's one validator: each fact a call must match (type, dtype, trailing shape,
    rows, device, contiguity, autograd, the output's shape, dtype, device and overlap) is one comparison against
    a value cached here, and a failed comparison raises its precise error, before any communication.
    ``run(x, args)`` is the one way a call reaches the route: it refuses a second thread, counts the site's user
    calls, proves across ranks that every rank makes this call (``init(check=True)``'s full comparison, else the
    call guard: its separate fixed-size header, or the header the route carries in its messages, armed here;
    backends/guard.py), calls the bound route and turns a library error into a
    ``PeerTimeout`` or ``CollectiveFailed`` that names the site, the call, this rank and the cause."""

    __slots__ = ("comm", "site", "name", "bound", "collective", "op", "dtype", "in_dtype", "ndim", "row_dim",
                 "width", "tail", "lead", "max_rows", "device", "in_place", "mul", "div", "header", "message", "calls",
                 "virtual", "fused", "agreed")

    def __init__(self, comm: Communicator, site: Site, bound: BoundRoute) -> None:
        self.comm = comm
        self.site = site
        self.name = site.name
        self.bound = bound
        self.collective = site.collective
        self.op = site.op
        self.dtype = site.dtype
        v = site.virtual_shards
        self.virtual = v is not None
        # A virtual-shard call passes this rank's V/W fp32 partials [V/W, rows, *shape] (docs/spec.md §9.1).
        self.lead: tuple[int, ...] = () if v is None else (v // comm.world_size,)
        self.in_dtype = torch.float32 if self.virtual else site.dtype
        self.row_dim = len(self.lead)
        self.ndim = self.row_dim + 1 + len(site.shape)
        self.tail = site.shape
        # One trailing dimension (a hidden size: the usual site) is compared as an int: slicing a torch.Size
        # builds a new one on every call. None: compare the whole trailing shape.
        self.width = site.shape[0] if len(site.shape) == 1 and not self.virtual else None
        self.max_rows = site.max_rows
        self.device = comm.device
        self.in_place = bound.in_place and not self.virtual
        # The output's rows are the input's * mul // div; a reduce_scatter's input rows must divide by div.
        self.mul = comm.world_size if site.collective is Collective.ALL_GATHER else 1
        self.div = comm.world_size if site.collective is Collective.REDUCE_SCATTER else 1
        # The call guard (backends/guard.py): the separate header, or the one the route carries in its messages.
        self.header = (CallHeader(site, native=comm._native, device=comm.device)
                       if comm.call_guard == _guard.HEADER else None)
        self.message = getattr(bound, "guard", None)
        self.calls = 0  # this site's user calls on this communicator (named in errors; self-checks not counted)
        self.fused = getattr(bound, "fused", None)  # the workspace's fused norm kernel, where routing chose it
        self.agreed = False  # the next call's fingerprint was already compared (Communicator._resolve)

    def check(self, x: object, out: object) -> torch.Tensor | None:
        """Validate a call (see the class docstring); returns what the route gets as ``CallArgs.out`` (None:
        it allocates, and the collective copies the result into ``out``)."""
        if type(x) is not torch.Tensor and not isinstance(x, torch.Tensor):
            raise TypeError(f"site {self.name!r}: expected a torch.Tensor, got {type(x).__name__}")
        sh = x.shape
        if (len(sh) != self.ndim or x.dtype is not self.in_dtype
                or (sh[1] != self.width if self.width is not None else sh[self.row_dim + 1:] != self.tail)
                or (self.virtual and sh[0] != self.lead[0])):
            self._contradiction(x)
        rows = sh[self.row_dim]
        if rows > self.max_rows:
            raise ValueError(f"site {self.name!r}: {rows} rows exceed the declared max_rows={self.max_rows}; "
                             "declare the site with a larger max_rows (the most rows it will ever carry)")
        if rows % self.div:
            raise ValueError(_rs_rows(self.name, rows, self.div))
        if x.device != self.device:
            self.comm._check_tensor(self.name, x)
        if not x.is_contiguous():
            raise ValueError(f"site {self.name!r}: tensor is not contiguous; pass x.contiguous()")
        if x.requires_grad:
            _check_grad(self.name, x)
        if out is None:
            return None
        if out is x:
            return x if self.in_place else None
        if type(out) is not torch.Tensor and not isinstance(out, torch.Tensor):
            raise TypeError(f"site {self.name!r}: out must be a torch.Tensor, got {type(out).__name__}")
        osh = out.shape
        if self.mul == self.div == 1 and not self.virtual:
            bad = osh != sh
        else:
            bad = (len(osh) != 1 + len(self.tail) or osh[0] != rows * self.mul // self.div
                   or osh[1:] != sh[self.row_dim + 1:])
        if bad or out.dtype is not self.dtype or out.device != self.device:
            want = [rows * self.mul // self.div, *self.tail]
            raise ValueError(
                f"site {self.name!r}: out must be a {name_of(self.dtype)} tensor of shape {want} on {self.device}, "
                f"got {str(out.dtype).replace('torch.', '')} {list(osh)} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(f"site {self.name!r}: out is not contiguous; pass a contiguous buffer")
        a, b = out.data_ptr(), x.data_ptr()
        if a == b:  # x's bytes (x itself, or another view of them): in place
            return out if self.in_place else None
        if a < b + x.nbytes and b < a + out.nbytes:
            raise ValueError(f"site {self.name!r}: out partially overlaps the input; pass out=x (in place) or a "
                             "separate buffer")
        return None if self.virtual else out

    def _contradiction(self, x: torch.Tensor) -> None:
        name, s = self.name, self.site
        if x.dim() < 1:
            raise ValueError(f"site {name!r}: expected a tensor of rows (at least 1-D, dim 0 = rows), got a 0-d tensor")
        if self.virtual:
            k, v = self.lead[0], s.virtual_shards
            r = self.comm.rank
            want = f"float32 [V/W={k}, rows, {', '.join(map(str, s.shape))}]"
            mine = f"this rank's {k} fp32 partial sums (shards {r * k}..{r * k + k - 1} of {v})"
            if x.dtype != torch.float32:
                raise ValueError(f"site {name!r}: a virtual-shard call takes {mine} as {want}; got dtype "
                                 f"{str(x.dtype).replace('torch.', '')}: pass the GEMM's fp32 partials "
                                 "(out_dtype=torch.float32), not values rounded to the output dtype")
            raise ValueError(f"site {name!r}: a virtual-shard call takes {mine} as {want}; got shape "
                             f"{list(x.shape)}: stack this rank's shards on dim 0 (V={v}, W={self.comm.world_size})")
        problems = []
        if x.dtype != s.dtype:
            problems.append(f"dtype {str(x.dtype).replace('torch.', '')} != {name_of(s.dtype)}")
        if tuple(x.shape[1:]) != s.shape:
            problems.append(f"trailing shape {tuple(x.shape[1:])} != {s.shape}")
        raise ValueError(
            f"site {name!r} was {self.comm._declared_as(s)}; this call contradicts it: {'; '.join(problems)}. "
            "A site is static: declare another site for this call (or cast/reshape the input)."
        )

    def call(self, x: torch.Tensor, out: torch.Tensor | None, async_op: bool) -> torch.Tensor | Work:
        """A plain collective entry (all_reduce, reduce_scatter, all_gather): validate, run, deliver into ``out``
        where given, wrap in a ``Work`` for ``async_op``. Collective."""
        target = self.check(x, out)
        result = self.run(x, NO_ARGS if target is None else CallArgs(out=target))
        if out is not None and result is not out:
            out.copy_(result)
            result = out
        return Work(result) if async_op else result

    def run(self, x: torch.Tensor, args: CallArgs, *, rows_per_rank: Sequence[int] | None = None,
            uneven: bool = False, prepare: Callable[[], CallArgs] | None = None) -> torch.Tensor:
        """The call through the bound route (see the class docstring). ``prepare``: builds the route's arguments
        after the call is proven and before its data moves (an uneven all_to_all's count exchange). Collective."""
        comm = self.comm
        if not comm._lock.acquire(False):
            raise comm._busy(self.name)
        try:
            self._prove(x, rows_per_rank, uneven)
            if prepare is not None:
                args = prepare()
            return self.bound(x, args)
        except RuntimeError as e:  # torch.distributed.DistError derives from it
            if isinstance(e, DetcommError):
                raise
            raise comm._failure(self.name, self.calls, e) from e
        finally:
            comm._lock.release()

    def _prove(self, x: torch.Tensor, rows_per_rank: Sequence[int] | None, uneven: bool) -> None:
        """Count the call and prove across ranks that every rank makes it (the checker's fingerprint with checking
        on, else the call guard's separate header), before its data moves; or arm the header the route carries
        in its messages (compared before the route returns). Collective; runs under
        the communicator's lock, for run and the fused norm alike."""
        comm = self.comm
        self.calls += 1
        if comm._verifier is not None:
            if self.agreed:  # the first call's fingerprint went before the site's implicit declaration
                self.agreed = False
            else:
                comm._verifier.agree(self.name, self.collective, self.op, x, rows_per_rank=rows_per_rank,
                                     uneven=uneven)
        elif self.header is not None:
            # Inside a CUDA-graph capture no header can be exchanged (host traffic): captured calls carry no guard,
            # as with the in-message guard (backends/guard.py). This is what lets a gloo-staged CUDA group capture
            # its ipc_fold calls, whose kernels compare their own per-call descriptor.
            if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                self.header.exchange(self.calls, -1 if uneven or rows_per_rank is not None else x.shape[self.row_dim],
                                     rows_per_rank)
        elif self.message is not None:
            self.message.arm(self.calls, -1 if uneven or rows_per_rank is not None else x.shape[self.row_dim],
                             rows_per_rank)

    def check_norm(self, x: object, residual: object, weight: object, eps: float) -> None:
        """Validate an all_reduce_residual_rmsnorm call before any communication: x as every call of the site
        (``check``: a virtual-shard site's fp32 partials [V/W, rows, *shape]), the residual as the all-reduced
        rows ([rows, *shape] in the site's dtype, on this communicator's device), the weight [H] and eps."""
        what = f"site {self.name!r}: all_reduce_residual_rmsnorm"
        if not self.virtual:
            _norm._check_add(what, x, residual, weight)  # type: ignore[arg-type]
        self.check(x, None)
        if self.virtual:
            assert isinstance(x, torch.Tensor)
            _norm.check_residual(what, residual, weight, dtype=self.dtype, shape=tuple(x.shape[1:]),
                                 device=self.device)
        _norm.eps_fp32(eps)

    def run_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """An all_reduce_residual_rmsnorm call: the fused kernel where routing chose it, else the all-reduce
        through ``run`` and the canonical norm. Collective."""
        if self.fused is None:
            return _norm.add_rms_norm(self.run(x, NO_ARGS), residual, weight, eps=eps)
        comm = self.comm
        if not comm._lock.acquire(False):
            raise comm._busy(self.name)
        try:
            self._prove(x, None, False)
            return self.fused(x, residual, weight, eps)  # type: ignore[no-any-return]
        except RuntimeError as e:
            if isinstance(e, DetcommError):
                raise
            raise comm._failure(self.name, self.calls, e) from e
        finally:
            comm._lock.release()


def _name_of(site: object) -> str:
    """A Site's name ("" for anything else; the identity test after the lookup sends it to the resolution)."""
    return site.name if type(site) is Site else ""


def _check_grad(name: str, x: torch.Tensor) -> None:
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"site {name!r}: the input requires grad, and detcomm's collectives are forward-only (no backward: "
            "gradients would silently stop here). Call it under torch.no_grad() / torch.inference_mode() "
            "(serving), pass x.detach(), or use torch.distributed.nn.functional's collectives to train through it"
        )


def _rs_rows(name: str, rows: int, w: int) -> str:
    return (f"site {name!r}: reduce_scatter needs a row count divisible by the world size {w} (rank r receives "
            f"row block r); got {rows} rows: pad to {-(-rows // w) * w}")


def _dtype(dtype: object, name: str) -> torch.dtype:
    """A site's dtype: a torch dtype, or its name ("bfloat16")."""
    if isinstance(dtype, str):
        return from_name(dtype.removeprefix("torch."))
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"site {name!r}: dtype must be a torch.dtype or its name (\"bfloat16\"), got {dtype!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"site {name!r}: dtype {dtype} is not supported; use one of "
                         f"{[str(d) for d in SUPPORTED_DTYPES]}")
    return dtype


def _shape(shape: object, name: str) -> tuple[int, ...]:
    """A site's ``shape=`` argument as a tuple: one row's trailing shape, an int (one dimension, as torch accepts
    an int for a 1-D size) or a sequence of ints. The ints themselves are checked by ``Site``."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        return (shape,)
    if isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)):
        return tuple(shape)
    raise TypeError(
        f"site {name!r}: shape= is one row's trailing shape: an int (the row width, e.g. 4096) or a sequence of "
        f"ints (e.g. (8, 128); () for scalar rows), got {shape!r} ({type(shape).__name__})"
    )


def _site_bytes(s: Site, world_size: int) -> int:
    """What one call at max_rows passes on this rank: max_rows rows of the site's trailing shape (the fp32
    partials of V/W shards per row on a virtual-shard site)."""
    if s.virtual_shards is not None:
        return s.max_rows * s.row_numel * 4 * max(1, s.virtual_shards // world_size)
    return s.max_rows * s.row_numel * s.dtype.itemsize


def _allocatable(device: torch.device) -> int:
    """The device's total memory in bytes (total, not free: the same on every rank of one host and at any time,
    so every rank reaches the same verdict; what is free is the allocator's to report). Unknown: no limit."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # no sysconf on this platform
        return sys.maxsize


def _caller() -> str:
    """file:line of the first frame outside detcomm (where an implicit declaration came from)."""
    here = os.path.dirname(os.path.abspath(__file__))
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(here + os.sep):
        f = f.f_back  # type: ignore[assignment]
    return "unknown caller" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


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
