"""Collective cost of the tensor-parallel layouts of a row-parallel layer (o_proj, down_proj): what each layout
moves per call, timed side by side in one run, at decode and prefill row counts.

    detcomm-bench tp-layouts --quick                                   # CPU gloo, W=2 and 4, small sizes (~2 min)
    detcomm-bench tp-layouts --device cuda                             # every GPU, NCCL, one rank each
    detcomm-launch --nproc 8 -m detcomm.bench.tp_layouts --device cuda # the same under the launcher
    python -m detcomm.bench.tp_layouts --help

Layouts (output width H = --hidden, reduction width K = --k, bf16 output, V = --virtual-shards):
  native    each rank's bf16 partial row, the library's all-reduce (NCCL/gloo): not batch-invariant, W-dependent
  fold      each rank's bf16 partial row, detcomm's canonical fold (ipc_fold where the CUDA-IPC workspace
            arms and rows <= its armed rows, else gather_fold): batch-invariant, W-dependent
  vs_gather each rank's V/W fp32 partials [V/W, rows, H], gather_fold over the V shards: the same bits at every
            W dividing V
  vs_a2a    the same partials, a2a_fold (all-to-all of column blocks, fold, all-gather of the rounded blocks)
  vs_tree   the same partials on a tree-order site (shard_fold="tree"), gather_fold: each rank folds its subtree
            and sends one fp32 row; the same bits at every power-of-two W dividing V
  vs_tree_a2a  the tree-order site on a2a_fold (column blocks of the subtree roots)
  full_k    all-gather of the K-wide bf16 activation (each rank holds K/W columns) and of the output (each
            rank computes H/W columns with the full K): no cross-rank sum at all; the column interleave copies
            are included
Only communication and the fold arithmetic are timed (no GEMM). Each sample is one call from an aligned start
(a barrier; on GPUs the device is synchronized after the call); the layouts are interleaved in rounds so that a
drift of the machine's load does not land on one of them. Medians (p10..p90) of rank 0, ratios against native in
the same run, and the bytes each rank receives per call (analytic; see docs/spec.md §9.1).
The group runs numerics="auto" (the library's own NCCL algorithms for native); every fold site is forced to
its route and self-checked as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..tables import format_table

__all__ = ["LAYOUTS", "received_bytes", "job", "main"]

LAYOUTS = ("native", "fold", "vs_gather", "vs_a2a", "vs_tree", "vs_tree_a2a", "full_k")
DECODE_ROWS = (1, 4, 16, 64)
PREFILL_ROWS = (512, 1024, 2048, 4096)
QUICK = {"rows": (1, 16, 64, 512), "hidden": 4096, "k": 4096, "iters": 12, "worlds": (2, 4)}


def received_bytes(layout: str, *, rows: int, hidden: int, k: int, w: int, v: int, elem: int = 2) -> int:
    """Bytes one rank receives from the others in one call of ``layout`` (``elem``: the output dtype's size)."""
    out_row = rows * hidden * elem
    if layout == "native":  # ring all-reduce: reduce-scatter + all-gather
        return 2 * (w - 1) * out_row // w
    if layout == "fold":
        # ipc_fold one-shot reads the W-1 peers' rows; gather_fold receives them all
        return (w - 1) * out_row
    if layout == "vs_gather":
        return (w - 1) * (v // w) * rows * hidden * 4
    if layout == "vs_a2a":
        c = -(-hidden // w)
        return (w - 1) * (v // w) * rows * c * 4 + (w - 1) * rows * c * elem
    if layout == "vs_tree":  # the tree order: one fp32 subtree root per rank
        return (w - 1) * rows * hidden * 4
    if layout == "vs_tree_a2a":
        c = -(-hidden // w)
        return (w - 1) * rows * c * 4 + (w - 1) * rows * c * elem
    if layout == "full_k":
        return (w - 1) * rows * (k // w) * elem + (w - 1) * rows * (hidden // w) * elem
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def job(rank: int, w: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Time every layout at every row count on this group. Collective; returns rank 0's rows (others: [])."""
    import torch
    import torch.distributed as dist

    import detcomm
    from detcomm.bench.timing import summarize, synced, time_cpu

    detcomm.shutdown()
    # workspace=True arms the CUDA-IPC workspace on a CUDA group (a CPU group says why not and goes on).
    comm = detcomm.init(numerics="auto", workspace=True)
    dev = comm.device
    cuda = dev.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # W ranks share the machine's cores
    bf16, h, k, v = torch.bfloat16, cfg["hidden"], cfg["k"], cfg["virtual_shards"]
    if v % w or k % w or h % w:
        raise ValueError(f"W={w} must divide --virtual-shards {v}, --k {k} and --hidden {h}")
    gen = torch.Generator().manual_seed(1000 + rank)
    out: list[dict[str, Any]] = []
    for rows in cfg["rows"]:
        x = torch.randn(rows, h, generator=gen).to(dev, bf16)
        partials = torch.randn(v // w, rows, h, generator=gen).to(dev)
        act = torch.randn(rows, k // w, generator=gen).to(dev, bf16)
        col = torch.randn(rows, h // w, generator=gen).to(dev, bf16)
        fold_route = "ipc_fold" if comm.caps.workspace and rows <= comm.caps.workspace_max_rows else "gather_fold"
        s_native = detcomm.site(f"tp.native.{rows}", collective="all_reduce", dtype=bf16, shape=(h,), max_rows=rows,
                                route="native")
        s_fold = detcomm.site(f"tp.fold.{rows}", collective="all_reduce", dtype=bf16, shape=(h,), max_rows=rows,
                              route=fold_route)
        s_vg = detcomm.site(f"tp.vs_gather.{rows}", collective="all_reduce", dtype=bf16, shape=(h,), max_rows=rows,
                            virtual_shards=v, route="gather_fold")
        s_va = detcomm.site(f"tp.vs_a2a.{rows}", collective="all_reduce", dtype=bf16, shape=(h,), max_rows=rows,
                            virtual_shards=v, route="a2a_fold")
        s_vt = detcomm.site(f"tp.vs_tree.{rows}", collective="all_reduce", dtype=bf16, shape=(h,), max_rows=rows,
                            virtual_shards=v, shard_fold="tree", route="gather_fold")
        s_vta = detcomm.site(f"tp.vs_tree_a2a.{rows}", collective="all_reduce", dtype=bf16, shape=(h,),
                             max_rows=rows, virtual_shards=v, shard_fold="tree", route="a2a_fold")
        s_act = detcomm.site(f"tp.full_k.act.{rows}", collective="all_gather", dtype=bf16, shape=(k // w,),
                             max_rows=rows)
        s_out = detcomm.site(f"tp.full_k.out.{rows}", collective="all_gather", dtype=bf16, shape=(h // w,),
                             max_rows=rows)

        def full_k() -> torch.Tensor:
            a = detcomm.all_gather(act, s_act).view(w, rows, k // w).permute(1, 0, 2).reshape(rows, k)
            y = detcomm.all_gather(col, s_out).view(w, rows, h // w).permute(1, 0, 2).reshape(rows, h)
            return a[:, :1] + y[:, :1]  # both gathered rows are used; the layer's GEMM is not timed

        calls = {
            "native": lambda: detcomm.all_reduce(x, s_native),
            "fold": lambda: detcomm.all_reduce(x, s_fold),
            "vs_gather": lambda: detcomm.all_reduce(partials, s_vg),
            "vs_a2a": lambda: detcomm.all_reduce(partials, s_va),
            "vs_tree": lambda: detcomm.all_reduce(partials, s_vt),
            "vs_tree_a2a": lambda: detcomm.all_reduce(partials, s_vta),
            "full_k": full_k,
        }

        samples: dict[str, list[float]] = {name: [] for name in calls}
        rounds = cfg["rounds"]
        for _ in range(rounds):
            for name, fn in calls.items():
                samples[name] += time_cpu(synced(fn, cuda=cuda), iters=max(1, cfg["iters"] // rounds), warmup=1,
                                          barrier=dist.barrier)
        stats = {name: summarize(s) for name, s in samples.items()}
        base = stats["native"]["median_us"]
        for name in LAYOUTS:
            route = {"native": "native", "fold": fold_route, "vs_gather": "gather_fold", "vs_a2a": "a2a_fold",
                     "vs_tree": "gather_fold", "vs_tree_a2a": "a2a_fold", "full_k": "native all_gather x2"}[name]
            out.append({
                "layout": name, "route": route, "rows": rows, "hidden": h, "k": k, "world_size": w,
                "virtual_shards": v if name.startswith("vs") else None, "device": str(dev), "dtype": "bf16",
                "received_bytes": received_bytes(name, rows=rows, hidden=h, k=k, w=w, v=v),
                **{q: stats[name][q] for q in ("median_us", "p10_us", "p90_us", "n")},
                "ratio_vs_native": stats[name]["median_us"] / base,
            })
    detcomm.shutdown()
    return out if rank == 0 else []


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table: one line per (W, rows), each layout's median and its ratio to native."""
    by_point: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_point.setdefault((r["world_size"], r["rows"]), {})[r["layout"]] = r
    head = ["W", "rows", *(f"{name} us (x native)" for name in LAYOUTS), "bytes in/rank: " + " / ".join(LAYOUTS)]
    table = [[w, n, *(f"{point[name]['median_us']:.0f} ({point[name]['ratio_vs_native']:.2f})" for name in LAYOUTS),
              " / ".join(_human(point[name]["received_bytes"]) for name in LAYOUTS)]
             for (w, n), point in sorted(by_point.items())]
    return format_table(head, table, markdown=True, align="l" * len(head))


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("expected positive integers")
    return vals


def build_parser(prog: str = "detcomm-bench tp-layouts") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join((__doc__ or "").split("\n\n")[1:]))
    p.add_argument("--quick", action="store_true", help=f"small CPU run: {QUICK}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one rank per GPU")
    p.add_argument("--worlds", type=_ints, help="group sizes to spawn (default: 2,4 on CPU, the GPU count on "
                   "cuda); ignored under a launcher, which fixes W")
    p.add_argument("--rows", type=_ints, help=f"row counts (default decode {DECODE_ROWS} and prefill {PREFILL_ROWS})")
    p.add_argument("--hidden", type=int, default=4096, help="output width H (default 4096)")
    p.add_argument("--k", type=int, default=4096, help="reduction width K of the layer (default 4096)")
    p.add_argument("--virtual-shards", type=int, default=8, help="V (default 8)")
    p.add_argument("--iters", type=int, default=30, help="timed calls per layout and row count (default 30)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds the calls are split into (default 3)")
    p.add_argument("--json", metavar="PATH", help="also write the rows (and the command, host, date) to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg: dict[str, Any] = {"hidden": args.hidden, "k": args.k, "iters": args.iters, "rows": DECODE_ROWS + PREFILL_ROWS,
                           "virtual_shards": args.virtual_shards, "rounds": args.rounds, "device": args.device}
    if args.quick:
        cfg.update({key: val for key, val in QUICK.items() if key != "worlds"})
    if args.rows:
        cfg["rows"] = args.rows
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    from detcomm.envelope import MULTICAST_OFF_ENV

    os.environ.update(MULTICAST_OFF_ENV)  # docs/spec.md §8, before any communicator; spawned ranks inherit it
    t0 = time.time()
    if launched:  # every rank of a detcomm-launch / torchrun group runs this; rank 0 reports
        rank, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        rows = job(rank, w, cfg)
        if rank != 0:
            return 0
        worlds: tuple[int, ...] = (w,)
    else:
        import torch

        from detcomm._spawn import LocalCluster

        if args.device == "cuda":
            if not torch.cuda.is_available():
                build_parser().error("--device cuda: no CUDA device")
            worlds = args.worlds or (torch.cuda.device_count(),)
            backend = "nccl"
        else:
            worlds = args.worlds or QUICK["worlds"]  # type: ignore[assignment]
            backend = "gloo"
        rows = []
        for w in worlds:
            with LocalCluster(w, backend=backend, pg_timeout_s=600) as cluster:
                rows += cluster.run(job, cfg, timeout_s=3600)[0]
    command = "detcomm-bench tp-layouts " + " ".join(sys.argv[1:] if argv is None else argv)
    device = rows[0]["device"] if rows else args.device
    print(f"TP layouts, collective cost per call: W={','.join(map(str, worlds))} {device}, hidden {cfg['hidden']}, "
          f"K {cfg['k']}, V={cfg['virtual_shards']}, bf16; median of {cfg['iters']} calls per point (ratio to native)")
    print(format_rows(rows))
    if device == "cpu":
        print("(CPU timings on a shared machine are noise beyond a factor of about 2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "host": platform.node(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t0)),
                       "config": cfg, "rows": rows, "median_ratio": {name: statistics.median(
                           r["ratio_vs_native"] for r in rows if r["layout"] == name) for name in LAYOUTS}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
