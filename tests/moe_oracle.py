"""Independent numpy oracle of the MoE combine (detcomm/moe.py's slot-order fold), on raw bits.

Nothing here imports detcomm or torch. Per token t::

    acc = +0.0; for j in 0..k-1 (skipping the zero expert, id -1): acc = fp32(acc + fp32(w[t,j] * y[t,j]))
    acc = fp32(acc + shared[t]) when a shared-expert output is given;  out = round(acc), canonical NaN

numpy's float32 multiply and add are each one IEEE round-to-nearest-even operation (never fused), so a
product is rounded before it is added. Rounding to bf16/fp16 is tests/oracle.py's integer rounding.
"""

from __future__ import annotations

import numpy as np

from oracle import round_fp32_bits, widen

ZERO, IDENTITY = -1, -2


def combine_oracle(expert_bits: np.ndarray, weight_bits: np.ndarray, ids: np.ndarray, token_bits: np.ndarray,
                   dtype: str, *, weight_dtype: str = "float32", shared_bits: np.ndarray | None = None) -> np.ndarray:
    """expert_bits [T, k, H] (slot j's expert output for token t, raw bits of `dtype`; ignored for ids -1/-2),
    weight_bits [T, k], ids [T, k], token_bits [T, H] (the identity expert's rows) -> out bits [T, H]."""
    T, k, H = expert_bits.shape
    acc = np.zeros((T, H), dtype=np.float32)
    w = widen(weight_bits, weight_dtype)
    with np.errstate(all="ignore"):
        for j in range(k):
            y = np.where((ids[:, j] == IDENTITY)[:, None], widen(token_bits, dtype), widen(expert_bits[:, j], dtype))
            p = (w[:, j : j + 1] * y).astype(np.float32)
            acc = np.where((ids[:, j] == ZERO)[:, None], acc, (acc + p).astype(np.float32))
        if shared_bits is not None:
            acc = (acc + widen(shared_bits, dtype)).astype(np.float32)
    return round_fp32_bits(acc.view(np.uint32), dtype)


def scale_expert_oracle(x_bits: np.ndarray, scale_bits: np.ndarray, dtype: str) -> np.ndarray:
    """The tests' exact expert: round(fp32(x) * fp32(scale)) elementwise, raw bits of `dtype`."""
    with np.errstate(all="ignore"):
        p = (widen(x_bits, dtype) * widen(scale_bits, dtype)).astype(np.float32)
    return round_fp32_bits(p.view(np.uint32), dtype)
