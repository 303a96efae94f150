"""detcomm.hf's engine on a GPU with its CUDA attention impl (the Triton paged-attention kernel): the checks of
tests/test_hf_paged.py with the engine's tensors on cuda:0, W = 1 and 2 ranks sharing the device over gloo:
a request's logprob bits are the same alone, chunked and packed, and teacher forced; its logits match
transformers' unsharded model (window included); the split-KV negative control fails."""

from __future__ import annotations

import pytest

import test_hf_paged as t
from clusters import get_cluster
from detcomm.hf import write_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [1, 2])
def test_engine_bits_on_cuda_with_triton(world: int, tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("mistral-tiny", str(tmp_path), seed=3)
    for r in get_cluster(world).run(t.job_paged_bits, directory, False, "cuda:0"):
        assert r["impl"] == "triton"
        assert r["tokens"][0] == r["tokens"][1]
        assert r["packed"] == 0 and r["forced"] == 0, r
        assert r["freed"] and r["windows"] == [48, 48]
        assert r["err"] < 1e-4 < r["window_effect"], r


def test_negative_control_split_kv_on_cuda(tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("mistral-tiny", str(tmp_path), seed=3)
    for r in get_cluster(2).run(t.job_paged_bits, directory, True, "cuda:0"):
        assert r["packed"] > 0, r
