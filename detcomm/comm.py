"""The communicator: one per process group. It owns the group's sites, their route decisions, the startup
self-checks and the route implementations; every call goes through its site's one call path (calls.py, SiteCall).

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
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import envelope as _env
from .calls import SiteCall, a2a_splits, argmax_start, busy, check_tensor, norm_args, rs_rows, token_counts
from .declare import caller, dtype_of, member, shape_of
from .numerics.fold import BATCH_INVARIANT, FLOAT_DTYPES, Leaf, select_leaf
from .route import RouteEntry, Router, RouteTable
from .route_impls import A2AFoldRoute, GatherFoldRoute, NativeRoute, RsAgFoldRoute
from .route_impls import guard as _guard
from .route_impls.guard import SHUTDOWN, shutdown_header
from .selfcheck import CheckResult, SelfChecks, agree_at_init, agree_declaration
from .sites import (
    DEFAULT_MAX_ROWS,
    DEFAULT_WORKSPACE_BYTES,  # defined with the sites' vocabulary, torch-free (the static route view reads it)
    DEFAULT_WORKSPACE_MAX_ROWS,
    BoundRoute,
    Capabilities,
    Collective,
    ReduceOp,
    Route,
    RouteImpl,
    Site,
)
from .topology import discover as discover_topology

if TYPE_CHECKING:
    from .workspace import Workspace
from .deadline import DEFAULT_TIMEOUT_S, is_timeout, peer_timeout
from .errors import CollectiveFailed, DetcommError
from .verify import CallChecker
from .work import Work

__all__ = ["Communicator", "RouteTable", "RouteEntry"]

_log = logging.getLogger("detcomm")

# Width of the startup self-checks' rows: not a multiple of 8, so vectorized kernels' scalar tails run too.
_STARTUP_CHECK_SHAPE = (76,)
# The collectives' enum members as constants: reading an Enum member off its class is a descriptor call (~70 ns
# on the CI machine, a twentieth of a call's host path), paid by every call that names it.
_ALL_REDUCE, _REDUCE_SCATTER, _ALL_GATHER = Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER
_ALL_REDUCE_RMSNORM, _TOKEN_ALL_GATHER = Collective.ALL_REDUCE_RMSNORM, Collective.TOKEN_ALL_GATHER
_ALL_TO_ALL, _ARGMAX, _SUM, _MAX = Collective.ALL_TO_ALL, Collective.ARGMAX, ReduceOp.SUM, ReduceOp.MAX


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
        group's do). ``call_guard`` replaces the call guard the group's kind picks (route_impls/guard.py): "header" or
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
        # The one guard every call carries, from static facts (route_impls/guard.py): a separate header where the
        # messages live in host memory, the header inside each route's messages where they live on the device.
        self.call_guard = _guard.mode(world_size=self.world_size, messages_on_device=self.device.type == "cuda" and not staged,
                                      checking=check, forced=call_guard)
        self._native = NativeRoute(group, stage_through_host=staged, in_message=self.call_guard == _guard.IN_MESSAGE)
        self._impls: dict[Route, RouteImpl] = {
            Route.NATIVE: self._native,
            Route.GATHER_FOLD: GatherFoldRoute(self._native, self.leaf),
            Route.A2A_FOLD: A2AFoldRoute(self._native, self.leaf),
            Route.RS_AG_FOLD: RsAgFoldRoute(self._native, self.leaf),
        }
        self._workspace: Workspace | None = None
        # One collective call at a time per communicator (SiteCall.run): the ranks pair calls by their order.
        self._lock = threading.RLock()
        # The deadline in force, for the errors: init's timeout_s, detcomm's default on a group it creates,
        # else the group's own (unknown here: None).
        self.deadline_s: float | None = timeout_s if timeout_s is not None else (DEFAULT_TIMEOUT_S if owns_group else None)
        t0 = time.perf_counter()
        agree_at_init(self.group, self.resolved, rank=self.rank, world_size=self.world_size, device=self.device,
                      check=check, selfcheck=selfcheck, default_max_rows=default_max_rows, workspace=workspace,
                      call_guard=self.call_guard)
        self.caps = self._discover_capabilities(workspace, workspace_max_rows, workspace_bytes, timeout_s)
        # Cross-rank call verification (detcomm/verify.py); timeout_s only names the group's timeout in its errors.
        self._verifier = (CallChecker(native=self._native, device=self.device, rank=self.rank,
                                      world_size=self.world_size, timeout_s=timeout_s) if check else None)
        self._selfchecks = SelfChecks(native=self._native, device=self.device)
        self.router = Router(resolved, self.caps, impls=self._impls,
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
        routes = sorted({e.decision.route.value for e in self.router.table(self.router.bound_sites()).entries})
        _log.info(
            "detcomm: init on %s W=%d rank=%d device=%s (%s) numerics=%s fold leaf=%s routes in use=%s; "
            "call guard=%s; workspace: %s; %d self-checks (%d failed) in %.3f s; init took %.3f s",
            self.backend_name, self.world_size, self.rank, self.device, self.caps.topology, self.resolved.numerics,
            self.leaf.name, ",".join(routes) or "-", self.call_guard, self.caps.workspace_reason, len(checks), len(failed),
            self._selfchecks.seconds(), seconds)

    # -- startup ------------------------------------------------------------------------------------
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
        from .route_impls.ipc_fold import arm  # the workspace's modules load only where one is armed

        route, why = arm(self.group, device=self.device, resolved=self.resolved, capacity=capacity,
                         max_rows=max_rows, timeout_s=timeout_s)
        if route is not None:
            self._workspace = route.workspace
            self._impls[Route.IPC_FOLD] = route
        return route is not None, why

    def _startup_checks(self) -> None:
        """Check, on a small payload of each float dtype, the SUM routes this group would use for a bitwise
        claim. Other claims (MAX/MIN keys, argmax, other shapes) are checked when a site first needs them."""
        for dtype in FLOAT_DTYPES:
            for coll in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER):
                # A one-row site reaches an armed workspace; a DEFAULT_MAX_ROWS one the gather/all-to-all
                # fold. Where both land on one route the second check is the first's cached result.
                for max_rows in (1, DEFAULT_MAX_ROWS):
                    self.router.route(Site("<startup>", coll, dtype, _STARTUP_CHECK_SHAPE, max_rows, ReduceOp.SUM,
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
        shape = shape_of(shape, name)
        coll = member(Collective, collective, "collective", name)
        rop = ReduceOp.MAX if coll is Collective.ARGMAX and op == "sum" else member(ReduceOp, op, "op", name)
        s = Site(
            name=name,
            collective=coll,
            dtype=dtype_of(dtype, name),
            shape=shape,
            max_rows=max_rows,
            op=rop,
            group=self.group_label,
            route=None if route is None else member(Route, route, "route", name),
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
        self.router.candidates(s)
        with self._exclusive(s.name):  # the declaration exchange and routing's self-check are collectives
            self._agree_declaration(s)
            bound = self.router.route(s)
        self._sites[s.name] = s
        self._site_calls[s.name] = SiteCall(self, s, bound)
        if where:
            self._implicit_where[s.name] = where
        return s

    def _agree_declaration(self, s: Site) -> None:
        """Prove a new declaration the same on every rank, and that it fits this device (selfcheck.py)."""
        agree_declaration(s, native=self._native, world_size=self.world_size, device=self.device)

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
        if (collective is Collective.REDUCE_SCATTER and isinstance(x, torch.Tensor) and x.dim() >= 1
                and x.shape[0] % self.world_size):
            label = site.name if isinstance(site, Site) else site  # a virtual site's rows are its dim 1:
            if not (isinstance(label, str) and getattr(self._site_calls.get(label), "virtual", False)):
                raise ValueError(rs_rows(label, x.shape[0], self.world_size))  # type: ignore[arg-type]
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
        rop = member(ReduceOp, op, "op", name)
        sc = self._site_calls.get(name)
        if sc is None:
            check_tensor(name, x, device=self.device, backend=self.backend_name)
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
            self._declare(implicit, where=caller())
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

    @contextlib.contextmanager
    def _exclusive(self, name: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise busy(name, self.rank)
        try:
            yield
        finally:
            self._lock.release()

    def _failure(self, name: str, call: int, e: RuntimeError) -> DetcommError:
        """The error a route's library error becomes: it names the site, the call, this rank and the cause."""
        if is_timeout(e):
            return peer_timeout(name, call, e, group=self.group, rank=self.rank, timeout_s=self.deadline_s)
        return CollectiveFailed(
            f"site {name!r}, call #{call} on rank {self.rank} of {self.world_size}: the collective failed in "
            f"torch.distributed ({self.backend_name}): {e}. A peer died, closed its process group, or made another "
            "call; the first rank that failed is the one to look at (detcomm-launch names it)"
        )

    def _site_call(self, site: object, collective: Collective, x: object, op: object, *,
                   rows_per_rank: Sequence[int] | None = None, uneven: bool = False) -> SiteCall:
        """The bound call a call names: one lookup for a declared site called by its name or Site; any other call
        (undeclared, foreign, contradicting, after close) takes the resolution that declares or refuses it."""
        sc = self._site_calls.get(site if type(site) is str else _name_of(site))
        if (sc is None or sc.collective is not collective or op != sc.op
                or (type(site) is not str and site is not sc.site)):
            return self._resolve(site, collective, x, op, rows_per_rank=rows_per_rank, uneven=uneven)
        return sc

    # -- collectives: each checks its own arguments, then its site's bound call (calls.py) ------------------
    def all_reduce(self, x: torch.Tensor, site: str | Site, *, op: str = "sum", out: torch.Tensor | None = None,
                   async_op: bool = False) -> torch.Tensor | Work:
        """Reduce every rank's ``x`` (sum, avg, max or min); identical bits on every rank.

        Returns a new tensor, or ``out`` when given (``out=x`` reduces in place). ``async_op=True`` returns a
        ``detcomm.Work`` handle instead (``.wait()``, ``.result()``). Collective.

        On a virtual-shard site ``x`` is this rank's [V/W, rows, *shape] fp32 partial sums and the result is
        [rows, *shape] in the site's dtype (docs/spec.md §9.1)."""
        return self._site_call(site, _ALL_REDUCE, x, op).call(x, out, async_op)

    def reduce_scatter(self, x: torch.Tensor, site: str | Site, *, op: str = "sum", out: torch.Tensor | None = None,
                       async_op: bool = False) -> torch.Tensor | Work:
        """Rank r receives row block r of the reduction; ``x.shape[0]`` must divide by the world size.
        ``out`` (``x.shape[0] // W`` rows) and ``async_op`` as for ``all_reduce``. Collective.

        On a virtual-shard site ``x`` is this rank's [V/W, rows, *shape] fp32 partial sums and rank r receives
        row block r of the folded [rows, *shape] result, in the site's dtype (docs/spec.md §9.1)."""
        return self._site_call(site, _REDUCE_SCATTER, x, op).call(x, out, async_op)

    def all_gather(self, x: torch.Tensor, site: str | Site, *, out: torch.Tensor | None = None,
                   async_op: bool = False) -> torch.Tensor | Work:
        """Every rank's ``x`` concatenated along dim 0 in rank order (``out``: ``W * rows`` rows). Collective."""
        return self._site_call(site, _ALL_GATHER, x, _SUM).call(x, out, async_op)

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
            norm_args(name, x, residual, weight, eps)
        return self._site_call(site, _ALL_REDUCE_RMSNORM, x, _SUM).norm(x, residual, weight, eps)

    def token_all_gather(self, x: torch.Tensor, site: str | Site, *, rows_per_rank: Sequence[int]) -> torch.Tensor:
        """Uneven all-gather: rank r contributes ``rows_per_rank[r]`` rows; concatenated in rank order. Collective."""
        self._check_open()
        counts = token_counts(site.name if isinstance(site, Site) else site, x, rows_per_rank,
                              world_size=self.world_size, rank=self.rank)
        sc = self._site_call(site, _TOKEN_ALL_GATHER, x, _SUM, rows_per_rank=counts)
        return sc.token_all_gather(x, counts)

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
        in_splits, known = a2a_splits(site.name if isinstance(site, Site) else site, x, splits, out_splits,
                                      world_size=self.world_size)
        sc = self._site_call(site, _ALL_TO_ALL, x, _SUM, uneven=splits is not None)
        return sc.all_to_all(x, in_splits, known)

    def argmax(self, logits_shard: torch.Tensor, site: str | Site, *, vocab_start: int) -> torch.Tensor:
        """Vocabulary-parallel argmax: int64 global index per row; lowest index on exact ties; -0.0 == +0.0;
        NaN counts as the largest value (as torch.argmax). Collective."""
        self._check_open()
        argmax_start(site.name if isinstance(site, Site) else site, logits_shard, vocab_start)
        return self._site_call(site, _ARGMAX, logits_shard, _MAX).argmax(logits_shard, vocab_start)

    # -- introspection and lifecycle ----------------------------------------------------------------
    def routes(self) -> RouteTable:
        """The route table of the declared sites (local; identical on every rank)."""
        return self.router.table(list(self._sites.values()),
                               note=f"topology: {self.caps.topology}; workspace: {self.caps.workspace_reason}")

    def capture_refusal(self, site: str, *, library: bool = True) -> str | None:
        """Why a call of the declared ``site`` cannot be captured in a CUDA graph on this group, or None where it
        can (local; the same answer on every rank). Static facts only, read before any capture: the group's device,
        the call checker (its fingerprints are read back on the host), and the site's route in the route table
        with whether this group moves CUDA tensors through host memory (a gloo group: ranks sharing a GPU), the
        facts a call raises ``CaptureThroughHost`` from inside a capture. ipc_fold (the workspace's kernels, the
        fused norms and trees among them) captures on any CUDA group; every route captures on a group of one rank (its
        transport is a local copy: no library call, no host staging) and on a group whose library moves CUDA tensors
        itself (NCCL). ``library=False`` also refuses the latter: a graph that captured an NCCL
        call holds NCCL's communicator until the graph is released, and ``detcomm.shutdown`` waits for it forever
        while it lives (what an engine that captures on its own, unasked, must not leave behind)."""
        self._check_open()
        s = self._sites.get(site)
        if s is None:
            raise ValueError(f"capture_refusal: site {site!r} is not declared on this group; declare it first "
                             "(detcomm.site)")
        if self.device.type != "cuda":
            return f"the group works on {self.device}: CUDA graphs capture CUDA work only"
        if self._verifier is not None:
            return ("call checking is on (detcomm.init(check=True) or DETCOMM_CHECK): every call's fingerprint is "
                    "read back on the host, which a CUDA graph cannot hold")
        route = self.router.table([s]).entries[0].decision.route
        if route is Route.IPC_FOLD:
            return None
        if not self._native.calls_library:
            # One rank: every route's transport is a local copy (route_impls/native.py), so the call holds no
            # library communicator and stages nothing through the host, whatever the backend.
            return None
        if not self._native.stage:
            if library:
                return None
            return (f"site {site!r} takes route {route.value}, whose {self.backend_name} calls a CUDA graph would "
                    "capture: such a graph holds the library's communicator until it is released, and "
                    "detcomm.shutdown() waits for it forever while it lives (pytorch/pytorch#115388); capture anyway "
                    "with cuda_graphs=True and release the graphs (release_graphs()) before detcomm.shutdown()")
        return (f"site {site!r} takes route {route.value}, which moves its CUDA tensors through host memory on this "
                f"{self.backend_name} group (ranks sharing a GPU), and a CUDA graph cannot hold a host copy "
                f"(detcomm.CaptureThroughHost); only ipc_fold calls capture here: arm the CUDA-IPC workspace for the "
                f"site (a batch-invariant envelope, detcomm.init(workspace_max_rows=...) >= its max_rows "
                f"{s.max_rows}; workspace: {self.caps.workspace_reason}) or give each rank its own GPU over NCCL")

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
        self._impls.clear()
        self._verifier = None
        self._selfchecks = None  # type: ignore[assignment]
        self.router.release()
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


def _name_of(site: object) -> str:
    """A Site's name ("" for anything else; the identity test after the lookup sends it to the resolution)."""
    return site.name if type(site) is Site else ""
