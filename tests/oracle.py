"""Independent exact oracle for the canonical fold (docs/spec.md section 1), in numpy only.

Nothing here imports detcomm or torch: the oracle must not share code with what it checks. Values travel as
raw bit patterns (uint16 for bf16/fp16, uint32 for fp32) so that signed zeros, subnormals and NaN payloads
are compared exactly. Rounding to bf16 and fp16 is done by integer arithmetic on the fp32 bits, not by any
library conversion.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Canonical NaN per dtype: detcomm's documented NaN policy writes every NaN result as the positive quiet NaN
# with an empty payload, whichever NaN (or Inf - Inf) produced it.
CANONICAL_NAN = {"float32": 0x7FC00000, "bfloat16": 0x7FC0, "float16": 0x7E00}
BITS_DTYPE = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}


def widen(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Exact widening of raw bits of `dtype` to float32 values."""
    bits = np.asarray(bits)
    if dtype == "float32":
        return bits.astype(np.uint32).view(np.float32)
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype == "float16":
        return _fp16_bits_to_fp32(bits.astype(np.uint16))
    raise ValueError(dtype)


def _fp16_bits_to_fp32(h: np.ndarray) -> np.ndarray:
    h = h.astype(np.uint32)
    sign = (h >> 15) & 1
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    out = np.zeros(h.shape, dtype=np.uint32)
    normal = (exp > 0) & (exp < 31)
    out[normal] = (sign[normal] << 31) | ((exp[normal] + 112) << 23) | (man[normal] << 13)
    infnan = exp == 31
    out[infnan] = (sign[infnan] << 31) | (0xFF << 23) | (man[infnan] << 13)
    sub = (exp == 0) & (man != 0)
    # subnormal fp16: man * 2^-24, exactly representable in fp32 as a normal number
    vals = man[sub].astype(np.float64) * 2.0**-24
    out[sub] = (vals.astype(np.float32).view(np.uint32)) | (sign[sub] << 31)
    zero = (exp == 0) & (man == 0)
    out[zero] = sign[zero] << 31
    return out.view(np.float32)


def round_fp32_bits(acc_bits: np.ndarray, dtype: str) -> np.ndarray:
    """Round fp32 bit patterns to `dtype` bit patterns, to nearest even, NaN canonicalized."""
    b = np.asarray(acc_bits, dtype=np.uint32)
    is_nan = ((b & 0x7F800000) == 0x7F800000) & ((b & 0x007FFFFF) != 0)
    if dtype == "float32":
        out = b.copy()
    elif dtype == "bfloat16":
        lsb = (b >> 16) & 1
        out = ((b.astype(np.uint64) + 0x7FFF + lsb) >> 16).astype(np.uint32) & 0xFFFF
    elif dtype == "float16":
        out = _fp32_bits_to_fp16_rne(b)
    else:
        raise ValueError(dtype)
    out = np.where(is_nan, CANONICAL_NAN[dtype], out)
    return out.astype(BITS_DTYPE[dtype])


def _fp32_bits_to_fp16_rne(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    sign = (b >> 31) & 1
    exp = (b >> 23) & 0xFF
    man = b & 0x7FFFFF
    out = np.zeros(b.shape, dtype=np.int64)
    # Inf (NaN is overwritten by the caller)
    out = np.where(exp == 0xFF, 0x7C00, out)
    # finite: value = 1.man * 2^(exp-127) (or 0.man * 2^-126 for fp32 subnormals)
    finite = exp != 0xFF
    e = exp - 127
    full = np.where(exp == 0, man, man | 0x800000)  # 24-bit significand, value = full * 2^(e-23)
    e_eff = np.where(exp == 0, -126, e)
    # fp16 normal if e_eff >= -14: keep 11 bits of significand; else subnormal: unit 2^-24
    # number of bits to drop so that the result unit is 2^(e_eff-10) (normal) or 2^-24 (subnormal)
    unit_exp = np.maximum(e_eff - 10, -24)
    shift = unit_exp - (e_eff - 23)  # >= 13
    shift = np.clip(shift, 0, 62)
    q = full >> shift
    rem = full - (q << shift)
    half = np.where(shift > 0, np.int64(1) << np.maximum(shift - 1, 0), 0)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1) & (shift > 0))
    q = q + round_up.astype(np.int64)
    # q * 2^unit_exp; encode
    # normal: unit_exp = e_eff - 10 >= -24 ... handle carry into next binade
    normal_path = e_eff - 10 >= -24
    # For the normal path q is in [2^10, 2^11] (2^11 after a carry)
    qe = np.where(normal_path & (q >= 2048), q >> 1, q)
    ee = np.where(normal_path & (q >= 2048), e_eff + 1, e_eff)
    enc_normal = ((ee + 15) << 10) | (qe & 0x3FF)
    enc_normal = np.where(ee + 15 >= 31, 0x7C00, enc_normal)  # overflow to Inf
    # subnormal path: q counts units of 2^-24; q == 1024 means the smallest normal (encoding 0x400) naturally
    enc_sub = q
    enc = np.where(normal_path, enc_normal, enc_sub)
    enc = np.where(full == 0, 0, enc)
    out = np.where(finite, enc, out)
    return ((sign << 15) | out).astype(np.uint32)


def fold_oracle(inputs: Sequence[np.ndarray], dtype: str) -> np.ndarray:
    """The canonical fold of raw-bit inputs [rank][...] -> raw bits of `dtype`.

    acc = +0.0; for r in 0..W-1: acc = fp32(acc + widen(x_r)); out = round(acc).
    numpy's float32 add is one IEEE round-to-nearest-even addition with no FMA and no flush to zero.
    """
    acc = np.zeros(np.asarray(inputs[0]).shape, dtype=np.float32)
    with np.errstate(all="ignore"):
        for x in inputs:
            acc = (acc + widen(x, dtype)).astype(np.float32)
    return round_fp32_bits(acc.view(np.uint32), dtype)


def avg_oracle(inputs: Sequence[np.ndarray], dtype: str) -> np.ndarray:
    """op="avg": the fold's fp32 accumulator (unrounded), one IEEE fp32 division by W, one rounding to `dtype`."""
    acc = np.zeros(np.asarray(inputs[0]).shape, dtype=np.float32)
    with np.errstate(all="ignore"):
        for x in inputs:
            acc = (acc + widen(x, dtype)).astype(np.float32)
        q = (acc / np.float32(len(inputs))).astype(np.float32)
    return round_fp32_bits(q.view(np.uint32), dtype)


def ordered_key_extreme_oracle(inputs: Sequence[np.ndarray], dtype: str, op: str) -> np.ndarray:
    """MAX/MIN under detcomm's policy: any NaN -> canonical NaN; -0.0 and +0.0 compare equal and the
    result zero is +0.0; otherwise the IEEE maximum/minimum. Returns raw bits of `dtype`."""
    vals = np.stack([widen(x, dtype).astype(np.float64) for x in inputs])
    nan = np.isnan(vals).any(axis=0)
    with np.errstate(all="ignore"):
        red = vals.max(axis=0) if op == "max" else vals.min(axis=0)
    red = np.where(red == 0.0, 0.0, red)  # canonical +0.0
    out32 = red.astype(np.float32).view(np.uint32)  # exact: red is one of the inputs
    out = round_fp32_bits(out32, dtype)
    return np.where(nan, CANONICAL_NAN[dtype], out).astype(BITS_DTYPE[dtype])


def _self_test() -> None:
    # bf16: 1 + 2^-8 rounds to even (1.0); 1 + 3*2^-9 rounds up
    one = np.float32(1.0).view(np.uint32)
    assert round_fp32_bits(np.array([one + (1 << 15)], np.uint32), "bfloat16")[0] == 0x3F80
    assert round_fp32_bits(np.array([one + (3 << 14)], np.uint32), "bfloat16")[0] == 0x3F81
    # fp16 agrees with numpy's own conversion on a sweep (numpy is an independent implementation)
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200000, dtype=np.uint64).astype(np.uint32)
    f = bits.view(np.float32)
    ok = ~np.isnan(f)
    with np.errstate(all="ignore"):
        ref = f[ok].astype(np.float16).view(np.uint16)
    got = _fp32_bits_to_fp16_rne(bits[ok]).astype(np.uint16)
    assert np.array_equal(ref, got), int((ref != got).sum())
    # targeted sweeps through fp16's subnormal, normal and overflow ranges
    for scale in (1e-8, 1e-7, 6e-5, 1.0, 1000.0, 65504.0, 70000.0):
        f = (rng.standard_normal(100000) * scale).astype(np.float32)
        with np.errstate(all="ignore"):
            ref = f.astype(np.float16).view(np.uint16)
        got = _fp32_bits_to_fp16_rne(f.view(np.uint32)).astype(np.uint16)
        assert np.array_equal(ref, got), (scale, int((ref != got).sum()))
    # every fp16 bit pattern widens exactly
    h = np.arange(65536, dtype=np.uint16)
    ref32 = h.view(np.float16).astype(np.float32)
    ok = ~np.isnan(ref32)
    assert np.array_equal(widen(h, "float16")[ok].view(np.uint32), ref32[ok].view(np.uint32))


if __name__ == "__main__":
    _self_test()
    print("oracle self-test ok")
