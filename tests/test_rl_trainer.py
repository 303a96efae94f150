"""detcomm.rl's trainer on real spawned gloo ranks: the engine's own forward with autograd gives, at W_t = 1 and 2,
the bits of the sampling-time logprobs a W_s = 4 rollout produced (greedy through the engine's ``generate``, T = 1
sampling through ``detcomm.rl.rollout.sample``), with a sequence longer than T_pad teacher-forced in two pieces.
Independent checks: the logprobs recomputed in fp64 by transformers' own forward of the unsharded model (within
``LP_BOUND``), and the gradients of the summed logprobs against fp64 autograd (within ``GRAD_BOUND``). Negative
controls: transformers' own fp32 forward does not give the rollout's bits, and at W_t = 2 a backward without the
conjugate all-reduce of the activations' gradients misses the bound. The same equality in bf16 (W_t = 2). W = 3 is
not run: the tree layout's invariance holds at the W that are powers of two dividing V and the model's fixed
block count (8, 4 or 2: docs/spec.md §9.1), never at W = 3. The trainer's KV store keeps each sequence's history
apart (on its table, not under an id() a new table may reuse: tested with the reuse happening).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from detcomm.hf import write_tiny_checkpoint

PROMPTS = [list(range(200, 260)), [5, 77, 300, 2, 999, 41], [12, 640, 8]]  # 60 + 10 rows: two T_pad pieces
NEW = 10
LP_BOUND = 1e-4  # |fp32 engine - fp64 reference| of a logprob (measured: 1.7e-6)
BF16_LP_BOUND = 0.1  # bf16 weights and activations against fp64 (measured: 0.021)
GRAD_BOUND = 1e-3  # max |grad - fp64 grad| / max |fp64 grad| per tensor (measured: 1.3e-6; without the
# conjugate all-reduce at W = 2: 0.97)


def _engine(directory: str, dtype: str = "float32"):  # noqa: ANN202
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    return TPCausalLM(load_causal_lm(directory, dtype=getattr(torch, dtype)), ServingConfig(t_pad=64, max_context=128),
                      layout="virtual", virtual_shards=8, shard_fold="tree")


def job_rollout(rank: int, w: int, directory: str, dtype: str = "float32") -> dict:
    import detcomm
    from detcomm.rl.rollout import sample

    torch.set_num_threads(1)
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise")
    try:
        lm = _engine(directory, dtype)
        return {"greedy": lm.generate(PROMPTS, max_new_tokens=NEW),
                "sampled": sample(lm, PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=11)}
    finally:
        detcomm.shutdown()


def job_trainer(rank: int, w: int, directory: str, seqs: list[list[int]], starts: list[int],
                dtype: str = "float32") -> dict:
    import detcomm
    from detcomm.rl import regions
    from detcomm.rl.reshard import gather_full
    from detcomm.rl.trainer import Trainer

    torch.set_num_threads(1)
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise")
    try:
        lm = _engine(directory, dtype)
        tr = Trainer(lm)
        lps = tr.token_logprobs(seqs, starts)
        tr.backward(torch.stack([lp.sum() for lp in lps]).sum())
        grads = gather_full(lm, grad=True)
        real = regions._grad_sum
        regions._grad_sum = lambda g: g  # type: ignore[assignment]  # the negative control: no conjugate all-reduce
        try:
            tr.backward(torch.stack([lp.sum() for lp in tr.token_logprobs(seqs, starts)]).sum())
        finally:
            regions._grad_sum = real
        bad = gather_full(lm, grad=True)
    finally:
        detcomm.shutdown()
    return {"logprobs": [lp.detach().cpu() for lp in lps], "grads": grads, "bad": bad}


def _reference(directory: str, seqs: list[list[int]], starts: list[int], dtype: torch.dtype):  # noqa: ANN202
    """transformers' own forward of the unsharded model: each sequence's logprobs and the gradients of their sum."""
    from detcomm.hf import load_causal_lm

    model = load_causal_lm(directory, dtype=torch.float32).to(dtype)
    lps = []
    for seq, st in zip(seqs, starts):
        logits = model(torch.tensor([seq])).logits[0].to(dtype)
        lp = torch.log_softmax(logits, dim=-1)
        lps.append(lp[torch.arange(st - 1, len(seq) - 1), torch.tensor(seq[st:])])
    torch.stack([lp.sum() for lp in lps]).sum().backward()
    return [lp.detach() for lp in lps], {n: p.grad for n, p in model.named_parameters()}


def _reference_bf16(directory: str, seqs: list[list[int]], starts: list[int]):  # noqa: ANN202
    """transformers' own bf16 forward (the negative control), its logprobs in fp32 as the engine computes them."""
    from detcomm.hf import load_causal_lm

    model = load_causal_lm(directory, dtype=torch.bfloat16)
    with torch.no_grad():
        lps = [torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)[
            torch.arange(st - 1, len(seq) - 1), torch.tensor(seq[st:])] for seq, st in zip(seqs, starts)]
    return lps, None


def _grad_errors(got: dict, ref: dict) -> dict[str, float]:
    return {n: float((got[n].double() - g).abs().max() / g.abs().max()) for n, g in ref.items()}


def _grad_error(got: dict, ref: dict) -> float:
    return max(_grad_errors(got, ref).values())


@pytest.mark.slow
def test_trainer_logprobs_equal_rollout_at_other_widths(tmp_path, cluster2, cluster4) -> None:  # noqa: ANN001
    from clusters import get_cluster

    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    rolled = cluster4.run(job_rollout, directory)
    for r in rolled[1:]:  # every rollout rank returns the same tokens and bits
        for kind in ("greedy", "sampled"):
            for (t0, l0), (t1, l1) in zip(rolled[0][kind], r[kind]):
                assert t0 == t1 and torch.equal(l0, l1)
    starts = [len(p) for p in PROMPTS] * 2
    seqs = [p + t for p, (t, _) in zip(PROMPTS, rolled[0]["greedy"])] + \
           [p + t for p, (t, _) in zip(PROMPTS, rolled[0]["sampled"])]
    assert [s[-NEW:] for s in seqs[:3]] != [s[-NEW:] for s in seqs[3:]], "sampling gave the greedy tokens"
    rollout_lps = [lp for _, lp in rolled[0]["greedy"]] + [lp for _, lp in rolled[0]["sampled"]]
    ref64, grad64 = _reference(directory, seqs, starts, torch.float64)
    ref32, _ = _reference(directory, seqs, starts, torch.float32)
    for w, cluster in ((1, get_cluster(1)), (2, cluster2)):
        ranks = cluster.run(job_trainer, directory, seqs, starts)
        for r in ranks:
            for i, (got, want) in enumerate(zip(r["logprobs"], rollout_lps)):
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (w, i, got - want)
        for got, want in zip(ranks[0]["logprobs"], ref64):
            assert float((got.double() - want).abs().max()) < LP_BOUND
        assert _grad_error(ranks[0]["grads"], grad64) < GRAD_BOUND, w
        if w == 2:
            assert _grad_error(ranks[0]["bad"], grad64) > GRAD_BOUND, "the gradients' all-reduce did not matter"
    assert any(not torch.equal(a, b) for a, b in zip(ref32, rollout_lps)), \
        "transformers' own fp32 forward gave the rollout's bits: the equality would not bite"


@pytest.mark.slow
def test_trainer_logprobs_equal_rollout_bf16(tmp_path, cluster2, cluster4) -> None:  # noqa: ANN001
    """The same in bf16 (W_s = 4, W_t = 2, greedy and sampled): bit-equal; against the fp64 reference within
    ``BF16_LP_BOUND``; transformers' own bf16 forward does not give the rollout's bits."""
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    rolled = cluster4.run(job_rollout, directory, "bfloat16")[0]
    outs = rolled["greedy"] + rolled["sampled"]
    seqs = [p + t for p, (t, _) in zip(PROMPTS * 2, outs)]
    starts = [len(p) for p in PROMPTS] * 2
    got = cluster2.run(job_trainer, directory, seqs, starts, "bfloat16")[0]["logprobs"]
    for a, (_, b) in zip(got, outs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), a - b
    ref64, _ = _reference(directory, seqs, starts, torch.float64)
    err = max(float((a.double() - b).abs().max()) for a, b in zip(got, ref64))
    assert err < BF16_LP_BOUND, err
    own, _ = _reference_bf16(directory, seqs, starts)
    assert any(not torch.equal(a, b) for a, (_, b) in zip(own, outs)), "transformers' bf16 forward gave the bits"


def job_refusals(rank: int, w: int, directory: str, moe: str) -> list[str]:
    """What the trainer refuses, with the fix: the fold layout; and what it accepts: an MoE model (``moe``) in the
    tree layout (its local boundary goes through detcomm.rl.regions; tests/test_rl_bias.py refuses one that bypasses
    it), an engine on the Triton attention (constructible on CPU; trained on CUDA through its forward and the torch
    impl's gradient: tests/test_rl_served_attention.py, tests/gpu/test_rl_gpu.py)."""
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm
    from detcomm.rl.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    tree = dict(layout="virtual", virtual_shards=8, shard_fold="tree")
    for d, kw, impl in ((directory, {}, None), (moe, tree, None), (directory, tree, "triton")):
        detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
        detcomm.init(numerics="rl-bitwise")
        try:
            serving = ServingConfig(t_pad=64, max_context=64, attention_impl=impl)
            lm = TPCausalLM(load_causal_lm(d, dtype=torch.float32), serving, **kw)
            try:
                Trainer(lm)
                out.append("accepted")
            except ValueError as e:
                out.append(str(e))
        finally:
            detcomm.shutdown()
    return out


@pytest.mark.slow
def test_trainer_refuses_what_it_cannot_train(tmp_path) -> None:  # noqa: ANN001
    from clusters import get_cluster

    llama = write_tiny_checkpoint("llama-tiny", str(tmp_path / "llama"), seed=3)
    moe = write_tiny_checkpoint("qwen3-moe-tiny", str(tmp_path / "moe"), seed=3)
    fold, ep, triton = get_cluster(1).run(job_refusals, llama, moe)[0]
    assert "layout='virtual', virtual_shards=V, shard_fold='tree'" in fold, fold
    assert ep == "accepted", ep
    assert triton == "accepted", triton


@pytest.mark.slow
def test_tied_head_qwen3(tmp_path, cluster2, cluster4) -> None:  # noqa: ANN001
    """A tied checkpoint (Qwen3: tie_word_embeddings, per-head q/k norms): rollout W = 4, trainer W = 2, bit-equal;
    the embedding's and the head's copies get one gradient, the sum of both uses, and with the q/k norms' gradients
    summed over the ranks every gradient matches fp64 autograd of transformers' tied model (the negative control:
    without the conjugate all-reduces the bound is missed)."""
    directory = write_tiny_checkpoint("qwen3-tiny", str(tmp_path), seed=3)
    rolled = cluster4.run(job_rollout, directory)[0]
    outs = rolled["greedy"] + rolled["sampled"]
    seqs = [p + t for p, (t, _) in zip(PROMPTS * 2, outs)]
    starts = [len(p) for p in PROMPTS] * 2
    got = cluster2.run(job_trainer, directory, seqs, starts)[0]
    for a, (_, b) in zip(got["logprobs"], outs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), a - b
    _, grad64 = _reference(directory, seqs, starts, torch.float64)
    assert "lm_head.weight" not in grad64  # transformers' tied model: one parameter
    assert torch.equal(got["grads"]["lm_head.weight"], got["grads"]["model.embed_tokens.weight"])
    errors = _grad_errors(got["grads"], grad64)
    assert max(errors.values()) < GRAD_BOUND, {n: e for n, e in errors.items() if e >= GRAD_BOUND}
    assert max(_grad_errors(got["bad"], grad64).values()) > GRAD_BOUND


def _train_kv():  # noqa: ANN202
    """A trainer KV store over a stand-in engine (2 layers, 2 KV heads of 8, blocks of 16; the torch attention)."""
    from types import SimpleNamespace

    from detcomm.numerics.attention import PagedKV
    from detcomm.rl.trainer import _TrainKV

    kv = PagedKV(layers=2, kv_heads=2, head_dim=8, block_size=16, num_blocks=8, max_context=64, dtype=torch.float32,
                 device=torch.device("cpu"), impl="torch")
    return _TrainKV(SimpleNamespace(kv=kv, device=torch.device("cpu"), layers=[None, None]), grad=False)



def _attend(kv, tables, spans, gen):  # noqa: ANN001, ANN202
    """One layer-0 step of ``tables``' rows (``spans``: (start, n) each) with random q/k/v: (q, k, v, output)."""
    rows = sum(n for _, n in spans)
    q, k, v = (torch.randn(rows, h, 8, generator=gen) for h in (4, 2, 2))
    return q, k, v, kv.attend(0, q, k, v, kv.step(tables, spans), scale=0.35, window=None)


def _alone(first_k: torch.Tensor, first_v: torch.Tensor, q, k, v) -> torch.Tensor:  # noqa: ANN001
    """The oracle: in a store of its own, one sequence with rows ``first_k/v`` at 0.., then the row q/k/v after."""
    kv = _train_kv()
    t = kv.new_table()
    n = first_k.shape[0]
    kv.attend(0, torch.zeros(n, 4, 8), first_k, first_v, kv.step([t], [(0, n)]), scale=0.35, window=None)
    return kv.attend(0, q, k, v, kv.step([t], [(n, q.shape[0])]), scale=0.35, window=None)


def test_train_kv_histories_never_mix() -> None:
    """Each sequence's history holds exactly its own pieces in position order, whatever steps it shared, and its
    attention rows in a packed step are the bits of the same rows computed alone (an independent store; the
    control: with the other sequence's keys in its history, the row differs). A table made after another was freed
    starts with an empty history even when it gets the freed one's id(): the negative control shows the reuse is
    real here, so a map keyed by id(table) would have handed it the dead one's history."""
    import gc

    gen = torch.Generator().manual_seed(0)
    kv = _train_kv()
    a, b = kv.new_table(), kv.new_table()
    _, k1, v1, _ = _attend(kv, [a, b], [(0, 3), (0, 2)], gen)
    q2, k2, v2, out2 = _attend(kv, [b, a], [(2, 4), (3, 1)], gen)  # the other order: b's rows first
    assert [c[0].data_ptr() for c in a.history[0]] == [k1[:3].data_ptr(), k2[4:].data_ptr()]
    assert [c[0].data_ptr() for c in b.history[0]] == [k1[3:].data_ptr(), k2[:4].data_ptr()]
    assert a.history[1] == [] and b.history[1] == []  # layer 1 never attended
    assert torch.equal(out2[4:], _alone(k1[:3], v1[:3], q2[4:], k2[4:], v2[4:]))
    assert not torch.equal(out2[4:], _alone(k1[2:], v1[2:], q2[4:], k2[4:], v2[4:])), "b's keys did not matter"
    # a freed table's id() reused by a new one: its history is its own (empty), not the dead one's
    old_keyed: dict[int, list] = {}
    for _ in range(1000):
        dead = kv.new_table()
        _attend(kv, [dead], [(0, 2)], gen)
        old_keyed[id(dead)], freed = dead.history, id(dead)
        del dead
        gc.collect()
        fresh = kv.new_table()
        if id(fresh) == freed:
            break
    else:
        pytest.fail("CPython never reused a freed table's id(): the negative control did not run")
    assert old_keyed[id(fresh)][0], "the id-keyed map holds the dead table's pieces under the new table's id"
    assert fresh.history == [[], []]
    _attend(kv, [fresh], [(0, 2)], gen)  # position 0 accepted (the dead one's 2 rows would put it at 2)
    with pytest.raises(AssertionError, match="a table of this store"):
        kv.step([[]], [(0, 1)])  # a plain list (an engine's table) is not one of this store's
