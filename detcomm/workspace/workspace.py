"""The armed CUDA-IPC workspace: symmetric buffers + loaded kernels + the host logic of each collective.

Every reduction is the canonical fold of docs/spec.md §1 (csrc/detcomm_common.cuh), so one-shot, two-shot and any chunking
give the same bits; the row count only picks the kernel and the chunking.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

from ..dtypes import FLOAT_DTYPES, FLOAT_NAMES, name_of
from ..errors import WorkspaceUnavailable
from . import plan
from .kernels import KernelSet, kernel_set

DEFAULT_TIMEOUT_S = 10.0


def _refuse_under_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"detcomm workspace: {what} allocates device memory and loads kernels, which CUDA graph capture forbids; "
            "create the workspace before capturing"
        )


def _u64(x: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(x)


def _i64(x: int) -> ctypes.c_int64:
    return ctypes.c_int64(x)


class _HostErrorWords:
    """Pinned, device-mapped host memory for the kernels' timeout records. It stays readable from the host after
    a __trap() has destroyed the CUDA context, which is the point."""

    def __init__(self, words: int) -> None:
        from cupy.cuda import runtime  # noqa: PLC0415

        self.words = words
        self.ptr = runtime.hostAlloc(words * 4, runtime.hostAllocMapped)
        ctypes.memset(self.ptr, 0, words * 4)
        self._array = (ctypes.c_uint32 * words).from_address(self.ptr)

    def read(self) -> list[int]:
        return list(self._array)

    def clear(self) -> None:
        ctypes.memset(self.ptr, 0, self.words * 4)

    def free(self) -> None:
        from cupy.cuda import runtime  # noqa: PLC0415

        if self.ptr:
            runtime.freeHost(self.ptr)
            self.ptr = 0


class Workspace:
    """One rank's armed CUDA-IPC workspace (or one rank view of an in-process group).

    Collective calls (every rank of the group must make them, in the same order, with the same shapes):
    `create`, `all_reduce`, `reduce_scatter`, `all_gather`, `close`. Local calls: `abort`, `error_record`.
    `in_process` is not collective (one process plays every rank); its rank views' collectives must still be
    called once per rank, each from its own stream.

    Inputs are contiguous tensors on the workspace's device, [rows, *trailing], rows along dim 0. One collective
    may be in flight per workspace: a call from another stream while the previous one has not finished raises.
    """

    def __init__(self, *, transport: Any, kernels: KernelSet, grid: int, capacity_bytes: int, max_rows_armed: int,
                 one_shot_max_bytes: int, timeout_ns: int, device: torch.device) -> None:
        # Private: use Workspace.create or Workspace.in_process.
        self._transport = transport
        self._kernels = kernels
        self.grid = grid
        self.capacity_bytes = capacity_bytes
        self.max_rows_armed = max_rows_armed
        self.one_shot_max_bytes = one_shot_max_bytes
        self.timeout_ns = timeout_ns
        self.device = device
        self.rank = transport.rank
        self.world_size = transport.world_size
        self._slot_bytes = plan.slot_bytes(capacity_bytes, self.world_size, grid)
        data_ptrs = [p + plan.data_offset() for p in transport.ptrs]
        sig_ptrs = list(transport.ptrs)
        # The kernels read the peer pointers from device memory (a kernel argument cannot hold W pointers
        # portably through the driver API); allocated once here, so calls never allocate.
        self._table = torch.tensor(data_ptrs + sig_ptrs, dtype=torch.int64, device=device)
        self._err = _HostErrorWords(plan.MAX_BLOCKS * plan.ERR_WORDS)
        # The Group arguments every kernel ends with: constant for the workspace's life, built once.
        self._tail = [_u64(self._table.data_ptr()), _u64(self._table.data_ptr() + 8 * self.world_size),
                      ctypes.c_int32(self.rank), _u64(self.timeout_ns), _u64(self._err.ptr)]
        self._lock = threading.Lock()
        self._last_stream: torch.cuda.Stream | None = None
        self._done = torch.cuda.Event()
        self._dead: str | None = None

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def create(cls, group: Any = None, *, device: torch.device | str | int, capacity_bytes: int, max_rows_armed: int,
               one_shot_max_bytes: int = plan.DEFAULT_ONE_SHOT_MAX_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S,
               max_grid: int = plan.DEFAULT_MAX_GRID, _variant: str = "canonical") -> Workspace:
        """Arm a workspace over `group` (torch.distributed group; None = default). COLLECTIVE.

        capacity_bytes: bytes of one rank's rows one launch carries (plan.plan_capacity sizes it from the sites);
        max_rows_armed: the most rows of the sites this workspace was armed for (reported to the router; calls
        with more rows still work, chunked). Raises ValueError for bad arguments and WorkspaceUnavailable (on
        every rank, with every rank's reason) when the kernels, the symmetric memory or the peer-access proof
        fail. `_variant="rotated"` builds the negative-control kernels (tests only: NOT the canonical fold).
        """
        import torch.distributed as dist  # noqa: PLC0415

        from ..symm_mem import IpcSymmetricBuffer, SymmMemUnavailable  # noqa: PLC0415

        _refuse_under_capture("Workspace.create")
        dev = cls._check_args(device, capacity_bytes, max_rows_armed, one_shot_max_bytes, timeout_s, _variant)
        world = dist.get_world_size(group)
        if not 1 <= world <= plan.MAX_WORLD:
            raise ValueError(f"the workspace serves groups of 1..{plan.MAX_WORLD} ranks, got {world}")

        err, sm_count, ks = None, 0, None
        try:
            sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
            ks = kernel_set(dev.index, world, rotated=_variant == "rotated")
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            err = f"kernels: {type(e).__name__}: {e}"
        config = (capacity_bytes, max_rows_armed, one_shot_max_bytes, max_grid, _variant)
        infos: list[Any] = [None] * world
        dist.all_gather_object(infos, (err, sm_count, config), group=group)
        reasons = [f"rank {r}: {i[0]}" for r, i in enumerate(infos) if i[0]]
        reasons += [f"rank {r}: configuration {i[2]} differs from rank 0's {infos[0][2]}"
                    for r, i in enumerate(infos) if i[2] != infos[0][2]]
        if reasons:
            raise WorkspaceUnavailable("; ".join(reasons))
        assert ks is not None
        grid = plan.grid_blocks(world, min(i[1] for i in infos), max_grid=max_grid)
        try:
            transport = IpcSymmetricBuffer.create(plan.buffer_bytes(capacity_bytes, world, grid), group=group,
                                                  device_index=dev.index, probe_offset=plan.probe_offset())
        except SymmMemUnavailable as e:
            raise WorkspaceUnavailable(str(e)) from e
        return cls(transport=transport, kernels=ks, grid=grid, capacity_bytes=capacity_bytes,
                   max_rows_armed=max_rows_armed, one_shot_max_bytes=one_shot_max_bytes,
                   timeout_ns=int(timeout_s * 1e9), device=dev)

    @classmethod
    def in_process(cls, world_size: int, *, device: torch.device | str | int, capacity_bytes: int,
                   max_rows_armed: int = plan.DEFAULT_MAX_ROWS_ARMED,
                   one_shot_max_bytes: int = plan.DEFAULT_ONE_SHOT_MAX_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S,
                   max_grid: int = plan.DEFAULT_MAX_GRID, _variant: str = "canonical") -> list[Workspace]:
        """W rank views of one workspace inside this process on one GPU (the W-stream harness). NOT collective.

        Drive rank r's collectives from its own CUDA stream and launch all W before waiting on any: a rank's
        kernel spins until the same block of every other rank arrives. Under CUDA graphs capture one graph per
        rank (on its own stream), never all ranks in one graph, whose replay would serialize them.
        """
        from ..symm_mem import create_local_group  # noqa: PLC0415

        _refuse_under_capture("Workspace.in_process")
        dev = cls._check_args(device, capacity_bytes, max_rows_armed, one_shot_max_bytes, timeout_s, _variant)
        if not 1 <= world_size <= plan.MAX_WORLD:
            raise ValueError(f"world_size must be in 1..{plan.MAX_WORLD}, got {world_size}")
        sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
        grid = plan.grid_blocks(world_size, sm_count, max_grid=max_grid)
        ks = kernel_set(dev.index, world_size, rotated=_variant == "rotated")
        views = create_local_group(world_size, plan.buffer_bytes(capacity_bytes, world_size, grid),
                                   device_index=dev.index, probe_offset=plan.probe_offset())
        return [cls(transport=v, kernels=ks, grid=grid, capacity_bytes=capacity_bytes, max_rows_armed=max_rows_armed,
                    one_shot_max_bytes=one_shot_max_bytes, timeout_ns=int(timeout_s * 1e9), device=dev)
                for v in views]

    @staticmethod
    def _check_args(device: Any, capacity_bytes: int, max_rows_armed: int, one_shot_max_bytes: int,
                    timeout_s: float, variant: str) -> torch.device:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise ValueError(f"the workspace lives on a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if capacity_bytes < plan.PACK_BYTES:
            raise ValueError(f"capacity_bytes must be >= {plan.PACK_BYTES}, got {capacity_bytes}")
        if max_rows_armed < 1:
            raise ValueError(f"max_rows_armed must be >= 1, got {max_rows_armed}")
        if one_shot_max_bytes < 0:
            raise ValueError(f"one_shot_max_bytes must be >= 0, got {one_shot_max_bytes}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if variant not in ("canonical", "rotated"):
            raise ValueError(f"unknown kernel variant {variant!r}")
        return dev

    # ---- lifecycle -------------------------------------------------------------------------------------
    def close(self) -> None:
        """COLLECTIVE: wait for this rank's work, meet the peers, release the IPC mappings and buffers."""
        if self._dead == "closed":
            return
        self._transport.close()
        self._err.free()
        self._dead = "closed"

    def abort(self) -> None:
        """LOCAL (for failures): never waits on the device or the peers. The workspace refuses every later call;
        device buffers, mappings and the host error words stay allocated until the process exits, because a
        peer's kernel may still be writing into them."""
        if self._dead is None:
            self._dead = "aborted"
            self._transport.abort()

    def error_record(self) -> str | None:
        """LOCAL: the first timeout record a kernel of this rank wrote before trapping, decoded; None if none.
        Readable after the trap has destroyed the CUDA context (the words live in pinned host memory)."""
        if not self._err.ptr:
            return None
        words = self._err.read()
        for b in range(plan.MAX_BLOCKS):
            rec = words[b * plan.ERR_WORDS:(b + 1) * plan.ERR_WORDS]
            if rec[0] == plan.ERR_TIMEOUT:
                kind = plan.BARRIER_NAMES[rec[3]] if rec[3] < len(plan.BARRIER_NAMES) else str(rec[3])
                return (f"rank {rec[1]} (block {b}) timed out after {rec[6]} ms at the {kind} barrier waiting for "
                        f"rank {rec[2]} (epoch {rec[4]}, flag seen {rec[5]})")
        return None

    # ---- collectives -----------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor | None = None, algo: str | None = None) -> torch.Tensor:
        """COLLECTIVE. SUM of x over the group by the canonical fold; every rank gets identical bits.

        algo: None chooses by message size (one-shot up to one_shot_max_bytes per launch, two-shot above);
        "one_shot" / "two_shot" force one (tests, bench). All choices and any chunking give the same bits.
        """
        if algo not in (None, "one_shot", "two_shot"):
            raise ValueError(f"algo must be None, 'one_shot' or 'two_shot', got {algo!r}")
        dtype = self._fold_dtype(x)
        out = self._output(x, out, tuple(x.shape))
        rows, row_elems, row_bytes = self._rows(x)
        if rows == 0 or row_elems == 0:
            return out
        sfx = plan.DTYPE_SUFFIX[dtype]
        per = plan.rows_per_chunk(self.capacity_bytes, row_bytes)
        with self._collective() as stream_ptr:
            for a, b in plan.chunks(rows, per):
                n = (b - a) * row_elems
                xp, op = x.data_ptr() + a * row_bytes, out.data_ptr() + a * row_bytes
                one = algo == "one_shot" or (algo is None and n * x.element_size() <= self.one_shot_max_bytes)
                if one:
                    self._launch(f"detcomm_one_shot_{sfx}", [_u64(xp), _u64(op), _i64(n)], stream_ptr)
                else:
                    geo = plan.two_shot_slices(n, self.world_size, dtype, self.grid)
                    assert geo.slot_bytes_used(self.world_size) <= self._slot_bytes, (geo, self._slot_bytes)
                    self._launch(f"detcomm_two_shot_{sfx}",
                                 [_u64(xp), _u64(op), _i64(n), _i64(geo.length), _i64(geo.stride_packs)], stream_ptr)
        return out

    def reduce_scatter(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """COLLECTIVE. x is [W * R, *trailing]; rank r gets the canonical fold over ranks of rows [r*R, (r+1)*R)."""
        dtype = self._fold_dtype(x)
        rows, row_elems, row_bytes = self._rows(x)
        if rows % self.world_size:
            raise ValueError(f"reduce_scatter needs rows divisible by the world size {self.world_size}, got {rows}")
        shard = rows // self.world_size
        out = self._output(x, out, (shard, *x.shape[1:]))
        if shard == 0 or row_elems == 0:
            return out
        sfx = plan.DTYPE_SUFFIX[dtype]
        per = plan.rows_per_chunk(self.capacity_bytes, row_bytes, parts=self.world_size)
        with self._collective() as stream_ptr:
            for a, b in plan.chunks(shard, per):
                geo = plan.reduce_scatter_slices(b - a, row_elems, dtype, self.grid)
                assert geo.slot_bytes_used(self.world_size) <= self._slot_bytes, (geo, self._slot_bytes)
                self._launch(f"detcomm_reduce_scatter_{sfx}",
                             [_u64(x.data_ptr() + a * row_bytes), _i64(shard * row_elems),
                              _u64(out.data_ptr() + a * row_bytes), _i64(geo.length), _i64(geo.stride_packs)],
                             stream_ptr)
        return out

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """COLLECTIVE. x is [R, *trailing] on every rank; returns [W * R, *trailing], rank r's rows at r*R.
        Data movement only (any dtype)."""
        self._check_tensor(x)
        rows, row_elems, row_bytes = self._rows(x)
        out = self._output(x, out, (self.world_size * rows, *x.shape[1:]))
        if rows == 0 or row_bytes == 0:
            return out
        per = plan.rows_per_chunk(self.capacity_bytes, row_bytes)
        with self._collective() as stream_ptr:
            for a, b in plan.chunks(rows, per):
                self._launch("detcomm_all_gather",
                             [_u64(x.data_ptr() + a * row_bytes), _u64(out.data_ptr() + a * row_bytes),
                              _i64((b - a) * row_bytes), _i64(rows * row_bytes)], stream_ptr)
        return out

    # ---- helpers ---------------------------------------------------------------------------------------
    def _check_tensor(self, x: torch.Tensor) -> None:
        if self._dead is not None:
            raise RuntimeError(f"detcomm workspace (rank {self.rank}) is {self._dead}")
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
        if x.device != self.device:
            raise ValueError(f"tensor on {x.device}, workspace on {self.device}")
        if x.dim() < 1:
            raise ValueError("tensor must have a row dimension (dim 0)")
        if not x.is_contiguous():
            raise ValueError("tensor must be contiguous")

    def _fold_dtype(self, x: torch.Tensor) -> str:
        self._check_tensor(x)
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"the workspace folds {list(FLOAT_NAMES)}, got {x.dtype}")
        return name_of(x.dtype)

    def _output(self, x: torch.Tensor, out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=x.dtype, device=x.device)
        if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape} on {x.device}")
        if out.data_ptr() == x.data_ptr() and out.numel():
            raise ValueError("out must not alias x")
        return out

    @staticmethod
    def _rows(x: torch.Tensor) -> tuple[int, int, int]:
        rows = x.shape[0]
        row_elems = x[0].numel() if rows else 0
        return rows, row_elems, row_elems * x.element_size()

    def _launch(self, name: str, args: list[Any], stream_ptr: int) -> None:
        self._kernels.launch(name, self.grid, args + self._tail, stream_ptr=stream_ptr)

    def _collective(self) -> _InFlight:
        return _InFlight(self)


class _InFlight:
    """Enforces one in-flight collective per workspace and runs the launches on the caller's current stream."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws

    def __enter__(self) -> int:
        ws = self.ws
        if not ws._lock.acquire(blocking=False):
            raise RuntimeError(f"detcomm workspace (rank {ws.rank}): another thread is issuing a collective on it")
        try:
            self.capturing = torch.cuda.is_current_stream_capturing()
            # Launches go to the current context: switch devices only when the caller is on another one.
            self.guard = torch.cuda.device(ws.device) if torch.cuda.current_device() != ws.device.index else None
            if self.guard is not None:
                self.guard.__enter__()
            stream = torch.cuda.current_stream()
            last = ws._last_stream
            # Event queries are not allowed during capture; a captured launch does not run now anyway.
            if (last is not None and last != stream and not self.capturing and not ws._done.query()):
                raise RuntimeError(
                    f"detcomm workspace (rank {ws.rank}): a collective issued on stream {last.cuda_stream:#x} is still "
                    f"in flight; one collective per workspace at a time (this call came from stream "
                    f"{stream.cuda_stream:#x}). Synchronize the streams or use one workspace per stream.")
            self.stream = stream
            return stream.cuda_stream
        except BaseException:
            guard = getattr(self, "guard", None)
            if guard is not None:
                guard.__exit__(None, None, None)
            ws._lock.release()
            raise

    def __exit__(self, *exc: Any) -> None:
        ws = self.ws
        try:
            if not self.capturing:
                ws._done.record(self.stream)
                ws._last_stream = self.stream
        finally:
            if self.guard is not None:
                self.guard.__exit__(None, None, None)
            ws._lock.release()
