"""Fused all-reduce + residual + RMSNorm vs the unfused composition, W ranks as W CUDA streams of ONE GPU.

    PYTHONPATH=. python bench/fused_streams.py [--world 2] [--hidden 4096,8192] [--rows 1,8,64,256]

For a machine with one GPU (the multi-GPU bench is `python bench/norm.py --fused`). Each rank view of an
in-process workspace captures its calls in its own CUDA graph (--calls per graph) and the W graphs are replayed
together: --warmup replays first (clocks and caches settle), then the median of --iters replays, us per call.
Columns: fused and unfused on the default route (ranks sharing a GPU never take the one-store kernel:
plan.one_store_max_bytes), unfused = the workspace all-reduce then detcomm.numerics.norm.add_rms_norm; the two parts of unfused
alone (all_reduce; add + norm), so fused - all_reduce is the fused kernel's norm tail; and the one-store kernels
forced (a second workspace with 256 KiB one-store areas; "-" where the launch does not fit them). Bits: every fused
variant == unfused on every shape and rank, checked before timing. The fused kernel column names the paths and the
row layout that ran (plan.fused_norm_layout, recorded through detcomm.workspace.debug). --build fused_batch4 times
the fused kernels with their load batch at 4 chunks per lane (the canonical build: 2; csrc/fused_norm_row.cuh says
why), --build fused_no_wide streams the rows the canonical build gives the wide kernels.
"""

# ruff: noqa: B023  (the per-shape closures run only inside their own loop iteration)
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from detcomm.envelope import MULTICAST_OFF_ENV  # torch-free: set before torch loads

os.environ.update(MULTICAST_OFF_ENV)

import torch  # noqa: E402

from detcomm.numerics import norm  # noqa: E402
from detcomm.tables import format_table  # noqa: E402
from detcomm.workspace import debug  # noqa: E402

EPS = 1e-6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", default="4096,8192")
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--calls", type=int, default=20, help="calls per graph")
    ap.add_argument("--warmup", type=int, default=5, help="replays before timing")
    ap.add_argument("--iters", type=int, default=40, help="timed replays (median)")
    ap.add_argument("--json", type=Path, default=None,
                    help="also write the records here (bench/goals_table.py reads them: the fused goals)")
    ap.add_argument("--one-store-grid", type=int, default=None,
                    help="at most this many blocks in the forced one-store launches (Workspace one_store_grid; "
                         "default: the tiers of plan.one_store_tiers)")
    ap.add_argument("--build", default="canonical",
                    help="kernel build (detcomm.workspace.kernels.BUILD_DEFINES), e.g. fused_no_wide (rows the wide "
                         "kernels serve stream instead) or fused_batch4: the fused "
                         "kernels' load batch of 4 chunks per lane instead of 2, the same bits")
    args = ap.parse_args()
    w = args.world
    dev = torch.device("cuda", 0)
    workspace = debug.workspace_class(args.build, record=True)  # records which fused path and layout ran
    views = workspace.in_process(w, device=dev, capacity_bytes=8 << 20, timeout_s=30.0)
    one_store_views = workspace.in_process(w, device=dev, capacity_bytes=8 << 20, one_store_max_bytes=256 << 10,
                                     timeout_s=30.0, one_store_grid=args.one_store_grid) if w > 1 else None
    streams = [torch.cuda.Stream(dev) for _ in range(w)]
    main_s = torch.cuda.current_stream(dev)
    eps32 = norm.eps_fp32(EPS)
    records: list[dict] = []
    print(f"W={w} streams of one {torch.cuda.get_device_name(0)}, kernels {args.build}, one-store tiers (bytes, blocks) "
          f"{[(t.max_bytes, t.blocks) for t in one_store_views[0].one_store_tiers] if one_store_views else '-'}, bf16, graphs of {args.calls} calls, "
          f"{args.warmup} warm-up replays, median of {args.iters}")
    head = ("hidden", "rows", "fused kernel", "fused us", "unfused us", "all_reduce us", "add + norm us",
            "fused - all_reduce us", "fused/unfused", "one-store fused us", "one-store all_reduce us", "bits equal")
    table: list[list[object]] = []
    for h in (int(v) for v in args.hidden.split(",")):
        weight = (1.0 + 0.1 * torch.randn(h, device=dev)).to(torch.bfloat16)
        # Load the norm kernel before any rank spins: in one process a module load waits for the running kernels.
        norm.add_rms_norm(torch.zeros(1, h, device=dev, dtype=torch.bfloat16),
                          torch.zeros(1, h, device=dev, dtype=torch.bfloat16), weight, eps=EPS)
        torch.cuda.synchronize()
        for n in (int(v) for v in args.rows.split(",")):
            xs = [torch.randn(n, h, device=dev).to(torch.bfloat16) for _ in range(w)]
            res = [torch.randn(n, h, device=dev).to(torch.bfloat16) for _ in range(w)]
            outs = [torch.empty_like(xs[0]) for _ in range(w)]
            fns = {
                "fused": lambda r: views[r].all_reduce_rmsnorm(xs[r], res[r], weight, eps32, label="f"),
                "unfused": lambda r: norm.add_rms_norm(views[r].all_reduce(xs[r], out=outs[r], label="u"), res[r],
                                                       weight, eps=EPS),
                # the unfused composition's two parts alone: what the fused kernel's norm tail is measured against
                "all_reduce": lambda r: views[r].all_reduce(xs[r], out=outs[r], label="a"),
                "norm": lambda r: norm.add_rms_norm(outs[r], res[r], weight, eps=EPS),
            }
            if one_store_views is not None and n * h * 2 <= one_store_views[0].one_store_max_bytes:
                fns["fused_one_store"] = lambda r: one_store_views[r].all_reduce_rmsnorm(xs[r], res[r], weight, eps32,
                                                                                algo="one_store", label="fl")
                fns["all_reduce_one_store"] = lambda r: one_store_views[r].all_reduce(xs[r], out=outs[r], algo="one_store",
                                                                              label="al")

            def all_ranks(name: str) -> list:
                got = []
                for r in range(w):
                    streams[r].wait_stream(main_s)
                    with torch.cuda.stream(streams[r]):
                        got.append(fns[name](r))
                for s in streams:
                    main_s.wait_stream(s)
                torch.cuda.synchronize()
                return got

            ref = all_ranks("unfused")
            same = True
            for name in ("fused", "fused_one_store"):
                if name in fns:
                    for (y, r_), (yu, ru) in zip(all_ranks(name), ref):
                        same &= bool(torch.equal(y.view(torch.int16), yu.view(torch.int16))
                                     and torch.equal(r_.view(torch.int16), ru.view(torch.int16)))
            all_ranks("all_reduce")
            all_ranks("norm")
            if "all_reduce_one_store" in fns:
                all_ranks("all_reduce_one_store")
            debug.record(*views)
            all_ranks("fused")
            ran = views[0].variants_run or set()
            kernel = ",".join(sorted(k for c, _, k in ran if c == "all_reduce_rmsnorm"))
            times = {}
            for name in fns:
                graphs = []
                for r in range(w):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, stream=streams[r]):
                        for _ in range(args.calls):
                            fns[name](r)
                    graphs.append(g)
                samples = []
                for it in range(args.warmup + args.iters):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(main_s)
                    for r in range(w):
                        streams[r].wait_stream(main_s)
                        with torch.cuda.stream(streams[r]):
                            graphs[r].replay()
                    for s in streams:
                        main_s.wait_stream(s)
                    end.record(main_s)
                    torch.cuda.synchronize()
                    if it >= args.warmup:
                        samples.append(start.elapsed_time(end) * 1e3 / args.calls)
                samples.sort()
                times[name] = samples[len(samples) // 2]
                del graphs
            one_store = ([f"{times['fused_one_store']:.2f}", f"{times['all_reduce_one_store']:.2f}"] if "fused_one_store" in times
                   else ["-", "-"])
            table.append([h, n, kernel, *(f"{times[k]:.2f}" for k in ("fused", "unfused", "all_reduce", "norm")),
                          f"{times['fused'] - times['all_reduce']:.2f}", f"{times['fused'] / times['unfused']:.2f}",
                          *one_store, "yes" if same else "NO"])
            print(f"hidden {h} rows {n}: fused {times['fused']:.2f} us", file=sys.stderr, flush=True)  # progress
            records.append({"hidden": h, "rows": n, "world_size": w, "dtype": "bfloat16", "fused_kernel": kernel,
                            "fused_equals_unfused": same, **{k: {"median_us": v} for k, v in times.items()}})
    print(format_table(head, table, markdown=True, align="rrlrrrrrrrrl"), flush=True)
    for v in views + (one_store_views or []):
        v.check()
    if args.json is not None:
        args.json.write_text(json.dumps({"setting": "streams", "device": torch.cuda.get_device_name(0),
                                         "torch": torch.__version__, "world_size": w, "build": args.build,
                                         "records": records}, indent=1))


if __name__ == "__main__":
    main()
