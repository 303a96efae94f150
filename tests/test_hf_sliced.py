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


def job_sliced_vs_full(rank: int, w: int, full_dir: str, sliced_dir: str, dtype_name: str, ep: str | None) -> dict:
    """Both shards of this rank: {name: (full bits, sliced bits)} over every parameter and buffer, and the
    names of each's parameters (to check that neither has one the other lacks)."""
    import detcomm
    from detcomm.hf import Checkpoint, EPConfig, checkpoint_config, load_causal_lm, meta_model
    from detcomm.hf.layers import StepRows
    from detcomm.hf.shard import shard_model
    from detcomm.hf.sliced import fill
    from detcomm.moe import Placement

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    detcomm.init(numerics="rl-bitwise")
    try:
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
        return {"keys": (sorted(a), sorted(b)),
                "tensors": {k: (_bits(a[k]), _bits(b[k])) for k in a if k in b},
                "dtypes": {k: (str(a[k].dtype), str(b[k].dtype)) for k in a if k in b},
                "kv": (shards.kv_heads, shards.heads)}
    finally:
        detcomm.shutdown()


def _check_identical(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        full_keys, sliced_keys = res["keys"]
        assert full_keys == sliced_keys, (rank, set(full_keys) ^ set(sliced_keys))
        for k, (x, y) in res["tensors"].items():
            assert res["dtypes"][k][0] == res["dtypes"][k][1], (rank, k, res["dtypes"][k])
            assert x.shape == y.shape and np.array_equal(x, y), (rank, k)


CASES = [  # (config, W, dtype, EP placement, max_shard_size)
    ("llama-tiny", 3, "bfloat16", None, "300KB"),  # several safetensors files and an index
    ("qwen3-tiny", 3, "bfloat16", None, None),  # tied LM head; per-head q/k norms
    ("qwen2-moe-tiny", 3, "float32", "round_robin", None),  # q/k/v biases, shared expert, dense layer 0, tied head
    ("mixtral-tiny", 4, "bfloat16", "random", "400KB"),  # block_sparse_moe.experts.E.w1/w3/w2 in the checkpoint
    ("qwen3-kv2-tiny", 4, "bfloat16", None, None),  # 2 KV heads over 4 ranks: each replicated twice
    ("qwen2-moe-kv2-tiny", 4, "bfloat16", "round_robin", None),
]


@pytest.mark.parametrize(("name", "w", "dtype", "ep", "shard_size"), CASES, ids=[f"{c[0]}-W{c[1]}" for c in CASES])
def test_sliced_load_same_bits(name: str, w: int, dtype: str, ep: str | None, shard_size: str | None,
                               tmp_path) -> None:  # noqa: ANN001
    d = write_tiny_checkpoint(name, str(tmp_path / "ckpt"), seed=11, max_shard_size=shard_size)
    if shard_size is not None:
        assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    _check_identical(get_cluster(w).run(job_sliced_vs_full, d, d, dtype, ep))


def test_kv_replication_slices_match_numpy_oracle(tmp_path) -> None:  # noqa: ANN001
    """fp32, so the checkpoint's values are the parameters' (no cast): every rank's q/k/v/o slices of every layer
    against numpy slices of the file, from the definition."""
    from safetensors.numpy import load_file

    d = write_tiny_checkpoint("qwen3-kv2-tiny", str(tmp_path / "ckpt"), seed=12)
    w, heads, kv, hd = 4, 4, 2, 48
    ref = load_file(os.path.join(d, "model.safetensors"))
    results = get_cluster(w).run(job_sliced_vs_full, d, d, "float32", None)
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


def test_negative_control_one_flipped_bit(tmp_path) -> None:  # noqa: ANN001
    """One bit of one k_proj element flipped in a copy of the checkpoint: the comparison must fail on exactly the
    ranks whose replicated KV head holds it (KV head 1: ranks 2 and 3 at W = 4), on that parameter only."""
    from safetensors.torch import load_file, save_file

    good = write_tiny_checkpoint("qwen3-kv2-tiny", str(tmp_path / "good"), seed=12)
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    key = "model.layers.1.self_attn.k_proj.weight"
    flat = tensors[key].view(torch.int32).reshape(-1)
    flat[48 * 192 + 5] ^= 1  # row 48: the first row of KV head 1 (head_dim 48, hidden 192)
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    results = get_cluster(4).run(job_sliced_vs_full, good, bad, "float32", None)
    for r, res in enumerate(results):
        differ = [k for k, (x, y) in res["tensors"].items() if not np.array_equal(x, y)]
        assert differ == ([key] if r >= 2 else []), (r, differ)
    with pytest.raises(AssertionError):
        _check_identical(results)
