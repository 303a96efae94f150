"""The canonical residual add + RMSNorm (docs/spec.md §9), and what the numerics allow of fusing its composition with
the canonical all-reduce (``fusion_refusal``; the collective itself is ``detcomm.all_reduce_residual_rmsnorm``).

For one row r of H elements (dtype bf16, fp16 or fp32) and a weight w of H elements (any of those dtypes)::

    a_i = fp32(r_i);  q_i = fp32(a_i * a_i)
    lane t = 0..255 owns the 8-element chunks c = t, t+256, t+512, ... (elements 8c .. 8c+7, those < H);
        p_t = +0.0, then p_t = fp32(p_t + q_i) over its elements in increasing index order
    S = halving tree over each warp's 32 lanes (h = 16, 8, 4, 2, 1: v_l = v_l + v_{l+h}), then over the 8 warp
        results (h = 4, 2, 1)
    inv_rms = fp32(1 / fp32(sqrt(fp32(fp32(S / H) + fp32(eps)))))     # each step correctly rounded
    y_i = round_dtype(fp32(fp32(a_i * inv_rms) * fp32(w_i)))             # canonical NaN

Every step is one IEEE fp32 operation rounded to nearest even: no FMA contraction, no flush-to-zero, no
approximate rsqrt. The order depends only on H, never on the row count, the row's offset, the batch or W, so a
row's bits are the same whatever it travels with. The fixed geometry (256 lanes of 8-element chunks, warps of 32)
is what one 256-thread CUDA block per row computes with 16-byte loads and a shuffle tree (csrc/rms_norm.cu).

Two implementations give those bits: torch elementwise ops arranged in that order (any device; the sums are
explicit adds of slices, so no torch reduction kernel picks an order), and the NVRTC kernel (CUDA devices where
cupy is installed). ``rms_norm`` takes the kernel when it can; tests hold both to an independent numpy oracle.

The residual add: r = round_dtype(fp32(residual) + fp32(s)), s the all-reduced (already rounded) sum.
"""

from __future__ import annotations

import logging
import math
from numbers import Real
from typing import TYPE_CHECKING

import torch

from ..envelope import Resolved
from . import norm_cuda
from .fold import BATCH_INVARIANT, FLOAT_DTYPES, canonicalize_nan, divide_exactly

if TYPE_CHECKING:
    from ..sites import Site

__all__ = [
    "LANES",
    "CHUNK",
    "WARP",
    "MAX_HIDDEN",
    "eps_fp32",
    "sum_of_squares",
    "sqrt_rn",
    "inv_rms",
    "rms_norm",
    "rms_norm_torch",
    "add_rms_norm",
    "add_rms_norm_torch",
    "check_residual",
    "FUSED_KERNEL_FEATURES",
    "fusion_refusal",
]

log = logging.getLogger("detcomm.numerics.norm")

LANES = 256
CHUNK = 8
WARP = 32
# fp32(H) must be exact for S / H to be the definition's one rounding.
MAX_HIDDEN = 1 << 24


def eps_fp32(eps: float) -> float:
    """``eps`` rounded to fp32 (nearest even): the value every implementation adds. Refuses what is not a finite
    non-negative real number, or what fp32 cannot hold."""
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    value = float(eps)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    e32 = torch.tensor(value, dtype=torch.float32).item()
    if math.isinf(e32):
        raise ValueError(f"eps {eps!r} overflows fp32")
    return e32


def _check(name: str, r: torch.Tensor, weight: torch.Tensor) -> int:
    for what, t in (("input", r), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: {what} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {what} is not contiguous; pass {what}.contiguous()")
    if weight.dim() != 1:
        raise ValueError(f"{name}: weight must be 1-D [hidden], got shape {tuple(weight.shape)}")
    hidden = weight.shape[0]
    if r.dim() < 1 or r.shape[-1] != hidden:
        raise ValueError(f"{name}: the input's last dimension must equal the weight's length {hidden}, "
                         f"got shape {tuple(r.shape)}")
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"{name}: hidden size must be in 1..{MAX_HIDDEN}, got {hidden}")
    if r.device != weight.device:
        raise ValueError(f"{name}: input on {r.device} but weight on {weight.device}; move the weight")
    return hidden


def sum_of_squares(a: torch.Tensor) -> torch.Tensor:
    """S of every row of fp32 ``a`` [rows, H] in the definition's order (module docstring); returns [rows] fp32.

    The squares are padded with +0.0 to whole 8-element chunks: adding +0.0 to a partial that is >= +0.0 or NaN
    (the only values a sum of squares takes) leaves it unchanged, so the padding is the definition's "elements
    < H" exactly. Lanes a pass does not reach keep their partial as it is."""
    assert a.dtype == torch.float32 and a.dim() == 2
    rows, hidden = a.shape
    chunks = -(-hidden // CHUNK)
    q = torch.mul(a, a)
    if chunks * CHUNK != hidden:
        q = torch.nn.functional.pad(q, (0, chunks * CHUNK - hidden))
    q = q.view(rows, chunks, CHUNK)  # chunk c = 256*k + t holds elements 8c .. 8c+7
    p = torch.zeros(rows, LANES, dtype=torch.float32, device=a.device)  # the +0.0 start of every lane
    for first in range(0, chunks, LANES):  # pass k = first / 256
        n = min(LANES, chunks - first)
        for j in range(CHUNK):
            p[:, :n].add_(q[:, first : first + n, j])
    v = p.view(rows, LANES // WARP, WARP)
    h = WARP // 2
    while h >= 1:  # halving tree inside each warp
        v = v[..., :h] + v[..., h : 2 * h]
        h //= 2
    u = v[..., 0]
    h = LANES // WARP // 2
    while h >= 1:  # halving tree over the warp results
        u = u[:, :h] + u[:, h : 2 * h]
        h //= 2
    return u[:, 0].contiguous()


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root of fp32 ``v``, whatever the accuracy of torch's sqrt.

    torch.sqrt is not correctly rounded everywhere: on CPUs with AVX-512 its vectorized fp32 and fp64 kernels are
    off by an ulp on about 0.5 % of inputs (tests/test_norm.py measures it). So: a guess from the fp64 root rounded to
    fp32 (within one fp32 ulp of the true root for any fp64 sqrt that is off by a few fp64 ulps), then one exact
    correction step. y is the rounded root iff m_lo^2 < v < m_hi^2, m_lo and m_hi the midpoints between y and its
    fp32 neighbours: the midpoints have 25 significant bits, so they and their squares (50 bits) are exact in
    fp64, and v never equals one of those squares (an odd 25-bit integer squared has more bits than v), so the
    comparisons decide exactly. Zero, Inf and NaN pass through (the guess is exact there)."""
    assert v.dtype == torch.float32
    y = torch.sqrt(v.to(torch.float64)).to(torch.float32)
    down = torch.nextafter(y, torch.full_like(y, -math.inf))
    up = torch.nextafter(y, torch.full_like(y, math.inf))
    v64, y64 = v.to(torch.float64), y.to(torch.float64)
    m_lo = torch.mul(torch.add(y64, down.to(torch.float64)), 0.5)
    m_hi = torch.mul(torch.add(y64, up.to(torch.float64)), 0.5)
    fix = torch.isfinite(v) & (v > 0)
    y = torch.where(fix & (v64 < m_lo * m_lo), down, y)
    return torch.where(fix & (v64 > m_hi * m_hi), up, y)


def inv_rms(sum_sq: torch.Tensor, hidden: int, eps32: float) -> torch.Tensor:
    """1 / sqrt(S / H + eps) with every step one correctly rounded fp32 operation.

    Both operands of each division are full tensors (fold.divide_exactly): torch turns a division by a scalar into
    a multiplication by its reciprocal on some devices and dtypes, which is a different rounding."""
    assert sum_sq.dtype == torch.float32
    mean = divide_exactly(sum_sq, hidden)
    var = torch.add(mean, torch.full_like(mean, eps32))
    return torch.div(torch.ones_like(var), sqrt_rn(var))


def rms_norm_torch(r: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """The canonical RMSNorm with torch elementwise ops (any device); the same bits as the kernel."""
    hidden = _check("rms_norm", r, weight)
    eps32 = eps_fp32(eps)
    a = r.reshape(-1, hidden).to(torch.float32)
    inv = inv_rms(sum_of_squares(a), hidden, eps32)
    y = torch.mul(torch.mul(a, inv[:, None]), weight.to(torch.float32)[None, :])
    return canonicalize_nan(y.to(r.dtype)).view(r.shape)


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and norm_cuda.available()


def rms_norm(r: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """The canonical RMSNorm of docs/spec.md §9 over the last dimension of ``r``; not collective.

    ``weight``: [H] of any float dtype. Returns a new tensor of ``r``'s dtype and shape. Each row's bits depend
    only on that row, the weight and eps (batch-invariant), and are the same on the CPU and on a GPU.
    """
    hidden = _check("rms_norm", r, weight)
    eps32 = eps_fp32(eps)
    if not _use_kernel(r):
        return rms_norm_torch(r, weight, eps=eps)
    return norm_cuda.rms_norm_cuda(r.view(-1, hidden), weight, eps32).view(r.shape)


def _check_add(name: str, s: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> int:
    hidden = _check(name, s, weight)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{name}: residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.dtype != s.dtype or residual.shape != s.shape or residual.device != s.device:
        raise ValueError(f"{name}: residual must match the input's dtype, shape and device: got "
                         f"{residual.dtype} {tuple(residual.shape)} on {residual.device} vs "
                         f"{s.dtype} {tuple(s.shape)} on {s.device}")
    if not residual.is_contiguous():
        raise ValueError(f"{name}: residual is not contiguous; pass residual.contiguous()")
    return hidden


def check_residual(name: str, residual: object, weight: object, *, dtype: torch.dtype, shape: tuple[int, ...],
                   device: torch.device) -> int:
    """The composition's arguments where the caller's x is not the sum s: on a virtual-shard site x is this rank's
    fp32 partials [V/W, rows, *shape] and s, their all-reduce, is [rows, *shape] of the site's ``dtype``. The
    residual must be s's dtype, shape (``shape``: rows first) and ``device``; the weight 1-D, its length the rows'
    last dimension. Returns H. Raises before any communication."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{name}: residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.dtype != dtype or tuple(residual.shape) != tuple(shape) or residual.device != device:
        raise ValueError(f"{name}: residual must be the rows of the all-reduced sum in the site's dtype, "
                         f"{str(dtype).replace('torch.', '')} {list(shape)} on {device} (x holds this rank's fp32 "
                         f"partials of those rows), got {str(residual.dtype).replace('torch.', '')} "
                         f"{list(residual.shape)} on {residual.device}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name}: weight must be a torch.Tensor, got {type(weight).__name__}")
    return _check(name, residual, weight)


def add_rms_norm_torch(s: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r): r = round(fp32(residual) + fp32(s)), y = the canonical RMSNorm of r; torch ops, any device."""
    _check_add("add_rms_norm", s, residual, weight)
    r = canonicalize_nan(torch.add(residual.to(torch.float32), s.to(torch.float32)).to(s.dtype))
    return rms_norm_torch(r, weight, eps=eps), r


def add_rms_norm(s: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical residual add then RMSNorm of ``s`` (an already reduced sum); not collective.

    Returns ``(y, r)`` with r = round(fp32(residual) + fp32(s)) (the next layer's residual) and y = rms_norm(r).
    On a CUDA device with cupy both come from one kernel pass; the bits are those of the torch composition.
    """
    hidden = _check_add("add_rms_norm", s, residual, weight)
    eps32 = eps_fp32(eps)
    if not _use_kernel(s):
        return add_rms_norm_torch(s, residual, weight, eps=eps)
    y, r = norm_cuda.add_rms_norm_cuda(s.view(-1, hidden), residual.view(-1, hidden), weight, eps32)
    return y.view(s.shape), r.view(s.shape)


# What the fused workspace kernel (csrc/fused_rmsnorm.cu) guarantees: the composition's bits for every row,
# whatever the batch (docs/spec.md §9.2); the self-checks prove it on the group before a site uses it.
FUSED_KERNEL_FEATURES: frozenset[str] = frozenset({BATCH_INVARIANT})


def fusion_refusal(resolved: Resolved, site: Site, *,
                   features: frozenset[str] = FUSED_KERNEL_FEATURES) -> str | None:
    """What the numerics allow: why ``all_reduce_residual_rmsnorm`` at ``site`` may not take a fused kernel with
    ``features`` under ``resolved`` (the envelope's switches, the kernel's features, the rows the definition
    takes); None when it may. The rows a route's fused kernels hold are that route's own rule
    (detcomm.route.fusion_refusal asks both)."""
    if not resolved.switches.batch_invariant_fusion:
        why = ("layer_boundary_norm='unfused'" if resolved.switches.layer_boundary_norm == "unfused"
               else "batch_invariant_fusion=False")
        return f"fusion off ({why})"
    if resolved.bitwise and BATCH_INVARIANT not in features:
        return f"numerics={resolved.numerics!r} fuses only kernels with the {BATCH_INVARIANT!r} feature"
    if len(site.shape) != 1:
        return f"the fused kernel takes rows of one dimension, the site's are {list(site.shape)}"
    if not 1 <= site.shape[0] <= MAX_HIDDEN:
        return f"hidden size {site.shape[0]} outside 1..{MAX_HIDDEN}"
    return None
