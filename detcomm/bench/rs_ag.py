"""rs_ag_fold against gather_fold on CPU gloo, same run: bytes each rank receives and time per all-reduce.

    python -m detcomm.bench.rs_ag [--nproc 4] [--mib 16] [--calls 10] [--dtype bfloat16] [--json out.json]
    python -m detcomm.bench.rs_ag --model      (the predicted cost table of docs/performance.md, no ranks)
    detcomm-bench rs-ag ...                    (the same through the bench's console script)

W local ranks (gloo) under rl-bitwise; two sites of one shape (rows x 4096 of ``--dtype``, ``--mib`` MiB per
rank), one forced onto each route, called alternately (a barrier before every call, so the ranks start it
together) so that a drift of the machine's load lands on both. The time is each rank's wall time of the public
``detcomm.all_reduce`` call, median over the calls, the slowest rank's median reported; the bytes are what the
route's collectives deliver to the rank from the other ranks (payload, the call guard's headers on device groups
and the padding of the last block), counted at the library's collectives. Both routes' results are compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from detcomm._spawn import LocalCluster

WIDTH = 4096
ROUTES = ("gather_fold", "rs_ag_fold")


def job(rank: int, world_size: int, mib: int, calls: int, dtype_name: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import detcomm

    dtype = getattr(torch, dtype_name)
    rows = mib * (1 << 20) // (WIDTH * dtype.itemsize)
    comm = detcomm.init(numerics="rl-bitwise")
    try:
        native = comm._native
        received = {"n": 0}
        a2a, gather = native.all_to_all, native.all_gather

        def count(out: torch.Tensor) -> torch.Tensor:
            received["n"] += out.numel() * out.element_size() * (world_size - 1) // world_size
            return out

        native.all_to_all = lambda x, i, o, **kw: count(a2a(x, i, o, **kw))  # type: ignore[method-assign]
        native.all_gather = lambda x, **kw: count(gather(x, **kw))  # type: ignore[method-assign]
        for r in ROUTES:
            comm.site(f"bench.{r}", collective="all_reduce", dtype=dtype, shape=(WIDTH,), max_rows=rows, route=r)
        x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(rank)).to(dtype)
        times: dict[str, list[float]] = {r: [] for r in ROUTES}
        nbytes: dict[str, int] = {}
        out: dict[str, torch.Tensor] = {}
        for i in range(calls + 1):  # the first round warms up
            for r in ROUTES:
                dist.barrier()
                received["n"] = 0
                t0 = time.perf_counter()
                out[r] = detcomm.all_reduce(x, site=f"bench.{r}")
                if i:
                    times[r].append(time.perf_counter() - t0)
                nbytes[r] = received["n"]
        table = {d["site"]: d["route"] for d in comm.routes().as_dicts()}
        assert all(table[f"bench.{r}"] == r for r in ROUTES), table
        return {"median_s": {r: statistics.median(t) for r, t in times.items()}, "bytes": nbytes,
                "same_bits": bool(torch.equal(out[ROUTES[0]].view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                                              out[ROUTES[1]].view(torch.int16 if dtype.itemsize == 2 else torch.int32))),
                "message_bytes": x.numel() * x.element_size()}
    finally:
        detcomm.shutdown()


# The cost model of docs/performance.md ("Beyond one node"): t = collectives x A + bytes received per rank / B +
# the fold's memory traffic / HBM. A: an eager NCCL all-reduce of 16 KiB (20.7 us host time, 2x H200); B: NVLink
# per GPU 275 GB/s (the workspace's and NCCL's 64 MiB runs at W = 2) on one node, one 400 Gb/s NIC per GPU
# (50 GB/s, 8 NICs per node: an assumption) across nodes; HBM: the fold kernel at the copy rate (4.2 TB/s,
# csrc/fold_local.cu at 92-101 % of a device copy). NCCL's ring folds inside its kernels (no separate pass).
MODEL_A_S = 20e-6
MODEL_NVLINK_BPS = 275e9
MODEL_NIC_BPS = 50e9
MODEL_HBM_BPS = 4.2e12


def model_us(route: str, w: int, nbytes: int, *, hosts: int) -> float:
    """Predicted microseconds of one all-reduce of ``nbytes`` per rank at W = ``w`` on ``hosts`` hosts."""
    link = MODEL_NIC_BPS if hosts > 1 else MODEL_NVLINK_BPS
    if route == "gather_fold":
        n, received, fold = 1, (w - 1) * nbytes, (w + 1) * nbytes
    elif route == "rs_ag_fold":
        c = -(-nbytes // w)
        n, received, fold = 2, 2 * (w - 1) * c, (w + 1) * c
    else:  # NCCL's ring
        n, received, fold = 1, 2 * (w - 1) * nbytes // w, 0
    return (n * MODEL_A_S + received / link + fold / MODEL_HBM_BPS) * 1e6


def model_table() -> str:
    sizes = [(16 << 10, "16 KiB"), (1 << 20, "1 MiB"), (64 << 20, "64 MiB"), (256 << 20, "256 MiB")]
    lines = ["| W (nodes x GPUs) | size | gather_fold | rs_ag_fold | NCCL ring | rs_ag_fold / gather_fold | "
             "rs_ag_fold / NCCL |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for w, hosts in ((8, 1), (16, 2), (64, 8)):
        for nbytes, label in sizes:
            g, r, n = (model_us(x, w, nbytes, hosts=hosts) for x in ("gather_fold", "rs_ag_fold", "nccl"))
            lines.append(f"| {w} ({hosts} x 8) | {label} | {_us(g)} | {_us(r)} | {_us(n)} | {r / g:.2f}x | "
                         f"{r / n:.2f}x |")
    return "\n".join(lines)


def _us(t: float) -> str:
    return f"{t:,.0f} us" if t < 10_000 else f"{t / 1000:,.1f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="detcomm-bench rs-ag", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--json", default=None, help="write the per-rank results here")
    p.add_argument("--model", action="store_true", help="print the predicted cost table and exit (no ranks)")
    a = p.parse_args(argv)
    if a.model:
        print(model_table())
        return 0
    with LocalCluster(a.nproc) as cluster:
        res = cluster.run(job, a.mib, a.calls, a.dtype, timeout_s=1800)
    slowest = {r: max(x["median_s"][r] for x in res) for r in ROUTES}
    m = res[0]["message_bytes"]
    print(f"rs_ag_fold vs gather_fold: gloo W={a.nproc}, all_reduce {a.dtype} [{m // (WIDTH * 2 if a.dtype != 'float32' else WIDTH * 4)}, "
          f"{WIDTH}] = {m / 2**20:.1f} MiB per rank, median of {a.calls} calls (slowest rank), same run")
    for r in ROUTES:
        b = res[0]["bytes"][r]
        print(f"  {r:<12} {slowest[r] * 1e3:9.1f} ms   received per rank {b / 2**20:8.2f} MiB ({b / m:.3f}x the message)")
    print(f"  rs_ag_fold / gather_fold: time {slowest['rs_ag_fold'] / slowest['gather_fold']:.2f}x, bytes "
          f"{res[0]['bytes']['rs_ag_fold'] / res[0]['bytes']['gather_fold']:.3f}x; same bits on every rank: "
          f"{all(x['same_bits'] for x in res)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"nproc": a.nproc, "mib": a.mib, "calls": a.calls, "dtype": a.dtype, "ranks": res}, f, indent=2)
    return 0 if all(x["same_bits"] for x in res) else 1


if __name__ == "__main__":
    raise SystemExit(main())
