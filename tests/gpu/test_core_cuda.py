"""The core on a CUDA device: the torch fold leaf and the integer keys against the numpy oracle, and a
one-rank NCCL communicator end to end (NCCL refuses two ranks on one GPU; multi-rank GPU runs use the
workspace tests' W-stream harness or several GPUs)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import oracle
from datagen import DTYPES, ill_bits, random_bits, to_bits, to_torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("w", [2, 3, 5, 8])
def test_cuda_leaf_selected_and_equals_oracle(dtype: str, w: int) -> None:
    from detcomm.numerics.fold import BATCH_INVARIANT, select_leaf

    leaf = select_leaf(device_type="cuda", required=frozenset({BATCH_INVARIANT}))
    assert leaf.name == "cuda_nvrtc"
    for seed, gen, rows, width in ((1, ill_bits, 513, 67), (2, random_bits, 1, 3), (3, ill_bits, 4096, 1031)):
        inputs = [gen(rows, width, dtype, seed=seed, rank=r) for r in range(w)]
        stacked = torch.stack([to_torch(b, dtype) for b in inputs]).cuda()
        assert np.array_equal(to_bits(leaf.fold(stacked, DTYPES[dtype])), oracle.fold_oracle(inputs, dtype))
    # negative control: the same leaf over a rotated rank order differs from the oracle
    inputs = [ill_bits(513, 67, dtype, seed=1, rank=r) for r in range(w)]
    stacked = torch.stack([to_torch(b, dtype) for b in inputs]).cuda()
    if w >= 3:
        assert not np.array_equal(to_bits(leaf.fold(torch.roll(stacked, -1, 0), DTYPES[dtype])),
                                  oracle.fold_oracle(inputs, dtype))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("w", [2, 3, 4, 8])
def test_portable_leaf_on_cuda_equals_oracle(dtype: str, w: int) -> None:
    from detcomm.numerics.fold import portable_fold, reference_fold

    for seed, gen in ((1, ill_bits), (2, random_bits)):
        inputs = [gen(513, 67, dtype, seed=seed, rank=r) for r in range(w)]
        stacked = torch.stack([to_torch(b, dtype) for b in inputs]).cuda()
        expected = oracle.fold_oracle(inputs, dtype)
        assert np.array_equal(to_bits(portable_fold(stacked, DTYPES[dtype])), expected)
        assert np.array_equal(to_bits(reference_fold(stacked, DTYPES[dtype])), expected)
    if w >= 3:  # negative control: the same leaf over a rotated rank order differs from the oracle
        inputs = [ill_bits(513, 67, dtype, seed=1, rank=r) for r in range(w)]
        stacked = torch.stack([to_torch(b, dtype) for b in inputs]).cuda()
        assert not np.array_equal(to_bits(portable_fold(torch.roll(stacked, -1, 0), DTYPES[dtype])),
                                  oracle.fold_oracle(inputs, dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_leaf_keeps_a_narrow_fold_in_fp32_for_avg(dtype: str) -> None:
    """op="avg" divides the fold's unrounded fp32 accumulator: the CUDA leaf takes a bf16/fp16 stack with an fp32
    output (gather_fold and a2a_fold ask for that), and the average's bits are the oracle's."""
    from detcomm.numerics.fold import BATCH_INVARIANT, average, canonicalize_nan, select_leaf

    leaf = select_leaf(device_type="cuda", required=frozenset({BATCH_INVARIANT}))
    w = 3
    inputs = [ill_bits(513, 67, dtype, seed=4, rank=r) for r in range(w)]
    stacked = torch.stack([to_torch(b, dtype) for b in inputs]).cuda()
    expected = oracle.avg_oracle(inputs, dtype)
    assert np.array_equal(to_bits(average(leaf.fold(stacked, torch.float32), w, DTYPES[dtype])), expected)
    # negative control: rounding the fold to the dtype before the division gives other bits
    rounded_first = average(leaf.fold(stacked, DTYPES[dtype]).float(), w, DTYPES[dtype])
    assert not np.array_equal(to_bits(rounded_first), expected)
    if dtype == "float16":
        # negative control: dividing by a Python scalar lets torch's CUDA kernel multiply by the reciprocal, which
        # these fp16 averages expose (bf16's coarser rounding happens to hide it on this payload)
        by_reciprocal = canonicalize_nan((leaf.fold(stacked, torch.float32) / float(w)).to(DTYPES[dtype]))
        assert not np.array_equal(to_bits(by_reciprocal), expected)


def test_subnormals_survive_on_cuda() -> None:
    from detcomm.numerics.fold import portable_fold

    tiny = torch.tensor([[1e-45, 3e-39, -2e-40]], dtype=torch.float32, device="cuda")
    out = portable_fold(torch.stack([tiny, tiny, tiny]), torch.float32)
    assert (out != 0).all() and torch.equal(out.cpu(), (tiny * 3).cpu())


@pytest.mark.parametrize("op", ["max", "min"])
def test_keys_on_cuda(op: str) -> None:
    from detcomm.numerics import keys

    for dtype in sorted(DTYPES):
        inputs = [ill_bits(64, 33, dtype, seed=4, rank=r) for r in range(4)]
        ks = [keys.to_key(to_torch(b, dtype).cuda(), op=op) for b in inputs]
        red = ks[0]
        for k in ks[1:]:
            red = torch.maximum(red, k) if op == "max" else torch.minimum(red, k)
        got = to_bits(keys.from_key(red, DTYPES[dtype], op=op))
        assert np.array_equal(got, oracle.ordered_key_extreme_oracle(inputs, dtype, op))


def test_one_rank_nccl_communicator() -> None:
    import torch.distributed as dist

    import detcomm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("DETCOMM_TEST_PORT", "29533"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    for k in ("NCCL_ALGO", "NCCL_PROTO"):
        os.environ.pop(k, None)
    comm = detcomm.init(numerics="rl-bitwise")
    try:
        assert dist.get_backend() == "nccl" and comm.device.type == "cuda"
        assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["NCCL_NVLS_ENABLE"] == "0"
        # AR and RS for three dtypes, on the workspace (one-row probe sites) and on the gather/all-to-all fold
        assert comm.caps.workspace, comm.caps.workspace_reason
        # 12 startup checks, plus one per extra kernel variant the workspace serves (two-shot, chunked, ...)
        assert all(c.passed for c in comm.checks()) and len(comm.checks()) >= 12
        bits = ill_bits(100, 256, "bfloat16", seed=3, rank=0)
        x = to_torch(bits, "bfloat16").cuda()
        y = detcomm.all_reduce(x, site="gpu.o_proj")
        assert np.array_equal(to_bits(y), oracle.fold_oracle([bits], "bfloat16"))
        idx = detcomm.argmax(x.float(), site="gpu.argmax", vocab_start=0)
        assert torch.equal(idx, torch.argmax(x.float(), dim=-1))
        rs = detcomm.reduce_scatter(x, site="gpu.rs")
        assert torch.equal(rs.view(torch.int16), y.view(torch.int16))
        assert {e["route"] for e in comm.routes().as_dicts()} <= {"gather_fold", "a2a_fold", "native", "ipc_fold"}
    finally:
        detcomm.shutdown()
    assert not dist.is_initialized()
