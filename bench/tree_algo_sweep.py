"""One-shot against two-shot for the plain fold and the tree order, per launch size, on the workspace: W ranks as W
CUDA streams of ONE GPU, each rank's calls captured in its own CUDA graph and the W graphs replayed together.

    PYTHONPATH=. python bench/tree_algo_sweep.py [--world 2,4] [--rows 16,32,64,128,256,2048] [--hidden 4096]

Columns, median us per call: plain = the site-bound plain fold of bf16 [rows, H] (its automatic kernel choice),
plain 1shot / 2shot = Workspace.all_reduce forced; tree = the site-bound tree call on fp32 [V/W, rows, H] partials
(plan.tree_algo's choice), tree 1shot / 2shot = Workspace.all_reduce_tree forced; the last two columns divide the
forced tree kernels by the plain fold. The data behind plan.tree_algo's rule (docs/performance.md, "Tree-order
virtual shards on the workspace").
"""

# ruff: noqa: B023  (the per-shape closures run only inside their own loop iteration)
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from detcomm.envelope import MULTICAST_OFF_ENV  # torch-free: set before torch loads

os.environ.update(MULTICAST_OFF_ENV)

import torch  # noqa: E402

from detcomm.tables import format_table  # noqa: E402
from detcomm.workspace import Workspace  # noqa: E402


def replayed_us(w: int, fn: Callable[[int], object], streams: list[torch.cuda.Stream], *, calls: int = 20,
                warmup: int = 5, iters: int = 25) -> float:
    """Median us per call of ``fn(rank)`` captured ``calls`` times per rank, the W graphs replayed together."""
    main_s = torch.cuda.current_stream()
    for r in range(w):  # eager once, all ranks launched before any is waited on
        streams[r].wait_stream(main_s)
        with torch.cuda.stream(streams[r]):
            fn(r)
    for st in streams:
        main_s.wait_stream(st)
    torch.cuda.synchronize()
    graphs = []
    for r in range(w):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=streams[r]):
            for _ in range(calls):
                fn(r)
        graphs.append(g)
    samples = []
    for it in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main_s)
        for r in range(w):
            streams[r].wait_stream(main_s)
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        for st in streams:
            main_s.wait_stream(st)
        end.record(main_s)
        torch.cuda.synchronize()
        if it >= warmup:
            samples.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default="2,4")
    ap.add_argument("--rows", default="16,32,64,128,256,2048")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--shards", type=int, default=8, help="V, the virtual shards")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    h, v = args.hidden, args.shards
    rows_list = [int(r) for r in args.rows.split(",")]
    head = ("W", "rows", "plain", "plain 1shot", "plain 2shot", "tree", "tree 1shot", "tree 2shot",
            "tree 1shot/plain", "tree 2shot/plain")
    table: list[list[object]] = []
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16 rows of {h}, V={v}", flush=True)
    for w in (int(x) for x in args.world.split(",")):
        s = v // w
        views = Workspace.in_process(w, device=dev, capacity_bytes=max(rows_list) * h * 4, timeout_s=30.0)
        streams = [torch.cuda.Stream(dev) for _ in range(w)]
        plain_b = [x.bind_all_reduce(torch.bfloat16, h, label="plain") for x in views]
        tree_b = [x.bind_all_reduce_tree(torch.bfloat16, h, s, label="tree") for x in views]
        for n in rows_list:
            xs = [torch.randn(n, h, device=dev).to(torch.bfloat16) for _ in range(w)]
            ps = [torch.randn(s, n, h, device=dev) for _ in range(w)]
            outs = [torch.empty(n, h, dtype=torch.bfloat16, device=dev) for _ in range(w)]
            t = {
                "plain": replayed_us(w, lambda r: plain_b[r](xs[r], outs[r]), streams),
                "p1": replayed_us(w, lambda r: views[r].all_reduce(xs[r], out=outs[r], algo="one_shot"), streams),
                "p2": replayed_us(w, lambda r: views[r].all_reduce(xs[r], out=outs[r], algo="two_shot"), streams),
                "tree": replayed_us(w, lambda r: tree_b[r](ps[r], outs[r]), streams),
                "t1": replayed_us(w, lambda r: views[r].all_reduce_tree(ps[r], dtype=torch.bfloat16, out=outs[r],
                                                                        algo="one_shot"), streams),
                "t2": replayed_us(w, lambda r: views[r].all_reduce_tree(ps[r], dtype=torch.bfloat16, out=outs[r],
                                                                        algo="two_shot"), streams),
            }
            table.append([w, n, *(f"{t[k]:.2f}" for k in ("plain", "p1", "p2", "tree", "t1", "t2")),
                          f"{t['t1'] / t['plain']:.2f}", f"{t['t2'] / t['plain']:.2f}"])
            print(f"W={w} rows {n} done", flush=True)
        for x in views:
            x.check()
    print(format_table(head, table, markdown=True, align="r" * len(head)), flush=True)


if __name__ == "__main__":
    main()
