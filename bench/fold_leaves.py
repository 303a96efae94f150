"""Throughput of the registered fold leaf against a plain copy of the same bytes on the same device.

For W inputs of n elements the fold must read W*n input elements and write n outputs; the copy moves a buffer
of half those bytes (it reads and writes each byte once), so both count the same traffic and their ratio is
the fold's fraction of the device's copy bandwidth. Medians over repeats; CUDA events on GPU, perf_counter
on CPU. Not a test: results go to docs/performance.md.

    python bench/fold_leaves.py [--device cpu|cuda] [--rows 2048] [--hidden 4096] [--dtype bfloat16] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

import detcomm  # noqa: F401 - registers every leaf this installation has
from detcomm.bench.timing import median_ms_back_to_back
from detcomm.dtypes import FLOAT_NAMES, from_name, info
from detcomm.numerics.fold import BATCH_INVARIANT, registered_leaves
from detcomm.tables import format_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(FLOAT_NAMES))
    p.add_argument("--worlds", default="2,3,4,5,6,7,8")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = from_name(args.dtype)
    leaves = [l for l in registered_leaves() if device.type in l.device_types and BATCH_INVARIANT in l.features]
    elem = info(dtype).size
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    rows = []
    print(f"fold leaves on {hw}: {args.rows}x{args.hidden} {args.dtype} per rank, median of {args.repeats}")
    for leaf in leaves:
        for w in (int(v) for v in args.worlds.split(",")):
            stacked = torch.randn(w, args.rows, args.hidden, device=device).to(dtype)
            moved = (w + 1) * args.rows * args.hidden * elem  # W inputs read + one output written
            src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            # Warm-up (kernel load, allocator), then back-to-back calls as a serving loop issues them.
            leaf.fold(stacked, dtype)
            dst.copy_(src)
            cuda = device.type == "cuda"
            t_fold = median_ms_back_to_back(lambda: leaf.fold(stacked, dtype), repeats=args.repeats, iters=10,
                                            cuda=cuda) / 1e3
            t_copy = median_ms_back_to_back(lambda: dst.copy_(src), repeats=args.repeats, iters=10, cuda=cuda) / 1e3
            fold_bw, copy_bw = moved / t_fold / 1e9, moved / t_copy / 1e9
            rows.append({"leaf": leaf.name, "W": w, "fold_s": t_fold, "fold_GBps": fold_bw, "copy_GBps": copy_bw,
                         "ratio": fold_bw / copy_bw})
    print(format_table(("leaf", "W", "fold ms", "fold GB/s", "copy GB/s", "fold/copy"),
                       [[r["leaf"], r["W"], f"{r['fold_s'] * 1e3:.2f}", f"{r['fold_GBps']:.1f}", f"{r['copy_GBps']:.1f}",
                         f"{r['ratio']:.2f}"] for r in rows], markdown=True))
    if args.out:
        Path(args.out).write_text(json.dumps({"hardware": hw, "dtype": args.dtype,
                                              "rows": args.rows, "hidden": args.hidden, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
