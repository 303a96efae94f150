"""How the bench times one call: per-call samples, their order statistics, and nccl-tests bandwidths.

CPU (gloo): each timed call starts after a barrier and is timed by perf_counter, so a sample is one call's
latency from an aligned start. GPU: back-to-back calls bracketed by CUDA events (one interval per call, no host
synchronization in between, as nccl-tests does), eager; and CUDA-graph replay, where one replay runs
``calls_per_graph`` captured calls and one sample is the replay's time divided by that count.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["synced", "time_cpu", "time_cuda_eager", "time_cuda_graph", "streams_replay_us", "median_ms_back_to_back",
           "host_us_per_call", "summarize", "bandwidth"]


def synced(fn: Callable[[], object], *, cuda: bool) -> Callable[[], None]:
    """``fn`` followed, on CUDA, by a device synchronization: one call's full latency for ``time_cpu``."""
    def call() -> None:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return call


def time_cpu(fn: Callable[[], object], *, iters: int, warmup: int, barrier: Callable[[], None]) -> list[float]:
    """Seconds per call of ``fn`` over ``iters`` calls after ``warmup``, each started right after ``barrier()``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        barrier()
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return samples


def time_cuda_eager(fn: Callable[[], object], *, iters: int, warmup: int,
                    barrier: Callable[[], None] | None = None) -> list[float]:
    """Seconds per call, from CUDA events around each of ``iters`` back-to-back calls on the current stream."""
    for _ in range(warmup):
        fn()
    return _event_intervals(fn, iters=iters, barrier=barrier)


def host_us_per_call(fn: Callable[[], object], *, calls: int = 200, repeats: int = 15,
                     barrier: Callable[[], None] | None = None) -> float:
    """Host time per eager call, in microseconds: ``calls`` back-to-back calls timed by the host clock with the
    device idle when they start (after ``barrier()`` where ranks must start together), the median over
    ``repeats``. 200 small launches stay far below the launch queue's depth, so the host never waits for the
    device: this is the Python + driver cost of one call."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def median_ms_back_to_back(fn: Callable[[], object], *, repeats: int, iters: int, cuda: bool = True) -> float:
    """Milliseconds per call: the median over ``repeats`` of the mean of ``iters`` back-to-back calls (CUDA
    events on the current stream, or perf_counter with ``cuda=False``), so one call's host-side launch cost
    overlaps the previous call's device work, as in a serving loop. For kernels measured against a copy."""
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t) * 1e3 / iters)
    return statistics.median(times)


def time_cuda_graph(capture: Callable[[], Callable[[], None]], *, iters: int, calls_per_graph: int,
                    barrier: Callable[[], None] | None = None) -> list[float]:
    """Seconds per call from ``iters`` back-to-back replays; ``capture()`` records ``calls_per_graph`` calls and
    returns the replay function (the caller owns the graphs; they die with the returned closure)."""
    replay = capture()
    replay()
    return [t / calls_per_graph for t in _event_intervals(replay, iters=iters, barrier=barrier)]


def streams_replay_us(fn: Callable[[int], object], streams: Sequence[torch.cuda.Stream], *, calls: int, warmup: int,
                      iters: int) -> float:
    """Median microseconds per call of W ranks played as W streams of one GPU (``Workspace.in_process``): ``fn(r)``
    runs once eagerly on rank r's stream (every rank launched before any is waited on: a rank's kernel spins until
    the others arrive), is captured ``calls`` times into one graph per rank on that rank's stream (one graph for all
    ranks would serialize them), and the W graphs are replayed together ``warmup + iters`` times between two events
    on the current stream; the median of the ``iters`` timed replays, divided by ``calls``."""
    main_s = torch.cuda.current_stream()
    for r, st in enumerate(streams):
        st.wait_stream(main_s)
        with torch.cuda.stream(st):
            fn(r)
    for st in streams:
        main_s.wait_stream(st)
    torch.cuda.synchronize()
    graphs = []
    for r, st in enumerate(streams):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=st):
            for _ in range(calls):
                fn(r)
        graphs.append(g)
    samples = []
    for it in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main_s)
        for g, st in zip(graphs, streams):
            st.wait_stream(main_s)
            with torch.cuda.stream(st):
                g.replay()
        for st in streams:
            main_s.wait_stream(st)
        end.record(main_s)
        torch.cuda.synchronize()
        if it >= warmup:
            samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def _event_intervals(fn: Callable[[], object], *, iters: int, barrier: Callable[[], None] | None) -> list[float]:
    """Seconds between consecutive CUDA events around ``iters`` back-to-back calls, after the device drained
    and (``barrier``) the ranks lined up."""
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(iters)]


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, p10 and p90 in microseconds (numpy's linear interpolation between order statistics), and the
    sample count."""
    if not samples:
        raise ValueError("no samples to summarize")
    p10, median, p90 = np.quantile(np.asarray(samples, dtype=np.float64), [0.1, 0.5, 0.9]) * 1e6
    return {"median_us": float(median), "p10_us": float(p10), "p90_us": float(p90), "n": len(samples)}


_BUS_FACTOR = {"all_reduce": lambda w: 2 * (w - 1) / w, "reduce_scatter": lambda w: (w - 1) / w,
               "all_gather": lambda w: (w - 1) / w}


def bandwidth(collective: str, *, nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s by the nccl-tests definitions: algbw = size / time with size the full buffer
    (all-reduce: the per-rank message; reduce-scatter: the input; all-gather: the output); busbw = algbw *
    2(W-1)/W for all-reduce and (W-1)/W for reduce-scatter and all-gather."""
    if collective not in _BUS_FACTOR:
        raise ValueError(f"unknown collective {collective!r}; expected one of {sorted(_BUS_FACTOR)}")
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    alg = nbytes / seconds / 1e9
    return alg, alg * _BUS_FACTOR[collective](world_size)
