"""The armed CUDA-IPC workspace: symmetric buffers + loaded kernels, their lifecycle (create, close, abort, check,
synchronize), and the one path every all-reduce call takes: bind (a call shape checked once) and run.

Every reduction is the canonical fold of docs/spec.md §1 (csrc/detcomm_common.cuh), so one-shot, two-shot and any chunking
give the same bits; the row count only picks the kernel (plan.launch_kernel) and the chunking. The collective calls
a caller makes are in collectives.py (this class's base), the launches in launch.py.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from ..errors import CaptureUnprepared, WorkspaceFailed, WorkspaceUnavailable
from . import plan
from .collectives import Collectives
from .kernels import MODULE_DTYPE_CODES, KernelSet, kernel_set
from .launch import BoundCall, InFlight, Launcher

_LOG = logging.getLogger("detcomm.workspace")
# The device-side deadline of every barrier spin. A spin only waits while some rank has not launched its kernel
# yet, so the deadline must outlast the longest host stall a healthy rank can have between two collectives: a
# first-call JIT compile (torch.compile, Triton, NVRTC: seconds to tens of seconds), a full garbage collection of
# a large heap, a checkpoint page-in. 60 s covers those with margin, and a real failure (a dead or diverged
# rank) still surfaces within a minute; a failure costs no rank its CUDA context, so a generous
# deadline is cheap. Override per workspace (Workspace.create(timeout_s=...), which init(timeout_s=) sets). Not the
# group's deadline (detcomm.deadline.DEFAULT_TIMEOUT_S): this one bounds the kernels' spins alone.
DEFAULT_SPIN_DEADLINE_S = 60.0
# Call numbers whose label is kept for failure messages (the kernels report the call they were in).
_LABELS_KEPT = 4096  # a power of two: the label ring is indexed by call & (_LABELS_KEPT - 1)


def _refuse_under_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise CaptureUnprepared.before_capture(f"detcomm workspace: {what}", "create the workspace")


def _u64(x: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(x)


class _HostCtrl:
    """Pinned, device-mapped host memory: this rank's failure record (written by the first failing kernel thread
    of the rank) and the host's abort word (polled by every spin). Mapped memory needs no copy to read, so the
    host reads the record with one load, without waiting on the device, and also after a debug trap."""

    def __init__(self) -> None:
        from cupy.cuda import runtime  # noqa: PLC0415

        self.ptr = runtime.hostAlloc(plan.CTRL_WORDS * 4, runtime.hostAllocMapped)
        ctypes.memset(self.ptr, 0, plan.CTRL_WORDS * 4)
        self.words = (ctypes.c_uint32 * plan.CTRL_WORDS).from_address(self.ptr)

    def tagged(self) -> bool:
        return self.words[0] != 0

    def record(self) -> list[int]:
        return list(self.words[:plan.ERR_WORDS])

    def free(self) -> None:
        from cupy.cuda import runtime  # noqa: PLC0415

        if self.ptr:
            runtime.freeHost(self.ptr)
            self.ptr = 0


class Workspace(Collectives):
    """One rank's armed CUDA-IPC workspace (or one rank view of an in-process group).

    Collective calls (every rank of the group must make them, in the same order, with the same shapes):
    `create`, `all_reduce`, `all_reduce_virtual`, `all_reduce_tree`, `all_reduce_rmsnorm`, `all_reduce_rmsnorm_tree`,
    `reduce_scatter`, `all_gather`, `run`, `close`. Local calls: `abort`, `check`, `synchronize`, `error_record`,
    `variants`, `family_variants` (and its named forms `virtual_variants`, `tree_variants`, `fused_norm_variants`,
    `fused_norm_tree_variants`), `bind`, `bind_all_reduce` and `bind_all_reduce_tree` (once per site; the call
    they return is collective). `in_process` is not collective (one process plays every rank); its rank views'
    collectives must still be called once per rank, each from its own stream.

    Inputs are contiguous tensors on the workspace's device, [rows, *trailing], rows along dim 0. One collective
    may be in flight per workspace: a call from another stream while the previous one has not finished raises;
    a graph replay overlapping another kernel of the workspace fails the workspace (device-side busy words).

    Failures (docs/spec.md §9): a barrier that passes its deadline, an `abort()` on any rank, ranks making
    different calls (kernel, dtype, element count or call number, compared on the device at every start barrier,
    whatever host-side checking says) or two kernels at once end the kernels of every rank without a trap; each
    rank records one line, and the host raises WorkspaceFailed naming the rank, the awaited rank, the call and
    its label at the next call, `check()`, `synchronize()` or `close()`, after which every call raises until the
    workspace is re-created. A rank that was not inside a kernel learns of a peer's failure when its next kernel
    runs (that kernel stops at once), so it raises at the call after, or at `synchronize()`.
    """

    # The kernel build (kernels.BUILD_DEFINES): "canonical" here; only detcomm.workspace.debug's subclasses change it
    # (the tests' negative controls, the bench), and only it sets the path recorder (variants_run).
    _kernel_build: ClassVar[str] = "canonical"

    def __init__(self, *, transport: Any, kernels: KernelSet, grid: int,
                 one_store_tiers: tuple[plan.OneStoreTier, ...], capacity_bytes: int,
                 max_rows_armed: int, one_shot_max_bytes: int, timeout_ns: int,
                 device: torch.device) -> None:
        # Private: use Workspace.create or Workspace.in_process.
        self._transport = transport
        self._kernels = kernels
        self.grid = grid
        #: the one-store tiers, smallest first (plan.one_store_tiers): a launch takes the first that holds it.
        self.one_store_tiers = one_store_tiers
        self.capacity_bytes = capacity_bytes
        self.max_rows_armed = max_rows_armed
        self.one_shot_max_bytes = one_shot_max_bytes
        #: all-reduce launches up to this many bytes take the one-store kernel (csrc/one_store.cu); 0 = never.
        self.one_store_max_bytes = one_store_tiers[-1].max_bytes if one_store_tiers else 0
        self.timeout_ns = timeout_ns
        self.device = device
        self.rank = transport.rank
        self.world_size = transport.world_size
        self._slot_bytes = plan.slot_bytes(capacity_bytes, self.world_size, grid)
        # data[p * W + k]: slot copy p of rank k (the kernels pick the copy by their use's parity; the one-store
        # kernels use data[k] + their tier's offset).
        data_ptrs = [p + plan.data_offset() + c * self._slot_bytes for c in range(plan.SLOT_COPIES)
                     for p in transport.ptrs]
        sig_ptrs = list(transport.ptrs)
        # The kernels read the peer pointers from device memory (a kernel argument cannot hold W pointers
        # portably through the driver API); allocated once here, so calls never allocate.
        self._table = torch.tensor(data_ptrs + sig_ptrs, dtype=torch.int64, device=device)
        self._ctrl = _HostCtrl()
        # The Group arguments every kernel ends with: constant for the workspace's life, built once.
        self._tail = [_u64(self._table.data_ptr()), _u64(self._table.data_ptr() + 8 * len(data_ptrs)),
                      ctypes.c_int32(self.rank), _u64(self.timeout_ns), _u64(self._ctrl.ptr)]
        self._sig_ptrs = sig_ptrs
        self._lock = threading.Lock()
        self._device_index = device.index
        # The in-flight guard's state: the raw stream of the last eager call and an event recorded after it (a
        # timing-free CUDA event through cupy's runtime binding: recording and querying it by handle costs well
        # under a microsecond, where torch's Event wants a Stream object built per call).
        self._last_stream: int | None = None
        from cupy.cuda import runtime  # noqa: PLC0415

        with torch.cuda.device(device):
            self._done = runtime.eventCreateWithFlags(2)  # cudaEventDisableTiming
        # Bound once: a function-level import costs a lookup in sys.modules on every call of the hot path.
        self._event_record = runtime.eventRecord
        self._event_query = runtime.eventQuery
        self._launchers: dict[tuple[str, str, int, int, str], Launcher] = {}
        self._bound: dict[tuple[Any, ...], BoundCall] = {}
        self._dead: str | None = None
        self._failure: str | None = None
        # Launch numbers: every launch carries one, peers compare them at the start barrier; labels name them.
        self._calls = 0
        self._label_ring: list[tuple[int, str] | None] = [None] * _LABELS_KEPT
        self._in_flight = InFlight(self)
        self.refused: dict[str, str] = dict(kernels.refused)
        #: (collective, dtype, variant) of every code path this workspace has run, when recording; None otherwise.
        self.variants_run: set[tuple[str, str, str]] | None = None
        # The path recorder: a hook only detcomm.workspace.debug sets (record()); the launches skip it when None.
        self._record_path: Callable[[tuple[str, str, str]], None] | None = None

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def create(cls, group: Any = None, *, device: torch.device | str | int, capacity_bytes: int, max_rows_armed: int,
               one_shot_max_bytes: int | None = None, one_store_max_bytes: int | None = None,
               timeout_s: float = DEFAULT_SPIN_DEADLINE_S, max_grid: int = plan.DEFAULT_MAX_GRID,
               one_store_grid: int | None = None, one_store_tiers: Sequence[tuple[int, int]] | None = None) -> Workspace:
        """Arm a workspace over `group` (torch.distributed group; None = default). COLLECTIVE.

        capacity_bytes: bytes of one rank's rows one launch carries (init's workspace_bytes; more rows are chunked);
        max_rows_armed: the most rows of the sites this workspace was armed for (reported to the router; calls
        with more rows still work, chunked). one_shot_max_bytes: messages above it take two-shot (None: from the
        topology, plan.one_shot_max_bytes). one_store_max_bytes: all-reduce launches up to this size take the one-store
        kernel (None: from the topology, plan.one_store_max_bytes; 0: never). timeout_s: the device-side deadline of every barrier (see
        DEFAULT_SPIN_DEADLINE_S for why 60 s). max_grid caps the blocks of every launch, one_store_grid those of the
        one-store launches alone (None: no cap below the grid). one_store_tiers: the (max bytes, blocks) tiers of the
        one-store launches below the largest (None: plan.DEFAULT_ONE_STORE_TIERS; (): every one-store launch on the
        whole grid); plan.one_store_tiers says how they combine with the grid and one_store_grid. Raises ValueError for bad arguments and WorkspaceUnavailable (on every
        rank, with every rank's reason) when no kernel module, the symmetric memory or the peer-access proof
        fails. A dtype whose module cannot be built on some rank is refused alone on every rank (`refused`,
        `variants`). The kernels are the canonical build (other builds: detcomm.workspace.debug).
        """
        import torch.distributed as dist  # noqa: PLC0415

        from ..symm_mem import IpcSymmetricBuffer, SymmMemUnavailable  # noqa: PLC0415

        _refuse_under_capture("Workspace.create")
        dev = cls._check_args(device, capacity_bytes, max_rows_armed, one_shot_max_bytes, timeout_s, one_store_max_bytes)
        world = dist.get_world_size(group)
        if not 1 <= world <= plan.MAX_WORLD:
            raise ValueError(f"the workspace serves groups of 1..{plan.MAX_WORLD} ranks, got {world}")

        err, sm_count, gpu_id, ks, refused = None, 0, "", None, {}
        try:
            props = torch.cuda.get_device_properties(dev)
            sm_count, gpu_id = props.multi_processor_count, str(props.uuid)
            ks = kernel_set(dev.index, world, build=cls._kernel_build)
            refused = ks.refused
            if len(refused) == len(MODULE_DTYPE_CODES):
                err = "kernels: no module could be built: " + "; ".join(f"{m}: {r}" for m, r in refused.items())
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            err = f"kernels: {type(e).__name__}: {e}"
        table = plan.DEFAULT_ONE_STORE_TIERS if one_store_tiers is None else tuple((b, n) for b, n in one_store_tiers)
        config = (capacity_bytes, max_rows_armed, one_shot_max_bytes, one_store_max_bytes, max_grid, one_store_grid, table,
                  cls._kernel_build, timeout_s)
        infos: list[Any] = [None] * world
        dist.all_gather_object(infos, (err, sm_count, config, refused, gpu_id), group=group)
        reasons = [f"rank {r}: {i[0]}" for r, i in enumerate(infos) if i[0]]
        reasons += [f"rank {r}: configuration {i[2]} differs from rank 0's {infos[0][2]}"
                    for r, i in enumerate(infos) if i[2] != infos[0][2]]
        if reasons:
            raise WorkspaceUnavailable("; ".join(reasons))
        assert ks is not None
        # A module refused on any rank is refused on every rank (the same calls must run everywhere).
        all_refused = {m: f"rank {r}: {why}" for r, i in reversed(list(enumerate(infos))) for m, why in i[3].items()}
        # Geometry from topology: the device identities every rank reported decide whether ranks share a GPU.
        shared = len({i[4] for i in infos}) < world
        grid = plan.grid_blocks(world, min(i[1] for i in infos), max_grid=max_grid, shared_gpu=shared)
        if one_shot_max_bytes is None:
            one_shot_max_bytes = plan.one_shot_max_bytes(world, shared_gpu=shared)
        if one_store_max_bytes is None:
            one_store_max_bytes = plan.one_store_max_bytes(world, shared_gpu=shared)
        tiers = plan.one_store_tiers(one_store_max_bytes, world, grid, base=plan.one_store_offset(capacity_bytes, world, grid),
                                   table=table, max_blocks=one_store_grid)
        try:
            transport = IpcSymmetricBuffer.create(plan.buffer_bytes(capacity_bytes, world, grid, tiers),
                                                  group=group,
                                                  device_index=dev.index, probe_offset=plan.probe_offset())
        except SymmMemUnavailable as e:
            raise WorkspaceUnavailable(str(e)) from e
        ws = cls(transport=transport, kernels=ks, grid=grid, one_store_tiers=tiers, capacity_bytes=capacity_bytes,
                 max_rows_armed=max_rows_armed, one_shot_max_bytes=one_shot_max_bytes,
                 timeout_ns=int(timeout_s * 1e9), device=dev)
        ws.refused = all_refused
        if all_refused:
            _LOG.warning("detcomm workspace: kernel modules refused (their calls take another route): %s", all_refused)
        return ws

    @classmethod
    def in_process(cls, world_size: int, *, device: torch.device | str | int, capacity_bytes: int,
                   max_rows_armed: int = plan.DEFAULT_MAX_ROWS_ARMED,
                   one_shot_max_bytes: int = plan.DEFAULT_ONE_SHOT_MAX_BYTES, one_store_max_bytes: int | None = None,
                   timeout_s: float = DEFAULT_SPIN_DEADLINE_S, max_grid: int = plan.DEFAULT_MAX_GRID,
                   one_store_grid: int | None = None, one_store_tiers: Sequence[tuple[int, int]] | None = None
                   ) -> list[Workspace]:
        """W rank views of one workspace inside this process on one GPU (the W-stream harness). NOT collective.

        Drive rank r's collectives from its own CUDA stream and launch all W before waiting on any: a rank's
        kernel spins until the same block of every other rank arrives. Under CUDA graphs capture one graph per
        rank (on its own stream), never all ranks in one graph, whose replay would serialize them.
        """
        from ..symm_mem import create_local_group  # noqa: PLC0415

        _refuse_under_capture("Workspace.in_process")
        dev = cls._check_args(device, capacity_bytes, max_rows_armed, one_shot_max_bytes, timeout_s, one_store_max_bytes)
        if not 1 <= world_size <= plan.MAX_WORLD:
            raise ValueError(f"world_size must be in 1..{plan.MAX_WORLD}, got {world_size}")
        if one_store_max_bytes is None:
            one_store_max_bytes = plan.one_store_max_bytes(world_size, shared_gpu=True)
        sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
        grid = plan.grid_blocks(world_size, sm_count, max_grid=max_grid)
        tiers = plan.one_store_tiers(one_store_max_bytes, world_size, grid,
                                   base=plan.one_store_offset(capacity_bytes, world_size, grid),
                                   table=plan.DEFAULT_ONE_STORE_TIERS if one_store_tiers is None else one_store_tiers,
                                   max_blocks=one_store_grid)
        ks = kernel_set(dev.index, world_size, build=cls._kernel_build)
        views = create_local_group(world_size, plan.buffer_bytes(capacity_bytes, world_size, grid, tiers),
                                   device_index=dev.index, probe_offset=plan.probe_offset())
        return [cls(transport=v, kernels=ks, grid=grid, one_store_tiers=tiers, capacity_bytes=capacity_bytes,
                    max_rows_armed=max_rows_armed,
                    one_shot_max_bytes=one_shot_max_bytes,
                    timeout_ns=int(timeout_s * 1e9), device=dev)
                for v in views]

    @staticmethod
    def _check_args(device: Any, capacity_bytes: int, max_rows_armed: int, one_shot_max_bytes: int | None,
                    timeout_s: float, one_store_max_bytes: int | None = None) -> torch.device:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise ValueError(f"the workspace lives on a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if capacity_bytes < plan.PACK_BYTES:
            raise ValueError(f"capacity_bytes must be >= {plan.PACK_BYTES}, got {capacity_bytes}")
        if max_rows_armed < 1:
            raise ValueError(f"max_rows_armed must be >= 1, got {max_rows_armed}")
        if one_shot_max_bytes is not None and one_shot_max_bytes < 0:
            raise ValueError(f"one_shot_max_bytes must be >= 0, got {one_shot_max_bytes}")
        if one_store_max_bytes is not None and one_store_max_bytes < 0:
            raise ValueError(f"one_store_max_bytes must be >= 0 (0 turns the one-store kernel off), got "
                             f"{one_store_max_bytes}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        return dev

    # ---- lifecycle -------------------------------------------------------------------------------------
    def close(self) -> None:
        """COLLECTIVE: wait for this rank's work, meet the peers, release the IPC mappings and buffers. After an
        abort or a failure every kernel has ended (no spin outlives the deadline), so close still releases."""
        if self._dead == "closed":
            return
        if self._dead == "aborted":
            # abort() promised to leave memory to process exit: a peer may still store its abort word here.
            self._dead = "closed"
            return
        self._transport.close()
        self._ctrl.free()
        from cupy.cuda import runtime  # noqa: PLC0415

        runtime.eventDestroy(self._done)
        self._dead = "closed"

    def abort(self) -> None:
        """LOCAL (for failures): never waits on the device or the peers. Releases this rank's spinning kernels
        (the host abort word every spin polls) and tells the peers (their header's abort word, written by an
        asynchronous copy on a private stream), whose kernels then stop at their next barrier and raise
        WorkspaceFailed naming this rank. The workspace refuses every later call; device buffers, mappings and
        the control words stay allocated until the process exits, because a peer's kernel may still write them."""
        if self._dead in ("aborted", "closed"):
            return
        self._dead = "aborted"
        value = plan.ABORT_BY_HOST | self.rank
        self._ctrl.words[plan.HOST_ABORT_WORD] = value
        try:
            from cupy.cuda import runtime  # noqa: PLC0415

            src = self._ctrl.ptr + plan.HOST_ABORT_WORD * 4
            with torch.cuda.device(self.device):
                stream = runtime.streamCreateWithFlags(1)  # cudaStreamNonBlocking: never waits on the spinning work
                for base in self._sig_ptrs:
                    runtime.memcpyAsync(base + plan.ABORT_INDEX * 4, src, 4, runtime.memcpyHostToDevice, stream)
        except Exception as e:  # noqa: BLE001 - a context a debug trap destroyed cannot copy; the deadline still ends the peers' spins
            _LOG.warning("detcomm workspace (rank %d): could not tell the peers about the abort: %s", self.rank, e)
        self._transport.abort()

    def check(self) -> None:
        """LOCAL, never waits: raise WorkspaceFailed if a kernel of this rank recorded a failure (or the workspace
        was aborted). Every collective call does this first; call it after synchronizing to learn about the last
        call (see `synchronize`)."""
        if self._failure is not None:
            raise WorkspaceFailed(self._failure)
        if self._ctrl.ptr and self._ctrl.tagged():
            line = plan.decode_record(self._ctrl.record(), self._labels())
            self._failure = (f"detcomm workspace (rank {self.rank}) failed: {line}. It refuses every call until it is "
                             "re-created (close it and create a new one on every rank).")
            if self._dead is None:
                self._dead = "failed"
            raise WorkspaceFailed(self._failure)
        if self._dead == "aborted":
            self._failure = f"detcomm workspace (rank {self.rank}) was aborted on this rank; re-create it"
            raise WorkspaceFailed(self._failure)
        if self._dead == "closed":
            raise WorkspaceFailed(f"detcomm workspace (rank {self.rank}) is closed: create a new one")

    def synchronize(self) -> None:
        """LOCAL: wait for this rank's work on the current stream and for this workspace's last launch, on
        whichever stream it was issued (at most the deadline, since no spin outlives it), then `check()`."""
        torch.cuda.current_stream(self.device).synchronize()
        if self._last_stream is not None and self._dead != "closed":
            from cupy.cuda import runtime  # noqa: PLC0415

            # The last eager launch may sit on another stream than the caller's: without this wait, check() could
            # read the failure record before that kernel wrote it (a fast host path makes the race real).
            runtime.eventSynchronize(self._done)
        self.check()

    def error_record(self) -> str | None:
        """LOCAL: this rank's failure record, decoded into one line; None if there is none. Readable without
        waiting on the device (the record lives in mapped pinned host memory)."""
        if not self._ctrl.ptr:
            return None
        return plan.decode_record(self._ctrl.record(), self._labels())

    # ---- one call shape, checked once; one run method for every all-reduce family ---------------------------
    def bind(self, family: str, dtype: str, row_elems: int, *, shards: int = 1, weight: str = "float32",
             algo: str | None = None, chunk_rows: int | None = None, label: str | None = None) -> BoundCall:
        """LOCAL: the calls of `family` (plan.FAMILY_ALGOS) on rows of `row_elems` elements of `dtype` (the output's;
        shards: fp32 slabs per rank of the slab families; weight: the fused norm weight's dtype), with a forced
        kernel (algo) or rows per launch (chunk_rows) or neither, checked here once: the dtype served, the tree's
        V, a row fitting a launch, a forced kernel fitting its areas. Bound calls are kept per shape."""
        key = (family, dtype, row_elems, shards, weight, algo, chunk_rows, label)
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bind(family, dtype, row_elems, shards, weight, algo, chunk_rows, label)
            if len(self._bound) < _LABELS_KEPT:
                self._bound[key] = bound
        return bound

    def _bind(self, family: str, dtype: str, row_elems: int, shards: int, weight: str, algo: str | None,
              chunk_rows: int | None, label: str | None) -> BoundCall:
        algos = plan.FAMILY_ALGOS[family]
        if algo is not None and algo not in algos:
            raise ValueError(f"algo must be None or one of {algos}, got {algo!r}")
        if dtype in self.refused:
            raise WorkspaceUnavailable(f"the workspace's {dtype} kernels were refused: {self.refused[dtype]}")
        if row_elems < 1:
            raise ValueError(f"row_numel must be >= 1, got {row_elems}")
        if family in ("tree", "fused_tree"):
            why = plan.tree_refusal(shards * self.world_size, self.world_size)
            if why is not None:
                raise ValueError(f"{why} (this call passes S={shards} slabs per rank)")
        per = plan.rows_per_launch(family, row_elems=row_elems, dtype=dtype, shards=shards,
                                   capacity_bytes=self.capacity_bytes, world_size=self.world_size, grid=self.grid)
        if per < 1:
            if family == "plain":  # a caller's error: the row is larger than the capacity it armed
                plan.rows_per_chunk(self.capacity_bytes, row_elems * plan.elem_size(dtype))
            what = f"one fp32 row of {row_elems} elements" if family != "virtual" else \
                f"one row's {shards} fp32 slabs of {row_elems} elements"
            raise WorkspaceUnavailable(f"{what} does not fit one launch of this workspace (capacity "
                                       f"{self.capacity_bytes} bytes{', fused' if family.startswith('fused') else ''})")
        if chunk_rows is not None:
            if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int):
                raise TypeError(f"chunk_rows must be an int, got {type(chunk_rows).__name__}")
            if not 1 <= chunk_rows <= per:
                raise ValueError(f"chunk_rows must be in 1..{per} (rows one launch carries), got {chunk_rows}")
        if algo == "one_store":
            fit = plan.one_store_rows(family, row_elems=row_elems, dtype=dtype, one_store_max=self.one_store_max_bytes)
            if fit < 1 or (chunk_rows is not None and chunk_rows > fit):
                raise ValueError(f"algo='one_store' serves launches of at most {fit} row(s) of {row_elems} elements "
                                 f"(one_store_max_bytes={self.one_store_max_bytes}); asked for {chunk_rows or 1}")
            per = min(per, fit)  # forced: as many rows per launch as the one-store areas hold
        layout = self._kernels.fused_norm_layout(row_elems, dtype) if family.startswith("fused") else "registers"
        lkey = (family, dtype, row_elems, shards, weight)
        launcher = self._launchers.get(lkey)
        if launcher is None:
            launcher = self._launchers[lkey] = Launcher(self, family, dtype, row_elems, shards=shards, weight=weight,
                                                        layout=layout)
        return BoundCall(launcher, per if chunk_rows is None else chunk_rows, algo, label)

    def run(self, call: BoundCall, ptrs: Sequence[int], rows: int, *, eps: float = 0.0) -> None:
        """COLLECTIVE: the launches of one call of `rows` rows bound as `call` (bind), on the operands at `ptrs`
        (launch.Launcher's order), on the caller's current stream. Every check of the call is already made: the
        operands' (the collective methods, or the communicator for a site-bound call) and the workspace's liveness
        (the collective methods' _check_tensor, the site-bound calls' own)."""
        if rows:
            with self._in_flight as stream:
                call.launcher.launch(self, stream, ptrs, rows, call.per, call.algo, call.label, eps)

    def _next_call(self, label: str | None) -> int:
        """The next launch number (peers compare it at the start barrier); remembers the label of the last
        _LABELS_KEPT calls for failure messages (a ring of (call, label): one store per call)."""
        call = self._calls = (self._calls + 1) & 0xFFFFFFFF
        if label is not None:
            self._label_ring[call & (_LABELS_KEPT - 1)] = (call, label)
        return call

    def _labels(self) -> dict[int, str]:
        return dict(entry for entry in self._label_ring if entry is not None)

