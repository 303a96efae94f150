"""Adversarial rows for the canonical RMSNorm tests, generated in numpy as raw bits (no detcomm involved).

Row kinds, cycled by row index: ordinary activations, huge values whose squares overflow fp32, large values that
do not, tiny values whose squares underflow to fp32 subnormals or zero, subnormal inputs, signed zeros, a NaN, an
Inf, and the order-sensitive row (one 1.0 among values whose squares are each below half an ulp of 1.0, so a
sum that meets the 1.0 early drops them and one that sums them first keeps them).
"""

from __future__ import annotations

import numpy as np

from oracle import round_fp32_bits

KINDS = ("normal", "huge", "large", "tiny", "subnormal", "zeros", "nan", "inf", "order")


def _to_bits(v: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        f32 = np.asarray(v, np.float64).astype(np.float32)
    return round_fp32_bits(f32.view(np.uint32), dtype)


def adversarial_rows(rows: int, hidden: int, dtype: str, *, seed: int, kinds: tuple[str, ...] = KINDS) -> np.ndarray:
    """[rows, hidden] raw bits of `dtype`; row i is of kind kinds[i % len(kinds)]."""
    rng = np.random.default_rng([seed, 4099])
    half = dtype == "float16"
    out = np.empty((rows, hidden), np.float64)
    for i in range(rows):
        kind = kinds[i % len(kinds)]
        sign = np.where(rng.random(hidden) < 0.5, -1.0, 1.0)
        mant = 1.0 + rng.random(hidden)
        if kind == "normal":
            v = rng.standard_normal(hidden) * 10.0 ** rng.uniform(-2, 2)
        elif kind == "huge":
            v = sign * mant * 10.0 ** rng.uniform(*((4.2, 4.8) if half else (19.5, 37.5)), hidden)
        elif kind == "large":
            v = sign * mant * 10.0 ** rng.uniform(*((1, 2.3) if half else (12, 16)), hidden)
        elif kind == "tiny":
            v = sign * mant * 10.0 ** rng.uniform(*((-7.5, -3) if half else (-30, -18)), hidden)
        elif kind == "subnormal":
            v = sign * mant * 10.0 ** rng.uniform(*((-7.7, -5) if half else (-44.5, -38.5)), hidden)
        elif kind == "zeros":
            v = sign * 0.0
        elif kind == "nan":
            v = rng.standard_normal(hidden)
            v[rng.integers(hidden)] = np.nan
        elif kind == "inf":
            v = rng.standard_normal(hidden)
            v[rng.integers(hidden)] = np.inf if rng.random() < 0.5 else -np.inf
        elif kind == "order":
            v = sign * 0.99 * 2.0**-12
            v[rng.integers(min(hidden, 64))] = 1.0
        else:
            raise ValueError(kind)
        out[i] = v
    return _to_bits(out, dtype)


def weight_bits(hidden: int, dtype: str, *, seed: int) -> np.ndarray:
    """A norm weight: values around 1 with a spread, some negative, a few zeros."""
    rng = np.random.default_rng([seed, 8191])
    v = 1.0 + 0.5 * rng.standard_normal(hidden)
    v[rng.random(hidden) < 0.01] = 0.0
    return _to_bits(v, dtype)
