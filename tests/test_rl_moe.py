"""detcomm.rl trains expert-parallel MoE blocks (Qwen3-MoE: 8 experts, top-4 renormalized, tied head, q/k norms).

Each rank dispatches its chunk of a step's rows; the backward sends the experts' output gradients back along the
dispatch's path and the rows' gradients along the combine's (``detcomm.rl.regions``), and the trainer sums the
blocks' parameter gradients over the ranks. A W_s = 4 rollout (greedy and T = 1 sampled) against a trainer at
W_t = 1 and 2: the logprobs bit-equal; the logprobs and every gradient (router, experts) within a bound of
transformers' fp64 forward and autograd; every trainer rank holds the same MoE-gradient bits; after an AdamW step
and the weight sync the W_s = 4 engine's logprobs equal the trainer's again. Negative control: at W_t = 2 without
the sum of the blocks' gradients over the ranks (each rank's chunk's part only) the bound is missed (at W_t = 1,
where the chunk is every row, it is met); transformers' own fp32 forward does not give the rollout's bits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from detcomm.hf import write_tiny_checkpoint
from test_rl_bias import _bits_equal, _engine, job_synced
from test_rl_trainer import GRAD_BOUND, LP_BOUND, PROMPTS, _grad_errors, job_rollout


def _reference(directory: str, seqs: list[list[int]], starts: list[int],  # noqa: ANN202
               dtype: torch.dtype = torch.float64):
    """transformers' own forward of the unsharded model in ``dtype`` (its eager experts: the grouped GEMM has no
    fp64), each sequence's logprobs and the gradients of their sum."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                              experts_implementation="eager").to(dtype)
    lps = []
    for seq, st in zip(seqs, starts):
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].to(dtype), dim=-1)
        lps.append(lp[torch.arange(st - 1, len(seq) - 1), torch.tensor(seq[st:])])
    torch.stack([lp.sum() for lp in lps]).sum().backward()
    return [lp.detach() for lp in lps], {n: p.grad for n, p in model.named_parameters()}


def job_moe_trainer(rank: int, w: int, directory: str, seqs: list[list[int]], starts: list[int]) -> dict:
    import detcomm
    from detcomm.rl.reshard import gather_full
    from detcomm.rl.trainer import Trainer

    torch.set_num_threads(1)
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise")
    try:
        lm = _engine(directory)
        tr = Trainer(lm, lr=1e-2)
        moe_params, tr.moe_params = tr.moe_params, []  # the control: each rank keeps its chunk's part
        tr.backward(torch.stack([lp.sum() for lp in tr.token_logprobs(seqs, starts)]).sum())
        partial = gather_full(lm, grad=True)
        tr.moe_params = moe_params
        lps = tr.token_logprobs(seqs, starts)
        tr.backward(torch.stack([lp.sum() for lp in lps]).sum())
        grads = gather_full(lm, grad=True)
        mine = [t.grad.clone() for t in tr.moe_params]
        tr.opt.step()
        after = tr.token_logprobs(seqs, starts)
        full = tr.full_weights()
    finally:
        detcomm.shutdown()
    return {"logprobs": [lp.detach() for lp in lps], "grads": grads, "moe_grads": mine,
            "after": [lp.detach() for lp in after], "full": full, "partial": partial}


@pytest.mark.slow
def test_moe_trains_exactly(tmp_path, cluster2, cluster4) -> None:  # noqa: ANN001
    from clusters import get_cluster

    directory = write_tiny_checkpoint("qwen3-moe-tiny", str(tmp_path), seed=3)
    rolled = cluster4.run(job_rollout, directory)[0]
    outs = rolled["greedy"] + rolled["sampled"]
    seqs = [p + t for p, (t, _) in zip(PROMPTS * 2, outs)]
    starts = [len(p) for p in PROMPTS] * 2
    ref64, grad64 = _reference(directory, seqs, starts)
    ref32, _ = _reference(directory, seqs, starts, torch.float32)
    assert any(not _bits_equal(a, b) for a, (_, b) in zip(ref32, outs)), \
        "transformers' own fp32 forward gave the rollout's bits: the equality would not bite"
    moe_names = [n for n in grad64 if ".mlp." in n]
    assert moe_names and all(grad64[n].abs().max() > 0 for n in moe_names)
    for w, cluster in ((1, get_cluster(1)), (2, cluster2)):
        ranks = cluster.run(job_moe_trainer, directory, seqs, starts)
        for r in ranks:
            for i, (got, (_, want)) in enumerate(zip(r["logprobs"], outs)):
                assert _bits_equal(got, want), (w, i, got - want)
            for a, b in zip(r["moe_grads"], ranks[0]["moe_grads"]):  # replicated: one gradient, bit for bit
                assert torch.equal(a, b), w
        got = ranks[0]
        assert max(float((a.double() - b).abs().max()) for a, b in zip(got["logprobs"], ref64)) < LP_BOUND
        errors = _grad_errors(got["grads"], grad64)
        assert max(errors.values()) < GRAD_BOUND, {n: e for n, e in errors.items() if e >= GRAD_BOUND}
        if w == 1:  # at one rank the chunk is every row: the control is within the bound
            assert max(_grad_errors(got["partial"], grad64).values()) < GRAD_BOUND
        if w == 2:
            bad = _grad_errors(got["partial"], grad64)
            assert max(bad[n] for n in moe_names) > GRAD_BOUND, "the sum over the ranks did not matter"
        synced = cluster4.run(job_synced, directory, got["full"], seqs, starts)[0]
        for i, (a, b, before) in enumerate(zip(synced, got["after"], got["logprobs"])):
            assert _bits_equal(a, b), (w, i, a - b)
            assert not torch.equal(a, before), "the step left the logprobs as they were: the sync would not bite"


def job_placement_refused(rank: int, w: int, directory: str) -> str:
    import detcomm
    from detcomm.hf import EPConfig, ServingConfig, TPCausalLM, load_causal_lm
    from detcomm.moe import Placement
    from detcomm.rl.trainer import Trainer

    torch.set_num_threads(1)
    detcomm.shutdown()
    detcomm.init(numerics="rl-bitwise")
    try:
        lm = TPCausalLM(load_causal_lm(directory, dtype=torch.float32), ServingConfig(t_pad=64, max_context=64),
                        ep=EPConfig(placement=Placement.round_robin(8, w)), layout="virtual", virtual_shards=8,
                        shard_fold="tree")
        try:
            Trainer(lm)
        except ValueError as e:
            return str(e)
        return "accepted"
    finally:
        detcomm.shutdown()


@pytest.mark.slow
def test_moe_placement_refused(tmp_path, cluster2) -> None:  # noqa: ANN001
    """Experts spread over the ranks (each on one) are refused with the fix: the trainer trains every expert on
    every rank."""
    directory = write_tiny_checkpoint("qwen3-moe-tiny", str(tmp_path), seed=3)
    for msg in cluster2.run(job_placement_refused, directory):
        assert "every expert on every rank" in msg and "ep=None" in msg, msg
