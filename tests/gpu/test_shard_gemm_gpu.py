"""detcomm.numerics.shard_gemm on CUDA (issue 42 item 3): the fixed-config Triton kernels of the TP-invariant layouts.

Kernel level (cuda:0, one process): a shard's fp32 partial has the same bits whatever the batch count S = V/W in
{1, 2, 4, 8} and whatever the row count (1..64), for fp32 shards (ieee dot) and bf16 shards (tensor cores, fp32
accumulate); a column block's bits do not depend on how many blocks the launch holds; both within a stated bound
of an fp64 oracle. Negative controls: today's per-shard cuBLAS torch.matmul and a split-K variant give other bits, so
the bitwise checks can fail. A CUDA graph replays the eager bits.

Model level (W processes sharing cuda:0, gloo + the workspace): the probe decoder (detcomm.probe.model.TPTransformer,
bf16, tree layout V = 8) and detcomm.hf's engine (llama-tiny, tree layout V = 4) give identical logits / tokens /
logprob bits at W = 1 and W = 2, and the same with cuda_graphs off and "auto"."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import test_hf_graphs as t
import test_probe_graphs as p
from clusters import get_cluster
from detcomm.hf import write_tiny_checkpoint

pytestmark = pytest.mark.gpu


def _sg():  # type: ignore[no-untyped-def]
    from detcomm.numerics import shard_gemm

    return shard_gemm


def _data(t_: int, s: int, kv: int, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t_, s * kv, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(s, kv, n, generator=g) / kv**0.5).to(torch.bfloat16).to(dtype).cuda()
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv", "n"), [(256, 2048), (1024, 256), (72, 200)])  # o_proj, down_proj shapes; ragged
def test_shard_bits_do_not_depend_on_batch_count_or_rows(dtype: torch.dtype, kv: int, n: int) -> None:
    sg = _sg()
    x, w = _data(64, 8, kv, n, dtype, seed=kv)
    allv = sg.shard_partials(x, w)
    # fp64 oracle: the products are exact (bf16 operands); the fp32 accumulation's error is bounded by Kv ulps of
    # the sum of magnitudes (a generous bound for any order of fp32 adds)
    oracle = torch.stack([x[:, j * kv : (j + 1) * kv].double() @ w[j].double() for j in range(8)])
    mag = torch.stack([x[:, j * kv : (j + 1) * kv].double().abs() @ w[j].double().abs() for j in range(8)])
    assert bool(((allv.double() - oracle).abs() <= kv * 2.0**-23 * mag + 1e-30).all())
    for shard in (0, 3, 7):
        ref = sg.shard_partials(x[:, shard * kv : (shard + 1) * kv], w[shard : shard + 1])[0]
        assert torch.equal(allv[shard], ref)
        for s in (2, 4, 8):
            lo = (shard // s) * s  # rank lo // s's shards at W = 8 / s
            got = sg.shard_partials(x[:, lo * kv : (lo + s) * kv], w[lo : lo + s])
            assert torch.equal(got[shard - lo], ref), (shard, s)
        for rows in (1, 2, 3, 7, 16, 17, 33, 63):
            got = sg.shard_partials(x[:rows, shard * kv : (shard + 1) * kv].contiguous(), w[shard : shard + 1])
            assert torch.equal(got[0], ref[:rows]), (shard, rows)


@pytest.mark.parametrize("transposed", [False, True])
def test_block_bits_do_not_depend_on_block_count(transposed: bool) -> None:
    sg = _sg()
    g = torch.Generator().manual_seed(1)
    k, width, nb = 2048, 1024, 8
    x = torch.randn(64, k, generator=g).to(torch.bfloat16).cuda()
    kn = (torch.randn(nb, k, width, generator=g) / k**0.5).to(torch.bfloat16).cuda()
    w = kn.transpose(1, 2).contiguous() if transposed else kn
    y = sg.block_gemm(x, w, None, transposed=transposed)
    oracle = torch.cat([x.double() @ kn[j].double() for j in range(nb)], 1)
    mag = torch.cat([x.double().abs() @ kn[j].double().abs() for j in range(nb)], 1)
    # the fp32 accumulation bound plus the one bf16 rounding of the output
    assert bool(((y.double() - oracle).abs() <= k * 2.0**-23 * mag + 2.0**-8 * oracle.abs() + 1e-30).all())
    for lo, cnt in ((5, 1), (4, 2), (4, 4)):  # block 5 at W = 8, 4, 2
        got = sg.block_gemm(x, w[lo : lo + cnt], None, transposed=transposed)
        assert torch.equal(got[:, (5 - lo) * width : (6 - lo) * width], y[:, 5 * width : 6 * width]), (lo, cnt)
    for rows in (1, 5, 64):
        got = sg.block_gemm(x[:rows].contiguous(), w[5:6], None, transposed=transposed)
        assert torch.equal(got, y[:rows, 5 * width : 6 * width]), rows


def test_negative_controls_cublas_and_split_k_give_other_bits() -> None:
    sg = _sg()
    for dtype in (torch.float32, torch.bfloat16):
        x, w = _data(64, 8, 1024, 2048, dtype, seed=9)
        ours = sg.shard_partials(x, w)
        wf = w.to(torch.float32)
        cublas = torch.stack([torch.matmul(x.float()[:, j * 1024 : (j + 1) * 1024].contiguous(), wf[j])
                              for j in range(8)])
        assert not torch.equal(ours, cublas), dtype  # today's per-shard path: other bits ("bits changed on GPU")
        # split-K (each shard's K in two halves, each its own accumulation, then one fp32 add): what a library's
        # split-K choice does; the kernel's pinned bits are not these. (A different BK alone need not change
        # the bits on the device: the MMA/FMA chain over K runs in K order whatever the chunk width.)
        xs = x.view(64, 8, 2, 512)
        halves = [sg.shard_partials(xs[:, :, h].reshape(64, 8 * 512), w[:, h * 512 : (h + 1) * 512].contiguous())
                  for h in range(2)]
        assert not torch.equal(ours, halves[0] + halves[1]), dtype


def test_capturable_in_a_cuda_graph() -> None:
    sg = _sg()
    x, w = _data(64, 4, 256, 512, torch.bfloat16, seed=2)
    eager = sg.shard_partials(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sg.shard_partials(x, w)  # warm-up: the compile happens outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sg.shard_partials(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def job_probe(rank: int, w: int, shard_weights: str, graphs: bool | str) -> list:
    import detcomm
    from detcomm.probe.model import ModelConfig, TPTransformer

    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise", device="cuda:0")
    try:
        cfg = ModelConfig(t_pad=64, max_context=64, block_size=4, num_blocks=64, dtype=torch.bfloat16)
        m = TPTransformer(cfg, device="cuda:0", layout="virtual", virtual_shards=8, shard_fold="tree",
                          cuda_graphs=graphs, shard_weights=shard_weights)  # type: ignore[arg-type]
        m.declare_sites()
        out = p._drive(m)
        m.release_graphs()
        return out
    finally:
        detcomm.shutdown()


def _joined(ranks: list, one: list) -> list:
    """The W ranks' results as one rank's: a field that is a vocabulary shard (an array whose last dimension is
    1/W of W = 1's: the shard logits, the shard logprobs) joined over the ranks in rank order (rank r holds the r-th
    vocabulary slice); any other field (tokens, picks, full logits) is every rank's, checked equal, and taken once."""
    w = len(ranks)
    out = []
    for i, ref in enumerate(one):
        fields = []
        for j, x in enumerate(ref):
            mine = [r[i][j] for r in ranks]
            if isinstance(x, np.ndarray) and mine[0].shape[-1] * w == x.shape[-1] and w > 1:
                fields.append(np.concatenate(mine, axis=-1))
            else:
                assert all(np.array_equal(m, mine[0]) if isinstance(m, np.ndarray) else m == mine[0] for m in mine), \
                    (i, j, "the ranks disagree on a replicated field")
                fields.append(mine[0])
        out.append(tuple(fields))
    return out


def _same(a: list, b: list) -> list[bool]:
    return [all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(f, s))
            for f, s in zip(a, b)]


@pytest.mark.parametrize("shard_weights", ["fp32", "model"])
def test_probe_tree_layout_bits_at_w1_and_w2_graphs_on_and_off(shard_weights: str) -> None:
    (one,) = get_cluster(1).run(job_probe, shard_weights, False)
    (one_g,) = get_cluster(1).run(job_probe, shard_weights, "auto")
    two = get_cluster(2).run(job_probe, shard_weights, False)
    assert len(one) == 6 and all(_same(one, one_g)), _same(one, one_g)
    assert all(_same(one, _joined(two, one))), _same(one, _joined(two, one))
    shard = next(f for f in one[0] if isinstance(f, np.ndarray))  # the control: a rank's shard alone is not W = 1's
    assert two[0][0][0].shape != shard.shape


def job_hf(rank: int, w: int, directory: str, graphs: bool | str) -> dict:
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    detcomm.shutdown()
    detcomm.init(numerics="rl-bitwise", device="cuda:0")
    try:
        serving = dict(t_pad=64, max_context=64, block_size=t.BLOCK, num_blocks=64, cuda_graphs=graphs)
        lm = TPCausalLM(load_causal_lm(directory, dtype=torch.bfloat16), ServingConfig(**serving), **t.LAYOUTS["tree"])
        out: dict = t._drive(lm)
        lm.release_graphs()
        return out
    finally:
        detcomm.shutdown()


def _same_hf(a: dict, b: dict) -> bool:
    steps = all(all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(f, s))
                for f, s in zip(a["steps"], b["steps"]))
    gen = all(f[0] == s[0] and np.array_equal(f[1], s[1]) for f, s in zip(a["generate"], b["generate"]))
    return steps and gen and len(a["steps"]) == len(b["steps"]) == 6


def test_hf_tree_layout_bits_at_w1_and_w2_graphs_on_and_off(tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    (one,) = get_cluster(1).run(job_hf, directory, False)
    (one_g,) = get_cluster(1).run(job_hf, directory, "auto")
    two = get_cluster(2).run(job_hf, directory, "auto")
    assert _same_hf(one, one_g)
    joined = dict(two[0], steps=_joined([r["steps"] for r in two], one["steps"]))
    assert _same_hf(one, joined)
