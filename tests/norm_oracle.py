"""Independent numpy oracle of the canonical residual add + RMSNorm (docs/spec.md §9).

Nothing here imports detcomm or torch. Values travel as raw bits (oracle.py's convention); bf16/fp16 rounding is
oracle.py's integer rounding. Each fp32 operation is computed differently from the code under test: exactly or
nearly in float64, then rounded once to fp32 by numpy's conversion. For +, -, *, / and sqrt of fp32 operands a
float64 result rounded to fp32 is the correctly rounded fp32 result (53 >= 2*24 + 2: double rounding is
innocuous), subnormal and overflowing results included. The summation order is written from the definition's
index arithmetic (lane = chunk mod 256, elements past H skipped), not from a reshape into padded blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from oracle import fold_oracle, round_fp32_bits, widen

LANES, CHUNK, WARP = 256, 8, 32


def _r32(x64: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(x64, dtype=np.float64).astype(np.float32)


def add32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return _r32(np.asarray(a, np.float64) + np.asarray(b, np.float64))


def mul32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return _r32(np.asarray(a, np.float64) * np.asarray(b, np.float64))  # exact in float64, one rounding


def div32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return _r32(np.asarray(a, np.float64) / np.asarray(b, np.float64))


def sqrt32(a: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return _r32(np.sqrt(np.asarray(a, np.float64)))


def eps32(eps: float) -> np.float32:
    return np.float32(eps)  # numpy's conversion of a Python float rounds to nearest even


def halving(values: list[np.ndarray]) -> np.ndarray:
    """Halving tree: while more than one value, value l becomes value l + value l+h (h = half the count)."""
    while len(values) > 1:
        h = len(values) // 2
        values = [add32(values[l], values[l + h]) for l in range(h)]
    return values[0]


def sum_squares_oracle(a: np.ndarray) -> np.ndarray:
    """S for every row of fp32 values a [rows, H] -> [rows] fp32."""
    rows, hidden = a.shape
    q = mul32(a, a)
    lane_of = (np.arange(hidden) // CHUNK) % LANES
    lanes = []
    for t in range(LANES):
        p = np.zeros(rows, np.float32)  # +0.0 start
        for i in np.flatnonzero(lane_of == t):  # the lane's elements in increasing index order
            p = add32(p, q[:, i])
        lanes.append(p)
    warps = [halving(lanes[w * WARP : (w + 1) * WARP]) for w in range(LANES // WARP)]
    return halving(warps)


def inv_rms_oracle(sum_sq: np.ndarray, hidden: int, eps: float) -> np.ndarray:
    mean = div32(sum_sq, np.float32(hidden))
    return div32(np.float32(1.0), sqrt32(add32(mean, eps32(eps))))


def rms_norm_oracle(r_bits: np.ndarray, w_bits: np.ndarray, dtype: str, w_dtype: str, eps: float) -> np.ndarray:
    """Raw bits of y for raw-bit rows r [rows, H] of `dtype` and weight bits [H] of `w_dtype`."""
    a = widen(r_bits, dtype)
    inv = inv_rms_oracle(sum_squares_oracle(a), a.shape[1], eps)
    y = mul32(mul32(a, inv[:, None]), widen(w_bits, w_dtype)[None, :])
    return round_fp32_bits(y.view(np.uint32), dtype)


def residual_add_oracle(s_bits: np.ndarray, res_bits: np.ndarray, dtype: str) -> np.ndarray:
    return round_fp32_bits(add32(widen(res_bits, dtype), widen(s_bits, dtype)).view(np.uint32), dtype)


def composition_oracle(x_bits: Sequence[np.ndarray], res_bits: np.ndarray, w_bits: np.ndarray, dtype: str,
                       w_dtype: str, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(y, r) bits of all-reduce (canonical fold of the per-rank x) + residual add + RMSNorm."""
    r = residual_add_oracle(fold_oracle(x_bits, dtype), res_bits, dtype)
    return rms_norm_oracle(r, w_bits, dtype, w_dtype, eps), r
