"""Cost of the call checks on CPU gloo: the cross-rank call verification (detcomm.init(check=True) /
DETCOMM_CHECK=1) and the always-on call guard in each of its modes (detcomm/route_impls/guard.py).

    python bench/verify_cost.py [--nproc 4] [--calls 400] [--rows 8] [--width 64]

For a small all_reduce (fp32, rows x width) on the native route (numerics=auto) and on gather_fold
(rl-bitwise), the median per-call time with the check off and on, measured on every rank after a warm-up
(rank 0's numbers printed; the medians of the ranks differ by noise only). The difference is the check's
overhead: one all-gather of a 9-int64 fingerprint per call. The call guard's cost: an all_gather, a native
all_reduce and a gather_fold all_reduce through the communicator under each guard mode (``guard_job``).
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


GUARDS = ("none", "header", "in_message", "header+in_message")


def guard_job(rank: int, world_size: int, calls: int, rows: int, width: int, guard: str) -> dict[str, float]:
    """Median per-call time of an all_gather, a native all_reduce (numerics=auto) and a gather_fold all_reduce
    (rl-bitwise) under one call guard (route_impls/guard.py): "none" (a device group's unguarded routes before the
    in-message guard), "header" (a host group's separate header), "in_message" (a device group's guard, here run
    on gloo) and "header+in_message" (a host group's fold routes before their redundant in-message header was
    dropped)."""
    import torch
    import torch.distributed as dist

    import detcomm
    from detcomm.comm import Communicator
    from detcomm.envelope import resolve_numerics
    from detcomm.route_impls.guard import CallHeader

    detcomm.shutdown()
    out: dict[str, float] = {}
    x = torch.randn(rows, width)
    for label, numerics, coll, route in (("all_gather", "auto", "all_gather", None),
                                         ("native all_reduce", "auto", "all_reduce", None),
                                         ("gather_fold all_reduce", "rl-bitwise", "all_reduce", "gather_fold")):
        assert dist.group.WORLD is not None
        comm = Communicator(group=dist.group.WORLD, resolved=resolve_numerics(numerics),
                            call_guard="header" if guard in ("none", "header") else "in_message")
        site = comm.site("bench", collective=coll, dtype=torch.float32, shape=(width,), max_rows=rows, route=route)
        sc = comm._site_calls["bench"]
        if guard == "none":
            sc.header = None
        elif guard == "header+in_message":
            sc.header = CallHeader(site, native=comm._native, device=comm.device)
        call = getattr(comm, coll)
        for _ in range(20):
            call(x, "bench")
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            call(x, "bench")
            times.append(time.perf_counter() - t0)
        assert comm.routes().as_dicts()[0]["route"] == ("gather_fold" if numerics == "rl-bitwise" else "native")
        comm.close()
        out[label] = statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--guard-only", action="store_true", help="only the call guard's modes, not check off/on")
    a = p.parse_args()
    print(f"call-check cost: gloo W={a.nproc}, all_reduce fp32 [{a.rows}, {a.width}], median of {a.calls} calls per setting")
    with LocalCluster(a.nproc) as cluster:
        for numerics in () if a.guard_only else ("auto", "rl-bitwise"):
            res: dict[bool, list[float]] = {}
            # Interleave off/on twice so a drift of the machine's load does not land on one setting.
            for check in (False, True, False, True):
                res.setdefault(check, []).append(cluster.run(job, numerics, check, a.calls, a.rows, a.width)[0])
            off, on = min(res[False]), min(res[True])
            route = "native" if numerics == "auto" else "gather_fold"
            print(f"  {route:<12} off {off * 1e6:8.1f} us   on {on * 1e6:8.1f} us   overhead {(on - off) * 1e6:8.1f} us/call "
                  f"({on / off:.2f}x)")
        # The call guard's modes, interleaved twice; the minimum of the two medians per cell.
        seen: dict[str, list[dict[str, float]]] = {}
        for guard in (*GUARDS, *GUARDS):
            seen.setdefault(guard, []).append(cluster.run(guard_job, a.calls, a.rows, a.width, guard)[0])
        print(f"  call guard per call (us): {'':<24}" + "".join(f"{g:>20}" for g in GUARDS))
        for label in seen[GUARDS[0]][0]:
            cells = [min(r[label] for r in seen[g]) * 1e6 for g in GUARDS]
            print(f"  {label:<48}" + "".join(f"{c:20.1f}" for c in cells))


if __name__ == "__main__":
    main()
