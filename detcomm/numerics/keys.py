"""Order-preserving integer keys for floating-point MAX, MIN and argmax.

A float MAX/MIN is exact in any order, but the libraries disagree on the edges: NCCL's and gloo's float max
may return either zero for max(-0.0, +0.0) depending on the order the ring presents them, and NaN handling
varies (fmaxf drops NaN, std::max keeps whichever came first). Mapping each value to an int32 key that sorts
like the real numbers, with -0.0 folded onto +0.0 and every NaN onto one key that wins, makes the reduction
an integer MAX/MIN: exact, order-free, identical on every rank and batch composition, on any library.

Policy: a NaN anywhere in an element's W inputs gives the canonical NaN (detcomm.numerics.fold's NaN policy); a zero
result is +0.0. For argmax, NaN counts as the largest value (as torch.argmax does) and exact ties resolve to
the lowest global index.
"""

from __future__ import annotations

import torch

from .fold import canonical_nan

__all__ = ["to_key", "from_key", "argmax_keys", "argmax_index"]

_INT32_MIN = -(2**31)
_POS_INF_KEY = 0x7F800000
_MAX_NAN_KEY = 0x7FC00000  # the canonical NaN's own bits: above +Inf's key
_LOW32 = 0xFFFFFFFF


def to_key(x: torch.Tensor, *, op: str) -> torch.Tensor:
    """int32 keys ordered like the values of ``x``; NaN maps to the key that wins under ``op``."""
    f = x.to(torch.float32)  # exact widening
    f = torch.where(f == 0, torch.zeros((), dtype=f.dtype, device=f.device), f)  # -0.0 -> +0.0
    bits = f.view(torch.int32)
    # Negative floats: flip the magnitude bits so that a larger magnitude gives a smaller key.
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    nan_key = _MAX_NAN_KEY if op == "max" else _INT32_MIN
    return torch.where(torch.isnan(f), torch.full_like(key, nan_key), key)


def from_key(key: torch.Tensor, dtype: torch.dtype, *, op: str) -> torch.Tensor:
    """Inverse of ``to_key``; the conversion to ``dtype`` is exact (the value was one of the inputs)."""
    is_nan = key > _POS_INF_KEY if op == "max" else key == _INT32_MIN
    bits = torch.where(key >= 0, key, key ^ 0x7FFFFFFF)
    out = bits.view(torch.float32).to(dtype)
    return torch.where(is_nan, canonical_nan(dtype, key.device), out)


def argmax_keys(logits: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Per row, the int64 key (value key << 32 | ~global_index) of the shard's best element.

    The low word stores ``2**32 - 1 - index`` so that, among equal values, the lowest index has the
    largest key; an int64 MAX across ranks then picks the global argmax with lowest-index ties.
    """
    vkey = to_key(logits, op="max").to(torch.int64)
    idx = torch.arange(logits.shape[-1], dtype=torch.int64, device=logits.device) + vocab_start
    full = (vkey << 32) | (_LOW32 - idx)
    return full.amax(dim=-1)


def argmax_index(key: torch.Tensor) -> torch.Tensor:
    return _LOW32 - (key & _LOW32)
