"""detcomm.hf on real spawned gloo ranks: the sharded transformers model computes what the unsharded one does
(to rounding: sharding changes the summation order, so this is a tolerance check of the wiring, the probe is
the bitwise one), transformers' own forward still runs on the sharded model, and wrong geometries are
refused with the fix.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from detcomm.hf import TINY_CONFIGS, write_tiny_checkpoint
from detcomm.hf.checkpoints import tiny_config
from detcomm.hf.layers import vocab_shard_width
from detcomm.hf.shard import check_divisible

PROMPT = [5, 77, 300, 2, 999, 41, 12, 640, 8, 3, 700, 15]


def job_against_unsharded(rank: int, w: int, directory: str) -> tuple[float, float, float, list[int], list[int]]:
    """Max |logit difference| of the sharded engine and of transformers' forward on the sharded model
    against the unsharded model, the engine's largest logprob error, and the greedy tokens of both."""
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm
    from detcomm.probe.model import Segment

    torch.set_num_threads(1)
    ref_model = load_causal_lm(directory, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].float()  # [T, vocab]
    ref_greedy = ref_model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    detcomm.init(numerics="rl-bitwise")
    try:
        lm = TPCausalLM(load_causal_lm(directory, dtype=torch.float32), ServingConfig(t_pad=64, max_context=64))
        logits, _ = lm.forward([Segment(lm.new_cache(), PROMPT, 0)])
        with torch.no_grad():  # transformers' own forward on the sharded modules (gathers the head's shards)
            own = lm.model(torch.tensor([PROMPT])).logits[0].float()
        step_lp = lm.logprobs(logits)[0]
        engine_last = logits.buf[len(PROMPT) - 1]
        v0 = rank * lm.shards.vocab_width
        shard_ref = ref[len(PROMPT) - 1, v0 : v0 + lm.shards.vocab_width]
        engine_err = float((engine_last[: shard_ref.numel()] - shard_ref).abs().max())
        own_err = float((own - ref).abs().max())
        lp_err = float((step_lp - torch.log_softmax(ref[len(PROMPT) - 1], -1)).abs().max())
        tokens, _ = lm.generate([PROMPT], max_new_tokens=4)[0]
    finally:
        detcomm.shutdown()
    return engine_err, own_err, lp_err, tokens, ref_greedy[0, len(PROMPT):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_sharded_matches_unsharded(name: str, tmp_path, cluster2) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint(name, str(tmp_path), seed=3)
    for engine_err, own_err, lp_err, tokens, ref_tokens in cluster2.run(job_against_unsharded, directory):
        assert engine_err < 1e-4 and own_err < 1e-4 and lp_err < 1e-4, (engine_err, own_err, lp_err)
        assert tokens == ref_tokens


def test_head_count_refused_with_the_fix() -> None:
    cfg = tiny_config("llama-tiny")  # 24 attention heads, 12 KV heads, intermediate 384
    check_divisible(cfg, 3)
    check_divisible(cfg, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads=12.* does not divide by 5: .*\[1, 2, 3, 4, 6, 12\]"):
        check_divisible(cfg, 5)
    cfg.num_key_value_heads = 8
    with pytest.raises(ValueError, match=r"num_key_value_heads=8 does not divide by 3: .*world size in \[1, 2, 4, 8\]"):
        check_divisible(cfg, 3)


def test_unsupported_family_refused() -> None:
    import transformers

    with pytest.raises(ValueError, match="not supported"):
        check_divisible(transformers.GPT2Config(), 2)


def test_vocab_shard_width() -> None:
    assert vocab_shard_width(1024, 4) == 256
    assert vocab_shard_width(1000, 3) == 384  # ceil(1000 / 3) = 334, padded to a multiple of 64
    with pytest.raises(ValueError, match="too small"):
        vocab_shard_width(100, 4)
