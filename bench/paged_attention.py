"""One layer's attention of a decode step on one GPU: detcomm's batch-invariant paged attention (one Triton launch,
detcomm.numerics.attention) against the serving engines' per-request path before issue 42 (detcomm.hf's: q_block-row
blocks against a fixed max_context cache, one eager attention per request; reproduced here, the engines now use the paged one) and against torch's SDPA on a dense
padded batch (the non-invariant peer: flash / memory-efficient kernels chosen from the shapes).

    python bench/paged_attention.py [--requests 1,64] [--context 512] [--heads 16] [--kv-heads 16] [--head-dim 128]

Prints per configuration the median time of one layer (CUDA events over back-to-back launches, medians of
repeats) and the bytes of K/V the row set reads, as GB/s against a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from detcomm.bench.timing import median_ms_back_to_back
from detcomm.numerics.attention import PagedKVCache, paged_attention


def _time_ms(fn, *, iters: int = 20) -> float:  # noqa: ANN001
    fn()  # the first call compiles the Triton kernel: not part of the time
    return median_ms_back_to_back(fn, repeats=7, iters=iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,8,64")
    p.add_argument("--context", type=int, default=512, help="every request's context (positions 0..context-1)")
    p.add_argument("--max-context", type=int, default=2048, help="the old path's fixed cache length per request")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--q-block", type=int, default=16)
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    hd, h, kvh, bs, ctx = a.head_dim, a.heads, a.kv_heads, a.block_size, a.context
    scale = 1.0 / math.sqrt(hd)
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    copy_ms = _time_ms(lambda: big.clone())
    copy_gbs = 2 * big.numel() / copy_ms / 1e6
    print(f"device copy: {copy_gbs:.0f} GB/s; bf16, heads {h}, kv heads {kvh}, head_dim {hd}, context {ctx}, "
          f"KV block {bs}; the old per-request path: q_block {a.q_block}, max_context {a.max_context}")
    print("| requests | paged (Triton, 1 launch) | paged GB/s (% of copy) | per-request eager (before issue 42) | SDPA dense |")
    print("| --- | --- | --- | --- | --- |")
    for n in (int(x) for x in a.requests.split(",")):
        nb = math.ceil(ctx / bs)
        cache = PagedKVCache.empty(layers=1, num_blocks=n * nb, block_size=bs, kv_heads=kvh, head_dim=hd, dtype=dt,
                                   device=dev)
        cache.k.normal_()
        cache.v.normal_()
        tables = torch.arange(n * nb, device=dev).view(n, nb)
        q = torch.randn(n, h, hd, dtype=dt, device=dev)
        req = torch.arange(n, device=dev)
        pos = torch.full((n,), ctx - 1, device=dev)
        paged = _time_ms(lambda: paged_attention(q, cache, 0, block_tables=tables, row_request=req, positions=pos,
                                                 scale=scale))
        kv_bytes = 2 * n * ctx * kvh * hd * 2
        # Today's path (detcomm.hf.engine._attention): per request, a q_block-row query block against the
        # fixed max_context cache with an additive mask, eager softmax attention.
        kc = torch.randn(n, kvh, a.max_context, hd, dtype=dt, device=dev)
        vc = torch.randn_like(kc)
        mask = torch.zeros(a.q_block, a.max_context, dtype=dt, device=dev)
        mask[:, ctx:] = torch.finfo(dt).min
        qp = torch.zeros(n, h, a.q_block, hd, dtype=dt, device=dev)
        rep = h // kvh

        def eager() -> None:
            for i in range(n):
                k = kc[i].repeat_interleave(rep, dim=0)
                v = vc[i].repeat_interleave(rep, dim=0)
                s = torch.matmul(qp[i], k.transpose(1, 2)) * scale + mask
                torch.matmul(torch.softmax(s.float(), dim=-1).to(dt), v)

        per_request = _time_ms(eager, iters=5)
        kd = torch.randn(n, h, ctx, hd, dtype=dt, device=dev)
        vd = torch.randn_like(kd)
        qd = q[:, :, None]
        sdpa = _time_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd))
        print(f"| {n} | {paged * 1e3:.1f} us | {kv_bytes / paged / 1e6:.0f} ({100 * kv_bytes / paged / 1e6 / copy_gbs:.0f} %) "
              f"| {per_request * 1e3:.1f} us ({per_request / paged:.1f}x) | {sdpa * 1e3:.1f} us |")


if __name__ == "__main__":
    main()
