"""A serving step on static input buffers, captured in a CUDA graph once per shape key and replayed (issue 42).

A fixed-width step's launch shapes follow a few host integers (the real row count, where it reaches the
reductions and the attention): its *shape key*. Everything else the step reads is an integer tensor of a fixed
shape (token ids, positions, block tables, each row's request, ...), which ``StepInputs`` keeps at fixed addresses:
the host writes a step's values into numpy views of one (pinned) host buffer and moves them in ONE copy to one
device buffer, whose views the step reads. ``StepGraphs`` runs a step body ``body(key)`` on those views:

* eagerly (``capture=False``: a CPU device, or a step with a site or an op a graph cannot hold), every call;
* on CUDA, captured once per key with torch's own API: the body warms up on a side stream (lazy inits, kernel
  loads and compiles happen there, as torch.cuda.graphs asks), is captured into a ``torch.cuda.CUDAGraph`` from
  one memory pool shared by all of the owner's graphs, and each later call of that key is one ``replay``.

The captured graph is the same body on the same buffers, so its bits are the eager body's by construction; what
changes is who issues the launches. What may not stand in a body: a read back to the host (``.item()``,
``.tolist()``, ``int(t)``, a data-dependent Python loop) or a host copy, since a replay re-runs the launches the
capture recorded and nothing of the host code. The engines decide capture from static facts before any step
(detcomm.hf.engine: the routes of the step's sites, the attention impl, MoE blocks), never by trying a capture.

Rejected: one graph per step with padded row counts (the real count reaches the reductions' arithmetic through
the rows they carry; padding them would change what they reduce), and torch.compile's "reduce-overhead" mode
(it would re-trace transformers' modules and detcomm's calls, and its guards are not a static fact).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Generic, TypeVar

import numpy as np
import torch

__all__ = ["StepInputs", "StepGraphs"]

T = TypeVar("T")


class StepInputs:
    """Named int64 fields of fixed shapes (``shapes``), written on the host and read on ``device``.

    ``begin()`` returns the host views (numpy, one buffer; pinned on CUDA) to write a step's values into;
    ``upload()`` moves the whole buffer to the device in one copy (asynchronous from pinned memory on CUDA: the
    next ``begin`` waits until that copy has read the host buffer). ``dev`` maps each name to its view of the one
    device buffer: the same tensor, at the same address, every step (what a captured graph reads)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], *, device: torch.device) -> None:
        if not shapes:
            raise ValueError("StepInputs: at least one field")
        sizes = {name: int(np.prod(shape, dtype=np.int64)) for name, shape in shapes.items()}
        total = sum(sizes.values())
        self.device = device
        pin = device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.int64, pin_memory=pin)
        self._dev = torch.zeros(total, dtype=torch.int64, device=device)
        flat = self._host.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        at = 0
        for name, shape in shapes.items():
            n = sizes[name]
            self.host[name] = flat[at : at + n].reshape(shape)
            self.dev[name] = self._dev[at : at + n].view(shape)
            at += n
        self._copied: torch.cuda.Event | None = torch.cuda.Event() if pin else None
        self._pending = False

    def begin(self) -> dict[str, np.ndarray]:
        """The host views, once the previous ``upload`` no longer reads them."""
        if self._pending:
            assert self._copied is not None
            self._copied.synchronize()  # by then a serving loop has read the last step's tokens: usually free
            self._pending = False
        return self.host

    def upload(self) -> None:
        """Copy every field to the device (one copy, on the current stream: ordered before the step's work)."""
        if self._copied is None:
            self._dev.copy_(self._host)
            return
        self._dev.copy_(self._host, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.device))
        self._pending = True


class StepGraphs(Generic[T]):
    """``body(key)`` per call: eagerly, or (``capture=True``, CUDA) captured once per ``key`` and replayed.

    ``body`` must read its inputs from fixed buffers (``StepInputs.dev``, a persistent cache) and give the same
    launch shapes for the same key; its result (a tensor or a tuple of them) is then the graph's static output,
    overwritten by the next replay of that key. ``captures`` counts the graphs captured so far; ``release()``
    drops them (a graph that captured an NCCL call must go before the communicator is destroyed)."""

    def __init__(self, body: Callable[[Hashable], T], *, device: torch.device, capture: bool) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"StepGraphs: CUDA graphs capture CUDA work only, the step runs on {device}")
        self.body, self.device, self.capture = body, device, capture
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, T]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def captures(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[Hashable]:
        """The shape keys captured so far, in capture order."""
        return list(self._graphs)

    def __call__(self, key: Hashable) -> T:
        if not self.capture:
            return self.body(key)
        hit = self._graphs.get(key)
        if hit is None:
            hit = self._graphs[key] = self._capture(key)
        else:
            hit[0].replay()
        return hit[1]

    def _capture(self, key: Hashable) -> tuple[torch.cuda.CUDAGraph, T]:
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        # Host-side in-flight checks (the detcomm workspace's: one collective at a time, across streams) must see
        # the main stream's last launch done before the side stream issues one; once per key, so the wait is cheap.
        main.synchronize()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            # The warm-up is a real step on the same buffers (its cache writes store the values the replay stores
            # again): lazy initialisation, kernel loads and Triton compiles happen here, outside the capture.
            self.body(key)
        main.wait_stream(side)
        side.synchronize()  # the same checks, the other way
        graph = torch.cuda.CUDAGraph()
        # thread_local: torch's NCCL watchdog thread queries events while this thread captures (tests/gpu/
        # test_fold_capture.py); nothing of the body runs on another thread.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.body(key)
        graph.replay()  # the capture ran nothing: this call's step
        return graph, out

    def release(self) -> None:
        """Drop every captured graph (later calls capture again)."""
        self._graphs.clear()
