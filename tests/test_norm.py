"""The canonical RMSNorm and residual add (docs/spec.md §9) on the CPU, bit for bit against the numpy oracle
(tests/norm_oracle.py), with negative controls: torch's own rms_norm and sums of squares in other orders must be
caught differing on the adversarial rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import norm_oracle
from datagen import DTYPES, random_bits, to_bits, to_torch
from detcomm.numerics import norm
from norm_rows import KINDS, adversarial_rows, weight_bits
from oracle import round_fp32_bits, widen

HIDDEN = [1, 7, 8, 9, 100, 2047, 2048, 2049, 4096, 4104]


def _w_dtypes(dtype: str) -> list[str]:
    return sorted({dtype, "float32"})


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_rms_norm_equals_oracle(dtype: str, hidden: int) -> None:
    rows = 2 * len(KINDS)
    r = adversarial_rows(rows, hidden, dtype, seed=hidden)
    for w_dtype in _w_dtypes(dtype):
        w = weight_bits(hidden, w_dtype, seed=hidden + 1)
        for eps in (1e-6, 1e-5):
            got = to_bits(norm.rms_norm(to_torch(r, dtype), to_torch(w, w_dtype), eps=eps))
            expected = norm_oracle.rms_norm_oracle(r, w, dtype, w_dtype, eps)
            assert np.array_equal(got, expected), (w_dtype, eps, np.flatnonzero((got != expected).any(axis=1)))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_add_rms_norm_equals_oracle(dtype: str) -> None:
    hidden = 2049
    s = adversarial_rows(len(KINDS), hidden, dtype, seed=3)
    res = random_bits(len(KINDS), hidden, dtype, seed=4, rank=0)
    w = weight_bits(hidden, dtype, seed=5)
    y, r = norm.add_rms_norm(to_torch(s, dtype), to_torch(res, dtype), to_torch(w, dtype), eps=1e-6)
    r_exp = norm_oracle.residual_add_oracle(s, res, dtype)
    assert np.array_equal(to_bits(r), r_exp)
    assert np.array_equal(to_bits(y), norm_oracle.rms_norm_oracle(r_exp, w, dtype, dtype, 1e-6))


def test_zero_row_with_zero_eps_is_canonical_nan() -> None:
    # S = 0, eps = 0: 1/sqrt(0) = Inf and 0 * Inf = NaN, written as the canonical NaN.
    y = norm.rms_norm(torch.zeros(1, 16, dtype=torch.bfloat16), torch.ones(16, dtype=torch.bfloat16), eps=0.0)
    assert (to_bits(y) == 0x7FC0).all()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_row_alone_equals_row_in_any_batch(dtype: str) -> None:
    hidden = 2049
    base = adversarial_rows(len(KINDS), hidden, dtype, seed=8)
    w = to_torch(weight_bits(hidden, dtype, seed=9), dtype)
    alone = np.concatenate([to_bits(norm.rms_norm(to_torch(base[i : i + 1], dtype), w, eps=1e-6))
                            for i in range(len(base))])
    assert np.array_equal(alone, norm_oracle.rms_norm_oracle(base, to_bits(w), dtype, dtype, 1e-6))
    for total, off in ((len(base), 0), (len(base) + 1, 1), (64, 17), (257, 200)):
        batch = random_bits(total, hidden, dtype, seed=total, rank=0).copy()
        batch[off : off + len(base)] = base
        got = to_bits(norm.rms_norm(to_torch(batch, dtype), w, eps=1e-6))[off : off + len(base)]
        assert np.array_equal(got, alone), (total, off)


def test_inv_rms_is_correctly_rounded() -> None:
    """torch's fp32 division and sqrt on this CPU, as used by norm.inv_rms, against the float64 oracle on sums of
    squares over the whole non-negative fp32 range (subnormals, zero, Inf, NaN included)."""
    rng = np.random.default_rng(12)
    bits = rng.integers(0, 0x7F800000, 400_000, dtype=np.uint64).astype(np.uint32)
    bits[:4] = [0, 1, 0x7F800000, 0x7FC00000]
    s = bits.view(np.float32)
    for hidden in (1, 3, 4096, 5000, 1 << 24):
        for eps in (0.0, 1e-6, 1e-5, 3e-41):
            got = norm.inv_rms(torch.from_numpy(s.copy()), hidden, norm.eps_fp32(eps)).numpy()
            expected = norm_oracle.inv_rms_oracle(s, hidden, eps)
            ok = np.isnan(expected) & np.isnan(got) | (got.view(np.uint32) == expected.view(np.uint32))
            assert ok.all(), (hidden, eps, int((~ok).sum()))


def test_sum_of_squares_equals_oracle() -> None:
    for hidden in (1, 9, 2048, 2049, 6000):
        a = widen(adversarial_rows(2 * len(KINDS), hidden, "float32", seed=hidden + 40), "float32")
        got = norm.sum_of_squares(torch.from_numpy(a.copy())).numpy()
        expected = norm_oracle.sum_squares_oracle(a)
        same = (got.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(got) & np.isnan(expected))
        assert same.all(), hidden


def test_oracle_arithmetic_agrees_with_numpy_fp32() -> None:
    """The oracle's float64-then-round operations equal numpy's own fp32 operations (two independent IEEE
    implementations) on random bit patterns, subnormals and overflow included."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    b = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        pairs = ((norm_oracle.add32(a, b), a + b), (norm_oracle.mul32(a, b), a * b),
                 (norm_oracle.div32(a, b), a / b), (norm_oracle.sqrt32(np.abs(a)), np.sqrt(np.abs(a))))
    for got, ref in pairs:
        ok = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
        assert ok.all()


# --- negative controls: other arithmetic must be caught ------------------------------------------------------
def _y_with_sum(a: np.ndarray, w: np.ndarray, dtype: str, sum_sq: np.ndarray) -> np.ndarray:
    inv = norm_oracle.inv_rms_oracle(sum_sq, a.shape[1], 1e-6)
    y = norm_oracle.mul32(norm_oracle.mul32(a, inv[:, None]), w[None, :])
    return round_fp32_bits(y.view(np.uint32), dtype)


def _other_orders(a: np.ndarray) -> dict[str, np.ndarray]:
    q = norm_oracle.mul32(a, a)
    seq = np.zeros(a.shape[0], np.float32)
    for i in range(a.shape[1]):
        seq = norm_oracle.add32(seq, q[:, i])
    with np.errstate(all="ignore"):
        numpy_pairwise = q.sum(axis=1, dtype=np.float32)
    # the canonical lanes, combined by an adjacent-pairs tree instead of the halving tree
    lane_of = (np.arange(a.shape[1]) // 8) % 256
    lanes = []
    for t in range(256):
        p = np.zeros(a.shape[0], np.float32)
        for i in np.flatnonzero(lane_of == t):
            p = norm_oracle.add32(p, q[:, i])
        lanes.append(p)
    while len(lanes) > 1:
        lanes = [norm_oracle.add32(lanes[2 * l], lanes[2 * l + 1]) for l in range(len(lanes) // 2)]
    return {"sequential": seq, "numpy_pairwise": numpy_pairwise, "adjacent_tree": lanes[0]}


def test_negative_control_other_sum_orders_are_caught() -> None:
    """Sequential, numpy's pairwise and an adjacent-pairs tree over the same lanes must each change some y.

    fp32 rows: the sum stage is the same fp32 code for every dtype, and only an fp32 output resolves the ulp-level
    differences two trees over positive terms can make (positive sums differ by a few ulps whatever the order)."""
    hidden = 2048
    r = np.concatenate([adversarial_rows(128, hidden, "float32", seed=23, kinds=("normal",)),
                        adversarial_rows(2 * len(KINDS), hidden, "float32", seed=24)])
    w = weight_bits(hidden, "float32", seed=22)
    got = to_bits(norm.rms_norm(to_torch(r, "float32"), to_torch(w, "float32"), eps=1e-6))
    assert np.array_equal(got, norm_oracle.rms_norm_oracle(r, w, "float32", "float32", 1e-6))
    a, wf = widen(r, "float32"), widen(w, "float32")
    for name, other in _other_orders(a).items():
        assert not np.array_equal(_y_with_sum(a, wf, "float32", other), got), f"{name} order not caught"


def test_negative_control_sequential_sum_is_caught_in_bf16() -> None:
    """The order-sensitive rows move bf16 outputs: a sequential sum drops thousands of squares the lanes keep."""
    hidden = 4096
    r = adversarial_rows(4, hidden, "bfloat16", seed=25, kinds=("order",))
    w = weight_bits(hidden, "bfloat16", seed=26)
    got = to_bits(norm.rms_norm(to_torch(r, "bfloat16"), to_torch(w, "bfloat16"), eps=1e-6))
    assert np.array_equal(got, norm_oracle.rms_norm_oracle(r, w, "bfloat16", "bfloat16", 1e-6))
    a, wf = widen(r, "bfloat16"), widen(w, "bfloat16")
    other = _y_with_sum(a, wf, "bfloat16", _other_orders(a)["sequential"])
    assert (other != got).any(axis=1).all()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_negative_control_torch_rms_norm_is_caught(dtype: str) -> None:
    hidden = 4096
    r = to_torch(adversarial_rows(2 * len(KINDS), hidden, dtype, seed=31), dtype)
    w = to_torch(weight_bits(hidden, dtype, seed=32), dtype)
    ours = to_bits(norm.rms_norm(r, w, eps=1e-6))
    theirs = to_bits(torch.nn.functional.rms_norm(r, (hidden,), w, eps=1e-6))
    assert not np.array_equal(ours, theirs)


def test_negative_control_fused_multiply_add_is_caught() -> None:
    """y = a * (inv * w) (another association of the same two products) differs from (a * inv) * w."""
    hidden = 4096
    r = adversarial_rows(2 * len(KINDS), hidden, "float32", seed=41)
    w = weight_bits(hidden, "float32", seed=42)
    a, wf = widen(r, "float32"), widen(w, "float32")
    inv = norm_oracle.inv_rms_oracle(norm_oracle.sum_squares_oracle(a), hidden, 1e-6)
    other = round_fp32_bits(norm_oracle.mul32(a, norm_oracle.mul32(inv[:, None], wf[None, :])).view(np.uint32),
                            "float32")
    got = to_bits(norm.rms_norm(to_torch(r, "float32"), to_torch(w, "float32"), eps=1e-6))
    assert not np.array_equal(other, got)


# --- argument checks ----------------------------------------------------------------------------------------
def test_refusals() -> None:
    r = torch.ones(2, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        norm.rms_norm(r, w, eps="1e-6")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        norm.rms_norm(r.tolist(), w, eps=1e-6)  # type: ignore[arg-type]
    for bad in (-1e-6, float("nan"), float("inf"), 1e39):
        with pytest.raises(ValueError):
            norm.rms_norm(r, w, eps=bad)
    with pytest.raises(ValueError, match="contiguous"):
        norm.rms_norm(torch.ones(8, 2, dtype=torch.bfloat16).t(), w, eps=1e-6)
    with pytest.raises(ValueError, match="last dimension"):
        norm.rms_norm(torch.ones(2, 7, dtype=torch.bfloat16), w, eps=1e-6)
    with pytest.raises(ValueError, match="1-D"):
        norm.rms_norm(r, torch.ones(1, 8), eps=1e-6)
    with pytest.raises(ValueError, match="dtype"):
        norm.rms_norm(r.to(torch.int32), w, eps=1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm.add_rms_norm(r, r.float(), w, eps=1e-6)


def test_sqrt_rn_is_correctly_rounded_where_torch_sqrt_is_not() -> None:
    """norm.sqrt_rn against numpy's fp32 sqrt (IEEE) on every binade, subnormals included. The negative control:
    torch.sqrt itself, on a CPU whose vectorized sqrt is off by an ulp (AVX-512 builds), must be caught."""
    rng = np.random.default_rng(13)
    bits = rng.integers(0, 0x7F800001, 1_000_000, dtype=np.uint64).astype(np.uint32)
    bits[:3] = [0, 1, 0x7F800000]
    v = bits.view(np.float32)
    expected = np.sqrt(v).view(np.uint32)
    got = norm.sqrt_rn(torch.from_numpy(v.copy())).numpy().view(np.uint32)
    assert np.array_equal(got, expected)
    torch_bad = int((torch.sqrt(torch.from_numpy(v.copy())).numpy().view(np.uint32) != expected).sum())
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert torch_bad > 0
