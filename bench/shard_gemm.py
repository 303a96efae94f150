"""Per-projection GPU time of the TP-invariant layouts' GEMMs (issue 42 item 3), CUDA events, medians, one process.

For each projection of the probe decoder at issue 42's width (hidden 2048, FFN 8192, V = 8 virtual shards, 8
column blocks, T_pad 64 rows, bf16), at W = 1 (a rank holding all V shards / all blocks: the most work per rank):

* row projections (o_proj K = 2048, down_proj K = 8192; N = 2048):
  - ``per-shard torch``: today's CUDA path (detcomm.tp before this change): x widened to fp32, V/W contiguous slices,
    one fp32 torch.matmul per shard, torch.stack;
  - ``shard kernel fp32``: detcomm.numerics.shard_gemm.shard_partials on fp32 shards (shard_weights="fp32");
  - ``shard kernel bf16``: the same on bf16 shards (shard_weights="model");
  - ``bmm fp32`` (reference only: the rejected cuBLAS strided-batched GEMM);
  - ``fold cuBLAS``: the fold layout's one bf16 GEMM [T, K] x [K, N].
* column projections (q/k/v K = N = 2048; gate/up K = 2048, N = 8192; 8 fixed blocks):
  - ``per-block torch``: one torch.matmul per block + torch.cat (today's CUDA path);
  - ``block kernel``: shard_gemm.block_gemm over all blocks, one launch;
  - ``fold cuBLAS``: one GEMM over the rank's columns.

Prints a markdown table (median us over --iters timed launches after --warmup; ratio = fold / path, the layout's
speed against the fold's) and writes --json. Keep it short: the gpu/run.sh stage "shardgemm" runs it in ~1 minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from detcomm.numerics import shard_gemm


def _time(fn: Callable[[], object], *, warmup: int, iters: int) -> float:
    """Median microseconds of one call, each call timed by its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--virtual-shards", type=int, default=8, metavar="V")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--world", type=int, default=1, help="the W whose per-rank share is timed (V/W shards, blocks/W)")
    p.add_argument("--t-pad", type=int, default=64)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", metavar="PATH")
    ns = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/shard_gemm.py times CUDA kernels: run it on a GPU machine")
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    t, v, w = ns.t_pad, ns.virtual_shards, ns.world
    rows: list[dict[str, object]] = []
    timing = {"warmup": ns.warmup, "iters": ns.iters}

    for name, k, n in (("o_proj", ns.hidden, ns.hidden), ("down_proj", ns.ffn, ns.hidden)):
        kl, s = k // w, v // w
        kv = k // v
        x = torch.randn(t, kl, generator=g).to(bf).to(dev)
        full = (torch.randn(kl, n, generator=g) / kl**0.5).to(bf)
        w_bf = full.to(dev)
        shards32 = [full[j * kv : (j + 1) * kv].to(torch.float32).contiguous().to(dev) for j in range(s)]
        p32 = shard_gemm.packed(shards32)
        p16 = p32.to(bf)

        def per_shard() -> torch.Tensor:
            xf = x.to(torch.float32)
            return torch.stack([torch.matmul(xf[:, j * kv : (j + 1) * kv].contiguous(), sw)
                                for j, sw in enumerate(shards32)])

        def bmm() -> torch.Tensor:
            return torch.bmm(x.to(torch.float32).view(t, s, kv).transpose(0, 1), p32)

        paths = {"per-shard torch": per_shard, "shard kernel fp32": lambda: shard_gemm.shard_partials(x, p32),
                 "shard kernel bf16": lambda: shard_gemm.shard_partials(x, p16), "bmm fp32": bmm,
                 "fold cuBLAS": lambda: torch.matmul(x, w_bf)}
        us = {key: _time(fn, **timing) for key, fn in paths.items()}
        ref = per_shard()
        err = {key: float((paths[key]().to(torch.float32) - ref).abs().max())  # type: ignore[union-attr]
               for key in ("shard kernel fp32", "shard kernel bf16")}
        rows.append({"projection": name, "K": k, "N": n, "us": us, "max_abs_diff_vs_per_shard": err})

    for name, k, n in (("q_proj", ns.hidden, ns.hidden), ("gate_proj", ns.hidden, ns.ffn)):
        nl, width = n // w, n // ns.blocks
        x = torch.randn(t, k, generator=g).to(bf).to(dev)
        local = (torch.randn(k, nl, generator=g) / k**0.5).to(bf).to(dev)
        blocks = [local[:, j : j + width].contiguous() for j in range(0, nl, width)]
        pb = shard_gemm.packed(blocks)
        paths = {"per-block torch": lambda: torch.cat([torch.matmul(x, b) for b in blocks], dim=1),
                 "block kernel": lambda: shard_gemm.block_gemm(x, pb, None, transposed=False),
                 "fold cuBLAS": lambda: torch.matmul(x, local)}
        us = {key: _time(fn, **timing) for key, fn in paths.items()}
        rows.append({"projection": name, "K": k, "N": n, "us": us})

    print(f"device {torch.cuda.get_device_name()}; T_pad {t}, V {v}, W {w}, blocks {ns.blocks}, bf16; "
          f"median us of {ns.iters} launches; (x) = fold cuBLAS us / path us")
    print("| projection | K x N | path | us | vs fold |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        times = r["us"]
        assert isinstance(times, dict)
        fold = times["fold cuBLAS"]
        for key, val in times.items():
            print(f"| {r['projection']} | {r['K']} x {r['N']} | {key} | {val:.1f} | {fold / val:.2f}x |")
    for r in rows:
        if "max_abs_diff_vs_per_shard" in r:
            print(f"{r['projection']}: max |kernel - per-shard torch| = {r['max_abs_diff_vs_per_shard']}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(ns), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
