"""The serving step's paged attention on a GPU (detcomm.numerics.attention): the Triton kernel (one launch, the
CUDA default) and the torch implementation on CUDA tensors keep the contract of tests/test_paged_attention.py:
bitwise alone == packed == chunked == another cache and block ids, fp32 and bf16, full and windowed, at any
number of kv heads per rank; the Triton
kernel within the fp64 bound; the split-KV negative control fails the same check."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import test_paged_attention as t
from detcomm.numerics.attention import paged_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 12], ids=["full", "window12"])
def test_bitwise_invariant_on_cuda(impl: str, dtype: torch.dtype, window: int | None) -> None:
    m = t.invariance_mismatches(functools.partial(paged_attention, impl=impl), dtype, window=window, device="cuda")
    assert m == dict.fromkeys(m, 0), m


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_a_heads_bits_do_not_depend_on_how_many_kv_heads_a_rank_holds_on_cuda(impl: str) -> None:
    assert t.kv_head_split_mismatches(functools.partial(paged_attention, impl=impl), device="cuda") == 0


def test_negative_control_split_kv_on_cuda() -> None:
    m = t.invariance_mismatches(t.split_kv_attention, torch.float32, device="cuda")
    assert m["packed"] > 0, m


@pytest.mark.parametrize("window", [None, 12], ids=["full", "window12"])
def test_triton_kernel_against_fp64(window: int | None) -> None:
    seqs = t._sequences(torch.float32)
    e = t.Engine(seqs, torch.float32, attend=functools.partial(paged_attention, impl="triton"), num_blocks=64,
                 shuffle_ids=3, window=window, device="cuda")
    for rows in t.schedules(seed=2)["chunked"]:
        e.step(rows)
    eps, group, worst = float(np.finfo(np.float32).eps), t.HEADS // t.KV_HEADS, 0.0
    for (r, p), o in e.out.items():
        ref = t._reference(seqs, r, p, window)
        q, k, v = (x.to(torch.float64).numpy() for x in seqs[r])
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(t.HEADS):
            smax = np.abs(k[lo : p + 1, h // group] @ q[p, h] * t.SCALE).max()
            bound = eps * (1.0 + smax) * np.abs(v[lo : p + 1, h // group]).max()
            worst = max(worst, float(np.abs(o[h].numpy().astype(np.float64) - ref[h]).max() / bound))
    print(f"triton paged attention vs fp64: worst {worst:.3f} of the bound")
    assert worst <= 2.0, worst
