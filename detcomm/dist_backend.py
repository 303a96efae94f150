"""``torch.distributed`` backend ``"detcomm"``: unmodified trainer code gets the canonical fold.

    import detcomm.dist_backend                      # registers the backend (importing is enough)
    dist.init_process_group("detcomm")               # instead of "gloo" / "nccl" / "cpu:gloo,cuda:nccl"
    pg = dist.new_group(ranks, backend="detcomm")    # or one group of a larger job

The group is a ``torch.distributed.ProcessGroup`` written in Python (the extension point torch's own
python-process-group tests use). Underneath it holds a gloo backend for CPU tensors and, where CUDA is
available, an NCCL backend for CUDA tensors, both on the same store; every call is routed by its tensors'
device. What each collective does:

* ``all_reduce`` (and ``allreduce_coalesced``, ``reduce``) with ``SUM`` or ``AVG`` on bf16 / fp16 / fp32 tensors:
  the canonical fold (docs/spec.md §2): an all-gather of the W inputs (data movement), then ``acc = +0.0;
  for r in 0..W-1: acc += fp32(x_r)`` and one round-to-nearest-even (``detcomm.numerics.fold.reference_fold``,
  canonical NaN). ``AVG`` divides the fp32 sum by W before that rounding. fp64 folds the same rank order in
  fp64. The result no longer depends on where an element sits in a bucket or how large the bucket is.
* ``reduce_scatter_tensor`` / ``reduce_scatter`` with SUM or AVG on floats: an all-to-all of the row blocks,
  then the same fold of each block (no extra traffic).
* ``all_gather_into_tensor``, ``all_gather``, ``broadcast``, ``all_to_all``, ``scatter``, ``gather``,
  ``send``/``recv``, ``barrier``: delegated to gloo / NCCL (data movement: exact).
* MIN / MAX on any dtype, and every op on integer and bool tensors: delegated (exact in any order).
* ``PRODUCT`` and ``PREMUL_SUM`` on floats are refused (ValueError): their result depends on the order and
  the fold defines none; multiply before a SUM instead.

Work objects: a delegated call returns gloo's / NCCL's own ``Work``. A folded call on CPU tensors runs its gather
and fold inside the call and returns a finished ``Work``. On CUDA tensors the gather (NCCL, on the current
stream) and the fold are queued on the stream current at the call, with no host synchronization, and the
returned ``Work`` behaves as NCCL's: ``wait()`` orders the caller's then-current stream after the fold and
returns at once (the host never blocks), ``is_completed()`` asks the GPU, ``get_future()`` is a CUDA-aware
future (DDP's comm hooks use it). ``async_op=True`` therefore returns before the GPU has run the fold, as NCCL's
does; on CPU there is no overlap.

CUDA graphs: folded CUDA calls can be captured and replayed (the gather and fold are stream work only; the
fold's temporaries come from the graph's pool); delegated calls capture as NCCL's own do. As with torch's own NCCL backend, the group's NCCL
communicator for a device is made by the first collective on that device, which must run outside a capture:
one eager call per device before capturing (the usual warm-up). A capture that would be the first call on its
device raises RuntimeError at once with that fix. Free captured graphs (and synchronize) before
``destroy_process_group``: with a graph holding NCCL work still alive, torch 2.11's own NCCL backend hung in
``destroy_process_group`` on two H200s.

The fold moves W x the data of a ring all-reduce (the cost of the gather_fold route, docs/performance.md).

Why not ``"cpu:gloo,cuda:detcomm"``: torch replaces the whole group by a Python process group as soon as one
device's backend is one, so the gloo half of that string would be dropped; ``"detcomm"`` serves both devices.
Tested on torch 2.13 (CPU, gloo) and torch 2.11 with NCCL 2.28 on two H200s (eager, async, captured and
replayed, W = 1 and 2); written against the API torch has had since 2.4 (``ProcessGroup(rank,
size)`` subclasses, ``Backend.register_backend(name, fn, devices=...)``, ``_allgather_base`` /
``_reduce_scatter_base``, renamed ``all_gather_single`` / ``reduce_scatter_single`` in recent releases: both
names are served).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    PrefixStore,
    ProcessGroupGloo,
    Work,
)

from .numerics.fold import FLOAT_DTYPES, canonical_nan, divide_exactly, reference_fold

__all__ = ["BACKEND_NAME", "DetcommProcessGroup", "register", "folds"]

BACKEND_NAME = "detcomm"
_log = logging.getLogger("detcomm.dist_backend")
_R = dist.ReduceOp


def folds(op: Any, dtype: torch.dtype) -> bool:
    """Does a reduction with ``op`` on ``dtype`` take the canonical fold (True) or the delegated backend
    (False)? Raises ValueError for the float reductions the backend refuses."""
    op = _kind(op)
    if not (dtype.is_floating_point or dtype.is_complex):
        return False
    if op in (_R.MIN, _R.MAX):
        return False
    if op in (_R.SUM, _R.AVG):
        return True
    raise ValueError(f"the detcomm backend refuses {op} on {dtype}: a floating-point {op} depends on the order "
                     "of the ranks and the canonical fold defines only SUM and AVG; multiply locally and reduce "
                     "with SUM")


def _kind(op: Any) -> Any:
    """The RedOpType of a ReduceOp object (as options hold it) or of a RedOpType."""
    return getattr(op, "op", op)


def _stream_ordered(opts: Any) -> Any:
    """``opts`` asking the delegated backend for its ``async_op=False`` behaviour: NCCL then queues the
    collective on the caller's current stream (no side stream, no events, no host wait), which is what the
    fold that follows needs and what a CUDA graph captures most simply. Options without the field (older
    torch) keep their default; the ``wait()`` that follows then orders the streams."""
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    return opts


def _settle(work: Work | None) -> None:
    """Finish a delegated call made with ``_stream_ordered`` options: NCCL returns no work for a call it queued
    on the current stream (nothing to wait for); gloo and older torch return one to wait on."""
    if work is not None:
        work.wait()


class _FoldWork(Work):
    """A folded collective's work. CPU outputs: finished when returned. CUDA outputs: queued on ``stream``
    (current at the call); ``wait()`` makes the caller's current stream wait for an event recorded after the
    fold, without blocking the host (NCCL's semantics; capturable)."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._outputs = outputs
        self._future: torch.futures.Future | None = None
        self._stream: torch.cuda.Stream | None = None
        self._done: torch.cuda.Event | None = None
        if outputs and outputs[0].is_cuda:
            self._stream = torch.cuda.current_stream(outputs[0].device)
            self._done = torch.cuda.Event()
            self._done.record(self._stream)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._done is not None:
            assert self._stream is not None
            current = torch.cuda.current_stream(self._stream.device)
            if current != self._stream:
                current.wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        return self._done is None or self._done.query()

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            if self._stream is None:
                self._future = torch.futures.Future()
                self._future.set_result(self._outputs)
            else:
                # A CUDA-aware future records the fold's stream when it is completed: whoever waits on it (DDP's
                # reducer) is ordered after the fold.
                self._future = torch.futures.Future(devices=[self._stream.device])
                with torch.cuda.stream(self._stream):
                    self._future.set_result(self._outputs)
        return self._future

    def synchronize(self) -> None:
        self.wait()


def _fold(stacked: torch.Tensor, op: Any, world: int) -> torch.Tensor:
    """[W, n] -> [n] in the input dtype: the canonical fold (fp64: the same rank order in fp64)."""
    dtype, op = stacked.dtype, _kind(op)
    if dtype in FLOAT_DTYPES:
        if op == _R.AVG:
            return divide_exactly(reference_fold(stacked, torch.float32), world).to(dtype)
        return reference_fold(stacked, dtype)
    acc = torch.zeros(stacked.shape[1:], dtype=dtype, device=stacked.device)
    for r in range(world):
        acc.add_(stacked[r])
    return divide_exactly(acc, world) if op == _R.AVG else acc


class DetcommProcessGroup(dist.ProcessGroup):
    """The ``"detcomm"`` process group (module docstring). Created by torch through the registered backend;
    every method is collective as torch's are."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size = rank, size
        self._gloo = ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)
        self._nccl = None
        if torch.cuda.is_available() and dist.is_nccl_available():
            from torch._C._distributed_c10d import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._nccl = ProcessGroupNCCL(PrefixStore("nccl/", store), rank, size, opts)
        # CUDA devices this group has run a collective on outside a capture: NCCL made their communicator then.
        self._connected: set[torch.device] = set()

    # -- identity ------------------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _backend(self, t: torch.Tensor) -> Any:
        if not t.is_cuda:
            return self._gloo
        if self._nccl is None:
            raise ValueError("a CUDA tensor reached the detcomm process group, but no NCCL backend was created "
                             "(CUDA was not available when the group was made)")
        if t.device not in self._connected:
            if torch.cuda.is_current_stream_capturing():
                # NCCL makes a device's communicator on its first collective; inside a capture that would hang
                # or fail deep in NCCL, so refuse here, before anything is queued.
                raise RuntimeError(f"the detcomm process group's first collective on {t.device} is being captured "
                                   "in a CUDA graph; NCCL creates the communicator on first use, which a capture "
                                   "forbids. Run one collective on this device eagerly (the usual warm-up) before "
                                   "capturing")
            for dtype in FLOAT_DTYPES:  # built from host bits once, so the fold never uploads during a capture
                canonical_nan(dtype, t.device)
            self._connected.add(t.device)
        return self._nccl

    # -- the folds -------------------------------------------------------------------------------------------
    def _gather_rows(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self._size * flat.numel(), dtype=flat.dtype, device=flat.device)
        _settle(self._backend(flat)._allgather_base(out, flat, _stream_ordered(AllgatherOptions())))
        return out.view(self._size, flat.numel())

    def _fold_into(self, t: torch.Tensor, op: Any) -> None:
        src = torch.view_as_real(t) if t.is_complex() else t
        flat = src.contiguous().view(-1)
        src.copy_(_fold(self._gather_rows(flat), op, self._size).view_as(src))

    def allreduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if opts is None:
            opts = AllreduceOptions()
        elif not hasattr(opts, "reduceOp"):
            op, opts = opts, AllreduceOptions()
            opts.reduceOp = op
        if not all(folds(opts.reduceOp, t.dtype) for t in tensors):
            return self._backend(tensors[0]).allreduce(tensors, opts)
        for t in tensors:
            self._fold_into(t, opts.reduceOp)
        return _FoldWork(tensors)

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Work:
        return self.allreduce(list(tensors), None if opts is None else opts.reduceOp)

    def reduce(self, tensors: Any, opts: Any) -> Work:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not all(folds(opts.reduceOp, t.dtype) for t in tensors):
            return self._backend(tensors[0]).reduce(tensors, opts)
        for t in tensors:  # every rank computes the fold; only the root keeps it, as torch's reduce promises
            keep = t.clone()
            self._fold_into(keep, opts.reduceOp)
            if self._rank == opts.rootRank:
                t.copy_(keep)
        return _FoldWork(tensors)

    def _reduce_scatter_flat(self, output: torch.Tensor, flat_in: torch.Tensor, opts: Any) -> Work:
        if not folds(opts.reduceOp, flat_in.dtype):
            return self._backend(output)._reduce_scatter_base(output, flat_in.view(-1), opts)
        n = output.numel()
        if flat_in.numel() != n * self._size:
            raise ValueError(f"reduce_scatter: the input holds {flat_in.numel()} elements, expected "
                             f"{self._size} x {n} (world size x output)")
        recv = torch.empty_like(flat_in)
        _settle(self._backend(output).alltoall_base(recv, flat_in, [], [], _stream_ordered(AllToAllOptions())))
        output.copy_(_fold(recv.view(self._size, n), opts.reduceOp, self._size).view_as(output))
        return _FoldWork([output])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Work:
        return self._reduce_scatter_flat(output, input.contiguous().view(-1), opts)

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]  # torch >= 2.12 names it so

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Work:  # type: ignore[override]
        if len(outputs) != 1:
            raise ValueError("the detcomm process group takes one output tensor per reduce_scatter call")
        if not folds(opts.reduceOp, outputs[0].dtype):
            return self._backend(outputs[0]).reduce_scatter(outputs, inputs, opts)
        flat = torch.cat([t.contiguous().view(-1) for t in inputs[0]])
        return self._reduce_scatter_flat(outputs[0], flat, opts)

    # -- delegated: data movement and exact reductions ---------------------------------------------------
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        return self._backend(input)._allgather_base(output, input, opts or AllgatherOptions())

    all_gather_single = _allgather_base  # torch >= 2.12 names it so

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        return self._backend(inputs[0]).allgather(outputs, inputs, opts or AllgatherOptions())

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        return self._backend(inputs[0]).allgather_coalesced(outputs, inputs, opts or AllgatherOptions())

    def broadcast(self, tensors: Any, opts: Any) -> Work:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        return self._backend(tensors[0]).broadcast(tensors, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Work:
        return self._backend(input).alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                                  opts or AllToAllOptions())

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        return self._backend(inputs[0]).alltoall(outputs, inputs, opts or AllToAllOptions())

    def gather(self, outputs: Any, inputs: Any, opts: Any) -> Work:  # type: ignore[override]
        return self._backend(inputs[0]).gather(outputs, inputs, opts)

    def scatter(self, outputs: Any, inputs: Any, opts: Any) -> Work:  # type: ignore[override]
        return self._backend(outputs[0]).scatter(outputs, inputs, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        return self._backend(tensors[0]).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        return self._backend(tensors[0]).recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        return self._backend(tensors[0]).recv_anysource(tensors, tag)

    def barrier(self, opts: Any = None) -> Work:
        return self._gloo.barrier(opts) if opts is not None else self._gloo.barrier()  # type: ignore[attr-defined]

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        self._gloo.monitored_barrier(timeout, wait_all_ranks)  # type: ignore[attr-defined]


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> DetcommProcessGroup:
    return DetcommProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register the ``"detcomm"`` backend with torch.distributed (done on import; idempotent). Local."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    _log.debug("registered the %r torch.distributed backend", BACKEND_NAME)


register()
