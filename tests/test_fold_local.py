"""Single-process tests of the fold leaf, the order-preserving keys and the NaN policy against the numpy
oracle (tests/oracle.py), with negative controls proving the comparisons can fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from datagen import DTYPES, ill_bits, random_bits, to_bits, to_torch
from detcomm.numerics import keys
from detcomm.numerics.fold import (
    BATCH_INVARIANT,
    Leaf,
    Priority,
    canonical_nan,
    portable_fold,
    reference_fold,
    register_leaf,
    select_leaf,
    unregister_leaf,
)


def test_oracle_self_test() -> None:
    oracle._self_test()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(w=st.integers(1, 8), rows=st.integers(1, 40), width=st.integers(1, 33),
       dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**16), ill=st.booleans())
def test_reference_fold_equals_oracle(w: int, rows: int, width: int, dtype: str, seed: int, ill: bool) -> None:
    gen = ill_bits if ill else random_bits
    inputs = [gen(rows, width, dtype, seed=seed, rank=r) for r in range(w)]
    stacked = torch.stack([to_torch(b, dtype) for b in inputs])
    expected = oracle.fold_oracle(inputs, dtype)
    assert np.array_equal(to_bits(reference_fold(stacked, DTYPES[dtype])), expected)
    assert np.array_equal(to_bits(portable_fold(stacked, DTYPES[dtype])), expected)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_negative_control_rotated_order_differs(dtype: str) -> None:
    """The comparison above can fail: folding from rank 1 instead of rank 0 gives other bits."""
    inputs = [ill_bits(64, 64, dtype, seed=3, rank=r) for r in range(4)]
    rotated = inputs[1:] + inputs[:1]
    assert not np.array_equal(oracle.fold_oracle(rotated, dtype), oracle.fold_oracle(inputs, dtype))
    stacked = torch.stack([to_torch(b, dtype) for b in rotated])
    assert not np.array_equal(to_bits(reference_fold(stacked, DTYPES[dtype])), oracle.fold_oracle(inputs, dtype))
    assert not np.array_equal(to_bits(portable_fold(stacked, DTYPES[dtype])), oracle.fold_oracle(inputs, dtype))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_signed_zero_sum_is_positive_zero(dtype: str) -> None:
    neg = to_torch(np.full((1, 4), 0x80000000 if dtype == "float32" else 0x8000), dtype)
    for fold in (reference_fold, portable_fold):
        assert (to_bits(fold(torch.stack([neg, neg, neg]), DTYPES[dtype])) == 0).all()
    # negative control: a fold that starts from x0 keeps -0.0
    assert (to_bits(neg + neg + neg) != 0).all()


def test_subnormals_kept() -> None:
    tiny = torch.tensor([[1e-45, 3e-39, -2e-40]], dtype=torch.float32)
    out = reference_fold(torch.stack([tiny, tiny]), torch.float32)
    assert torch.equal(out, tiny * 2) and (out != 0).all()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_nan_policy_canonical(dtype: str) -> None:
    t = DTYPES[dtype]
    a = torch.tensor([[float("nan"), float("inf"), float("inf"), 1.0]], dtype=t)
    # a NaN with a payload and sign bit, built from bits
    payload = {"float32": -0x3FFFFFFF, "bfloat16": -0x3F, "float16": -0x1FF}[dtype]
    weird = torch.tensor([payload], dtype=torch.int32 if dtype == "float32" else torch.int16).view(t)
    b = torch.tensor([[1.0, float("-inf"), 1.0, 2.0]], dtype=t)
    b[0, 0] = weird[0]
    out = portable_fold(torch.stack([a, b]), t)
    assert torch.equal(out.view(torch.int32 if dtype == "float32" else torch.int16),
                       reference_fold(torch.stack([a, b]), t).view(torch.int32 if dtype == "float32" else torch.int16))
    nan_bits = oracle.CANONICAL_NAN[dtype]
    got = to_bits(out)[0]
    assert got[0] == nan_bits and got[1] == nan_bits  # NaN + NaN and Inf - Inf: canonical NaN
    assert torch.isinf(out[0, 2]) and out[0, 2] > 0
    assert to_bits(canonical_nan(t).reshape(1))[0] == nan_bits


@settings(max_examples=40, deadline=None, derandomize=True)
@given(w=st.integers(1, 6), n=st.integers(1, 50), dtype=st.sampled_from(sorted(DTYPES)),
       op=st.sampled_from(["max", "min"]), seed=st.integers(0, 2**16))
def test_keys_max_min_equal_oracle(w: int, n: int, dtype: str, op: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    inputs = []
    for r in range(w):
        bits = ill_bits(1, n, dtype, seed=seed, rank=r)[0]
        nan = oracle.CANONICAL_NAN[dtype] | (1 << (31 if dtype == "float32" else 15))  # a negative NaN
        bits = np.where(rng.random(n) < 0.05, nan, bits).astype(bits.dtype)
        inputs.append(bits)
    ks = [keys.to_key(to_torch(b, dtype), op=op) for b in inputs]
    red = ks[0]
    for k in ks[1:]:
        red = torch.maximum(red, k) if op == "max" else torch.minimum(red, k)
    got = to_bits(keys.from_key(red, DTYPES[dtype], op=op))
    assert np.array_equal(got, oracle.ordered_key_extreme_oracle(inputs, dtype, op))


def test_keys_zero_and_order() -> None:
    x = torch.tensor([-0.0, 0.0, -1e-45, 1e-45, -float("inf"), float("inf"), -1.0, 1.0])
    k = keys.to_key(x, op="max")
    assert k[0] == k[1]  # -0.0 and +0.0 share a key
    order = torch.argsort(k, stable=True)
    assert x[order].tolist()[0] == -float("inf") and x[order].tolist()[-1] == float("inf")
    assert keys.to_key(torch.tensor([float("nan")]), op="max") > keys.to_key(torch.tensor([float("inf")]), op="max")
    assert keys.to_key(torch.tensor([float("nan")]), op="min") < keys.to_key(torch.tensor([-float("inf")]), op="min")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(1, 6), v=st.integers(1, 40), shards=st.integers(1, 5), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(sorted(DTYPES)))
def test_argmax_keys_match_torch_argmax(rows: int, v: int, shards: int, seed: int, dtype: str) -> None:
    rng = np.random.default_rng(seed)
    full = torch.from_numpy(rng.integers(-3, 4, (rows, v * shards)).astype(np.float32)).to(DTYPES[dtype])
    full[full == 0] = torch.where(torch.rand((full == 0).sum().item()) < 0.5, -0.0, 0.0).to(full.dtype)
    best = None
    for s in range(shards):
        k = keys.argmax_keys(full[:, s * v : (s + 1) * v], s * v)
        best = k if best is None else torch.maximum(best, k)
    assert torch.equal(keys.argmax_index(best), torch.argmax(full.float(), dim=-1))


def test_leaf_registry_priority_and_missing_feature() -> None:
    fake = Leaf("zz_fake", fold=reference_fold, priority=Priority.VENDOR, features=frozenset(), device_types=frozenset({"cpu"}))
    register_leaf(fake)
    try:
        assert select_leaf(device_type="cpu").name == "zz_fake"
        assert select_leaf(device_type="cpu", required=frozenset({BATCH_INVARIANT})).name == "torch_portable"
        with pytest.raises(ValueError, match="already registered"):
            register_leaf(fake)
        with pytest.raises(RuntimeError, match="no fold leaf for device type 'xpu'"):
            select_leaf(device_type="xpu", required=frozenset({BATCH_INVARIANT}))
    finally:
        unregister_leaf("zz_fake")
