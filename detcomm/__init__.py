"""detcomm: bitwise batch-invariant collectives for tensor-parallel LLM serving.

    import detcomm
    detcomm.init(numerics="rl-bitwise")                # once per process, after (or instead of) init_process_group
    detcomm.site("o_proj", collective="all_reduce", dtype=torch.bfloat16, shape=(4096,), max_rows=2048)
    y = detcomm.all_reduce(x, site="o_proj")           # same bits for a row whatever batch it travels in
    print(detcomm.routes())

Every collective function is collective over the site's group and returns a new tensor (the input is never
written). Row = dim 0. See docs/usage.md for the route table, the envelopes and the self-checks.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, overload

# Eager imports are torch-free (``detcomm routes`` and ``python -m detcomm routes`` must not load torch); the
# torch-side names are imported on first access (PEP 562 ``__getattr__`` below, and inside the functions that
# need them), so ``import detcomm; detcomm.init(...)`` works exactly as before.
from .envelope import (
    BITWISE_ENVELOPES,
    MULTICAST_OFF_ENV,
    Resolved,
    Switches,
    apply_environment,
    default_numerics,
    envelope_environment,
    known_envelopes,
    register_numerics_envelope,
    resolve_numerics,
)
from .errors import (
    CaptureThroughHost,
    CollectiveFailed,
    CollectiveMismatch,
    ConcurrentCall,
    DetcommError,
    PeerTimeout,
    RouteRefused,
    WorkspaceFailed,
    WorkspaceUnavailable,
)
from .mpi_env import rank_facts_from_environment
from .route import Router
from .sites import (
    DEFAULT_MAX_ROWS,
    DEFAULT_WORKSPACE_BYTES,
    DEFAULT_WORKSPACE_MAX_ROWS,
    Capabilities,
    Collective,
    ReduceOp,
    Route,
    Site,
)

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from .comm import Communicator, RouteEntry, RouteTable
    from .deadline import DEFAULT_TIMEOUT_S
    from .numerics.fold import BATCH_INVARIANT, Leaf, Priority, reference_fold, register_leaf, select_leaf
    from .numerics.norm import rms_norm
    from .work import Work

# name -> the submodule that defines it (each imports torch); importing detcomm.numerics also registers the
# CUDA fold leaf where cupy is installed. The MoE names are reached by name only, with no import even for types:
# detcomm.moe is an integration a layer above this one (docs/map.md) and asks this module for the communicator.
_LAZY = {
    "Communicator": "comm", "RouteEntry": "comm", "RouteTable": "comm",
    "DEFAULT_TIMEOUT_S": "deadline",
    "BATCH_INVARIANT": "numerics.fold", "Leaf": "numerics.fold", "Priority": "numerics.fold",
    "reference_fold": "numerics.fold", "register_leaf": "numerics.fold", "select_leaf": "numerics.fold",
    "moe_combine": "moe", "moe_dispatch": "moe", "moe_site": "moe",
    "rms_norm": "numerics.norm",
    "Work": "work",
}


def __getattr__(name: str) -> Any:
    """PEP 562: the torch-side names (``_LAZY``) and submodules, imported on first access."""
    module = _LAZY.get(name)
    if module is None:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "init",
    "site",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "token_all_gather",
    "argmax",
    "all_reduce_residual_rmsnorm",
    "rms_norm",
    "moe_site",
    "moe_dispatch",
    "moe_combine",
    "routes",
    "shutdown",
    "get_communicator",
    "use",
    "is_initialized",
    "Communicator",
    "Work",
    "DetcommError",
    "RouteRefused",
    "WorkspaceUnavailable",
    "WorkspaceFailed",
    "CollectiveMismatch",
    "CollectiveFailed",
    "ConcurrentCall",
    "PeerTimeout",
    "CaptureThroughHost",
    "rendezvous_plan",
    "RouteTable",
    "RouteEntry",
    "BITWISE_ENVELOPES",
    "register_numerics_envelope",
    "resolve_numerics",
    "envelope_environment",
    "apply_environment",
    "known_envelopes",
    "Resolved",
    "Switches",
    "Leaf",
    "Priority",
    "BATCH_INVARIANT",
    "register_leaf",
    "select_leaf",
    "reference_fold",
    "Router",
    "Capabilities",
    "Collective",
    "ReduceOp",
    "Route",
    "Site",
    "DEFAULT_MAX_ROWS",
    "DEFAULT_TIMEOUT_S",
]

_log = logging.getLogger("detcomm")
_COMMS: dict[object, Communicator] = {}
_DEFAULT: Communicator | None = None
_SAVED: dict[Communicator, _ProcessState] = {}  # what each init changed process-wide, restored by shutdown
_SHUT_DOWN = False  # whether shutdown() closed the module default (for get_communicator's message)

def _group_key(group: dist.ProcessGroup | None) -> object:
    import torch.distributed as dist

    return dist.group.WORLD if group is None else group


def rendezvous_plan(env: Mapping[str, str], gpus: int) -> tuple[str, int | None]:
    """The backend of the group ``init`` creates from a launcher's environment, and the CUDA device index this rank
    takes (None: CPU). Local, from static facts: this host's GPU count and its number of ranks.

    - no GPU: gloo on the CPU;
    - at most one rank per GPU (``LOCAL_WORLD_SIZE <= gpus``): NCCL, rank ``LOCAL_RANK`` on GPU ``LOCAL_RANK``;
    - more ranks than GPUs on this host: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the group
      is gloo and rank ``LOCAL_RANK`` keeps its tensors on GPU ``LOCAL_RANK % gpus``: the CUDA-IPC workspace folds
      on the GPU, and what the workspace does not serve travels through host memory on gloo (the same bits;
      docs/usage.md "Launching"). Every host must hold the same number of ranks per GPU, or the hosts would pick
      different backends."""
    if gpus <= 0:
        return "gloo", None
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    if local_world <= gpus:
        return "nccl", local_rank
    return "gloo", local_rank % gpus


def _env_rendezvous() -> tuple[str, int | None]:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK from torchrun's or an MPI launcher's variables; return ``rendezvous_plan``'s
    backend and device index for this machine."""
    import torch

    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        facts = rank_facts_from_environment(env)
        if facts is not None:
            env.update(RANK=str(facts.rank), WORLD_SIZE=str(facts.world_size), LOCAL_RANK=str(facts.local_rank),
                       LOCAL_WORLD_SIZE=str(facts.local_world_size))
        else:
            raise ValueError(
                "detcomm.init: no torch.distributed process group exists and the environment names no rank "
                "(RANK/WORLD_SIZE from torchrun, or OMPI_COMM_WORLD_*/PMI_* from mpiexec). Start the ranks with "
                "`detcomm-launch --nproc N ...` or torchrun, or call torch.distributed.init_process_group first."
            )
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(
            f"detcomm.init: {', '.join(missing)} not set: the ranks cannot find each other. detcomm-launch and "
            "torchrun set them; under a bare mpiexec export them (rank 0's host and a free port)."
        )
    return rendezvous_plan(env, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def init(
    *,
    numerics: str | None = None,
    group: dist.ProcessGroup | None = None,
    selfcheck: bool = True,
    default_max_rows: int = DEFAULT_MAX_ROWS,
    device: torch.device | str | None = None,
    workspace: bool | None = None,
    workspace_max_rows: int = DEFAULT_WORKSPACE_MAX_ROWS,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    check: bool | None = None,
    timeout_s: float | None = None,
    **switches: object,
) -> Communicator:
    """Create detcomm's communicator for ``group`` (default: the default process group). Collective.

    Uses the default torch.distributed group when one exists; otherwise creates it from the torchrun or MPI
    environment (NCCL when CUDA is present, gloo otherwise), after applying the envelope's environment
    (docs/spec.md §4 and 8). Resolves the numerics envelope (``numerics``: default ``$DETCOMM_NUMERICS``, set by
    detcomm-launch, else ``envelope.DEFAULT_NUMERICS``) with the explicit ``switches``, compares the envelope,
    the checking mode and these options across the ranks (``CollectiveMismatch`` on every rank when they
    differ, before any other collective), discovers the group's capabilities, runs the startup self-checks
    (``selfcheck=False`` skips them) and returns the communicator, which also becomes the module default when
    ``group`` is None. A second ``init`` on the same group raises ``DetcommError`` (call ``shutdown()`` first).

    ``device``: where the tensors live (default: the current CUDA device for NCCL, the CPU for gloo; a CUDA
    device with a gloo group stages native collectives through host memory, for W ranks sharing one GPU).
    ``workspace``: arm the CUDA-IPC workspace (None: when the envelope's batch-invariant collectives could use
    it); it serves SUM sites with ``max_rows <= workspace_max_rows`` and carries ``workspace_bytes`` of a
    rank's rows per launch (more rows are chunked, bits unchanged).

    ``check``: before every collective call, the ranks compare a fingerprint of the call (site, collective,
    op, dtype, trailing shape, rows, sequence number) and all raise ``CollectiveMismatch`` when they differ
    (detcomm/verify.py; costs one small collective per call). None: ``$DETCOMM_CHECK``, else off; the call
    guard's smaller header (site, call number, rows) guards every call either way (docs/spec.md §2).
    ``timeout_s``: the deadline of every blocking wait on the process group init creates (default
    ``DEFAULT_TIMEOUT_S``, 300 s). A group that already exists keeps the timeout it was created with; passing
    ``timeout_s`` then is an error.

    Process-wide state: a group init creates gets the envelope's environment variables (and the rank
    variables an MPI launcher implies), multicast stays off in the environment unless allowed, and
    ``disable_tf32`` turns torch's TF32 flags off; ``shutdown()`` restores every one of these to its value
    before ``init``.

    Raises ValueError for an unknown envelope or switch or conflicting switches (before any communication),
    ``DetcommError`` when the fold leaf the envelope requires is missing or the group was created without the
    NCCL environment a bitwise envelope needs, ``PeerTimeout`` when not every rank joins the rendezvous within
    the deadline, and ``RouteRefused`` (on every rank) when a route needed for a bitwise claim fails its
    self-check.
    """
    import torch
    import torch.distributed as dist

    from .comm import Communicator
    from .deadline import DEFAULT_TIMEOUT_S
    from .envelope import warn_missing_environment
    from .verify import check_from_env

    global _DEFAULT, _SHUT_DOWN
    resolved = resolve_numerics(default_numerics() if numerics is None else numerics, **switches)
    checking = check_from_env(check)
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if group is not None or dist.is_initialized():
            raise ValueError(
                "timeout_s applies only to the process group detcomm.init creates; this group already exists and "
                "keeps its own timeout: pass timeout=datetime.timedelta(seconds=...) to "
                "torch.distributed.init_process_group / new_group instead"
            )
    if _group_key(group) in _COMMS:  # local, before any communication: the other ranks are not waiting on it
        raise DetcommError("detcomm is already initialized on this group: use detcomm.get_communicator() for the "
                           "existing communicator, or call detcomm.shutdown() before a new init")
    saved = _ProcessState()
    created = False
    try:
        if group is None and not dist.is_initialized():
            backend, gpu = _env_rendezvous()
            apply_environment(resolved.numerics, **{k: getattr(resolved.switches, k) for k in resolved.explicit})
            if gpu is not None:
                torch.cuda.set_device(gpu)
                if backend == "gloo" and device is None:  # more ranks than GPUs: ranks share a GPU (rendezvous_plan)
                    device = torch.device("cuda", gpu)
                    _log.info("detcomm.init: %s ranks on %d GPU(s) of this host: a gloo group with this rank's "
                              "tensors on %s (NCCL refuses two ranks on one GPU)",
                              os.environ.get("LOCAL_WORLD_SIZE", "?"), torch.cuda.device_count(), device)
            deadline = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
            _init_default_group(backend, deadline)
            created = True
        pg = dist.group.WORLD if group is None else group
        assert pg is not None  # the default group exists by now
        if not created:
            warn_missing_environment(resolved, dist.get_backend(pg))
        # docs/spec.md §8: keep multicast off in every process this one starts, unless the user opted in.
        if not resolved.switches.allow_multicast:
            os.environ.update(MULTICAST_OFF_ENV)
        if resolved.switches.disable_tf32:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        try:
            comm = Communicator(group=pg, resolved=resolved, selfcheck=selfcheck, default_max_rows=default_max_rows,
                                owns_group=created, device=device, workspace=workspace,
                                workspace_max_rows=workspace_max_rows, workspace_bytes=workspace_bytes,
                                check=checking, timeout_s=timeout_s)
        except BaseException:
            if created:
                dist.destroy_process_group()
            raise
    except BaseException:
        saved.restore()
        raise
    # Keyed after the group exists: before init_process_group the default group's key is None.
    _COMMS[_group_key(group)] = comm
    saved.settle()
    _SAVED[comm] = saved
    if group is None:
        _DEFAULT = comm
        _SHUT_DOWN = False
    return comm


_ARRIVED = "detcomm/init/arrived"  # rendezvous-store key prefix: rank r reached detcomm.init (outside torch's keys)


def _init_default_group(backend: str, deadline: float) -> None:
    """``init_process_group(backend, env://)`` as torch does it (the env:// store, then the group on it), with
    one key of detcomm's own in the store first, ``_ARRIVED/<rank>``: when the group's rendezvous times out, the
    ranks whose key is absent never reached ``detcomm.init`` (hung or still starting before it), and the
    ``PeerTimeout`` names them (``silent``), rather than only saying that someone is missing."""
    import torch.distributed as dist

    from .deadline import arrivals

    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"

    def refused(e: BaseException, who: str, silent: tuple[int, ...] = ()) -> PeerTimeout:
        return PeerTimeout(
            f"detcomm.init on rank {rank}: not every one of the {world} ranks joined the rendezvous at {where} within "
            f"{deadline:g} s: {who}; its own output names the cause. Library error: {e}", silent=silent)

    timeout = timedelta(seconds=deadline)
    try:
        store, r, w = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
    except dist.DistStoreError as e:  # a plain env:// rendezvous: rank 0's store waits for every rank to connect
        raise refused(e, "a rank exited (or failed) before detcomm.init, or is still starting") from e
    store.set(f"{_ARRIVED}/{r}", "1")
    try:
        dist.init_process_group(backend=backend, store=store, rank=r, world_size=w, timeout=timeout)
    except dist.DistStoreError as e:
        came = arrivals(store, _ARRIVED, list(range(w)))
        missing = tuple(q for q in range(w) if came is not None and q not in came)
        if missing:
            who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never reached detcomm.init "
                   "(hung, failed or still starting before it)")
        elif came is None:
            who = "the store did not answer which ranks reached detcomm.init"
        else:
            who = "every rank reached detcomm.init, and one of them stopped before joining the group"
        raise refused(e, who, missing) from e


class _ProcessState:
    """The process-wide state init may change (os.environ, torch's TF32 flags): recorded before init, and what
    init changed is restored by shutdown (a variable the caller sets after init stays as the caller set it)."""

    def __init__(self) -> None:
        import torch

        self.before = dict(os.environ)
        self.tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        self.changed: dict[str, str | None] | None = None

    def settle(self) -> None:
        """Record which variables init changed (called when init returns)."""
        keys = set(self.before) | set(os.environ)
        self.changed = {k: self.before.get(k) for k in keys if self.before.get(k) != os.environ.get(k)}

    def restore(self) -> None:
        import torch

        if self.changed is None:
            self.settle()
        assert self.changed is not None
        for k, v in self.changed.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.tf32


def is_initialized(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``init`` created a communicator for ``group`` (default: the default group) not yet shut down. Local."""
    return _group_key(group) in _COMMS


def get_communicator(group: dist.ProcessGroup | None = None) -> Communicator:
    """The communicator of ``group`` (default: the module default)."""
    comm = _DEFAULT if group is None else _COMMS.get(group)
    if comm is None:
        if group is None and _SHUT_DOWN:
            raise DetcommError("detcomm was shut down (detcomm.shutdown()): call detcomm.init() again before "
                               "another collective")
        raise DetcommError(
            "detcomm is not initialized"
            + ("" if group is None else " on this group")
            + ": call detcomm.init(" + ("" if group is None else "group=...") + ") first"
        )
    return comm


def _live(comm: object) -> bool:
    """Whether ``comm`` is a communicator ``init`` created and no ``shutdown`` has closed (identity, not ==)."""
    return any(c is comm for c in _COMMS.values())


@contextmanager
def use(comm: Communicator) -> Iterator[Communicator]:
    """Make ``comm`` the module default inside the block: ``get_communicator()`` and every module-level call whose
    site is a name or a default-group ``Site`` (``detcomm.site``, ``all_reduce``, ...) go to it; the default the
    block found is back afterwards, also when the block raises (blocks nest). For two communicators in one
    process, e.g. a trainer TP group's next to the default group's (``init(group=...)`` returns it). Yields
    ``comm``. Local.

    The module default is process-wide, not per thread: another thread's module-level calls inside the block go
    to ``comm`` too, so keep one thread issuing a group's collectives (as every rank must anyway, in one order).
    Raises ValueError for a communicator that ``shutdown()`` closed (or no communicator at all). If ``shutdown``
    runs inside the block, the default stays unset afterwards rather than a closed one coming back."""
    global _DEFAULT
    if not _live(comm):
        raise ValueError(f"detcomm.use: {comm!r} is not a live communicator (it was shut down, or is not one "
                         "detcomm.init returned): call detcomm.init(group=...) again and pass the communicator "
                         "it returns")
    saved = _DEFAULT
    _DEFAULT = comm
    try:
        yield comm
    finally:
        _DEFAULT = saved if saved is None or _live(saved) else None


def _comm_for(site: str | Site) -> Communicator:
    if _DEFAULT is not None and (type(site) is str or type(site) is Site and site.group == "default"):
        return _DEFAULT  # the hot path: a site name, or a Site, on the default group (get_communicator()'s answer)
    if isinstance(site, Site) and site.group != "default":
        for comm in _COMMS.values():
            if comm.group_label == site.group:
                return comm
    return get_communicator()


def site(
    name: str,
    *,
    collective: str,
    dtype: torch.dtype | str,
    shape: int | Sequence[int],
    max_rows: int,
    op: str = "sum",
    group: dist.ProcessGroup | None = None,
    route: str | None = None,
    virtual_shards: int | None = None,
    shard_fold: str = "order",
) -> Site:
    """Declare a call site: its route is decided now, once, from these static properties.

    ``collective`` is one of all_reduce, all_gather, reduce_scatter, all_to_all, token_all_gather, argmax,
    all_reduce_rmsnorm; ``dtype`` a torch dtype or its name (``"bfloat16"``);
    ``shape`` is one row's trailing shape; ``max_rows`` the most rows a call will carry; ``route`` forces a
    route (refused when it would void the envelope). Declaring the same name again with the same properties
    returns the existing site; different properties raise ValueError. Collective when the site is new (every
    rank's declaration is compared; one that differs raises CollectiveMismatch on every rank): declare sites in
    the same order on every rank.

    ``virtual_shards=V`` (all_reduce, reduce_scatter or all_reduce_rmsnorm, op "sum", a float ``dtype``;
    docs/spec.md §9.1): the reduction dimension is split into V fixed shards and every call passes this rank's V/W fp32 partial sums,
    ``[V/W, rows, *shape]`` (slab j is shard r*V/W + j); the result, in ``dtype``, is the canonical fold over
    shards 0..V-1, rounded once: the same bits at every W dividing V, W = 1 included. V must be divisible by
    the group's W (choose a multiple of every TP size you will run, e.g. 8). Routed to gather_fold
    (all_reduce) or a2a_fold (reduce_scatter) under every envelope, and self-checked with V inputs on
    declaration; ``route="native"`` (outside bitwise envelopes) sums pre-folded per-rank partials instead: a
    W-dependent negative control.

    ``shard_fold="tree"`` (V a power of two; docs/spec.md §9.1 "The tree order"): the V partials are summed by a
    fixed balanced binary tree instead of the shard-order fold; each rank folds its own subtree and only its root,
    one fp32 value per element, crosses the wire. The same bits at every W that is a power of two dividing V.
    """
    return get_communicator(group).site(
        name, collective=collective, dtype=dtype, shape=shape, max_rows=max_rows, op=op, route=route,
        virtual_shards=virtual_shards, shard_fold=shard_fold,
    )


@overload
def all_reduce(x: torch.Tensor, site: str | Site, *, op: str = ..., out: torch.Tensor | None = ...,
               async_op: Literal[False] = ...) -> torch.Tensor: ...
@overload
def all_reduce(x: torch.Tensor, site: str | Site, *, op: str = ..., out: torch.Tensor | None = ...,
               async_op: Literal[True]) -> Work: ...
def all_reduce(x: torch.Tensor, site: str | Site, *, op: str = "sum", out: torch.Tensor | None = None,
               async_op: bool = False) -> torch.Tensor | Work:
    """All-reduce (sum, avg, max, min) of every rank's ``x`` through the site's route. Returns a new tensor, or
    ``out`` when given (``out=x``: in place), or a ``Work`` handle with ``async_op=True``. Collective.

    On a ``virtual_shards=V`` site, ``x`` is this rank's fp32 partials ``[V/W, rows, *shape]`` and the result is
    ``[rows, *shape]`` in the site's dtype: ``detcomm.numerics.fold.reference_fold(all V partials stacked, dtype)``."""
    return _comm_for(site).all_reduce(x, site, op=op, out=out, async_op=async_op)


@overload
def all_gather(x: torch.Tensor, site: str | Site, *, out: torch.Tensor | None = ...,
               async_op: Literal[False] = ...) -> torch.Tensor: ...
@overload
def all_gather(x: torch.Tensor, site: str | Site, *, out: torch.Tensor | None = ...,
               async_op: Literal[True]) -> Work: ...
def all_gather(x: torch.Tensor, site: str | Site, *, out: torch.Tensor | None = None,
               async_op: bool = False) -> torch.Tensor | Work:
    """Every rank's ``x`` concatenated along dim 0, in rank order. Collective."""
    return _comm_for(site).all_gather(x, site, out=out, async_op=async_op)


@overload
def reduce_scatter(x: torch.Tensor, site: str | Site, *, op: str = ..., out: torch.Tensor | None = ...,
                   async_op: Literal[False] = ...) -> torch.Tensor: ...
@overload
def reduce_scatter(x: torch.Tensor, site: str | Site, *, op: str = ..., out: torch.Tensor | None = ...,
                   async_op: Literal[True]) -> Work: ...
def reduce_scatter(x: torch.Tensor, site: str | Site, *, op: str = "sum", out: torch.Tensor | None = None,
                   async_op: bool = False) -> torch.Tensor | Work:
    """Reduce-scatter (sum or avg): rank r receives row block r (rows must divide by the world size). Collective.

    On a ``virtual_shards=V`` site, ``x`` is this rank's fp32 partials ``[V/W, rows, *shape]`` and rank r
    receives row block r (``rows / W`` rows, in the site's dtype) of the fold over the V shards."""
    return _comm_for(site).reduce_scatter(x, site, op=op, out=out, async_op=async_op)


def all_to_all(x: torch.Tensor, site: str | Site, *, splits: Sequence[int] | None = None,
               out_splits: Sequence[int] | None = None) -> torch.Tensor:
    """All-to-all of row blocks, even (``splits=None``) or uneven (``splits[q]`` rows to rank q; ``out_splits[q]``
    the rows rank q sends here, when known, skips the count exchange). Collective."""
    return _comm_for(site).all_to_all(x, site, splits=splits, out_splits=out_splits)


def token_all_gather(x: torch.Tensor, site: str | Site, *, rows_per_rank: Sequence[int]) -> torch.Tensor:
    """Uneven all-gather: rank r passes ``rows_per_rank[r]`` rows. Collective."""
    return _comm_for(site).token_all_gather(x, site, rows_per_rank=rows_per_rank)


def argmax(logits_shard: torch.Tensor, site: str | Site, *, vocab_start: int) -> torch.Tensor:
    """Vocabulary-parallel greedy argmax: global int64 index per row, lowest index on exact ties. Collective."""
    return _comm_for(site).argmax(logits_shard, site, vocab_start=vocab_start)


def all_reduce_residual_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float,
                                site: str | Site) -> tuple[torch.Tensor, torch.Tensor]:
    """The site's all-reduce of ``x``, then r = round(residual + s) and y = the canonical RMSNorm of r; returns
    ``(y, r)``, batch-invariant on every canonical route (docs/spec.md §9). Collective.

    On a site declared with ``virtual_shards=V`` (the layer boundary of a TP-size-invariant layout), ``x`` is this
    rank's fp32 partials ``[V/W, rows, H]`` and ``residual`` the ``[rows, H]`` rows in the site's dtype; the workspace
    serves a tree-order site (``shard_fold="tree"``) with its fused tree kernels where fusion is allowed, and every
    other route runs the virtual all-reduce, then the canonical norm: the same bits (docs/spec.md §9.2 "Tree
    sites")."""
    return _comm_for(site).all_reduce_residual_rmsnorm(x, residual, weight, eps=eps, site=site)


def routes(group: dist.ProcessGroup | None = None) -> RouteTable:
    """The route table (site, collective, dtype, shape, route, why) of the group's declared sites."""
    return get_communicator(group).routes()


def shutdown() -> None:
    """Close every communicator (collective) and destroy the process group if detcomm.init created it.

    Release every CUDA graph that captured a gather_fold or a2a_fold call first (drop the last reference to the
    torch.cuda.CUDAGraph): such a graph holds NCCL resources, and NCCL's communicator destruction waits for them
    forever while it lives (the same holds for any captured NCCL collective, pytorch/pytorch#115388)."""
    global _DEFAULT, _SHUT_DOWN
    comms = list(_COMMS.values())
    _SHUT_DOWN = _SHUT_DOWN or _DEFAULT is not None
    _COMMS.clear()
    _DEFAULT = None
    try:
        for comm in reversed(comms):
            try:
                comm.close()
            finally:
                saved = _SAVED.pop(comm, None)
                if saved is not None:
                    saved.restore()
    finally:
        _SAVED.clear()
