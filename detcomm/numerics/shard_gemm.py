"""The TP-invariant layouts' GEMMs as one fixed-configuration Triton launch per projection (CUDA; issue 42 item 3).

Two kernels, one fixed tile configuration each (``CONFIG``: no autotune, no split-K, no stream-K):

* ``shard_partials(x, w)``: the virtual layout's partials ``out[s] = x[:, s*Kv:(s+1)*Kv] @ w[s]`` for all S = V/W
  shards a rank holds, in ONE launch whose grid is (row tiles, column tiles, shards). Program (m, n, s) computes
  its [BM, BN] tile of shard s alone: its K loop runs over k = 0, BK, 2*BK, .. < Kv in that order, each step one
  ``tl.dot`` accumulating into the fp32 accumulator (``acc = tl.dot(a, b, acc)``), masked loads giving exact zeros
  past Kv and past the real rows. An output element's arithmetic therefore depends on Kv, the tile configuration
  and its own operands only: the same bits at every S (every W dividing V) and every row count T.
* ``block_gemm(x, w, bias)``: a column-parallel projection over ALL the rank's fixed column blocks in ONE launch;
  ``w`` is [blocks, ..] and a tile never straddles two blocks (the tile width BN = min(64, next power of two of
  the block width); a block wider than BN has ceil(width / BN) tiles, the last one masked). A column's bits depend
  on K, the block width and the config, never on how many blocks the rank holds (N/W). fp32 accumulation over
  the whole K, the bias (if any) added in fp32, one rounding to the output dtype.

What the bits are. 2-byte inputs (bf16/fp16): each tl.dot step is the device's tensor-core MMA with fp32
accumulation over a BK chunk (the products of two bf16 values are exact in fp32; the MMA's internal adds are the
hardware's, not fp32_add_rn one at a time), then the chunks in K order. fp32 inputs: ``input_precision="ieee"``
(never tf32): FMA dot products, so a partial is an fp32 GEMM of the fp32 values. Either way the bits are this
kernel's, not cuBLAS's: on GPU the virtual/tree layout's bits differ from the per-shard torch.matmul of before
(docs/spec.md §9.1); CPU never runs this module (detcomm.tp keeps its per-shard torch path and its bits).

CUDA-graph capturable: one launch, no host reads, no allocation but the output. ``ShardPartials`` and
``BlockGemm`` are the autograd wrappers detcomm.rl's trainer differentiates through: forward is the kernel,
backward deterministic torch matmuls of fixed shapes (the gradients today's per-shard autograd computes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CONFIG", "shard_partials", "block_gemm", "ShardPartials", "BlockGemm", "packed", "require_triton"]

# The one tile configuration (see the module doc: a versioned constant; its values are part of the GPU bits).
# Rejected: cuBLAS strided-batched ``torch.bmm`` of the S shards (cuBLAS picks its kernel, split-K included, from the
# batch count and shape, so the bits could change with S = V/W: exactly what the layout must not depend on, and
# pinning cuBLAS's choice is not an API); Triton's autotune (it picks the config by timing, so two processes, or two
# runs, could pick different configs and different bits); one launch per shard (V/W launches, the cost issue 42
# measures). The config below was chosen for the width (T_pad 64 rows = one row tile; BK = 64: four 16-deep
# MMA steps per load; 3 stages of [64, 64] tiles fit shared memory with fp32 weights too) without a device run to tune
# it; changing it may change the GPU bits of every virtual/tree-layout model, so it is a versioned constant, not a
# knob (bench/shard_gemm.py measures it).
#
# Both launches pass ``enable_fp_fusion=False`` (Triton 3.9 defaults it on and 3.10 off: pinned, so the bits do not
# follow the triton version's default): nothing outside the dot is contracted into an FMA (the bias add stays one fp32
# add); the ieee dot itself is explicit fma.rn.f32 instructions either way (checked in the sm_90 PTX).
CONFIG: dict[str, int] = {"BM": 64, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}

_FIX = ("pip install triton (it ships with torch's CUDA wheels); the GPU virtual/tree layouts compute with its "
        "fixed-config kernels, detcomm.numerics.shard_gemm, and have no other kernel with their bits")


triton: Any = None  # imported on first use: importing detcomm never needs triton, and TRITON_INTERPRET (the
tl: Any = None      # CPU tests' interpreter) is read when triton is first imported, not when detcomm is
_tile_dot: Any = None  # both kernels' tile arithmetic, a Triton function built with them (_build)
_KERNELS: tuple[Any, Any] | None = None


def require_triton() -> Any:
    """The triton module, or ImportError naming the fix (never a silent fallback to other numerics)."""
    global triton, tl
    if triton is None:
        try:
            import triton as _triton
            import triton.language as _tl
        except ImportError as e:  # pragma: no cover - exercised where triton is missing
            raise ImportError(f"detcomm.numerics.shard_gemm needs triton on CUDA tensors: {_FIX}") from e
        triton, tl = _triton, _tl
    return triton


def _kernels() -> tuple[Any, Any]:
    """The two jitted kernels, built on first use (ImportError naming the fix where triton is missing)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build()
    return _KERNELS


def _build() -> tuple[Any, Any]:
    require_triton()  # the kernels below read the module globals triton and tl (the interpreter patches tl there)
    # do_not_specialize: Triton would otherwise compile other code for T == 1 or T % 16 == 0; one binary for
    # every row count keeps T out of the arithmetic by construction. x's row stride is K/W, the one argument of the
    # shard kernel that follows W: not specialized either, so every W runs the same binary.
    global _tile_dot  # a module global like triton and tl: the interpreter resolves a kernel's callees there

    @triton.jit
    def _tile_dot(x_base, w_base, stride_xk, stride_wk, rm, rk, rn, T, K, N, BM: tl.constexpr, BN: tl.constexpr,
                  IEEE: tl.constexpr):
        # Both kernels' arithmetic: one [BM, BN] output tile over K in the fixed order 0, BK, 2 BK, .. (BK the
        # width of rk), each step one tl.dot into the fp32 accumulator; masked loads give exact zeros past T rows,
        # K and N columns.
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, rk.shape[0]):
            a = tl.load(x_base + k0 * stride_xk, mask=(rm[:, None] < T) & (k0 + rk[None, :] < K), other=0.0)
            b = tl.load(w_base + k0 * stride_wk, mask=(k0 + rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            if IEEE:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit(do_not_specialize=["T", "stride_xm"])
    def _shard_partials_kernel(x_ptr, w_ptr, out_ptr, T, N, KV,
                               stride_xm, stride_xk, stride_ws, stride_wk, stride_wn, stride_os, stride_om,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        s = tl.program_id(2).to(tl.int64)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        x_base = x_ptr + rm[:, None] * stride_xm + (s * KV + rk[None, :]) * stride_xk
        w_base = w_ptr + s * stride_ws + rk[:, None] * stride_wk + rn[None, :] * stride_wn
        acc = _tile_dot(x_base, w_base, stride_xk, stride_wk, rm, rk, rn, T, KV, N, BM, BN, IEEE)
        out = out_ptr + s * stride_os + rm[:, None] * stride_om + rn[None, :]
        tl.store(out, acc, mask=(rm[:, None] < T) & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["T"])
    def _block_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, T, K, WIDTH, TILES,
                           stride_xm, stride_xk, stride_wb, stride_wk, stride_wn, stride_ym,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                           HAS_BIAS: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        blk = (pid_n // TILES).to(tl.int64)  # the fixed column block this tile lies in (never two)
        rc = (pid_n % TILES) * BN + tl.arange(0, BN)  # column within the block
        rm = pid_m * BM + tl.arange(0, BM)
        rk = tl.arange(0, BK)
        x_base = x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk
        w_base = w_ptr + blk * stride_wb + rk[:, None] * stride_wk + rc[None, :] * stride_wn
        acc = _tile_dot(x_base, w_base, stride_xk, stride_wk, rm, rk, rc, T, K, WIDTH, BM, BN, IEEE)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + blk * WIDTH + rc, mask=rc < WIDTH, other=0.0).to(tl.float32)[None, :]
        cols = blk * WIDTH + rc
        y = y_ptr + rm[:, None] * stride_ym + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < T) & (rc[None, :] < WIDTH))

    return _shard_partials_kernel, _block_gemm_kernel



def _ieee(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True for the fp32 (ieee dot) path, False for the 2-byte tensor-core path; ValueError otherwise."""
    if w.dtype == torch.float32:
        return True
    if w.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype:
        return False
    raise ValueError(f"shard_gemm: weights {w.dtype} with input {x.dtype}: pass fp32 weights (any float input, "
                     "widened exactly in the kernel) or 2-byte weights with an input of the same dtype")


def shard_partials(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` [T, S*Kv] (any strides), ``w`` [S, Kv, N] (one tensor: the shards' slabs) -> fp32 [S, T, N], slab s =
    ``x[:, s*Kv:(s+1)*Kv] @ w[s]`` (module doc). One launch."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[0] * w.shape[1]:
        raise ValueError(f"shard_partials: x [T, S*Kv] and w [S, Kv, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.device != w.device:
        raise ValueError(f"shard_partials: x on {x.device}, w on {w.device}")
    ieee = _ieee(x, w)
    t, (s, kv, n) = x.shape[0], w.shape
    out = torch.empty(s, t, n, dtype=torch.float32, device=x.device)
    if t == 0 or n == 0 or s == 0:
        return out
    kern, _ = _kernels()
    c = CONFIG
    grid = (-(-t // c["BM"]), -(-n // c["BN"]), s)
    kern[grid](x, w, out, t, n, kv, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
               out.stride(0), out.stride(1), BM=c["BM"], BN=c["BN"], BK=c["BK"], IEEE=ieee,
               num_warps=c["num_warps"], num_stages=c["num_stages"], enable_fp_fusion=False)
    return out


def tile_width(width: int) -> int:
    """The column tile of a block of ``width`` columns: a power of two in 16..BN (tl.dot's minimum is 16)."""
    return max(16, min(CONFIG["BN"], 1 << (width - 1).bit_length()))


def block_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, transposed: bool) -> torch.Tensor:
    """``x`` [T, K]; ``w`` the rank's fixed column blocks as one tensor: [blocks, K, width] (``transposed=False``,
    detcomm.tp's [in, out] blocks) or [blocks, width, K] (``transposed=True``, nn.Linear's [out, in] blocks);
    ``bias`` [blocks * width] or None. Returns [T, blocks * width] in x's dtype, columns in block order. One
    launch."""
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"block_gemm: x [T, K] and w [blocks, ., .], got {tuple(x.shape)} and {tuple(w.shape)}")
    nb, width, k = (w.shape[0], w.shape[1], w.shape[2]) if transposed else (w.shape[0], w.shape[2], w.shape[1])
    if x.shape[1] != k:
        raise ValueError(f"block_gemm: x has {x.shape[1]} columns, the blocks {k} rows")
    if bias is not None and tuple(bias.shape) != (nb * width,):
        raise ValueError(f"block_gemm: bias must be [{nb * width}], got {tuple(bias.shape)}")
    ieee = _ieee(x, w)
    t = x.shape[0]
    y = torch.empty(t, nb * width, dtype=x.dtype, device=x.device)
    if t == 0 or y.numel() == 0:
        return y
    _, kern = _kernels()
    c = CONFIG
    bn = tile_width(width)
    tiles = -(-width // bn)
    swk, swn = (w.stride(2), w.stride(1)) if transposed else (w.stride(1), w.stride(2))
    grid = (-(-t // c["BM"]), nb * tiles)
    b = y if bias is None else bias.contiguous()  # an unused pointer when HAS_BIAS is off
    kern[grid](x, w, b, y, t, k, width, tiles, x.stride(0), x.stride(1), w.stride(0), swk, swn, y.stride(0),
               BM=c["BM"], BN=bn, BK=c["BK"], IEEE=ieee, HAS_BIAS=bias is not None,
               num_warps=c["num_warps"], num_stages=c["num_stages"], enable_fp_fusion=False)
    return y


def packed(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One [len, *shape] tensor whose slabs ARE ``tensors`` (shared storage), so a trainer's in-place update of a
    tensor is what the kernel reads. Where they are not yet slabs of one buffer (built on the CPU and moved, or
    replaced), they are copied into a new one once and each tensor's ``.data`` rebound to its slab (the objects, a
    trainer's parameters, stay the same). Call it eagerly before a CUDA-graph capture; after that it allocates
    nothing."""
    first = tensors[0]
    shape, n = tuple(first.shape), first.numel()
    ptr, off = first.untyped_storage().data_ptr(), first.storage_offset()
    ok = all(t.is_contiguous() and tuple(t.shape) == shape and t.dtype == first.dtype and t.device == first.device
             and t.untyped_storage().data_ptr() == ptr and t.storage_offset() == off + j * n
             for j, t in enumerate(tensors))
    if ok:
        view = torch.empty(0, dtype=first.dtype, device=first.device)
        return view.set_(first.untyped_storage(), off, (len(tensors), *shape),
                         (n, *torch.empty(shape, device="meta").stride()))
    for t in tensors:
        if tuple(t.shape) != shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError("shard_gemm.packed: the slabs must share one shape, dtype and device")
    buf = torch.empty((len(tensors), *shape), dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for j, t in enumerate(tensors):
            buf[j].copy_(t)
            t.data = buf[j]
    return buf


class ShardPartials(torch.autograd.Function):
    """``ShardPartials.apply(x, *shards)`` = ``shard_partials(x, packed(shards))``; backward: for each shard s,
    grad x[:, K_s] = g[s] @ w_s^T and grad w_s = x[:, K_s]^T @ g[s] (fp32, torch matmuls of fixed shapes: the
    gradients the per-shard autograd graph computes), grad x cast back to x's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *shards: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        w = packed(shards)  # first: it may rebind the shards' storage
        ctx.save_for_backward(x, *shards)
        return shard_partials(x, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, *shards = ctx.saved_tensors
        kv = shards[0].shape[0]
        xf = x.to(torch.float32)
        gx = [torch.matmul(g[j], w.to(torch.float32).t()) for j, w in enumerate(shards)] if ctx.needs_input_grad[0] else None
        gws = [torch.matmul(xf[:, j * kv : (j + 1) * kv].t(), g[j]).to(w.dtype) if ctx.needs_input_grad[1 + j]
               else None for j, w in enumerate(shards)]
        return (None if gx is None else torch.cat(gx, dim=1).to(x.dtype), *gws)


class BlockGemm(torch.autograd.Function):
    """``BlockGemm.apply(x, transposed, n_blocks, *blocks_then_biases)`` = ``block_gemm`` of the packed blocks
    (and packed biases, if given); backward: grad x = the sum over blocks, in block order, of g_j @ w_j (the
    block's [K, width] form), grad w_j = x^T @ g_j (in w's form), grad b_j = g_j's column sums; torch ops of fixed
    shapes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, transposed: bool, nb: int,  # type: ignore[override]
                *params: torch.Tensor) -> torch.Tensor:
        blocks, biases = params[:nb], params[nb:]
        ctx.transposed, ctx.nb, ctx.has_bias = transposed, nb, bool(biases)
        w, b = packed(blocks), (packed(biases).reshape(-1) if biases else None)  # first: they may rebind storage
        ctx.save_for_backward(x, *blocks)
        return block_gemm(x, w, b, transposed=transposed)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, *blocks = ctx.saved_tensors
        kn = [w.t() if ctx.transposed else w for w in blocks]  # each block as [K, width]
        at, gx, gws, gbs = 0, None, [], []
        for w in kn:
            gj = g[:, at : at + w.shape[1]]
            at += w.shape[1]
            part = torch.matmul(gj, w.t())
            gx = part if gx is None else gx + part
            gw = torch.matmul(x.t(), gj)
            gws.append(gw.t().contiguous() if ctx.transposed else gw)
            gbs.append(gj.sum(0))
        assert gx is not None
        return (gx, None, None, *gws, *(gbs if ctx.has_bias else ()))
