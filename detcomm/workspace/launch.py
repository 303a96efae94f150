"""The one launcher of the workspace's all-reduce families (plan.FAMILY_ALGOS: plain, fused, tree, fused_tree,
virtual) and the in-flight guard every collective call runs its launches under.

A `Launcher` holds, for one (family, dtype, row width, shards, weight dtype, row layout) of a workspace, every
kernel's parameter block prepared once (kernels.PreparedLaunch) and, per launch size, the kernel plan.launch_kernel
picks with its two-shot geometry. A `BoundCall` is a launcher with the call's static options (rows per launch, a
forced kernel, the label), checked once when it is bound (Workspace.bind). A call then only sets the operands'
pointers, the launch count and the call number, and launches: every choice and chunking gives the same bits (the
canonical fold is element-wise); the row count only moves latency.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConcurrentCall, WorkspaceFailed
from . import plan

# The workspace the launches run on (detcomm.workspace.workspace.Workspace, which imports this module: typed Any
# here, so the two modules form no import circle).
Workspace = Any

# The collective each family's code paths are recorded under (Workspace.variants_run).
COLLECTIVE = {"plain": "all_reduce", "fused": "all_reduce_rmsnorm", "tree": "all_reduce_tree",
              "fused_tree": "all_reduce_rmsnorm_tree", "virtual": "all_reduce_virtual"}
_FUSED = frozenset({"fused", "fused_tree"})
_SLABS = frozenset({"tree", "virtual", "fused_tree"})  # inputs of S fp32 slabs: a slab stride and S per call
_CHOICES_KEPT = 4096  # the distinct launch sizes of a site: bounded by its max rows


def _kernel_name(family: str, algo: str, dtype: str, weight: str, wide: bool) -> str:
    sfx = plan.DTYPE_SUFFIX[dtype]
    if family == "plain":
        return f"detcomm_{algo}_{sfx}"
    if family == "virtual":
        return f"detcomm_virtual_{algo}_{sfx}"
    if family == "tree":
        return plan.tree_kernel(algo, dtype)
    return plan.fused_norm_kernel(algo, dtype, weight, wide=wide, tree=family == "fused_tree")


class Launcher:
    """The launches of one family's calls on one workspace. Operands (pointers, in the kernels' order): plain and
    the shard orders (x, out); fused (x, residual, weight, y, r); fused_tree (partials, residual, weight, y, r)."""

    def __init__(self, ws: Workspace, family: str, dtype: str, row_elems: int, *, shards: int = 1,
                 weight: str = "float32", layout: str = "registers") -> None:
        self.family, self.dtype, self.row_elems, self.shards = family, dtype, row_elems, shards
        self.world, self.grid, self.slot_bytes = ws.world_size, ws.grid, ws._slot_bytes
        self.one_shot_max = ws.one_shot_max_bytes
        rb, rb32 = row_elems * plan.elem_size(dtype), row_elems * plan.F32_BYTES
        first = rb32 if family in _SLABS else rb
        # Bytes one row moves each operand's pointer by (the weight is one row for every row).
        self.strides = (first, rb) if family in ("plain", "tree", "virtual") else (first, rb, 0, rb, rb)
        self.ptrs = [ctypes.c_uint64() for _ in self.strides]
        self.count, self.call = ctypes.c_int64(), ctypes.c_uint32()
        self.length, self.stride = ctypes.c_int64(), ctypes.c_int64()
        self.x_stride, self.eps = ctypes.c_int64(), ctypes.c_float()
        self.count_unit = 1 if family in _FUSED else row_elems
        p = self.ptrs
        slab = [self.x_stride, ctypes.c_int32(shards)] if family in _SLABS else []
        if family in _FUSED:
            head = [p[0], *slab, *p[1:], self.count, ctypes.c_int64(row_elems), self.eps]
        else:
            head = [p[0], *slab, p[1], self.count]
        two = {"plain": [self.length, self.stride], "tree": [self.length], "virtual": [self.length]}.get(family, [])
        tail = [self.call, *ws._tail]
        algos = plan.FAMILY_ALGOS[family]
        tiers = ws.one_store_tiers if "one_store" in algos else ()
        self.tier_limits = tuple(t.max_bytes for t in tiers)
        ks = ws._kernels
        name = lambda algo: _kernel_name(family, algo, dtype, weight, layout == "wide")  # noqa: E731
        self.one_stores = [ks.prepare(name("one_store"), t.blocks,
                                      [*head, ctypes.c_int64(t.offset), ctypes.c_int64(t.cap), *tail]) for t in tiers]
        self.one_shot = ks.prepare(name("one_shot"), ws.grid, [*head, *tail])
        self.two_shot = ks.prepare(name("two_shot"), ws.grid, [*head, *two, *tail])
        coll = COLLECTIVE[family]
        tag = (lambda a: f"fused_{a}") if family in _FUSED else (lambda a: a)
        extra = [(coll, dtype, f"layout_{layout}")] if family in _FUSED else []
        self.paths = {a: [(coll, dtype, tag(a)), *extra] for a in algos}
        self.chunked = (coll, dtype, tag("chunked"))
        # Per forced kernel (None: the rule's), per launch rows: (launch, algo, two-shot length, stride).
        self._choices: dict[str | None, dict[int, tuple[Any, str, int, int]]] = {a: {} for a in (None, *algos)}
        self.slabs, self.fused, self.pair = family in _SLABS, family in _FUSED, len(self.strides) == 2

    def _choose(self, k: int, algo: str | None) -> tuple[Any, str, int, int]:
        """(launch, algo, two-shot length, stride) of a launch of k rows: plan.launch_kernel's pick, or the forced
        kernel (a forced one-store launch takes the first tier that holds it: the call's rows per launch fit one)."""
        rule, tier = plan.launch_kernel(self.family, k, row_elems=self.row_elems, dtype=self.dtype,
                                        shards=self.shards, one_store_tiers=self.tier_limits,
                                        one_shot_max_bytes=self.one_shot_max)
        kind = algo or rule
        n, length, stride = k * self.row_elems, 0, 0
        if kind == "one_store":
            assert rule == "one_store", (k, self.tier_limits)
            launch = self.one_stores[tier]
        else:
            launch = self.one_shot if kind == "one_shot" else self.two_shot
            length, stride, used = self._geometry(kind, n)
            assert used <= self.slot_bytes, (kind, n, used, self.slot_bytes)
        choice = (launch, kind, length, stride)
        if len(self._choices[algo]) < _CHOICES_KEPT:
            self._choices[algo][k] = choice
        return choice

    def _geometry(self, kind: str, n: int) -> tuple[int, int, int]:
        """(length, stride in packs, slot bytes used) of a barrier launch of n elements per operand row."""
        w, dtype = self.world, self.dtype
        if self.family == "plain":
            if kind == "one_shot":
                return 0, 0, 0  # the slot holds the capacity, and the launch's rows fit it
            geo = plan.two_shot_slices(n, w, dtype, self.grid)
            return geo.length, geo.stride_packs, geo.slot_bytes_used(w)
        if self.family == "tree":
            return plan.virtual_slices(n, w, dtype), 0, plan.tree_slot_bytes_used(n, w, dtype, kind)
        if self.family == "virtual":
            return (plan.virtual_slices(n, w, dtype), 0,
                    plan.virtual_slot_bytes_used(n, self.shards, w, dtype, kind))
        return 0, 0, 0  # the fused kernels lay their rows out within the slot (plan.fused_norm_rows_per_launch)

    def launch(self, ws: Workspace, stream: int, ptrs: Sequence[int], rows: int, per: int, algo: str | None,
               label: str | None, eps: float) -> None:
        """The launches of one call of `rows` rows, `per` at most each, on the raw stream `stream`: per launch, the
        operands' pointers, the count and the call number set in place, and the kernel kept for its size."""
        if self.slabs:
            self.x_stride.value = rows * self.row_elems  # elements between slabs
        if self.fused:
            self.eps.value = eps
        record = ws._record_path
        choices = self._choices[algo]
        slots, strides, count, unit, call = self.ptrs, self.strides, self.count, self.count_unit, self.call
        for a in range(0, rows, per):
            k = rows - a if rows - a < per else per
            if self.pair:  # (x, out): set without a loop, the decode step's one launch
                slots[0].value, slots[1].value = ptrs[0] + a * strides[0], ptrs[1] + a * strides[1]
            else:
                for slot, base, step in zip(slots, ptrs, strides, strict=True):
                    slot.value = base + a * step
            count.value = k * unit
            call.value = ws._next_call(label)
            launch, kind, length, stride = choices.get(k) or self._choose(k, algo)
            if length:
                self.length.value, self.stride.value = length, stride
            launch(stream)
            if record is not None:
                for path in self.paths[kind]:
                    record(path)
        if rows > per and record is not None:
            record(self.chunked)


@dataclass(frozen=True)
class BoundCall:
    """One call shape of a workspace, checked when it was bound (Workspace.bind): the launcher, the rows one launch
    carries, a forced kernel (None: the rule's) and the label failure messages name."""

    launcher: Launcher
    per: int
    algo: str | None
    label: str | None


class InFlight:
    """Enforces one in-flight collective per workspace and runs the launches on the caller's current stream (its
    raw handle: no torch Stream object is built per call). One per workspace (Workspace._in_flight), entered by
    every call: its fields are set only once the workspace's lock is held, so no two calls share them."""

    __slots__ = ("ws", "capturing", "guard", "stream")

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws

    def __enter__(self) -> int:
        ws = self.ws
        if not ws._lock.acquire(blocking=False):
            raise ConcurrentCall(f"detcomm workspace (rank {ws.rank}): another thread is issuing a collective on it")
        self.guard = None
        try:
            self.capturing = _is_capturing()
            # Launches go to the current context: switch devices only when the caller is on another one.
            if _current_device() != ws._device_index:
                self.guard = torch.cuda.device(ws.device)
                self.guard.__enter__()
            # The raw handle of the current stream: what torch.cuda.current_stream().cuda_stream returns, without
            # building a Stream object on every call. It is the accessor torch's own compiled kernels launch with
            # (inductor's generated code imports it as get_raw_stream), so it is as stable as torch.compile.
            stream = torch._C._cuda_getCurrentRawStream(ws._device_index)
            last = ws._last_stream
            # Event queries are not allowed during capture; a captured launch does not run now anyway.
            if last is not None and last != stream and not self.capturing and _event_pending(ws):
                raise ConcurrentCall(
                    f"detcomm workspace (rank {ws.rank}): a collective issued on stream {last:#x} is still "
                    f"in flight; one collective per workspace at a time (this call came from stream "
                    f"{stream:#x}). Synchronize the streams or use one workspace per stream.")
            self.stream = stream
            return stream
        except BaseException:
            if self.guard is not None:
                self.guard.__exit__(None, None, None)
            ws._lock.release()
            raise

    def __exit__(self, *exc: Any) -> None:
        ws = self.ws
        try:
            if not self.capturing:
                ws._event_record(ws._done, self.stream)
                ws._last_stream = self.stream
        finally:
            if self.guard is not None:
                self.guard.__exit__(None, None, None)
            ws._lock.release()


# The hot path's queries, without the torch.cuda wrappers' own calls (current_device() runs _lazy_init() each time;
# a workspace exists only after CUDA was initialised). A CPU-only torch has neither binding and never reaches them.
_is_capturing: Callable[[], bool] = getattr(torch._C, "_cuda_isCurrentStreamCapturing",
                                            torch.cuda.is_current_stream_capturing)
_current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _event_pending(ws: Workspace) -> bool:
    """Whether the work before the in-flight event's last record is still running (cudaEventQuery: 0 done, 600 not
    ready)."""
    status = ws._event_query(ws._done)
    if status not in (0, 600):
        raise WorkspaceFailed(f"detcomm workspace: cudaEventQuery failed with CUDA error {status}")
    return status == 600
