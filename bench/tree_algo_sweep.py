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

from detcomm.envelope import MULTICAST_OFF_ENV  # torch-free: set before torch loads

os.environ.update(MULTICAST_OFF_ENV)

import torch  # noqa: E402

from detcomm.bench.timing import streams_replay_us  # noqa: E402
from detcomm.tables import format_table  # noqa: E402
from detcomm.workspace import Workspace  # noqa: E402


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
            fns = {
                "plain": lambda r: plain_b[r](xs[r], outs[r]),
                "p1": lambda r: views[r].all_reduce(xs[r], out=outs[r], algo="one_shot"),
                "p2": lambda r: views[r].all_reduce(xs[r], out=outs[r], algo="two_shot"),
                "tree": lambda r: tree_b[r](ps[r], outs[r]),
                "t1": lambda r: views[r].all_reduce_tree(ps[r], dtype=torch.bfloat16, out=outs[r], algo="one_shot"),
                "t2": lambda r: views[r].all_reduce_tree(ps[r], dtype=torch.bfloat16, out=outs[r], algo="two_shot"),
            }
            t = {k: streams_replay_us(fn, streams, calls=20, warmup=5, iters=25) for k, fn in fns.items()}
            table.append([w, n, *(f"{t[k]:.2f}" for k in ("plain", "p1", "p2", "tree", "t1", "t2")),
                          f"{t['t1'] / t['plain']:.2f}", f"{t['t2'] / t['plain']:.2f}"])
            print(f"W={w} rows {n} done", flush=True)
        for x in views:
            x.check()
    print(format_table(head, table, markdown=True, align="r" * len(head)), flush=True)


if __name__ == "__main__":
    main()
