"""Host time of the communicator's per-call path, without any communication (a local tool, not a collective).

One process, a one-rank gloo group on the CPU: a site is declared, then its bound route is replaced by one that
returns its input (or the caller's ``out``), so what is timed is exactly what detcomm's public call costs on top
of the route: the module-level dispatch, the site lookup, the tensor and output checks, the route call and the
result handling. ``python bench/host_path.py`` prints microseconds per call (median and minimum of repeats) for
``detcomm.all_reduce`` with a new output, ``out=buf``, ``out=x``, a Site object and a reduce_scatter; ``--profile`` adds a cProfile
of the first case. ``--cuda`` times the real workspace route on one GPU instead (host time of eager calls).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

import detcomm
from detcomm.bench.timing import host_us_per_call
from detcomm.route_impls.base import Bound
from detcomm.sites import Route, Site


class _NopRoute:
    """The native route doing nothing: returns the caller's ``out`` (in place included) or the input."""

    route = Route.NATIVE

    def bind(self, site: Site) -> Bound:
        return Bound(self.route, site, lambda x, a: x if a.out is None else a.out, in_place=True)


def _per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> tuple[float, float]:
    """(median, minimum) microseconds per call over `repeats` rounds of `calls` calls: on a shared machine the
    minimum is the steadier figure (a round that was not descheduled)."""
    for _ in range(calls // 10):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples), min(samples)


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    """A one-rank gloo group for the body; detcomm is shut down after a body that returns, the group destroyed
    in any case."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield
            detcomm.shutdown()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _profile(fn: Callable[[], object], *, rounds: int, calls: int, lines: int, sync: bool = False) -> None:
    """A cProfile of `rounds` x `calls` calls of fn (sync: the device drained after each round), by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        for _ in range(calls):
            fn()
        if sync:
            torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--cuda", action="store_true",
                   help="time the real workspace route on cuda:0 (one rank) instead of a do-nothing route")
    a = p.parse_args(argv)
    if a.cuda:
        _main_cuda(a.repeats, a.profile)
        return
    with _one_rank_group():
        comm = detcomm.init(numerics="auto", selfcheck=False)
        # The native route's binding, swapped before the site is declared, so the site is bound to it the way
        # every route is (the communicator's caches included).
        comm.router._impls[Route.NATIVE] = _NopRoute()
        site = detcomm.site("bench.host", collective="all_reduce", dtype=torch.bfloat16, shape=(8192,), max_rows=8)
        detcomm.site("bench.rs", collective="reduce_scatter", dtype=torch.bfloat16, shape=(8192,), max_rows=8)
        assert {e.decision.route for e in comm.routes().entries} == {Route.NATIVE}
        x = torch.zeros(1, 8192, dtype=torch.bfloat16)
        buf = torch.empty_like(x)
        cases: dict[str, Callable[[], object]] = {
            "all_reduce(x, name)": lambda: detcomm.all_reduce(x, "bench.host"),
            "all_reduce(x, name, out=buf)": lambda: detcomm.all_reduce(x, "bench.host", out=buf),
            "all_reduce(x, name, out=x)": lambda: detcomm.all_reduce(x, "bench.host", out=x),
            "all_reduce(x, site)": lambda: detcomm.all_reduce(x, site),
            "comm.all_reduce(x, name)": lambda: comm.all_reduce(x, "bench.host"),
            "reduce_scatter(x, name, out=buf)": lambda: detcomm.reduce_scatter(x, "bench.rs", out=buf),
        }
        print(f"{'':34s} {'median':>7s} {'min':>7s} us/call ({a.repeats} rounds of {a.calls} calls)")
        for label, fn in cases.items():
            med, low = _per_call_us(fn, a.calls, a.repeats)
            print(f"{label:34s} {med:7.2f} {low:7.2f}")
        if a.profile:
            _profile(cases["all_reduce(x, name, out=buf)"], rounds=1, calls=a.calls, lines=15)


def _main_cuda(repeats: int, profile: bool) -> None:
    """The workspace route for real on one GPU: a one-rank group (the W = 1 kernel folds x straight into out),
    16 KiB bf16 per call. The host path is the one every W takes (site lookup, checks, the bound launcher, the
    in-flight guard, cuLaunchKernel, the event record); torch's own one-kernel op is timed beside it, and the
    workspace's site-bound call alone (what the route adds under the communicator's part)."""
    with _one_rank_group():
        comm = detcomm.init(numerics="rl-bitwise", device="cuda:0")
        detcomm.site("bench.host", collective="all_reduce", dtype=torch.bfloat16, shape=(8192,), max_rows=8)
        route = {e["site"]: e["route"] for e in comm.routes().as_dicts()}["bench.host"]
        x = torch.randn(1, 8192, device="cuda:0").to(torch.bfloat16)
        buf = torch.empty_like(x)
        cases: dict[str, Callable[[], object]] = {
            "detcomm.all_reduce(x, name)": lambda: detcomm.all_reduce(x, "bench.host"),
            "detcomm.all_reduce(x, name, out=buf)": lambda: detcomm.all_reduce(x, "bench.host", out=buf),
            "detcomm.all_reduce(x, name, out=x)": lambda: detcomm.all_reduce(x, "bench.host", out=x),
            "torch.add(x, x, out=buf) (one torch kernel)": lambda: torch.add(x, x, out=buf),
        }
        ws = comm._workspace
        if ws is not None:  # the workspace's part alone: its site-bound call (Workspace.bind, then run)
            bound = ws.bind_all_reduce(torch.bfloat16, 8192, label="bench.host")
            cases["workspace bound call(x, buf) (the route's part)"] = lambda: bound(x, buf)
            # The same with the output allocated (torch.empty_like on the device): what all_reduce(x, name) pays
            # for its new tensor inside the route, so that its communicator's share is the difference to this row.
            cases["workspace bound call(x, None) (allocates out)"] = lambda: bound(x, None)
        print(f"route {route}; one rank on {torch.cuda.get_device_name(0)}; 200 back-to-back calls, median of "
              f"{repeats} repeats")
        for label, fn in cases.items():
            print(f"{label:44s} {host_us_per_call(fn, calls=200, repeats=repeats):7.2f} us/call")
        if profile:
            _profile(cases["detcomm.all_reduce(x, name, out=buf)"], rounds=10, calls=200, lines=14, sync=True)


if __name__ == "__main__":
    main()
