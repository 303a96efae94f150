"""detcomm.rl's GRPO loop on a GPU host: a rollout engine at W_s = 4 and a trainer at W_t = 2, their ranks sharing
the GPUs (gloo, rank r on cuda:r mod the GPU count; sharing ranks stage the native collectives through host memory
and the workspace serves the tree sites), fp32 and bf16, 3 RL steps: every logprob equal before each step and
after the last sync (largest |delta| exactly 0). Negative control: the trainer side in the fold layout at W_t = 2
is refused by the contract and by the gate. Prints each step's rollout and train tokens/s (run with -s).

    python -m pytest -q -s -m gpu tests/gpu/test_rl_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from detcomm.errors import ContractMismatch
from detcomm.hf import write_tiny_checkpoint
from detcomm.rl.loop import GRPOLoop

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 77, 300, 2, 999, 41], [12, 640, 8], [400, 401, 402, 403]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_loop_exact_on_gpu(dtype: str, tmp_path) -> None:  # noqa: ANN001
    from clusters import get_cluster

    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    rollout, trainer = get_cluster(4), get_cluster(2)
    loop = GRPOLoop(directory, rollout=rollout, trainer=trainer, lr=1e-2, dtype=dtype, device="cuda")
    try:
        assert loop.contracts["rollout"]["device"] == "cuda"
        loop.check_contract()
        for _ in range(3):
            r = loop.step(PROMPTS, group=4, max_new_tokens=8)
            print(f"{dtype} step {r.step}: delta {r.delta!r}, rollout {r.rollout_tps:.0f} tok/s, "
                  f"train {r.train_tps:.0f} tok/s")
            assert r.refused is None and r.delta == 0.0, r
        assert loop.check(PROMPTS, max_new_tokens=8) == 0.0
    finally:
        loop.close()
    control = GRPOLoop(directory, rollout=rollout, trainer=trainer, control=True, dtype=dtype, device="cuda")
    try:
        with pytest.raises(ContractMismatch, match="layout: 'fold' != 'virtual'"):
            control.check_contract()
        report = control.step(PROMPTS, group=2, max_new_tokens=4)
        assert report.refused is not None and report.delta > 0.0
    finally:
        control.close()


def _gpu_engine(rank: int, directory: str, impl: str):  # noqa: ANN202
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise", device=f"cuda:{rank % torch.cuda.device_count()}")
    return TPCausalLM(load_causal_lm(directory, dtype=torch.float32),
                      ServingConfig(t_pad=64, max_context=128, attention_impl=impl),
                      layout="virtual", virtual_shards=8, shard_fold="tree")


def job_triton_rollout(rank: int, w: int, directory: str) -> list:
    import detcomm
    from test_rl_trainer import NEW
    from test_rl_trainer import PROMPTS as LONG

    try:
        lm = _gpu_engine(rank, directory, "triton")
        return [(t, lp.cpu()) for t, lp in lm.generate(LONG, max_new_tokens=NEW)]
    finally:
        detcomm.shutdown()


def job_triton_trainer(rank: int, w: int, directory: str, seqs: list[list[int]], starts: list[int]) -> dict:
    import detcomm
    from detcomm.rl.reshard import gather_full
    from detcomm.rl.trainer import Trainer, teacher_forced

    try:
        lm = _gpu_engine(rank, directory, "triton")
        tr = Trainer(lm)
        lps = tr.token_logprobs(seqs, starts)
        tr.backward(torch.stack([lp.sum() for lp in lps]).sum())
        grads = {n: g.cpu() for n, g in gather_full(lm, grad=True).items()}
        other = teacher_forced(_gpu_engine(rank, directory, "torch"), seqs, starts, grad=False)
    finally:
        detcomm.shutdown()
    return {"logprobs": [lp.detach().cpu() for lp in lps], "grads": grads, "torch_impl": [lp.cpu() for lp in other]}


def test_trainer_on_the_triton_attention(tmp_path) -> None:  # noqa: ANN001
    """The trainer over the engine CUDA serves with (Triton paged attention, no autograd of its own: forward its
    bits, backward the torch impl's gradient): a W_s = 2 rollout's greedy logprobs (a sequence longer than T_pad
    among them) bit-equal at W_t = 1, the gradients within the fp64 bound. Negative control: the torch impl's
    recompute does not give the rollout's bits (the impl is part of the arithmetic: the contract's field)."""
    from clusters import get_cluster
    from test_rl_trainer import GRAD_BOUND, LP_BOUND, _grad_errors, _reference
    from test_rl_trainer import PROMPTS as LONG

    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    rolled = get_cluster(2).run(job_triton_rollout, directory)[0]
    seqs = [p + t for p, (t, _) in zip(LONG, rolled)]
    starts = [len(p) for p in LONG]
    got = get_cluster(1).run(job_triton_trainer, directory, seqs, starts)[0]
    for i, (a, (_, want)) in enumerate(zip(got["logprobs"], rolled)):
        assert torch.equal(a.view(torch.int32), want.view(torch.int32)), (i, a - want)
    ref64, grad64 = _reference(directory, seqs, starts, torch.float64)
    assert max(float((a.double() - b).abs().max()) for a, b in zip(got["logprobs"], ref64)) < LP_BOUND
    errors = _grad_errors(got["grads"], grad64)
    assert max(errors.values()) < GRAD_BOUND, {n: e for n, e in errors.items() if e >= GRAD_BOUND}
    print(f"triton trainer: max grad error {max(errors.values()):.2e} (bound {GRAD_BOUND})")
    assert any(not torch.equal(a, want) for a, (_, want) in zip(got["torch_impl"], rolled)), \
        "the torch impl gave the Triton rollout's bits: the equality would not bite"
