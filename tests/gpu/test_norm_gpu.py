"""The canonical RMSNorm kernel (csrc/rms_norm.cu) on a CUDA device: bit for bit equal to the numpy oracle and to
detcomm's torch implementation (on the CPU and on the device), batch-invariant, capturable in a CUDA graph; torch's
own rms_norm is the negative control."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import norm_oracle
from datagen import DTYPES, random_bits, to_bits, to_torch
from norm_rows import KINDS, adversarial_rows, weight_bits

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy")

from detcomm import norm, norm_cuda  # noqa: E402

HIDDEN = [1, 7, 8, 9, 100, 2047, 2048, 2049, 4096, 4104, 8192, 16392]


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_kernel_equals_oracle_and_cpu(dtype: str, hidden: int) -> None:
    assert norm_cuda.available()
    r = adversarial_rows(2 * len(KINDS), hidden, dtype, seed=hidden)
    for w_dtype in sorted(DTYPES):
        w = weight_bits(hidden, w_dtype, seed=hidden + 1)
        expected = norm_oracle.rms_norm_oracle(r, w, dtype, w_dtype, 1e-6)
        rt, wt = to_torch(r, dtype), to_torch(w, w_dtype)
        got = to_bits(norm.rms_norm(rt.cuda(), wt.cuda(), eps=1e-6))
        assert np.array_equal(got, expected), (w_dtype, np.flatnonzero((got != expected).any(axis=1)))
        assert np.array_equal(to_bits(norm.rms_norm(rt, wt, eps=1e-6)), expected)  # the CPU path
        assert np.array_equal(to_bits(norm.rms_norm_torch(rt.cuda(), wt.cuda(), eps=1e-6)), expected)


@pytest.mark.parametrize("hidden", [9, 2049, 8192])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_add_kernel_equals_oracle(dtype: str, hidden: int) -> None:
    s = adversarial_rows(2 * len(KINDS), hidden, dtype, seed=3)
    res = random_bits(2 * len(KINDS), hidden, dtype, seed=4, rank=0)
    w = weight_bits(hidden, dtype, seed=5)
    y, r = norm.add_rms_norm(to_torch(s, dtype).cuda(), to_torch(res, dtype).cuda(), to_torch(w, dtype).cuda(),
                             eps=1e-5)
    r_exp = norm_oracle.residual_add_oracle(s, res, dtype)
    assert np.array_equal(to_bits(r), r_exp)
    assert np.array_equal(to_bits(y), norm_oracle.rms_norm_oracle(r_exp, w, dtype, dtype, 1e-5))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_row_alone_equals_row_in_any_batch_and_offset(dtype: str) -> None:
    hidden = 4104
    base = adversarial_rows(len(KINDS), hidden, dtype, seed=8)
    w = to_torch(weight_bits(hidden, dtype, seed=9), dtype).cuda()
    alone = np.concatenate([to_bits(norm.rms_norm(to_torch(base[i : i + 1], dtype).cuda(), w, eps=1e-6))
                            for i in range(len(base))])
    assert np.array_equal(alone, norm_oracle.rms_norm_oracle(base, to_bits(w), dtype, dtype, 1e-6))
    for total, off in ((len(base) + 1, 1), (300, 133), (2048, 2000)):
        batch = random_bits(total, hidden, dtype, seed=total, rank=0).copy()
        batch[off : off + len(base)] = base
        got = to_bits(norm.rms_norm(to_torch(batch, dtype).cuda(), w, eps=1e-6))[off : off + len(base)]
        assert np.array_equal(got, alone), (total, off)


def test_unaligned_views_and_grid_stride_rows() -> None:
    """A row starting mid-pack (scalar loads) and more rows than one grid holds (grid-stride loop)."""
    hidden = 24
    flat = adversarial_rows(1, 70001 * hidden + 1, "bfloat16", seed=10, kinds=("normal",))[0]
    w = weight_bits(hidden, "bfloat16", seed=11)
    rows = flat[1:].reshape(70001, hidden)
    view = to_torch(flat, "bfloat16").cuda()[1:].view(70001, hidden)  # 2 bytes past a 16-byte boundary
    got = to_bits(norm.rms_norm(view, to_torch(w, "bfloat16").cuda(), eps=1e-6))
    expected = to_bits(norm.rms_norm_torch(to_torch(rows, "bfloat16"), to_torch(w, "bfloat16"), eps=1e-6))
    assert np.array_equal(got, expected)
    assert np.array_equal(got[-5:], norm_oracle.rms_norm_oracle(rows[-5:], w, "bfloat16", "bfloat16", 1e-6))


def test_cuda_graph_replay_gives_the_same_bits() -> None:
    hidden = 4096
    r = to_torch(adversarial_rows(2 * len(KINDS), hidden, "bfloat16", seed=12), "bfloat16").cuda()
    w = to_torch(weight_bits(hidden, "bfloat16", seed=13), "bfloat16").cuda()
    eager = norm.rms_norm(r, w, eps=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = norm.rms_norm(r, w, eps=1e-6)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_negative_control_torch_rms_norm_on_cuda_is_caught(dtype: str) -> None:
    hidden = 4096
    r = adversarial_rows(2 * len(KINDS), hidden, dtype, seed=14)
    w = weight_bits(hidden, dtype, seed=15)
    theirs = to_bits(torch.nn.functional.rms_norm(to_torch(r, dtype).cuda(), (hidden,), to_torch(w, dtype).cuda(),
                                                  eps=1e-6))
    assert not np.array_equal(theirs, norm_oracle.rms_norm_oracle(r, w, dtype, dtype, 1e-6))
