"""Test inputs generated in numpy, independently of detcomm.payload, as raw bits per dtype.

Every rank can regenerate every other rank's input from (seed, rank), so the oracle is computed locally from
inputs that never went through a collective.
"""

from __future__ import annotations

import numpy as np
import torch

from oracle import BITS_DTYPE, round_fp32_bits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXP = {"float32": (-38, 38), "bfloat16": (-38, 38), "float16": (-7, 4)}


def ill_bits(rows: int, width: int, dtype: str, *, seed: int, rank: int) -> np.ndarray:
    """[rows, width] raw bits: wide magnitudes, cross-rank cancellation, ±0, subnormals, one huge vs ones."""
    n = rows * width
    shared = np.random.default_rng([seed, 7919])
    own = np.random.default_rng([seed, 104729, rank])
    lo, hi = _EXP[dtype]
    kind = shared.integers(0, 10, n)
    e_shared = shared.uniform(lo, hi, n)
    e_own = own.uniform(lo, hi, n)
    sign = np.where(own.random(n) < 0.5, -1.0, 1.0)
    mant = 1.0 + own.random(n)
    v = sign * mant * 10.0**e_shared
    v = np.where(kind < 3, sign * mant * 10.0**e_own, v)
    big = 3.0e4 if dtype == "float16" else 1.0e30
    # Ranks 0 and 1 hold +big and -big, the others small values with bits below big's fp32 ulp:
    # (big - big) + s keeps s exactly, (-big + s) + big rounds it away.
    small = sign * mant * (1e-3 if dtype == "float16" else 1.0)
    v = np.where(kind == 3, np.where(rank % 2 == 0, big, -big) if rank < 2 else small, v)
    tiny = 2.0e-5 if dtype == "float16" else 3.0e-40
    v = np.where(kind == 4, sign * tiny * own.random(n), v)
    v = np.where(kind == 5, sign * 0.0, v)
    with np.errstate(all="ignore"):
        f32 = v.astype(np.float32)
    return round_fp32_bits(f32.view(np.uint32), dtype).reshape(rows, width)


def random_bits(rows: int, width: int, dtype: str, *, seed: int, rank: int) -> np.ndarray:
    """Ordinary activations: normal values with a spread of scales."""
    rng = np.random.default_rng([seed, 31337, rank])
    v = rng.standard_normal(rows * width) * 10.0 ** rng.uniform(-3, 3, rows * width)
    return round_fp32_bits(v.astype(np.float32).view(np.uint32), dtype).reshape(rows, width)


def to_torch(bits: np.ndarray, dtype: str) -> torch.Tensor:
    signed = np.int32 if dtype == "float32" else np.int16
    return torch.from_numpy(np.ascontiguousarray(bits).astype(BITS_DTYPE[dtype]).view(signed).copy()).view(DTYPES[dtype])


def to_bits(t: torch.Tensor) -> np.ndarray:
    signed = torch.int32 if t.dtype == torch.float32 else torch.int16
    unsigned = np.uint32 if t.dtype == torch.float32 else np.uint16
    return t.detach().cpu().contiguous().view(signed).numpy().view(unsigned)
