"""Tree-order virtual-shard all-reduce vs the plain fold on the workspace, W ranks as W CUDA streams of ONE GPU.

    PYTHONPATH=. python bench/tree_streams.py [--world 2,4] [--hidden 4096] [--rows 1,8,64,2048] [--shards 8]

Each rank view of an in-process workspace captures its calls in its own CUDA graph (--calls per graph) and the W
graphs are replayed together: --warmup replays first, then the median of --iters replays, us per call. Columns:
plain = the site-bound plain fold of a bf16 [rows, H] tensor (Workspace.bind_all_reduce, the route's hot path);
tree = the site-bound tree call on this rank's fp32 [V/W, rows, H] partials (Workspace.bind_all_reduce_tree);
order = the shard-order virtual-shard kernel on the same partials (Workspace.all_reduce_virtual); fused plain /
fused tree = the fused all-reduce + residual + RMSNorm on the bf16 rows / on the tree's partials (what a tree-order
all_reduce_rmsnorm site runs on ipc_fold, docs/spec.md §9.2 "Tree sites"); composed tree = that site's composition,
the site-bound tree call then detcomm.numerics.norm.add_rms_norm (what the site ran before the fused tree kernels
served it, and what it runs where fusion is refused: fused tree/composed tree is the fusion's gain); each on the
default path of ranks sharing a GPU (no one-store kernel: plan.one_store_max_bytes), then the one-store kernels forced
on a second workspace ("-" where a launch does not fit its areas). The tree/plain columns are the goals' ratios
(docs/performance.md). --prewarm compiles every W's kernel modules in parallel first (NVRTC into the disk cache),
so the first workspace of each W does not compile them one after the other.
"""

# ruff: noqa: B023  (the per-shape closures run only inside their own loop iteration)
from __future__ import annotations

import argparse
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from detcomm.envelope import MULTICAST_OFF_ENV  # torch-free: set before torch loads

os.environ.update(MULTICAST_OFF_ENV)

import torch  # noqa: E402

from detcomm.bench.timing import streams_replay_us  # noqa: E402
from detcomm.numerics import norm  # noqa: E402
from detcomm.tables import format_table  # noqa: E402
from detcomm.workspace import Workspace, kernels  # noqa: E402


def _compile(job: tuple[int, str, str]) -> str:
    world, arch, module = job
    kernels.compile_cubin(kernels.flatten_source(), kernels.nvrtc_options(world, arch, module=module))
    return f"W={world} {module}"


def prewarm(worlds: list[int]) -> None:
    major, minor = torch.cuda.get_device_capability(0)
    jobs = [(w, f"sm_{major}{minor}", m) for w in worlds for m in kernels.MODULE_DTYPE_CODES]
    # spawn: the parent has a CUDA context, which forked children must not inherit (they only run NVRTC)
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in pool.map(_compile, jobs):
            print(f"compiled {done}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default="2,4")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="1,8,64,2048")
    ap.add_argument("--shards", type=int, default=8, help="V, the virtual shards (V/W fp32 slabs per rank)")
    ap.add_argument("--calls", type=int, default=20, help="calls per graph")
    ap.add_argument("--warmup", type=int, default=5, help="replays before timing")
    ap.add_argument("--iters", type=int, default=30, help="timed replays (median)")
    ap.add_argument("--prewarm", default="", help="compile these W's modules in parallel first, e.g. 2,4,8")
    args = ap.parse_args()
    if args.prewarm:
        prewarm([int(w) for w in args.prewarm.split(",")])
    dev = torch.device("cuda", 0)
    h, v = args.hidden, args.shards
    eps32 = norm.eps_fp32(1e-6)
    weight = (1.0 + 0.1 * torch.randn(h, device=dev)).to(torch.bfloat16)
    # The composed column runs the NVRTC norm kernel between the ranks' tree calls: load its module now. A module load
    # waits for the kernels running on the device, and inside the W-stream harness rank 0's tree kernel spins until
    # rank 1's launch, which the waiting host never issues (seen on the H200: the workspace's 30 s deadline fired).
    zeros = torch.zeros(1, h, device=dev, dtype=torch.bfloat16)
    norm.add_rms_norm(zeros, zeros, weight, eps=1e-6)
    torch.cuda.synchronize()
    rows_list = [int(r) for r in args.rows.split(",")]
    cap = max(rows_list) * h * 4
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16 rows of {h}, V={v}, graphs of "
          f"{args.calls} calls, {args.warmup} warm-up replays, median of {args.iters}", flush=True)
    head = ("W", "rows", "plain us", "tree us", "order us", "tree/plain", "order/plain", "one-store plain us",
            "one-store tree us", "one-store tree/plain", "fused plain us", "fused tree us", "fused tree/plain",
            "composed tree us", "fused tree/composed tree")
    table: list[list[object]] = []
    for w in (int(x) for x in args.world.split(",") if x):  # --world "": only --prewarm
        s = v // w
        views = Workspace.in_process(w, device=dev, capacity_bytes=cap, timeout_s=30.0)
        one_store = Workspace.in_process(w, device=dev, capacity_bytes=cap, one_store_max_bytes=1 << 20, timeout_s=30.0)
        streams = [torch.cuda.Stream(dev) for _ in range(w)]
        plain_b = [x.bind_all_reduce(torch.bfloat16, h, label="plain") for x in views]
        tree_b = [x.bind_all_reduce_tree(torch.bfloat16, h, s, label="tree") for x in views]
        for n in rows_list:
            xs = [torch.randn(n, h, device=dev).to(torch.bfloat16) for _ in range(w)]
            ps = [torch.randn(s, n, h, device=dev) for _ in range(w)]
            outs = [torch.empty(n, h, dtype=torch.bfloat16, device=dev) for _ in range(w)]
            res = [torch.randn(n, h, device=dev).to(torch.bfloat16) for _ in range(w)]
            fns = {
                "plain": lambda r: plain_b[r](xs[r], outs[r]),
                "tree": lambda r: tree_b[r](ps[r], outs[r]),
                "order": lambda r: views[r].all_reduce_virtual(ps[r], dtype=torch.bfloat16, out=outs[r]),
                "fused_plain": lambda r: views[r].all_reduce_rmsnorm(xs[r], res[r], weight, eps32, label="fp"),
                "fused_tree": lambda r: views[r].all_reduce_rmsnorm_tree(ps[r], res[r], weight, eps32, label="ft"),
                "composed_tree": lambda r: norm.add_rms_norm(tree_b[r](ps[r], outs[r]), res[r], weight, eps=1e-6),
            }
            if n * h * 2 <= one_store[0].one_store_max_bytes:
                fns["plain_one_store"] = lambda r: one_store[r].all_reduce(xs[r], out=outs[r], algo="one_store")
            if n * h * 4 <= one_store[0].one_store_max_bytes:
                fns["tree_one_store"] = lambda r: one_store[r].all_reduce_tree(ps[r], dtype=torch.bfloat16, out=outs[r],
                                                                       algo="one_store")
            times = {}
            for name, fn in fns.items():
                times[name] = streams_replay_us(fn, streams, calls=args.calls, warmup=args.warmup, iters=args.iters)
            one_store_cols = ["-", "-", "-"]
            if "tree_one_store" in times:
                one_store_cols = [f"{times['plain_one_store']:.2f}", f"{times['tree_one_store']:.2f}",
                            f"{times['tree_one_store'] / times['plain_one_store']:.2f}"]
            table.append([w, n, *(f"{times[k]:.2f}" for k in ("plain", "tree", "order")),
                          f"{times['tree'] / times['plain']:.2f}", f"{times['order'] / times['plain']:.2f}", *one_store_cols,
                          f"{times['fused_plain']:.2f}", f"{times['fused_tree']:.2f}",
                          f"{times['fused_tree'] / times['fused_plain']:.2f}", f"{times['composed_tree']:.2f}",
                          f"{times['fused_tree'] / times['composed_tree']:.2f}"])
            print(f"W={w} rows {n}: tree/plain {times['tree'] / times['plain']:.2f}", flush=True)
        for x in views + one_store:
            x.check()
    print(format_table(head, table, markdown=True, align="r" * len(head)), flush=True)


if __name__ == "__main__":
    main()
