"""detcomm.rl trains a checkpoint with biases after o_proj and down_proj (Llama, ``attention_bias`` and ``mlp_bias``).

The engine serves such a boundary as the layer's own all-reduce, the whole bias added once after it, then the local
canonical add + norm; the trainer runs that arithmetic with autograd (``regions.reduce_partials``, ``add_bias``,
``add_norm(site=None)``). A W_s = 4 rollout (greedy and T = 1 sampled) against a trainer at W_t = 1 and 2: the
logprobs bit-equal; the logprobs and every gradient (the biases' too) within a bound of transformers' fp64 forward
and autograd; every trainer rank holds the same bias-gradient bits; after an AdamW step and the weight sync the
W_s = 4 engine's logprobs equal the trainer's again. Negative controls: the bias added before the reduction (to rank
0's first partial: the same value in exact arithmetic) breaks the equality; at W_t = 2 the local boundary without
the all-reduce of its gradient (``bypass_local_boundaries``: the bare ``add_rms_norm``, the same forward) misses the
bound (at W_t = 1, where nothing is missing, it is met), and the trainer refuses an engine that bypasses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from detcomm.errors import ContractMismatch
from detcomm.rl.contract import Contract
from detcomm.rl.gate import check_contract
from test_rl_trainer import GRAD_BOUND, LP_BOUND, PROMPTS, _grad_errors, _reference, job_rollout

ROW_BIASES = ("self_attn.o_proj.bias", "mlp.down_proj.bias")


def _biased_llama(directory: str) -> str:
    """llama-tiny with every projection biased, seeded; the biases drawn nonzero (transformers zeroes them, which
    would hide a dropped one)."""
    import transformers

    from detcomm.hf.checkpoints import tiny_config

    cfg = tiny_config("llama-tiny")
    cfg.attention_bias = cfg.mlp_bias = True
    cfg._attn_implementation = "eager"
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(11)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                for proj in (a.o_proj, m.down_proj):
                    proj.bias.normal_(0.0, 0.5)
                for proj in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
                    proj.bias.normal_(0.0, 0.1)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def bypass_local_boundaries() -> Iterator[None]:
    """The negative control: the engine's local boundary (``site=None``) as the bare ``add_rms_norm``, the same
    forward without the all-reduce of its gradient; the sites' boundaries unchanged."""
    from detcomm.numerics.norm import add_rms_norm
    from detcomm.rl import regions

    real = regions.add_norm

    def add_norm(x, residual, weight, *, eps, site):  # noqa: ANN001, ANN202
        if site is None:
            return add_rms_norm(x, residual, weight, eps=eps)
        return real(x, residual, weight, eps=eps, site=site)

    regions.add_norm = add_norm  # type: ignore[assignment]
    try:
        yield
    finally:
        regions.add_norm = real


def _bias_before_sum() -> None:
    """The negative control: each biased row projection adds its bias to rank 0's first fp32 partial, before the
    reduction (the same value in exact arithmetic, other roundings)."""
    from detcomm.hf.layers import InvariantRowLinear
    from detcomm.rl import regions

    def forward(self, x):  # noqa: ANN001, ANN202
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0] if self._step.rows is None else self._step.rows
        parts = self.layer.partials(flat, rows)
        if self.bias is not None and self.layer.rank == 0:
            parts = torch.cat([(parts[0] + self.bias.float())[None], parts[1:]]).contiguous()
        out = torch.zeros(flat.shape[0], self.out_features, dtype=self.layer.dtype, device=flat.device)
        out[:rows] = regions.reduce_partials(parts, site=self.layer.site)
        return out.view(*x.shape[:-1], self.out_features)

    InvariantRowLinear.forward = forward  # type: ignore[method-assign]


def _engine(directory: str):  # noqa: ANN202
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    return TPCausalLM(load_causal_lm(directory, dtype=torch.float32), ServingConfig(t_pad=64, max_context=128),
                      layout="virtual", virtual_shards=8, shard_fold="tree")


def job_bias_trainer(rank: int, w: int, directory: str, seqs: list[list[int]], starts: list[int]) -> dict:
    """Recompute, gradients (and the local boundary's without its all-reduce), one AdamW step, the whole weights
    and the trainer's logprobs after the step."""
    import detcomm
    from detcomm.rl.reshard import gather_full
    from detcomm.rl.trainer import Trainer

    torch.set_num_threads(1)
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise")
    try:
        lm = _engine(directory)
        tr = Trainer(lm, lr=1e-2)
        with bypass_local_boundaries():  # the control: no all-reduce of the local boundary's gradient
            tr.backward(torch.stack([lp.sum() for lp in tr.token_logprobs(seqs, starts)]).sum())
        local = gather_full(lm, grad=True)
        lps = tr.token_logprobs(seqs, starts)
        tr.backward(torch.stack([lp.sum() for lp in lps]).sum())
        grads = gather_full(lm, grad=True)
        mine = {f"{i}.{n}": getattr(getattr(layer, n.split(".")[0]), n.split(".")[1]).bias.grad.clone()
                for i, layer in enumerate(lm.layers) for n in ("self_attn.o_proj", "mlp.down_proj")}
        tr.opt.step()
        after = tr.token_logprobs(seqs, starts)
        full = tr.full_weights()
    finally:
        detcomm.shutdown()
    return {"logprobs": [lp.detach() for lp in lps], "grads": grads, "bias_grads": mine,
            "after": [lp.detach() for lp in after], "full": full, "local": local}


def job_synced(rank: int, w: int, directory: str, full: dict, seqs: list[list[int]], starts: list[int]) -> list:
    """The rollout engine after the weight sync: its own (no-autograd) logprobs of the sequences."""
    import detcomm
    from detcomm.rl.reshard import load_full
    from detcomm.rl.trainer import teacher_forced

    torch.set_num_threads(1)
    detcomm.shutdown()
    detcomm.init(numerics="rl-bitwise")
    try:
        lm = _engine(directory)
        load_full(lm, full)
        return teacher_forced(lm, seqs, starts, grad=False)
    finally:
        detcomm.shutdown()


def job_control(rank: int, w: int, directory: str, seqs: list[list[int]], starts: list[int]) -> dict:
    """The bias added before the reduction (its logprobs); an engine bypassing the local boundary refused; the
    contract."""
    import detcomm
    from detcomm.hf.layers import InvariantRowLinear
    from detcomm.rl.contract import contract
    from detcomm.rl.trainer import Trainer, teacher_forced

    torch.set_num_threads(1)
    detcomm.shutdown()
    detcomm.init(numerics="rl-bitwise")
    real = InvariantRowLinear.forward
    try:
        lm = _engine(directory)
        Trainer(lm)  # the engine as it is: accepted
        try:
            with bypass_local_boundaries():
                Trainer(lm)
            refused = None
        except ValueError as e:
            refused = str(e)
        fields = contract(lm).fields
        _bias_before_sum()
        return {"refused": refused, "before_sum": teacher_forced(lm, seqs, starts, grad=False), "contract": fields}
    finally:
        InvariantRowLinear.forward = real  # type: ignore[method-assign]
        detcomm.shutdown()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.slow
def test_biased_row_projections_train_exactly(tmp_path, cluster2, cluster4) -> None:  # noqa: ANN001
    from clusters import get_cluster

    directory = _biased_llama(str(tmp_path))
    rolled = cluster4.run(job_rollout, directory)[0]
    outs = rolled["greedy"] + rolled["sampled"]
    seqs = [p + t for p, (t, _) in zip(PROMPTS * 2, outs)]
    starts = [len(p) for p in PROMPTS] * 2
    ref64, grad64 = _reference(directory, seqs, starts, torch.float64)
    assert all(f"model.layers.{i}.{n}" in grad64 for i in (0, 1) for n in ROW_BIASES)
    for w, cluster in ((1, get_cluster(1)), (2, cluster2)):
        ranks = cluster.run(job_bias_trainer, directory, seqs, starts)
        for r in ranks:
            for i, (got, (_, want)) in enumerate(zip(r["logprobs"], outs)):
                assert _bits_equal(got, want), (w, i, got - want)
            for n, g in r["bias_grads"].items():  # a replicated parameter: one gradient, bit for bit
                assert torch.equal(g, ranks[0]["bias_grads"][n]), (w, n)
        got = ranks[0]
        assert max(float((a.double() - b).abs().max()) for a, b in zip(got["logprobs"], ref64)) < LP_BOUND
        errors = _grad_errors(got["grads"], grad64)
        assert max(errors.values()) < GRAD_BOUND, {n: e for n, e in errors.items() if e >= GRAD_BOUND}
        if w == 1:  # at one rank nothing is missing: the control's gradients are within the bound
            assert max(_grad_errors(got["local"], grad64).values()) < GRAD_BOUND
        if w == 2:  # without the all-reduce of the local boundary's gradient: each rank's own heads' part only
            assert max(_grad_errors(got["local"], grad64).values()) > GRAD_BOUND
        synced = cluster4.run(job_synced, directory, got["full"], seqs, starts)[0]
        for i, (a, b, before) in enumerate(zip(synced, got["after"], got["logprobs"])):
            assert _bits_equal(a, b), (w, i, a - b)
            assert not torch.equal(a, before), "the step left the logprobs as they were: the sync would not bite"
    control = get_cluster(1).run(job_control, directory, seqs, starts)[0]
    assert control["refused"] is not None and "regions.add_norm(..., site=None)" in control["refused"], control
    assert any(not _bits_equal(a, b) for a, (_, b) in zip(control["before_sum"], outs)), \
        "the bias added before the reduction gave the rollout's bits: the equality would not bite"
    fields = control["contract"]  # the biases are the model's configuration: a bias-free side is refused by name
    assert fields["config.attention_bias"] is True and fields["config.mlp_bias"] is True
    with pytest.raises(ContractMismatch, match=r"in 1 field\(s\) .*: config.mlp_bias: False != True"):
        check_contract(Contract(dict(fields, **{"config.mlp_bias": False})), Contract(fields))
