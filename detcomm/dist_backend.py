"""``torch.distributed`` backend ``"detcomm"``: unmodified trainer code gets the canonical fold.

    import detcomm.dist_backend                      # registers the backend (importing is enough)
    dist.init_process_group("detcomm")               # instead of "gloo" / "nccl" / "cpu:gloo,cuda:nccl"
    pg = dist.new_group(ranks, backend="detcomm")    # or one group of a larger job

A ``torch.distributed.ProcessGroup`` written in Python over a gloo backend (CPU tensors) and a CUDA transport
(NCCL where every rank has its own GPU, host memory on gloo where ranks share one), both on the same store; it
carries a group name, so DeviceMesh, DTensor, FSDP2 and torch's functional collectives run on it.

* Float ``all_reduce`` / ``reduce`` / ``reduce_scatter`` (and coalesced forms) with SUM, AVG, MAX, MIN and
  PREMUL_SUM go through one ``detcomm.comm.Communicator`` per device over this group (rl-bitwise): the
  canonical fold of docs/spec.md §1 and §1.1 on the runtime's routes, sites and self-checks. fp64 and PRODUCT
  are folded by the backend itself on a gather in rank order; integers, bools and all data movement are
  delegated to gloo / NCCL (exact).
* Every reduction and barrier begins with the call guard's header (not on CUDA over NCCL, not in a capture):
  ranks making different calls raise ``CollectiveMismatch`` on every rank before any data moves.
* A tensor becomes rows of one site per (collective, op, dtype, number of elements) (``row_layout``), so a
  trainer's many sizes cost a few self-checks; the router gives each site its route from its bytes.
* On CUDA the work is queued on the caller's stream and ``Work`` behaves as NCCL's; a captured call needs its
  communicator and site made eagerly first (``CaptureBeforeWarmup`` otherwise), and host-staged calls refuse
  capture (``CaptureThroughHost``).

The design in full (each collective, Work objects, how reductions reach the runtime, the row layout, CUDA graphs,
what was rejected, the torch versions and method names served): docs/design/dist-backend.md; the user's view:
docs/trainers.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    PrefixStore,
    ProcessGroupGloo,
    ReduceScatterOptions,
    Work,
)
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from .comm import Communicator, RouteTable
from .dtypes import name_of
from .envelope import resolve_numerics
from .errors import CaptureThroughHost, DetcommError
from .numerics.fold import FLOAT_DTYPES, canonical_nan, canonicalize_nan, divide_exactly, product_fold
from .route_impls import guard as _guard
from .route_impls.native import all_gather_flat
from .selfcheck import CheckResult
from .sites import Route
from .topology import RankFacts, _local_facts, from_facts
from .verify import check_from_env

__all__ = ["BACKEND_NAME", "ROW_WIDTH", "HOST", "NCCL", "CaptureBeforeWarmup", "CaptureThroughHost",
           "DetcommProcessGroup", "register", "plan", "row_layout", "transport_for"]

BACKEND_NAME = "detcomm"
_log = logging.getLogger("detcomm.dist_backend")
_R = dist.ReduceOp
_FP64_NAN = float("nan")  # torch writes float('nan') as the quiet NaN with an empty payload, positive


# The backend's promise: the canonical fold's bits whatever DETCOMM_NUMERICS says (a trainer's gradients and a
# detcomm server's reductions agree only if both fold), so its communicators run the rl-bitwise envelope.
_ENVELOPE = resolve_numerics("rl-bitwise")
# The widest row of a site: a tensor of more elements travels as rows of this many (module docstring).
ROW_WIDTH = 4096


def row_layout(numel: int) -> tuple[int, int]:
    """(rows, width) of the site a tensor of ``numel`` elements travels on: up to ``ROW_WIDTH`` elements one row
    padded to the next power of two, more as rows of ``ROW_WIDTH`` (the last zero-padded). Local."""
    if numel <= ROW_WIDTH:
        return 1, 1 << max(numel - 1, 0).bit_length()
    return -(-numel // ROW_WIDTH), ROW_WIDTH


class CaptureBeforeWarmup(DetcommError):
    """The group's first collective on a CUDA device was issued inside a CUDA graph capture."""


# The transports of a group's CUDA tensors (``transport_for``): NCCL, or host memory on the group's gloo backend.
NCCL, HOST = "nccl", "host"


def transport_for(facts: Sequence[RankFacts], *, nccl_available: bool) -> tuple[str, str]:
    """``(transport, why)`` for a group's CUDA tensors, from every rank's (host, GPU) facts in rank order: ``HOST``
    (each collective's CUDA tensors copied to host memory, gloo, copied back) where two ranks are on one physical
    GPU (the same host and PCI bus id: NCCL refuses two ranks on one GPU) or NCCL is not available, else ``NCCL``.
    Pure: every rank holds the same facts and reaches the same answer."""
    if not facts:
        raise ValueError("transport_for: no ranks' facts given")
    topo = from_facts(list(facts))  # the runtime's topology: distinct GPUs = distinct (host, PCI bus id)
    if topo.gpus < len(facts):
        by_gpu: dict[tuple[str, str], list[int]] = {}
        for r, f in enumerate(facts):
            by_gpu.setdefault((f.host, f.pci_bus_id), []).append(r)
        shared = "; ".join(f"ranks {', '.join(map(str, rs))} on GPU {bus} of {host}"
                           for (host, bus), rs in by_gpu.items() if len(rs) > 1)
        return HOST, f"ranks share a GPU ({shared}), and NCCL refuses two ranks on one GPU"
    if not nccl_available:
        return HOST, "NCCL is not available in this torch build"
    return NCCL, f"one rank per GPU ({topo.describe()})"


# How a reduction is carried out: "fold" (SUM / AVG / PREMUL_SUM on floats), "keys" (float MAX / MIN),
# "product" (float PRODUCT: the backend's own gather and rank-order product) or "delegate" (the library's own
# collective: exact integer and bitwise reductions).
def plan(op: Any, dtype: torch.dtype) -> str:
    """How the group reduces ``op`` on ``dtype``: ``"fold"``, ``"keys"``, ``"product"`` or ``"delegate"``
    (module docstring). Raises ValueError for the float reductions the backend refuses. Local."""
    op = _kind(op)
    if not (dtype.is_floating_point or dtype.is_complex):
        return "delegate"
    if op in (_R.MIN, _R.MAX):
        if dtype.is_complex:
            raise ValueError(f"the detcomm backend refuses {op} on {dtype}: complex numbers have no order")
        return "keys"
    if op in (_R.SUM, _R.AVG, _R.PREMUL_SUM):
        return "fold"
    if op == _R.PRODUCT:
        if dtype.is_complex:
            # A complex product mixes the real and imaginary parts; the rank-order product of docs/spec.md §1.1
            # is defined on real floats only.
            raise ValueError(f"the detcomm backend refuses PRODUCT on {dtype}: the canonical product is defined on "
                             "real floats (bf16, fp16, fp32, fp64); multiply the complex values locally instead")
        return "product"
    raise ValueError(f"the detcomm backend refuses {op} on {dtype}: the canonical reductions are SUM, AVG, "
                     "PREMUL_SUM, PRODUCT, MAX and MIN on floats; reduce bitwise ops on an integer view instead")


def _kind(op: Any) -> Any:
    """The RedOpType of a ReduceOp object (as options hold it) or of a RedOpType."""
    return getattr(op, "op", op)


def _op_name(op: Any) -> str:
    return str(_kind(op)).rsplit(".", 1)[-1]


def _call(coll: str, t: torch.Tensor, op: Any, *, numel: int | None = None, root: int | None = None) -> str:
    """The readable form of a reduction call, as the backend's call guard names it (and hashes it: two ranks
    whose strings differ made different calls)."""
    dst = "" if root is None else f", dst={root}"
    n = t.numel() if numel is None else numel
    dtype = str(t.dtype).removeprefix("torch.")  # any dtype (name_of knows only the sites' dtypes)
    return f"dist.{coll}({dtype}[{n}] on {t.device.type}, op={_op_name(op)}{dst})"


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor a collective reads and writes: an ``AsyncCollectiveTensor`` is waited for and its
    storage-sharing ``elem`` returned (writing it writes the caller's tensor); the C++ library would crash on the
    subclass itself."""
    if isinstance(t, AsyncCollectiveTensor):
        return t.trigger_wait()
    return t


def _plains(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [_plain(t) for t in ts]


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


def premul_factor(op: Any) -> float | torch.Tensor:
    """The factor of a ``PREMUL_SUM`` ReduceOp (``_make_nccl_premul_sum(f)``): a float or a 0-d tensor. Read
    through the ReduceOp's pickle state, ``(op, factor)``, which every torch the package supports has (the
    ``.factor`` attribute only exists from torch 2.13; older ones raised AttributeError here, issue 40 item 10)."""
    try:
        state = op.__getstate__()
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"the detcomm backend cannot read the factor of this PREMUL_SUM ReduceOp ({op!r}: {e}); "
                         "make it with torch.distributed._make_nccl_premul_sum(factor)") from e
    factor = state[1]
    if not isinstance(factor, float | torch.Tensor):
        raise ValueError(f"the detcomm backend cannot read the factor of this PREMUL_SUM ReduceOp (its state is "
                         f"{state!r}); make it with torch.distributed._make_nccl_premul_sum(factor)")
    return factor


def _premultiplied(flat: torch.Tensor, op: Any) -> torch.Tensor:
    """PREMUL_SUM's per-rank operand (docs/spec.md §1.1): fp32(x) * fp32(factor), one IEEE fp32 rounding (fp64:
    the product in fp64). The factor is a fill on the tensor's device, so a CUDA graph can capture it."""
    factor = premul_factor(op)
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
    if isinstance(factor, torch.Tensor):
        f = factor.to(device=flat.device, dtype=wide).reshape(())
    else:
        f = torch.full((), float(factor), dtype=wide, device=flat.device)
    return flat.to(wide) * f


def _host(t: torch.Tensor, *, copy: bool = True) -> torch.Tensor:
    """A separate host buffer for ``t`` (its values when ``copy``): a CPU tensor gets its own buffer too, so the
    write-back below is the same code on either device (and testable on CPU). The device-to-host copy waits for
    the work queued on ``t``'s stream, which is what orders the collective after the producer."""
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return h.copy_(t) if copy else h


class _HostStaged:
    """A group's CUDA traffic through host memory, for ranks that share a GPU (``transport_for``): every
    collective copies its CUDA inputs to host buffers, runs on the group's gloo backend, waits, and copies the
    results back into the caller's tensors on the current stream; it returns a finished work.

    ProcessGroupGloo carries CUDA tensors itself for some collectives and not for others (reduce-scatter and
    send / recv take CPU tensors only), and where it does it copies through host memory anyway, on its own streams
    and worker threads. One explicit staging serves every collective the same way, and lets a CUDA graph capture be
    refused here at once (a capture cannot hold a host copy) instead of failing inside gloo's worker thread."""

    def __init__(self, gloo: Any, why: str) -> None:
        self._gloo = gloo
        self._why = why

    def _enter(self, what: str) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # (a CPU build has no query)
            raise CaptureThroughHost(_through_host(what, self._why))

    @staticmethod
    def _back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Work:
        for dev, h in pairs:
            dev.copy_(h)
        return _FoldWork([d for d, _ in pairs])

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        self._enter("allreduce")
        pairs = [(t, _host(t)) for t in tensors]
        self._gloo.allreduce([h for _, h in pairs], opts).wait()
        return self._back(pairs)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        self._enter("reduce")
        pairs = [(t, _host(t)) for t in tensors]
        self._gloo.reduce([h for _, h in pairs], opts).wait()
        return self._back(pairs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Work:
        self._enter("reduce_scatter")
        out = _host(output, copy=False)
        self._gloo._reduce_scatter_base(out, _host(input), opts).wait()
        return self._back([(output, out)])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Work:
        self._enter("all_gather")
        out = _host(output, copy=False)
        self._gloo._allgather_base(out, _host(input), opts).wait()
        return self._back([(output, out)])

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Work:
        self._enter("all_gather")
        outs = [[(o, _host(o, copy=False)) for o in lst] for lst in outputs]
        self._gloo.allgather([[h for _, h in lst] for lst in outs], [_host(t) for t in inputs], opts).wait()
        return self._back([p for lst in outs for p in lst])

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Work:
        self._enter("all_gather")
        outs = [[(o, _host(o, copy=False)) for o in lst] for lst in outputs]
        self._gloo.allgather_coalesced([[h for _, h in lst] for lst in outs], [_host(t) for t in inputs],
                                       opts).wait()
        return self._back([p for lst in outs for p in lst])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        self._enter("broadcast")
        pairs = [(t, _host(t)) for t in tensors]
        self._gloo.broadcast([h for _, h in pairs], opts).wait()
        return self._back(pairs)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any) -> Work:
        self._enter("all_to_all")
        out = _host(output, copy=False)
        self._gloo.alltoall_base(out, _host(input), output_split_sizes, input_split_sizes, opts).wait()
        return self._back([(output, out)])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> Work:
        self._enter("all_to_all")
        pairs = [(o, _host(o, copy=False)) for o in outputs]
        self._gloo.alltoall([h for _, h in pairs], [_host(t) for t in inputs], opts).wait()
        return self._back(pairs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Work:
        self._enter("gather")
        outs = [[(o, _host(o, copy=False)) for o in lst] for lst in outputs]  # empty on every rank but the root
        self._gloo.gather([[h for _, h in lst] for lst in outs], [_host(t) for t in inputs], opts).wait()
        pairs = [p for lst in outs for p in lst]
        return self._back(pairs) if pairs else _FoldWork(list(inputs))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Work:
        self._enter("scatter")
        pairs = [(o, _host(o, copy=False)) for o in outputs]
        self._gloo.scatter([h for _, h in pairs], [[_host(t) for t in lst] for lst in inputs], opts).wait()
        return self._back(pairs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        self._enter("send")
        self._gloo.send([_host(t) for t in tensors], dst, tag).wait()
        return _FoldWork(list(tensors))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        self._enter("recv")
        pairs = [(t, _host(t, copy=False)) for t in tensors]
        self._gloo.recv([h for _, h in pairs], src, tag).wait()
        return self._back(pairs)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        self._enter("recv")
        pairs = [(t, _host(t, copy=False)) for t in tensors]
        self._gloo.recv_anysource([h for _, h in pairs], tag).wait()
        return self._back(pairs)


def _through_host(what: str, why: str) -> str:
    return (f"the detcomm process group's {what} is being captured in a CUDA graph, but this group's CUDA traffic "
            f"goes through host memory on gloo ({why}), and a CUDA graph cannot capture a host copy. Run it "
            "outside the capture; inside one, only the float all-reduces and reduce-scatters that the CUDA-IPC "
            "workspace serves (SUM and PREMUL_SUM, also DDP's buckets: pg.routes('cuda') shows them as ipc_fold) "
            "capture on ranks sharing a GPU")


class DetcommProcessGroup(dist.ProcessGroup):
    """The ``"detcomm"`` process group (module docstring). Created by torch through the registered backend;
    every collective method is collective over the group, as torch's are."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size = rank, size
        self._name = ""
        self._desc = ""
        self._store, self._timeout = store, timeout
        self._gloo = ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)
        # Made at the first CUDA collective whose transport is NCCL (``_connect``), never on ranks sharing a GPU.
        self._nccl: Any = None
        # Per CUDA device this group has run a collective on outside a capture: what carries its CUDA tensors (NCCL,
        # or ``_HostStaged`` over gloo) and (transport, why), decided once by ``_connect``.
        self._cuda: dict[torch.device, Any] = {}
        self._transports: dict[torch.device, tuple[str, str]] = {}
        # detcomm's communicator per device (made by the first reduction there), and the sites declared on them with
        # the route each got (a capture on a host-staged group checks it).
        self._comms: dict[torch.device, Communicator] = {}
        self._sites: dict[tuple[torch.device, str], Route] = {}

    # -- identity ------------------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # torch's ProcessGroup keeps its name on its registered backends; this group registers none (every call
    # comes here), so it keeps the name torch assigns itself. DeviceMesh, FSDP2 and the functional collectives
    # look groups up by it.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._desc

    def _backend(self, t: torch.Tensor) -> Any:
        if not t.is_cuda:
            return self._gloo
        lib = self._cuda.get(t.device)
        return lib if lib is not None else self._connect(t.device)

    def _connect(self, device: torch.device) -> Any:
        """The group's first CUDA collective on ``device`` (collective): decide its transport from static facts
        (``transport_for`` of every rank's host and GPU, exchanged on the group's gloo backend before anything
        touches NCCL), and make NCCL's backend only where it is the transport."""
        if torch.cuda.is_current_stream_capturing():
            # The decision exchanges facts through the host, and NCCL makes a device's communicator on its first
            # collective; inside a capture either would hang or fail deep in the library, so refuse here, before
            # anything is queued.
            raise CaptureBeforeWarmup(
                f"the detcomm process group's first collective on {device} is being captured in a CUDA graph; "
                "the group chooses its CUDA transport (and NCCL creates its communicator) on first use, which a "
                "capture forbids. Run one collective on this device eagerly (the usual warm-up) before capturing")
        transport, why = transport_for(self._gather_facts(device), nccl_available=dist.is_nccl_available())
        if transport == NCCL:
            if self._nccl is None:
                from torch._C._distributed_c10d import ProcessGroupNCCL  # noqa: PLC0415 - CUDA builds only

                opts = ProcessGroupNCCL.Options()
                opts._timeout = self._timeout
                self._nccl = ProcessGroupNCCL(PrefixStore("nccl/", self._store), self._rank, self._size, opts)
            lib = self._nccl
        else:
            lib = _HostStaged(self._gloo, why)
        _log.info("detcomm process group %r (W=%d, rank %d): CUDA tensors on %s go through %s: %s", self._name,
                  self._size, self._rank, device, "NCCL" if transport == NCCL else "host memory on gloo", why)
        for dtype in FLOAT_DTYPES:  # built from host bits once, so the fold never uploads during a capture
            canonical_nan(dtype, device)
        self._cuda[device] = lib
        self._transports[device] = (transport, why)
        return lib

    def _gather_facts(self, device: torch.device) -> list[RankFacts]:
        """Every rank's (host, device index, PCI bus id) in rank order: two all-gathers on the gloo backend (the
        lengths, then the padded text), CPU tensors only, so nothing here reaches NCCL or this group's methods."""
        f = _local_facts(device)
        gloo: Any = self._gloo
        mine = torch.tensor(list(f"{f.host}\n{f.device_index}\n{f.pci_bus_id}".encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._size)]
        gloo.allgather([sizes], [torch.tensor([mine.numel()], dtype=torch.int64)]).wait()
        longest = max(int(n) for n in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: mine.numel()] = mine
        texts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self._size)]
        gloo.allgather([texts], [padded]).wait()
        facts = []
        for t, n in zip(texts, sizes, strict=True):
            host, index, bus = bytes(t[: int(n)].tolist()).decode().split("\n")
            facts.append(RankFacts(host, int(index), bus))
        return facts

    def cuda_transport(self, device: torch.device | str | int | None = None) -> str:
        """What carries this group's CUDA tensors on ``device`` (None: the current one): ``"nccl"``, or
        ``"host"`` (host memory on gloo: the group's ranks share a GPU, or NCCL is not available), with why. Local;
        raises ValueError before the group's first collective on that device (which decides it)."""
        dev = self._made_device(torch.device("cuda", device) if isinstance(device, int) else device or "cuda")
        got = self._transports.get(dev)
        if got is None:
            raise ValueError(f"the detcomm process group has run no collective on {dev} yet, so it has not chosen "
                             "that device's transport (its first collective there does); ask after one")
        return f"{got[0]}: {got[1]}"

    # -- the reductions: detcomm's communicator over this group ------------------------------------------------
    def _communicator(self, device: torch.device) -> Communicator:
        """This group's communicator for ``device``'s tensors, made by the first reduction on that device
        (collective, like that reduction: every rank makes its first reduction in the same order). Its own
        traffic is data movement and integer reductions, which this group delegates (module docstring)."""
        comm = self._comms.get(device)
        if comm is not None:
            return comm
        staged = False
        if device.type == "cuda":
            self._backend(torch.empty(0, device=device))  # refuses a capture before the transport is chosen
            staged = self._transports[device][0] == HOST
        # The call guard, from static facts. CPU: the runtime's (a separate header). CUDA over NCCL: none (the
        # in-message guard's host read per call would serialize DDP's and FSDP's overlap of collectives with
        # compute); DETCOMM_CHECK=1 turns the call checker on instead. CUDA through host memory (ranks sharing a
        # GPU): the runtime's choice for staged groups, the separate header, because there the host already waits
        # for every host-staged route's copies, so proving the call before its data moves costs one small gloo
        # all-gather and serializes nothing that was overlapping. ipc_fold, which needs no host, also compares a
        # per-call descriptor in its kernels; inside a CUDA-graph capture the header stands aside (comm.py) and
        # that descriptor is the captured calls' guard.
        comm = Communicator(group=self, resolved=_ENVELOPE, device=device, check=check_from_env(None),
                            stage_through_host=staged,
                            call_guard="none" if device.type == "cuda" and not staged else None)
        self._comms[device] = comm
        return comm

    # -- the backend's call guard ------------------------------------------------------------------------------
    def _guard(self, t: torch.Tensor, what: str) -> None:
        """Prove, before anything of this call moves, that every rank makes the call ``what`` (collective; raises
        ``CollectiveMismatch`` on every rank naming each rank's call otherwise).

        Every reduction and barrier of this group starts with exactly one fixed-size header all-gather on the
        group: this one (a call the backend serves itself: an empty tensor, fp64, PRODUCT, an integer or bool
        reduction, a reduce's root, a barrier; or a float reduction whose communicator or site is not made yet)
        or the communicator's own call header (a float reduction on a warm site). Both are the same 9 int64 on
        the same all-gather, so whichever two ranks pair, they compare, and every rank raises instead of pairing
        its data with another call's (issue 40 items 1, 2, 7, 9, 13). Where the communicator carries no guard
        (CUDA over NCCL: its callers overlap collectives with compute, which a host read per call would
        serialize; docs/trainers.md) this one stands aside too, and so it does inside a CUDA-graph capture."""
        if self._size == 1:
            return
        if t.is_cuda:
            self._backend(t)  # decides the device's transport (collective, the first time)
            if self._transports[t.device][0] == NCCL or torch.cuda.is_current_stream_capturing():
                return
        _guard.exchange(_GroupHeaders(self), [_BACKEND_MAGIC, _guard.hash_text(what)], what,
                        device=torch.device("cpu"))

    def _folded(self, flat: torch.Tensor, op: str, *, scatter: bool, what: str | None) -> torch.Tensor:
        """``op`` ("sum", "avg", "max", "min") of every rank's 1-D ``flat`` through the communicator's site for
        this (collective, op, dtype, size); ``scatter``: this rank's block of it. Returns a 1-D tensor. ``what``:
        the user's call for the backend's guard where the communicator's header will not be the call's first
        exchange (no communicator or no site yet; None: the caller guarded already)."""
        w = self._size
        n = flat.numel() // w if scatter else flat.numel()
        coll = "reduce_scatter" if scatter else "all_reduce"
        name = f"torch.{coll}.{op}.{name_of(flat.dtype)}.{n}"
        route = self._sites.get((flat.device, name))
        if what is not None and (n == 0 or route is None or flat.device not in self._comms):
            # An empty call moves nothing, and a cold one starts with the communicator's agreement or the site's
            # declaration: neither begins with the communicator's header, so the backend's goes first. A cold
            # call is named as the site call it is about to be (its first), as the communicator names its calls.
            self._guard(flat, what if n == 0 else f"site {name!r} call #1 ({what})")
        if n == 0:
            return flat[:0]
        comm = self._communicator(flat.device)
        rows, width = row_layout(n)
        if route is None:
            if flat.is_cuda and torch.cuda.is_current_stream_capturing():
                raise CaptureBeforeWarmup(
                    f"the detcomm process group's first {coll} {op} of {n} {name_of(flat.dtype)} elements on "
                    f"{flat.device} is being captured in a CUDA graph; its site is declared (and self-checked) at "
                    "its first call, which a capture forbids. Run one call of this size eagerly (the usual "
                    "warm-up) before capturing")
            site = comm.site(name, collective=coll, dtype=flat.dtype, shape=(width,),
                             max_rows=rows * (w if scatter else 1), op=op)
            route = self._sites[(flat.device, name)] = comm.router.table([site]).entries[0].decision.route
        if (route is not Route.IPC_FOLD and flat.is_cuda and self._transports[flat.device][0] == HOST
                and torch.cuda.is_current_stream_capturing()):
            # Every route but the workspace's goes through host memory here: refuse before anything is queued.
            raise CaptureThroughHost(_through_host(f"{coll} {op} of {n} {name_of(flat.dtype)} elements (route "
                                                   f"{route.value})", self._transports[flat.device][1]))
        pad = rows * width - n
        if scatter:
            x = flat.view(w, n)
            x = (F.pad(x, (0, pad)) if pad else x).reshape(w * rows, width)
            out = comm.reduce_scatter(x, name, op=op)
        else:
            x = (F.pad(flat, (0, pad)) if pad else flat).view(rows, width)
            out = comm.all_reduce(x, name, op=op)
        assert isinstance(out, torch.Tensor)
        return out.view(-1)[:n]

    def _reduce_flat(self, flat: torch.Tensor, op: Any, *, scatter: bool, what: str | None) -> torch.Tensor:
        """The reduction of every rank's ``flat`` (``scatter``: only this rank's block of it), in flat's dtype.
        ``what``: the user's call, for the backend's guard (None: the caller guarded it already)."""
        how, kind = plan(op, flat.dtype), _kind(op)
        flat = flat.detach()
        if flat.dtype == torch.float64 or how == "product":
            # Served by the backend itself (no communicator site): its guard always goes first.
            if what is not None:
                self._guard(flat, what)
            if how == "product":
                return product_fold((self._exchange_blocks if scatter else self._gather_rows)(flat), flat.dtype)
            return self._reduce_fp64(flat, op, scatter=scatter)
        if how == "keys":
            return self._folded(flat, "max" if kind == _R.MAX else "min", scatter=scatter, what=what)
        assert how == "fold", how
        if kind != _R.PREMUL_SUM:
            return self._folded(flat, "avg" if kind == _R.AVG else "sum", scatter=scatter, what=what)
        # docs/spec.md §1.1: the fp32 products, their canonical fold in fp32, one rounding to the input dtype.
        out = self._folded(_premultiplied(flat, op), "sum", scatter=scatter, what=what)
        return out if flat.dtype == torch.float32 else canonicalize_nan(out.to(flat.dtype))

    # fp64, which detcomm's sites do not carry: the fold and the extremum in fp64 on a gather of the W inputs.
    def _gather_rows(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self._size * flat.numel(), dtype=flat.dtype, device=flat.device)
        _settle(self._backend(flat)._allgather_base(out, flat, _stream_ordered(AllgatherOptions())))
        return out.view(self._size, flat.numel())

    def _exchange_blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """[W * n] -> [W, n]: row r is rank r's block destined for this rank (one all-to-all)."""
        recv = torch.empty_like(flat)
        _settle(self._backend(flat).alltoall_base(recv, flat, [], [], _stream_ordered(AllToAllOptions())))
        return recv.view(self._size, -1)

    def _reduce_fp64(self, flat: torch.Tensor, op: Any, *, scatter: bool) -> torch.Tensor:
        how, kind = plan(op, flat.dtype), _kind(op)
        move = self._exchange_blocks if scatter else self._gather_rows
        if how == "keys":
            return _fp64_extremum(move(flat), "max" if kind == _R.MAX else "min")
        stacked = move(_premultiplied(flat, op) if kind == _R.PREMUL_SUM else flat)
        acc = torch.zeros(stacked.shape[1:], dtype=torch.float64, device=stacked.device)
        for r in range(self._size):
            acc.add_(stacked[r])
        return divide_exactly(acc, self._size) if kind == _R.AVG else acc

    def routes(self, device: torch.device | str = "cpu") -> RouteTable:
        """The route table of this group's communicator for ``device``'s tensors: one site per (collective, op,
        dtype, size) the group has reduced, its route, why, and its self-check (local). Raises ValueError before
        the group's first float reduction on that device (the communicator is made by it). A CUDA device's table
        also names the transport of its CUDA tensors (``cuda_transport``)."""
        table = self._made(device).routes()
        got = self._transports.get(self._made_device(device))
        if got is None:
            return table
        return replace(table, note=f"{table.note}\nCUDA transport: {got[0]} ({got[1]})".lstrip("\n"))

    def checks(self, device: torch.device | str = "cpu") -> list[CheckResult]:
        """Every self-check this group's communicator for ``device`` has run, in order (local; ValueError as for
        ``routes``)."""
        return self._made(device).checks()

    @staticmethod
    def _made_device(device: torch.device | str) -> torch.device:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def _made(self, device: torch.device | str) -> Communicator:
        dev = self._made_device(device)
        comm = self._comms.get(dev)
        if comm is None:
            raise ValueError(f"the detcomm process group has reduced no float tensor on {dev} yet, so it has no "
                             "communicator there (its first float reduction makes it); ask after one")
        return comm

    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: release the communicators (local on a group torch created; they
        hold this group) before torch drops it."""
        comms, self._comms = self._comms, {}
        self._sites.clear()
        for comm in comms.values():
            comm.close()
        super().shutdown()

    def _reduce_into(self, t: torch.Tensor, op: Any, what: str | None) -> None:
        src = torch.view_as_real(t) if t.is_complex() else t
        src.copy_(self._reduce_flat(src.contiguous().view(-1), op, scatter=False, what=what).view_as(src))

    def _delegated_allreduce(self, t: torch.Tensor, op: Any) -> None:
        """The library's own all-reduce of one integer / bool tensor, written into ``t`` whatever its strides
        (gloo reads and writes a non-contiguous tensor as if it were dense: issue 40 item 6)."""
        dense = t if t.is_contiguous() else t.contiguous()
        _settle(self._backend(dense).allreduce([dense], _stream_ordered(_allreduce_opts(op))))
        if dense is not t:
            t.copy_(dense)

    def allreduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        tensors = _plains([tensors] if isinstance(tensors, torch.Tensor) else list(tensors))
        if opts is None:
            opts = AllreduceOptions()
        elif not hasattr(opts, "reduceOp"):
            op, opts = opts, AllreduceOptions()
            opts.reduceOp = op
        for t in tensors:  # one tensor at a time: gloo's list form would also sum the list's tensors together
            what = _call("all_reduce", t, opts.reduceOp)
            if plan(opts.reduceOp, t.dtype) == "delegate":
                self._guard(t, what)
                self._delegated_allreduce(t, opts.reduceOp)
            else:
                self._reduce_into(t, opts.reduceOp, what)
        return _FoldWork(tensors)

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Work:
        return self.allreduce(list(tensors), None if opts is None else opts.reduceOp)

    def reduce(self, tensors: Any, opts: Any) -> Work:  # type: ignore[override]
        tensors = _plains([tensors] if isinstance(tensors, torch.Tensor) else list(tensors))
        for t in tensors:  # every rank computes the reduction; only the root keeps it, as torch's reduce promises
            # The root is part of the call: ranks that name different roots would each keep or drop a result
            # nobody else expects (issue 40 item 13), so the backend's guard, which names it, always runs.
            self._guard(t, _call("reduce", t, opts.reduceOp, root=opts.rootRank))
            keep = t.clone()
            if plan(opts.reduceOp, t.dtype) == "delegate":
                self._delegated_allreduce(keep, opts.reduceOp)
            else:
                self._reduce_into(keep, opts.reduceOp, None)
            if self._rank == opts.rootRank:
                t.copy_(keep)
        return _FoldWork(tensors)

    def _reduce_scatter_flat(self, output: torch.Tensor, flat_in: torch.Tensor, opts: Any) -> Work:
        output = _plain(output)
        n = output.numel()
        if flat_in.numel() != n * self._size:
            raise ValueError(f"reduce_scatter: the input holds {flat_in.numel()} elements, expected "
                             f"{self._size} x {n} (world size x output)")
        what = _call("reduce_scatter", flat_in, opts.reduceOp, numel=n)
        if plan(opts.reduceOp, flat_in.dtype) == "delegate":
            self._guard(flat_in, what)
            # The library compares the leading dimensions: hand it the output flat, as the input is.
            if output.is_contiguous():
                return self._backend(output)._reduce_scatter_base(output.view(-1), flat_in, opts)
            flat_out = torch.empty(n, dtype=output.dtype, device=output.device)
            _settle(self._backend(output)._reduce_scatter_base(flat_out, flat_in, _stream_ordered(opts)))
            output.copy_(flat_out.view_as(output))
            return _FoldWork([output])
        src = torch.view_as_real(flat_in).view(-1) if flat_in.is_complex() else flat_in
        dst = torch.view_as_real(output) if output.is_complex() else output
        dst.copy_(self._reduce_flat(src, opts.reduceOp, scatter=True, what=what).view_as(dst))
        return _FoldWork([output])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Work:
        return self._reduce_scatter_flat(output, _plain(input).contiguous().view(-1), opts)

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]  # torch >= 2.12 names it so

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Work:
        opts = opts or ReduceScatterOptions()
        for out, inp in zip(outputs, inputs, strict=True):
            _settle(self._reduce_scatter_base(out, inp, opts))
        return _FoldWork(_plains(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]  # torch >= 2.12

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Work:  # type: ignore[override]
        if len(outputs) != 1:
            raise ValueError("the detcomm process group takes one output tensor per reduce_scatter call")
        flat = torch.cat([_plain(t).contiguous().view(-1) for t in inputs[0]])
        return self._reduce_scatter_flat(outputs[0], flat, opts)

    # -- delegated: data movement ----------------------------------------------------------------------------
    # gloo reads and writes a tensor's storage as if it were dense whatever its strides (a broadcast into
    # ``base[:, 1]`` wrote wrong values over the neighbouring elements, issue 40 item 6), and torch's NCCL backend
    # refuses one. Every call below hands the library dense tensors (``_dense``: the tensor itself, or a dense
    # copy) and writes a copy's result back into the caller's view (``_written``).
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        output, input = _plain(output), _dense(_plain(input))
        out = _dense(output)
        return _written(self._backend(input)._allgather_base(out, input, opts or AllgatherOptions()),
                        [(output, out)])

    all_gather_single = _allgather_base  # torch >= 2.12 names it so

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Work:
        outputs, inputs = _plains(outputs), _plains(inputs)
        for out, inp in zip(outputs, inputs, strict=True):
            dense = _dense(out)
            _settle(self._backend(inp)._allgather_base(dense, _dense(inp), _stream_ordered(AllgatherOptions())))
            if dense is not out:
                out.copy_(dense)
        return _FoldWork(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]  # torch >= 2.12

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        outputs, inputs = [_plains(o) for o in outputs], [_dense(t) for t in _plains(inputs)]
        dense = [[_dense(o) for o in lst] for lst in outputs]
        return _written(self._backend(inputs[0]).allgather(dense, inputs, opts or AllgatherOptions()),
                        _pairs(outputs, dense))

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        outputs, inputs = [_plains(o) for o in outputs], [_dense(t) for t in _plains(inputs)]
        dense = [[_dense(o) for o in lst] for lst in outputs]
        return _written(self._backend(inputs[0]).allgather_coalesced(dense, inputs, opts or AllgatherOptions()),
                        _pairs(outputs, dense))

    def broadcast(self, tensors: Any, opts: Any) -> Work:  # type: ignore[override]
        tensors = _plains([tensors] if isinstance(tensors, torch.Tensor) else list(tensors))
        dense = [_dense(t) for t in tensors]
        return _written(self._backend(dense[0]).broadcast(dense, opts), list(zip(tensors, dense)))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Work:
        input, output = _dense(_plain(input)), _plain(output)
        out = _dense(output)
        return _written(self._backend(input).alltoall_base(out, input, output_split_sizes, input_split_sizes,
                                                           opts or AllToAllOptions()), [(output, out)])

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        outputs, inputs = _plains(outputs), [_dense(t) for t in _plains(inputs)]
        dense = [_dense(o) for o in outputs]
        return _written(self._backend(inputs[0]).alltoall(dense, inputs, opts or AllToAllOptions()),
                        list(zip(outputs, dense)))

    def gather(self, outputs: Any, inputs: Any, opts: Any) -> Work:  # type: ignore[override]
        outputs, inputs = [_plains(o) for o in outputs], [_dense(t) for t in _plains(inputs)]
        dense = [[_dense(o) for o in lst] for lst in outputs]
        return _written(self._backend(inputs[0]).gather(dense, inputs, opts), _pairs(outputs, dense))

    def scatter(self, outputs: Any, inputs: Any, opts: Any) -> Work:  # type: ignore[override]
        outputs, inputs = _plains(outputs), [[_dense(t) for t in _plains(i)] for i in inputs]
        dense = [_dense(o) for o in outputs]
        return _written(self._backend(dense[0]).scatter(dense, inputs, opts), list(zip(outputs, dense)))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        tensors = [_dense(t) for t in _plains(tensors)]
        return self._backend(tensors[0]).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        tensors = _plains(tensors)
        dense = [_dense(t) for t in tensors]
        return _written(self._backend(dense[0]).recv(dense, src, tag), list(zip(tensors, dense)))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        tensors = _plains(tensors)
        dense = [_dense(t) for t in tensors]
        return _written(self._backend(dense[0]).recv_anysource(dense, tag), list(zip(tensors, dense)))

    def barrier(self, opts: Any = None) -> Work:
        # A barrier pairs with whatever its peers call; the guard names an extra reduction on another rank
        # instead of gloo's timeout (issue 40 item 9).
        self._guard(torch.empty(0), "dist.barrier()")
        return self._gloo.barrier(opts) if opts is not None else self._gloo.barrier()  # type: ignore[attr-defined]

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier on this group's ranks (collective). ``dist.monitored_barrier`` refuses any
        group whose backend is not named "gloo" before it gets here; call this method on the group instead."""
        self._gloo.monitored_barrier(timeout, wait_all_ranks)  # type: ignore[attr-defined]


# The first word of the backend's call header: never the communicator's (guard._MAGIC), so a backend call
# and a communicator call compare unequal whatever else they hold.
_BACKEND_MAGIC = 0x0DE7C0_BAC4


class _GroupHeaders:
    """What ``guard.exchange`` needs of a group: the same all-gather on this group that a CPU communicator's
    call header uses (``all_gather_flat``, served by gloo), and ``all_gather_object`` on it on a mismatch."""

    def __init__(self, group: DetcommProcessGroup) -> None:
        self.group = group
        self.world_size = group.size()
        self.rank = group.rank()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.world_size * x.numel(), dtype=x.dtype, device=x.device)
        all_gather_flat(out, x, group=self.group)
        return out


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the library can read and write it as it is (dense), else a dense copy of it."""
    return t if t.is_contiguous() else t.contiguous()


def _pairs(outputs: list[list[torch.Tensor]], dense: list[list[torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [p for lo, ld in zip(outputs, dense) for p in zip(lo, ld)]


def _written(work: Work, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Work:
    """``work`` as it is where every output was handed over as itself; else finish it and copy each dense
    stand-in's result into the caller's tensor (on CUDA: after ``wait()`` orders the current stream after the
    library's), returning a finished work."""
    moved = [(o, d) for o, d in pairs if o is not d]
    if not moved:
        return work
    _settle(work)
    for o, d in moved:
        o.copy_(d)
    return _FoldWork([o for o, _ in pairs])


def _allreduce_opts(op: Any) -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = op if isinstance(op, _R) else _R(op)
    return opts


def _fp64_extremum(stacked: torch.Tensor, name: str) -> torch.Tensor:
    """MAX / MIN over the rank axis of fp64 rows with the keys' rules (int32 keys would round fp64): a NaN among
    an element's inputs gives torch's quiet NaN, a zero result is +0.0. ``amax`` of a set depends on the order
    only through those two cases."""
    red = stacked.amax(dim=0) if name == "max" else stacked.amin(dim=0)
    red = torch.where(red == 0, torch.zeros_like(red), red)
    return torch.where(torch.isnan(stacked).any(dim=0), torch.full_like(red, _FP64_NAN), red)


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> DetcommProcessGroup:
    return DetcommProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register the ``"detcomm"`` backend with torch.distributed (done on import; idempotent). Local."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    _log.debug("registered the %r torch.distributed backend", BACKEND_NAME)


register()
