"""Drive W in-process workspace rank views from W CUDA streams (the one-GPU harness)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from payloads import from_tensor, to_tensor


def on_ranks(streams: Sequence[torch.cuda.Stream], fn: Callable[[int], Any]) -> list[Any]:
    """fn(r) on rank r's stream for every rank, all launched before any is waited on (a rank's kernel spins until
    every other rank's arrives); the streams start after the current stream's work and the current stream waits
    for them; then the device is synchronized. Returns fn's results in rank order."""
    device = streams[0].device
    main = torch.cuda.current_stream(device)
    outs = []
    for r, s in enumerate(streams):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            outs.append(fn(r))
    for s in streams:
        main.wait_stream(s)
    torch.cuda.synchronize(device)
    return outs


class Ranks:
    """W rank views + one stream each. `run(op, xs)` launches rank r's collective on stream r for every rank
    before waiting on any (a rank's kernel spins until every other rank's arrives), then synchronizes."""

    def __init__(self, views: Sequence[Any]) -> None:
        self.views = list(views)
        self.world = len(self.views)
        self.device = self.views[0].device
        self.streams = [torch.cuda.Stream(self.device) for _ in self.views]

    def run(self, op: str, xs: Sequence[torch.Tensor], **kw: Any) -> list[torch.Tensor]:
        return on_ranks(self.streams, lambda r: getattr(self.views[r], op)(xs[r], **kw))

    def run_bits(self, op: str, bits: Sequence[np.ndarray], dtype: str, **kw: Any) -> list[np.ndarray]:
        xs = [to_tensor(b, dtype, str(self.device)) for b in bits]
        return [from_tensor(o) for o in self.run(op, xs, **kw)]

    def close(self) -> None:
        for v in self.views:
            v.close()


_CACHED: dict = {}


def recorded_in_process(world: int, *, build: str = "canonical", **kw: Any) -> list[Any]:
    """Workspace.in_process over the kernel build `build`, recording the code paths each view runs (variants_run)."""
    from detcomm.workspace import debug

    return debug.workspace_class(build, record=True).in_process(world, **kw)


def cached_ranks(world: int, *, capacity: int, build: str = "canonical", **kw: Any) -> Ranks:
    """W in-process workspace views on cuda:0 (W streams of one GPU), built once per (world, capacity, kernel
    build, options) and shared by the tests: each build compiles and maps its buffers once."""
    key = (world, capacity, build, tuple(sorted(kw.items())))
    if key not in _CACHED:
        _CACHED[key] = Ranks(recorded_in_process(world, build=build, device="cuda:0", capacity_bytes=capacity,
                                                 max_rows_armed=4096, **kw))
    return _CACHED[key]


def run_collecting_failures(views: Sequence[Any], run: Any, *, default: Any) -> tuple[Any, list[str]]:
    """run() on a workspace that may fail (a negative control): returns (run()'s result, or `default` when a call
    already raised WorkspaceFailed while the calls were being issued; every rank's failure message). Every rank is
    checked after the device is idle."""
    from detcomm.errors import WorkspaceFailed

    failed: list[str] = []
    try:
        out = run()
    except WorkspaceFailed as e:
        out, failed = default, [str(e)]
    torch.cuda.synchronize()
    for v in views:
        try:
            v.check()
        except WorkspaceFailed as e:
            failed.append(str(e))
    return out, failed


def capture_and_replay(calls: Callable[[], dict[str, torch.Tensor]], refill: Callable[[int], None],
                       want: Callable[[str, int], np.ndarray], *, seeds: Sequence[int]
                       ) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The CUDA-graph check of a set of collective calls, shared by the route tests: ``calls()`` run eagerly on the
    inputs of seed 0 (their bits against ``want(name, 0)``; this also loads kernels and creates NCCL communicators,
    which a capture cannot), then captured once in one graph (capture_error_mode="thread_local": the other ranks'
    processes, and torch's own threads, keep running unrelated CUDA calls) and replayed after ``refill(seed)`` for
    each of ``seeds``. Every replayed output must equal ``want(name, seed)`` and differ from the previous replay's
    bits (the negative control: a graph that replays stale values, or reads another buffer than the captured one,
    fails it). Returns the problems found and the captured outputs."""
    from datagen import to_bits

    problems: list[str] = []
    for name, t in calls().items():
        if not np.array_equal(to_bits(t), want(name, 0)):
            problems.append(f"{name}: eager result differs from the oracle")
    torch.cuda.synchronize()
    refill(0)  # an in-place call overwrote its input eagerly
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outs = calls()
    before = {name: to_bits(t) for name, t in outs.items()}
    for seed in seeds:
        refill(seed)
        graph.replay()
        torch.cuda.synchronize()
        for name, t in outs.items():
            bits = to_bits(t)
            if not np.array_equal(bits, want(name, seed)):
                problems.append(f"{name}: replay with seed {seed} differs from the oracle")
            if np.array_equal(bits, before[name]):
                problems.append(f"negative control: {name} did not change after replay with new inputs")
            before[name] = bits
    return problems, outs
