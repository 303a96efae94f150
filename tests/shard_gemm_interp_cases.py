"""(Run by tests/test_shard_gemm.py in a subprocess.) detcomm.numerics.shard_gemm's kernels under Triton's interpreter (TRITON_INTERPRET=1, CPU): the math against an
fp64 oracle, and the bits of one shard / one column block the same whatever the batch count (S = V/W in 1, 2, 4,
8), the row count T (1..16) and the number of column blocks. Negative controls: a kernel whose K tile follows the
batch count (what a library choosing split-K or tiles from the batch shape does) must fail the invariance check,
and a split-K variant must change bits.

The interpreter runs the kernels' own code (every tile, mask and K step) with numpy arithmetic, so these tests pin
the indexing and the invariance of the construction; the device's MMA bits are tests/gpu/test_shard_gemm_gpu.py's.
Paths run here: fp32 (input_precision="ieee") and fp16 (the 2-byte path). bf16 is not: triton 3.9's interpreter
computes tl.dot of bf16 operands wrongly (garbage of order 1e10 even for one 16x16 tile), so the bf16 path is
tested on the GPU only.

Bound (fp32 path): |out - oracle| <= Kv * 2^-23 * sum_k |x_k w_k| (a recursive fp32 sum of Kv exact-ish terms;
the products' own rounding adds at most 2^-24 each); fp16 path: the same with the products exact in fp32."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # run through tests/test_shard_gemm.py, which sets it
    raise RuntimeError("tests/shard_gemm_interp_cases.py runs under TRITON_INTERPRET=1 set before triton is imported "
                       "(tests/test_shard_gemm.py runs it so)")

import detcomm.numerics.shard_gemm as _sg  # noqa: E402


@pytest.fixture(scope="module")
def sg():  # type: ignore[no-untyped-def]
    return _sg


DTYPES = [torch.float32, torch.float16]


def _data(t: int, s: int, kv: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, s * kv, generator=g).to(dtype)
    w = torch.randn(s, kv, n, generator=g).to(dtype)
    return x, w


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    kv = w.shape[1]
    mags = torch.stack([x[:, j * kv : (j + 1) * kv].double().abs() @ w[j].double().abs() for j in range(w.shape[0])])
    return kv * 2.0**-23 * mags + 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
def test_shard_partials_fp64_oracle(sg, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    # Kv = 70 (not a multiple of BK: the masked K tail), N = 72 (two column tiles, the last masked), T = 13
    x, w = _data(13, 3, 70, 72, dtype)
    out = sg.shard_partials(x, w)
    assert out.dtype == torch.float32 and out.shape == (3, 13, 72)
    oracle = torch.stack([x[:, j * 70 : (j + 1) * 70].double() @ w[j].double() for j in range(3)])
    err = (out.double() - oracle).abs()
    assert bool((err <= _bound(x, w)).all()), float(err.max())


def _invariance(fn, x: torch.Tensor, w: torch.Tensor, shard: int) -> list[str]:  # type: ignore[no-untyped-def]
    """Where shard ``shard``'s [T, N] bits differ from the S = 1, full-T call: a list of the differing cases."""
    kv, t = w.shape[1], x.shape[0]
    ref = fn(x[:, shard * kv : (shard + 1) * kv], w[shard : shard + 1])[0]
    bad = []
    for s in (1, 2, 4, 8):
        lo = min(shard, w.shape[0] - s)  # a batch of s shards that holds ``shard`` at position shard - lo
        got = fn(x[:, lo * kv : (lo + s) * kv], w[lo : lo + s])[shard - lo]
        if not torch.equal(got, ref):
            bad.append(f"S={s}")
    for rows in range(1, t + 1):
        got = fn(x[:rows, shard * kv : (shard + 1) * kv], w[shard : shard + 1])[0]
        if not torch.equal(got, ref[:rows]):
            bad.append(f"T={rows}")
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
def test_shard_partials_bits_do_not_depend_on_batch_or_rows(sg, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    x, w = _data(16, 8, 96, 64, dtype, seed=1)
    for shard in (0, 5, 7):
        assert _invariance(sg.shard_partials, x, w, shard) == []


def test_negative_control_tile_from_batch_count_fails(sg, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A kernel whose K tile follows the batch count (BK = 16 * S), as a library choosing its kernel from the batch
    # shape may: the same invariance check must catch it.
    base = dict(sg.CONFIG)

    def by_batch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        monkeypatch.setitem(sg.CONFIG, "BK", 16 * w.shape[0])
        try:
            return sg.shard_partials(x, w)  # type: ignore[no-any-return]
        finally:
            monkeypatch.setitem(sg.CONFIG, "BK", base["BK"])

    x, w = _data(16, 8, 128, 64, torch.float32, seed=2)
    bad = _invariance(by_batch, x, w, 5)
    assert any(b.startswith("S=") for b in bad), bad


def test_negative_control_split_k_changes_bits(sg) -> None:  # type: ignore[no-untyped-def]
    # Split-K (two halves of K computed apart, then added): the value is within the bound, the bits are not the
    # kernel's. The check that the kernel's own bits are pinned would fail on it.
    x, w = _data(16, 1, 256, 64, torch.float32, seed=3)
    out = sg.shard_partials(x, w)[0]
    halves = sg.shard_partials(x[:, :128], w[:, :128])[0] + sg.shard_partials(x[:, 128:], w[:, 128:])[0]
    assert not torch.equal(out, halves)
    assert bool(((out.double() - halves.double()).abs() <= 2 * _bound(x, w)[0]).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_block_gemm_oracle_and_block_invariance(sg, dtype: torch.dtype, transposed: bool) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(4)
    k, width, nb, t = 80, 48, 4, 11  # width 48: one tile of 64 masked to 48 (tiles never straddle blocks)
    x = torch.randn(t, k, generator=g).to(dtype)
    kn = torch.randn(nb, k, width, generator=g).to(dtype)  # [blocks, K, width]
    bias = torch.randn(nb * width, generator=g).to(dtype)
    w = kn.transpose(1, 2).contiguous() if transposed else kn
    y = sg.block_gemm(x, w, bias, transposed=transposed)
    assert y.dtype == dtype and y.shape == (t, nb * width)
    oracle = torch.cat([x.double() @ kn[j].double() for j in range(nb)], 1) + bias.double()
    mag = torch.cat([x.double().abs() @ kn[j].double().abs() for j in range(nb)], 1) + bias.double().abs()
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-10  # the output's one rounding dominates for fp16
    err = (y.double() - oracle).abs()
    assert bool((err <= (k + 1) * 2.0**-23 * mag + ulp * oracle.abs() + 1e-30).all()), float(err.max())
    # block 2's bits: alone, in a pair, in all four (N/W = 1, 2, 4 blocks), and at every row count
    ref = sg.block_gemm(x, w[2:3], bias[2 * width : 3 * width], transposed=transposed)
    assert torch.equal(y[:, 2 * width : 3 * width], ref)
    pair = sg.block_gemm(x, w[2:4], bias[2 * width : 4 * width], transposed=transposed)
    assert torch.equal(pair[:, :width], ref)
    for rows in range(1, t + 1):
        got = sg.block_gemm(x[:rows], w[2:3], bias[2 * width : 3 * width], transposed=transposed)
        assert torch.equal(got, ref[:rows]), rows


def test_block_gemm_wide_block_has_several_tiles(sg) -> None:  # type: ignore[no-untyped-def]
    # width 160 > BN: three tiles per block (the last masked), still within one block
    g = torch.Generator().manual_seed(5)
    x, kn = torch.randn(5, 40, generator=g), torch.randn(2, 40, 160, generator=g)
    y = sg.block_gemm(x, kn, None, transposed=False)
    oracle = torch.cat([x.double() @ kn[0].double(), x.double() @ kn[1].double()], 1)
    assert float((y.double() - oracle).abs().max()) < 1e-4
    assert torch.equal(y[:, 160:], sg.block_gemm(x, kn[1:], None, transposed=False))


def test_caller_errors(sg) -> None:  # type: ignore[no-untyped-def]
    x, w = _data(4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=r"x \[T, S\*Kv\]"):
        sg.shard_partials(x[:, :20], w)
    with pytest.raises(ValueError, match="2-byte weights with an input of the same dtype"):
        sg.shard_partials(x, w.to(torch.float16))
    with pytest.raises(ValueError, match="bias must be"):
        sg.block_gemm(x[:, :16], w, torch.zeros(3), transposed=False)


def test_packed_shares_storage_and_rebinds(sg) -> None:  # type: ignore[no-untyped-def]
    ws = [torch.randn(8, 4) for _ in range(3)]
    p = torch.nn.Parameter(ws[1])
    ws[1] = p
    buf = sg.packed(ws)
    assert all(t.data_ptr() == buf[j].data_ptr() for j, t in enumerate(ws))
    assert sg.packed(ws).data_ptr() == buf.data_ptr()  # already slabs: no copy
    with torch.no_grad():
        p.add_(1.0)  # a trainer's in-place update is what the kernel reads
    assert torch.equal(buf[1], p)


def test_autograd_matches_per_shard_torch(sg) -> None:  # type: ignore[no-untyped-def]
    x, w = _data(6, 2, 32, 16, torch.float32, seed=6)
    x.requires_grad_(True)
    shards = [w[j].clone().requires_grad_(True) for j in range(2)]
    out = sg.ShardPartials.apply(x, *shards)
    g = torch.randn_like(out)
    out.backward(g)
    x2 = x.detach().clone().requires_grad_(True)
    s2 = [t.detach().clone().requires_grad_(True) for t in shards]
    ref = torch.stack([torch.matmul(x2[:, j * 32 : (j + 1) * 32].contiguous(), s2[j]) for j in range(2)])
    ref.backward(g)
    assert x.grad is not None and x2.grad is not None
    assert torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for a, b in zip(shards, s2):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_autograd_two_byte_shards(sg) -> None:  # type: ignore[no-untyped-def]
    # model-dtype shards (shard_weights="model"): fp32 partials, gradients in the shards' and x's dtypes
    x, w = _data(6, 2, 32, 16, torch.float16, seed=7)
    x.requires_grad_(True)
    shards = [w[j].clone().requires_grad_(True) for j in range(2)]
    out = sg.ShardPartials.apply(x, *shards)
    assert out.dtype == torch.float32
    out.backward(torch.ones_like(out))
    assert x.grad is not None and x.grad.dtype == torch.float16
    ref = torch.cat([torch.ones(6, 16) @ s.detach().float().t() for s in shards], dim=1)
    assert torch.allclose(x.grad.float(), ref, rtol=1e-3, atol=1e-3)
    assert all(s.grad is not None and s.grad.dtype == torch.float16 for s in shards)


@pytest.mark.parametrize("transposed", [False, True])
def test_block_gemm_autograd_matches_per_block_torch(sg, transposed: bool) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(8)
    k, width, nb = 24, 16, 3
    x = torch.randn(5, k, generator=g, requires_grad=True)
    kn = [torch.randn(k, width, generator=g) for _ in range(nb)]
    blocks = [(b.t().contiguous() if transposed else b).requires_grad_(True) for b in kn]
    biases = [torch.randn(width, generator=g, requires_grad=True) for _ in range(nb)]
    y = sg.BlockGemm.apply(x, transposed, nb, *blocks, *biases)
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    x2 = x.detach().clone().requires_grad_(True)
    b2 = [b.detach().clone().requires_grad_(True) for b in blocks]
    c2 = [c.detach().clone().requires_grad_(True) for c in biases]
    ref = torch.cat([(torch.nn.functional.linear(x2, b, c) if transposed else x2 @ b + c) for b, c in zip(b2, c2)], 1)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    ref.backward(gy)
    for a, b in [(x, x2), *zip(blocks, b2), *zip(biases, c2)]:
        assert a.grad is not None and b.grad is not None and a.grad.shape == b.grad.shape
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-5)
