"""Sliced loading (detcomm/hf/sliced.py) on real spawned gloo ranks at W = 3 and 4: a model built on the meta
device and filled from each rank's slices of the safetensors files holds, parameter by parameter and buffer by
buffer, the bits of today's path (transformers' from_pretrained of the whole model, then shard_model), for dense
and MoE families, tied and untied heads, a multi-file checkpoint, expert parallelism and replicated KV heads.
Oracle for the KV-head replication: numpy slices of the checkpoint file, written from the definition (rank r
holds KV head r // (W / num_kv_heads) and query heads [r * heads / W, (r + 1) * heads / W)). Negative control: a
checkpoint with one flipped bit must show up as exactly the parameters that hold it.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import get_cluster  # noqa: E402
from detcomm.hf import write_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    return t.view(_INT[t.dtype]).numpy().copy() if t.dtype in _INT else t.numpy().copy()


def job_sliced_vs_full(rank: int, w: int, cases: list[tuple[str, str, str, str | None]]) -> list[dict]:
    """Per case (whole-load directory, sliced-load directory, dtype, EP placement) both shards of this rank:
    {name: (full bits, sliced bits)} over every parameter and buffer, and the names of each's entries (to check
    that neither has one the other lacks). One detcomm.init for all the cases."""
    import detcomm
    from detcomm.hf import Checkpoint, EPConfig, checkpoint_config, load_causal_lm, meta_model
    from detcomm.hf.layers import StepRows
    from detcomm.hf.shard import shard_model
    from detcomm.hf.sliced import fill
    from detcomm.moe import Placement

    torch.set_num_threads(1)
    detcomm.init(numerics="rl-bitwise")
    out = []
    try:
        for full_dir, sliced_dir, dtype_name, ep in cases:
            dtype = getattr(torch, dtype_name)
            config = checkpoint_config(full_dir, dtype=dtype)
            experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
            placement = {None: None, "round_robin": lambda: Placement.round_robin(experts, w),
                         "random": lambda: Placement.random(experts, w, seed=5, max_replicas=2)}[ep]
            cfg = None if ep is None else EPConfig(placement=placement())  # type: ignore[misc]
            full = load_causal_lm(full_dir, dtype=dtype)
            shard_model(full, rank=rank, world=w, step=StepRows(), ep=cfg)
            meta = meta_model(checkpoint_config(sliced_dir, dtype=dtype), dtype=dtype)
            shards = shard_model(meta, rank=rank, world=w, step=StepRows(), ep=cfg)
            fill(meta, shards, Checkpoint(sliced_dir), dtype=dtype)
            a, b = full.state_dict(), meta.state_dict()
            out.append({"keys": (sorted(a), sorted(b)),
                        "tensors": {k: (_bits(a[k]), _bits(b[k])) for k in a if k in b},
                        "dtypes": {k: (str(a[k].dtype), str(b[k].dtype)) for k in a if k in b},
                        "kv": (shards.kv_heads, shards.heads)})
    finally:
        detcomm.shutdown()
    return out


def _check_identical(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        full_keys, sliced_keys = res["keys"]
        assert full_keys == sliced_keys, (rank, set(full_keys) ^ set(sliced_keys))
        for k, (x, y) in res["tensors"].items():
            assert res["dtypes"][k][0] == res["dtypes"][k][1], (rank, k, res["dtypes"][k])
            assert x.shape == y.shape and np.array_equal(x, y), (rank, k)


CASES = {  # W: (config, dtype, EP placement, max_shard_size)
    3: [("llama-tiny", "bfloat16", None, "300KB"),  # several safetensors files and an index
        ("qwen3-tiny", "bfloat16", None, None),  # tied LM head; per-head q/k norms
        ("qwen2-moe-tiny", "float32", "round_robin", None)],  # q/k/v biases, shared expert, dense layer 0, tied
    4: [("mixtral-tiny", "bfloat16", "random", "400KB"),  # block_sparse_moe.experts.E.w1/w3/w2 in the checkpoint
        ("qwen3-kv2-tiny", "bfloat16", None, None),  # 2 KV heads over 4 ranks: each replicated twice
        ("qwen2-moe-kv2-tiny", "bfloat16", "round_robin", None)],
}
FLIPPED = "model.layers.1.self_attn.k_proj.weight"


def _flip_one_bit(good: str, bad: str) -> None:
    """A copy of checkpoint ``good`` with one bit of one k_proj element flipped: row 48, the first row of KV head 1
    (head_dim 48, hidden 192)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    flat = tensors[FLIPPED].view(torch.int32).reshape(-1)
    flat[48 * 192 + 5] ^= 1
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:  # noqa: ANN001
    """Every case, one cluster job per W; at W = 4 also fp32 qwen3-kv2-tiny (the numpy oracle's) and the
    one-bit-flipped copy of it (the negative control)."""
    base = tmp_path_factory.mktemp("sliced")
    out: dict = {}
    for w, cases in CASES.items():
        jobs, dirs = [], []
        for name, dtype, ep, size in cases:
            d = write_tiny_checkpoint(name, str(base / f"{name}-W{w}"), seed=11, max_shard_size=size)
            dirs.append(d)
            jobs.append((d, d, dtype, ep))
        if w == 4:
            good = write_tiny_checkpoint("qwen3-kv2-tiny", str(base / "fp32"), seed=12)
            _flip_one_bit(good, str(base / "flipped"))
            jobs += [(good, good, "float32", None), (good, str(base / "flipped"), "float32", None)]
            out["fp32"] = good
        out[w] = (dirs, get_cluster(w).run(job_sliced_vs_full, jobs))  # [rank][case]
    return out


@pytest.mark.parametrize("w", sorted(CASES))
def test_sliced_load_same_bits(w: int, runs: dict) -> None:
    dirs, results = runs[w]
    for i, ((name, _, _, size), d) in enumerate(zip(CASES[w], dirs)):
        if size is not None:
            assert os.path.isfile(os.path.join(d, "model.safetensors.index.json")), name
            assert len({f for f in os.listdir(d) if f.endswith(".safetensors")}) > 1, name
        _check_identical([per_rank[i] for per_rank in results])


def test_kv_replication_slices_match_numpy_oracle(runs: dict) -> None:
    """fp32, so the checkpoint's values are the parameters' (no cast): every rank's q/k/v/o slices of every layer
    against numpy slices of the file, from the definition."""
    from safetensors.numpy import load_file

    w, heads, kv, hd = 4, 4, 2, 48
    ref = load_file(os.path.join(runs["fp32"], "model.safetensors"))
    results = [per_rank[len(CASES[4])] for per_rank in runs[4][1]]
    _check_identical(results)
    for r, res in enumerate(results):
        assert res["kv"] == (1, heads // w)
        kvh = r // (w // kv)
        q = slice(r * heads // w * hd, (r + 1) * heads // w * hd)
        for layer in range(2):
            p = f"model.layers.{layer}.self_attn."
            want = {"q_proj": ref[p + "q_proj.weight"][q], "o_proj": ref[p + "o_proj.weight"][:, q],
                    "k_proj": ref[p + "k_proj.weight"][kvh * hd : (kvh + 1) * hd],
                    "v_proj": ref[p + "v_proj.weight"][kvh * hd : (kvh + 1) * hd]}
            for m, arr in want.items():
                got = res["tensors"][p + m + ".weight"][1]
                assert np.array_equal(got, np.ascontiguousarray(arr).view(np.int32)), (r, layer, m)


def test_negative_control_one_flipped_bit(runs: dict) -> None:
    """The sliced load of the one-bit-flipped copy against the whole load of the original: the comparison must
    fail on exactly the ranks whose replicated KV head holds the bit (KV head 1: ranks 2 and 3), on that
    parameter only."""
    results = [per_rank[len(CASES[4]) + 1] for per_rank in runs[4][1]]
    for r, res in enumerate(results):
        differ = [k for k, (x, y) in res["tensors"].items() if not np.array_equal(x, y)]
        assert differ == ([FLIPPED] if r >= 2 else []), (r, differ)
    with pytest.raises(AssertionError):
        _check_identical(results)
