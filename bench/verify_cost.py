"""Cost of the call checks on CPU gloo: the cross-rank call verification (detcomm.init(check=True) /
DETCOMM_CHECK=1) and the always-on call guard of the fold routes (detcomm/backends/guard.py).

    python bench/verify_cost.py [--nproc 4] [--calls 400] [--rows 8] [--width 64]

For a small all_reduce (fp32, rows x width) on the native route (numerics=auto) and on gather_fold
(rl-bitwise), the median per-call time with the check off and on, measured on every rank after a warm-up
(rank 0's numbers printed; the medians of the ranks differ by noise only). The difference is the check's
overhead: one all-gather of a 9-int64 fingerprint per call. The guard's cost is gather_fold with its 16-byte
header against the same route called without it (the route built from its public pieces, ``guard_job``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from detcomm._spawn import LocalCluster


def job(rank: int, world_size: int, numerics: str, check: bool, calls: int, rows: int, width: int) -> float:
    import torch

    import detcomm

    detcomm.shutdown()
    comm = detcomm.init(numerics=numerics, check=check)
    x = torch.randn(rows, width)
    detcomm.all_reduce(x, site="bench")
    for _ in range(20):
        detcomm.all_reduce(x, site="bench")
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        detcomm.all_reduce(x, site="bench")
        times.append(time.perf_counter() - t0)
    route = comm.routes().as_dicts()[0]["route"]
    detcomm.shutdown()
    assert route == ("native" if numerics == "auto" else "gather_fold")
    return statistics.median(times)


def guard_job(rank: int, world_size: int, calls: int, rows: int, width: int, guard: bool) -> float:
    """The gather_fold route itself, built from its public pieces over the communicator's group and called with
    and without its call guard: the difference is the guard alone (the communicator's call path is in neither)."""
    import torch

    import detcomm
    from detcomm.backends.gather_fold import GatherFoldBackend
    from detcomm.backends.guard import CallGuard
    from detcomm.backends.native import NativeBackend
    from detcomm.numerics.fold import BATCH_INVARIANT, select_leaf
    from detcomm.route import ReduceOp

    detcomm.shutdown()
    comm = detcomm.init(numerics="rl-bitwise")
    x = torch.randn(rows, width)
    site = comm.site("bench", collective="all_reduce", dtype=torch.float32, shape=(width,), max_rows=rows)
    route = GatherFoldBackend(NativeBackend(comm.group),
                              select_leaf(device_type="cpu", required=frozenset({BATCH_INVARIANT})))
    call_guard = CallGuard(site) if guard else None
    for _ in range(20):
        route.all_reduce(x, ReduceOp.SUM, guard=call_guard)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        route.all_reduce(x, ReduceOp.SUM, guard=call_guard)
        times.append(time.perf_counter() - t0)
    detcomm.shutdown()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    a = p.parse_args()
    print(f"call-check cost: gloo W={a.nproc}, all_reduce fp32 [{a.rows}, {a.width}], median of {a.calls} calls per setting")
    with LocalCluster(a.nproc) as cluster:
        for numerics in ("auto", "rl-bitwise"):
            res: dict[bool, list[float]] = {}
            # Interleave off/on twice so a drift of the machine's load does not land on one setting.
            for check in (False, True, False, True):
                res.setdefault(check, []).append(cluster.run(job, numerics, check, a.calls, a.rows, a.width)[0])
            off, on = min(res[False]), min(res[True])
            route = "native" if numerics == "auto" else "gather_fold"
            print(f"  {route:<12} off {off * 1e6:8.1f} us   on {on * 1e6:8.1f} us   overhead {(on - off) * 1e6:8.1f} us/call "
                  f"({on / off:.2f}x)")
        res = {}
        for guard in (False, True, False, True):
            res.setdefault(guard, []).append(cluster.run(guard_job, a.calls, a.rows, a.width, guard)[0])
        off, on = min(res[False]), min(res[True])
        print(f"  call guard (gather_fold): without {off * 1e6:8.1f} us   with {on * 1e6:8.1f} us   overhead "
              f"{(on - off) * 1e6:8.1f} us/call ({on / off:.2f}x)")


if __name__ == "__main__":
    main()
