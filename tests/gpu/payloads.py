"""Test payloads as raw bit patterns (numpy), and their round trip to torch tensors. Independent of detcomm."""

from __future__ import annotations

import numpy as np

BITS = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}


def random_bits(rng: np.random.Generator, world: int, shape: tuple[int, ...], dtype: str) -> list[np.ndarray]:
    """Ordinary data: normal values of mixed scale, rounded to the dtype by the oracle-independent numpy path."""
    out = []
    for _ in range(world):
        v = (rng.standard_normal(shape) * np.exp2(rng.integers(-4, 5, size=shape))).astype(np.float32)
        out.append(_narrow(v, dtype))
    return out


def _narrow(v: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return v.view(np.uint32).copy()
    if dtype == "float16":
        with np.errstate(all="ignore"):
            return v.astype(np.float16).view(np.uint16).copy()
    # bf16: truncate (any bf16 pattern is a valid input; no need to round here)
    return (v.view(np.uint32) >> 16).astype(np.uint16)


def ill_conditioned(rng: np.random.Generator, world: int, shape: tuple[int, ...], dtype: str,
                    *, specials: bool = True) -> list[np.ndarray]:
    """Magnitudes 1e-38..1e38 (dtype range permitting), cancellations across ranks, +-0, subnormals and, with
    specials, NaNs with payloads and +-Inf. The rank order of the additions matters for most elements."""
    n = int(np.prod(shape))
    bits_t = BITS[dtype]
    if dtype == "float16":
        lo, hi = -7.0, 4.8  # fp16: subnormals below 6e-5, max 65504
    else:
        lo, hi = -38.0, 38.0
    xs = []
    for _ in range(world):
        mag = 10.0 ** rng.uniform(lo, hi, n)
        sign = rng.choice([-1.0, 1.0], n)
        xs.append((mag * sign).astype(np.float64))
    # cancellations: rank 1 holds -(rank 0) plus a tiny residue on a third of the elements
    sel = rng.random(n) < 0.35
    if world >= 2:
        xs[1][sel] = -xs[0][sel] * (1.0 + rng.choice([0.0, 1e-7, -3e-7], sel.sum()))
    # large-then-small patterns: where the order decides whether the small terms survive
    sel2 = rng.random(n) < 0.2
    if world >= 3:
        big = 10.0 ** rng.uniform(max(lo + 1, hi - 8), hi - 0.5, sel2.sum())
        xs[0][sel2] = big
        xs[1][sel2] = 10.0 ** rng.uniform(lo, max(lo + 0.5, hi - 6), sel2.sum())
        xs[2][sel2] = -big
    out = []
    for r in range(world):
        with np.errstate(all="ignore"):
            f32 = xs[r].astype(np.float32)
        b = _narrow(f32, dtype)
        m = rng.random(n)
        if dtype == "float32":
            sub = rng.integers(1, 1 << 23, n, dtype=np.uint64).astype(np.uint32) | (rng.integers(0, 2, n).astype(np.uint32) << 31)
        else:
            sub = rng.integers(1, 1 << (7 if dtype == "bfloat16" else 10), n).astype(np.uint16) | (
                rng.integers(0, 2, n).astype(np.uint16) << 15)
        b = np.where(m < 0.08, sub, b)  # subnormals
        neg_zero = bits_t(0x80000000) if dtype == "float32" else bits_t(0x8000)
        b = np.where((m >= 0.08) & (m < 0.12), neg_zero, b)
        b = np.where((m >= 0.12) & (m < 0.14), bits_t(0), b)
        if specials:
            if dtype == "float32":
                nans = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x7FFFFFFF], dtype=np.uint32)
                infs = np.array([0x7F800000, 0xFF800000], dtype=np.uint32)
            elif dtype == "bfloat16":
                nans = np.array([0x7FC1, 0xFFC5, 0x7F81, 0x7FFF], dtype=np.uint16)
                infs = np.array([0x7F80, 0xFF80], dtype=np.uint16)
            else:
                nans = np.array([0x7E01, 0xFE55, 0x7C01, 0x7FFF], dtype=np.uint16)
                infs = np.array([0x7C00, 0xFC00], dtype=np.uint16)
            b = np.where((m >= 0.14) & (m < 0.15), rng.choice(nans, n), b)
            b = np.where((m >= 0.15) & (m < 0.165), rng.choice(infs, n), b)
        out.append(b.astype(bits_t).reshape(shape))
    # all-negative-zero elements: the +0.0 start must turn them into +0.0
    z = rng.random(n) < 0.02
    for r in range(world):
        flat = out[r].reshape(-1)
        flat[z] = bits_t(0x80000000) if dtype == "float32" else bits_t(0x8000)
    return out


def to_tensor(bits: np.ndarray, dtype: str, device: str):
    import torch

    signed = {np.uint32: np.int32, np.uint16: np.int16}[BITS[dtype]]
    t = torch.from_numpy(np.ascontiguousarray(bits).view(signed))
    return t.view(getattr(torch, dtype)).to(device)


def from_tensor(t) -> np.ndarray:
    import torch

    if t.dtype == torch.float32:
        return t.detach().cpu().contiguous().view(torch.int32).numpy().view(np.uint32)
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def first_mismatch(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    if bad.size == 0:
        return "equal"
    i = bad[0]
    return f"{bad.size} of {got.size} differ; first at flat {i}: got {int(got.reshape(-1)[i]):#x} want {int(want.reshape(-1)[i]):#x}"
