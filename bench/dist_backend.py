"""The "detcomm" torch.distributed backend on CPU gloo ranks: the time of a dist.all_reduce of one flat fp32
tensor and of a DistributedDataParallel step (several buckets), medians over repeats, beside plain gloo's
(docs/performance.md, docs/trainers.md).

    python bench/dist_backend.py [--world-size 4] [--mib 16] [--repeats 9] [--ddp-mib 16 --bucket-mib 4]

Each rank prints nothing; rank 0's medians are printed as one table. The first calls (the backend's
communicator, its self-checks and one per new tensor size) are warm-up and not timed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _job(rank: int, w: int, kind: str, numel: int, repeats: int, ddp_numel: int, bucket_mib: float) -> dict[str, float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import detcomm.dist_backend  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    pg = dist.new_group(backend=kind)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    dist.all_reduce(x.clone(), group=pg)
    out["first all_reduce s"] = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        y = x.clone()
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        dist.all_reduce(y, group=pg)
        times.append(time.perf_counter() - t0)
    out["all_reduce s"] = statistics.median(times)
    width = 1024
    torch.manual_seed(0)
    layers = max(1, ddp_numel // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    ddp = DDP(model, process_group=pg, bucket_cap_mb=bucket_mib)
    inp = torch.randn(4, width, generator=torch.Generator().manual_seed(10 + rank))
    steps = []
    for i in range(repeats + 2):
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        ddp(inp).sum().backward()
        if i == 0:
            out["first DDP step s"] = time.perf_counter() - t0
        elif i >= 2:
            steps.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    out["DDP step s"] = statistics.median(steps)
    if kind == "detcomm":
        checks = pg.checks()
        out["self-checks"] = len(checks)
        out["self-check s"] = sum(c.seconds for c in checks)
    dist.destroy_process_group(pg)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--mib", type=float, default=16.0, help="all_reduce size (fp32)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--ddp-mib", type=float, default=16.0, help="DDP model size (fp32 parameters)")
    p.add_argument("--bucket-mib", type=float, default=4.0, help="DDP bucket_cap_mb")
    a = p.parse_args()
    from detcomm._spawn import LocalCluster
    from detcomm.tables import format_table

    numel = int(a.mib * 2**20) // 4
    ddp_numel = int(a.ddp_mib * 2**20) // 4
    rows = []
    with LocalCluster(a.world_size, pg_timeout_s=600.0) as c:
        for kind in ("gloo", "detcomm"):
            r = c.run(_job, kind, numel, a.repeats, ddp_numel, a.bucket_mib, timeout_s=1800)[0]
            rows.append([kind, *(f"{r[k] * 1e3:.1f}" for k in ("all_reduce s", "first all_reduce s", "DDP step s",
                                                              "first DDP step s"))])
    print(f"W={a.world_size}, all_reduce {a.mib:g} MiB fp32, DDP {a.ddp_mib:g} MiB of fp32 parameters in "
          f"{a.bucket_mib:g} MiB buckets; medians of {a.repeats} (ms)")
    print(format_table(["backend", "all_reduce", "first all_reduce", "DDP step", "first DDP step"], rows))
    print(f"detcomm: {r['self-checks']:.0f} self-checks in {r['self-check s'] * 1e3:.0f} ms (in the first calls)")


if __name__ == "__main__":
    main()
