"""The paged attention of attention.py as one Triton kernel launch per call (CUDA; the default there).

One program per (row, kv head): it loads the row's queries of that kv head's group, walks the row's KV blocks in
position order from the first block holding a visible key to the block holding its position, and keeps the fp32
online softmax (running max, sum, accumulator) of attention.py's contract. Every program runs the same compiled
code on its own row's data and nothing else, so a row's bits follow its position alone, whatever the grid (the
step's row count), and no key outside the row's range is loaded (masked loads give exact zeros). Its bits are its
own, not the torch implementation's (another summation order inside a block; exp is the device's); both keep the
contract, and a step uses one of them for all its rows.

Why a reduction by tl.sum and not tl.dot: tl.dot needs tiles of at least 16 x 16 and would pad a decode row's one
query group to 16 rows; per-row programs keep the launch's shape out of a row's arithmetic by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["paged_attention_triton"]


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, req_ptr, pos_ptr,
                            stride_qr, stride_qh, stride_or, stride_oh, stride_kb, stride_ks, stride_kh,
                            stride_tr, scale, window,
                            GROUP: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                            BS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    r = tl.load(req_ptr + row)
    p = tl.load(pos_ptr + row)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p - window + 1, 0)
    g = tl.arange(0, GP)
    d = tl.arange(0, HDP)
    qmask = (g < GROUP)[:, None] & (d < HD)[None, :]
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HDP], tl.float32)
    offs = tl.arange(0, BS)
    for j in range(lo // BS, p // BS + 1):
        blk = tl.load(tables_ptr + r * stride_tr + j).to(tl.int64)
        kpos = j * BS + offs
        vis = (kpos <= p) & (kpos >= lo)
        kvmask = vis[:, None] & (d < HD)[None, :]
        base = blk * stride_kb + offs[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + base, mask=kvmask, other=0.0).to(tl.float32)  # [BS, HDP]
        v = tl.load(v_ptr + base, mask=kvmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BS]
        s = tl.where(vis[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        pr = tl.exp(s - m_new[:, None])
        corr = tl.exp(m - m_new)
        l = l * corr + tl.sum(pr, axis=1)
        acc = acc * corr[:, None] + tl.sum(pr[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    o = acc / l[:, None]
    tl.store(out_ptr + row * stride_or + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=qmask)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           block_tables: torch.Tensor, row_request: torch.Tensor, positions: torch.Tensor,
                           scale: float, window: int | None) -> torch.Tensor:
    """q [rows, heads, hd]; k_cache, v_cache [num_blocks, block_size, kv_heads, hd] (one layer, last dim
    contiguous); arguments checked by attention.paged_attention. One launch."""
    rows, heads, hd = q.shape
    _, bs, kvh, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert bs & (bs - 1) == 0, "block_size must be a power of two for the kernel's arange"
    out = torch.empty_like(q)
    if rows == 0:
        return out
    group = heads // kvh
    tables = block_tables.contiguous()
    _paged_attention_kernel[(rows, kvh)](
        q, k_cache, v_cache, out, tables, row_request.contiguous(), positions.contiguous(),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        float(scale), int(window or 0),
        GROUP=group, GP=triton.next_power_of_2(group), HD=hd, HDP=triton.next_power_of_2(hd), BS=bs,
        HAS_WINDOW=window is not None)
    return out
