"""detcomm.hf on real spawned gloo ranks: the sharded transformers model computes what the unsharded one does
(to rounding: sharding changes the summation order, and under rl-bitwise the layer-boundary norms are detcomm's
canonical one, so this is a tolerance check of the wiring, the probe is the bitwise one), transformers' own
forward still runs on the sharded model, the fused layer boundaries give the composition's bits (numpy oracle)
under rl-bitwise and leave transformers' path alone under auto, and wrong geometries are refused with the fix.
In the tree layout (``layout="virtual", shard_fold="tree"``) the boundaries are tree norm sites fed with the V/W
fp32 shard partials (the tree composition's bits), and the logits, tokens and logprobs are the same at W = 1, 2, 4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from detcomm.hf import TINY_CONFIGS, write_tiny_checkpoint
from detcomm.hf.checkpoints import tiny_config
from detcomm.hf.layers import vocab_shard_width
from detcomm.hf.shard import check_divisible

PROMPT = [5, 77, 300, 2, 999, 41, 12, 640, 8, 3, 700, 15]
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
_UINT = {torch.float32: np.uint32, torch.bfloat16: np.uint16}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(_INT[t.dtype]).numpy().view(_UINT[t.dtype])


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def job_boundaries(rank: int, w: int, directory: str, numerics: str, dtype_name: str,
                   virtual_shards: int | None = None, shard_fold: str = "order") -> dict:
    """One step of the engine with every fused boundary call recorded (site, operands, results) and every call
    of transformers' RMSNorm modules counted; the layer norms get random weights first (a checkpoint's are all
    ones, which would hide the weight's product). ``virtual_shards``: the virtual layout (``shard_fold``) instead
    of the fold layout."""
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm
    from detcomm.rl import regions
    from detcomm.tp import Segment

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    model = load_causal_lm(directory, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    decoder = model.model
    boundary_norms = [decoder.layers[0].input_layernorm, decoder.norm]
    for layer in decoder.layers:
        boundary_norms += [layer.input_layernorm, layer.post_attention_layernorm]
    for m in boundary_norms:
        m.weight.data = (1.0 + 0.25 * torch.randn(m.weight.shape, generator=g)).to(dtype)
    # Expected norm of each fused call, in call order: post-attention, then the next layer's input norm / final.
    expected = []
    for i, layer in enumerate(decoder.layers):
        nxt = decoder.layers[i + 1].input_layernorm if i + 1 < len(decoder.layers) else decoder.norm
        expected += [layer.post_attention_layernorm.weight, nxt.weight]
    embed = decoder.embed_tokens.weight.data.clone()  # before sharding
    counts = {"hf_norm": 0, "qk_norm": 0}

    def count(key: str):  # noqa: ANN202
        def hook(*_: object) -> None:
            counts[key] += 1
        return hook

    for m in set(boundary_norms):
        m.register_forward_hook(count("hf_norm"))
    for layer in decoder.layers:
        for m in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
            if m is not None:
                m.register_forward_hook(count("qk_norm"))
    calls: list[tuple] = []
    real_fused, real_local = detcomm.all_reduce_residual_rmsnorm, regions.add_rms_norm

    def fused(x, residual, weight, *, eps, site):  # noqa: ANN001, ANN202
        y, r = real_fused(x, residual, weight, eps=eps, site=site)
        calls.append((site, x.clone(), residual.clone(), weight, eps, y, r))
        return y, r

    def local(x, residual, weight, *, eps):  # noqa: ANN001, ANN202
        y, r = real_local(x, residual, weight, eps=eps)
        calls.append((None, x.clone(), residual.clone(), weight, eps, y, r))
        return y, r

    detcomm.init(numerics=numerics)
    detcomm.all_reduce_residual_rmsnorm, regions.add_rms_norm = fused, local
    try:
        layout = {} if virtual_shards is None else dict(layout="virtual", virtual_shards=virtual_shards,
                                                         shard_fold=shard_fold)
        lm = TPCausalLM(model, ServingConfig(t_pad=64, max_context=64), **layout)
        lm.forward([Segment(lm.new_cache(), PROMPT, 0)])
        entries = detcomm.routes().as_dicts()
        collectives = {str(e["site"]): str(e["collective"]) for e in entries}
        declared = {str(e["site"]): (e["collective"], e["virtual_shards"], e["shard_fold"]) for e in entries
                    if str(e["site"]).endswith(".add_norm")}
    finally:
        detcomm.all_reduce_residual_rmsnorm, regions.add_rms_norm = real_fused, real_local
        detcomm.shutdown()
    out = {"fuse": lm.fuse, "counts": dict(counts), "norm_sites": list(lm.shards.norm_sites),
           "add_norm_collectives": {k: v for k, v in collectives.items() if k.endswith(".add_norm")},
           "add_norm_declared": declared,
           "sites": [c[0] for c in calls], "weights_ok": [c[3] is e for c, e in zip(calls, expected)],
           "eps": [c[4] for c in calls], "config_eps": float(model.config.rms_norm_eps)}
    if calls:
        site, x, residual, weight, eps, y, r = calls[0]  # layer 0, after o_proj
        hf_y = decoder.layers[0].post_attention_layernorm(r)  # transformers' arithmetic (the negative control)
        out.update(x=_bits(x), residual=_bits(residual), weight=_bits(weight), y=_bits(y), r=_bits(r),
                   hf_y=_bits(hf_y), embed_rows=_bits(embed[PROMPT]))
    return out


def job_against_unsharded(rank: int, w: int, directory: str,
                          dtype_name: str = "float32") -> tuple[float, float, float, list[int], list[int]]:
    """Max |logit difference| of the sharded engine and of transformers' forward on the sharded model
    against the unsharded model, the engine's largest logprob error, and the greedy tokens of both."""
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm
    from detcomm.tp import Segment

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    ref_model = load_causal_lm(directory, dtype=dtype)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].float()  # [T, vocab]
    ref_greedy = ref_model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    detcomm.init(numerics="rl-bitwise")
    try:
        lm = TPCausalLM(load_causal_lm(directory, dtype=dtype), ServingConfig(t_pad=64, max_context=64))
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


def job_layout_bits(rank: int, w: int, directory: str, layouts: list[tuple[str, int | None, str]]) -> list[dict]:
    """For each (layout, virtual_shards, shard_fold) in turn, under rl-bitwise (its own detcomm.init): whether the
    boundaries fused, this rank's vocabulary shard of the fp32 logits of every real row of one prefill step, and the
    greedy token ids and logprob bits of two prompts generated together."""
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm
    from detcomm.tp import Segment

    torch.set_num_threads(1)
    out = []
    for layout, virtual_shards, shard_fold in layouts:
        detcomm.init(numerics="rl-bitwise")
        try:
            lm = TPCausalLM(load_causal_lm(directory, dtype=torch.float32), ServingConfig(t_pad=64, max_context=64),
                            layout=layout, virtual_shards=virtual_shards, shard_fold=shard_fold)
            logits, _ = lm.forward([Segment(lm.new_cache(), PROMPT, 0)])
            gen = lm.generate([PROMPT, PROMPT[5:0:-1]], max_new_tokens=3)
        finally:
            detcomm.shutdown()
        out.append({"fuse": lm.fuse, "logits": _bits(logits.buf[: len(PROMPT)]), "tokens": [t for t, _ in gen],
                    "logprobs": [_bits(lp) for _, lp in gen]})
    return out


# Tolerances: fp32 to rounding of the fold order and the canonical norm; bf16 a few bf16 ulps of the logits
# (measured on 2 ranks: at most 0.025 for llama-tiny and qwen3-tiny, the same with and without the fused boundaries).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2.0**-4}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype"), [*((n, "float32") for n in sorted(TINY_CONFIGS)),
                                             ("llama-tiny", "bfloat16"), ("qwen3-tiny", "bfloat16")])
def test_sharded_matches_unsharded(name: str, dtype: str, tmp_path, cluster2) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint(name, str(tmp_path), seed=3)
    tol = TOLERANCE[dtype]
    for engine_err, own_err, lp_err, tokens, ref_tokens in cluster2.run(job_against_unsharded, directory, dtype):
        assert engine_err < tol and own_err < tol and lp_err < tol, (engine_err, own_err, lp_err)
        assert tokens == ref_tokens


@pytest.mark.slow
def test_replicated_kv_heads_match_unsharded(tmp_path, cluster4) -> None:  # noqa: ANN001
    """2 KV heads over 4 ranks: each rank's query heads attend its replicated KV head, so the engine and
    transformers' own forward on the sharded model compute what the unsharded model does (to rounding), and
    greedy decoding gives its tokens."""
    directory = write_tiny_checkpoint("qwen3-kv2-tiny", str(tmp_path), seed=3)
    for engine_err, own_err, lp_err, tokens, ref_tokens in cluster4.run(job_against_unsharded, directory, "float32"):
        assert engine_err < 1e-4 and own_err < 1e-4 and lp_err < 1e-4, (engine_err, own_err, lp_err)
        assert tokens == ref_tokens


@pytest.mark.slow
def test_fused_boundaries_bits(cluster, tmp_path) -> None:  # noqa: ANN001
    """rl-bitwise: both boundaries of every layer are fused add_norm sites (declared, in the route table, called
    with the right norm's weight); the layer-0 o_proj boundary's (y, r) bits are the composition of the ranks'
    partials (numpy oracle, and detcomm.numerics.fold.reference_fold + detcomm.numerics.norm), its residual is the embedding;
    transformers' norm of r gives other bits (what the comparison would catch); Qwen3's q/k norms still run."""
    from detcomm.numerics.fold import reference_fold
    from detcomm.numerics.norm import add_rms_norm_torch
    from norm_oracle import composition_oracle

    directory = write_tiny_checkpoint("qwen3-tiny", str(tmp_path), seed=5)
    res = cluster.run(job_boundaries, directory, "rl-bitwise", "bfloat16")
    names = [f"model.layers.{i}.{m}.add_norm" for i in (0, 1) for m in ("self_attn.o_proj", "mlp.down_proj")]
    n = len(PROMPT)
    for got in res:
        assert got["fuse"] and got["norm_sites"] == names and got["sites"] == names
        assert got["add_norm_collectives"] == dict.fromkeys(names, "all_reduce_rmsnorm")
        assert all(got["weights_ok"]) and len(got["weights_ok"]) == 4
        assert got["eps"] == [got["config_eps"]] * 4
        assert got["counts"]["hf_norm"] == 0 and got["counts"]["qk_norm"] == 4  # q and k norm per layer
        assert got["x"].shape == (n, 192)
        np.testing.assert_array_equal(got["residual"], res[0]["embed_rows"])
    y_ref, r_ref = composition_oracle([g["x"] for g in res], res[0]["residual"], res[0]["weight"], "bfloat16",
                                      "bfloat16", res[0]["eps"][0])
    s = reference_fold(torch.stack([_bf16(g["x"]) for g in res]), torch.bfloat16)
    y_def, r_def = add_rms_norm_torch(s, _bf16(res[0]["residual"]), _bf16(res[0]["weight"]), eps=res[0]["eps"][0])
    for got in res:
        np.testing.assert_array_equal(got["r"], r_ref)
        np.testing.assert_array_equal(got["y"], y_ref)
        np.testing.assert_array_equal(got["y"], _bits(y_def))
        np.testing.assert_array_equal(got["r"], _bits(r_def))
    assert (res[0]["hf_y"] != y_ref).any(), "transformers' norm gave the canonical bits: the check would not bite"


@pytest.mark.slow
def test_tree_layout_boundaries_bits(cluster2, tmp_path) -> None:  # noqa: ANN001
    """layout='virtual', shard_fold='tree' under rl-bitwise: both boundaries of every layer are tree norm sites
    (declared and in the route table as all_reduce_rmsnorm with virtual_shards=8, shard_fold tree), called with this
    rank's [V/W, rows, H] fp32 shard partials and the right norm's weight; transformers' boundary norms never run
    (Qwen3's q/k norms do). The layer-0 o_proj boundary's (y, r) are the composition of the tree of the V partials
    gathered from the ranks (numpy oracle of the definition, and detcomm.numerics' reference_tree + the canonical add
    + norm), its residual the embedding. Negative controls: the shard-order fold of the same partials gives other
    bits, and so does transformers' norm of r."""
    from detcomm.numerics.norm import add_rms_norm_torch
    from detcomm.numerics.tree import reference_tree
    from norm_oracle import residual_add_oracle, rms_norm_oracle
    from test_tree_fold import order_oracle, tree_oracle

    directory = write_tiny_checkpoint("qwen3-tiny", str(tmp_path), seed=5)
    res = cluster2.run(job_boundaries, directory, "rl-bitwise", "float32", 8, "tree")
    names = [f"model.layers.{i}.{m}.add_norm" for i in (0, 1) for m in ("self_attn.o_proj", "mlp.down_proj")]
    n = len(PROMPT)
    for got in res:
        assert got["fuse"] and got["norm_sites"] == names and got["sites"] == names
        assert got["add_norm_declared"] == dict.fromkeys(names, ("all_reduce_rmsnorm", 8, "tree"))
        assert all(got["weights_ok"]) and len(got["weights_ok"]) == 4
        assert got["eps"] == [got["config_eps"]] * 4
        assert got["counts"]["hf_norm"] == 0 and got["counts"]["qk_norm"] == 4
        assert got["x"].shape == (8 // 2, n, 192)  # V/W fp32 slabs
        np.testing.assert_array_equal(got["residual"], res[0]["embed_rows"])
    leaves = np.concatenate([g["x"] for g in res])  # [V, n, H]: rank order is shard order
    eps = res[0]["eps"][0]
    r_ref = residual_add_oracle(tree_oracle(leaves, "float32"), res[0]["residual"], "float32")
    y_ref = rms_norm_oracle(r_ref, res[0]["weight"], "float32", "float32", eps)
    f32 = lambda b: torch.from_numpy(b.view(np.float32))  # noqa: E731
    y_def, r_def = add_rms_norm_torch(reference_tree(f32(leaves), torch.float32), f32(res[0]["residual"]),
                                      f32(res[0]["weight"]), eps=eps)
    for got in res:
        np.testing.assert_array_equal(got["r"], r_ref)
        np.testing.assert_array_equal(got["y"], y_ref)
        np.testing.assert_array_equal(got["r"], _bits(r_def))
        np.testing.assert_array_equal(got["y"], _bits(y_def))
    r_order = residual_add_oracle(order_oracle(leaves, "float32"), res[0]["residual"], "float32")
    assert (r_order != r_ref).any(), "the shard-order fold gave the tree's bits: the check would not bite"
    assert (res[0]["hf_y"] != y_ref).any(), "transformers' norm gave the canonical bits: the check would not bite"


@pytest.mark.slow
def test_tree_layout_same_bits_at_every_width(tmp_path, cluster2, cluster4) -> None:  # noqa: ANN001
    """The tree layout (its boundaries the fused tree sites) gives bit-identical logits of every prefill row, greedy
    token ids and logprobs at W = 1, 2 and 4. Negative controls on the same model and prompts: the fold layout's
    logits differ between W = 1 and W = 2 (the comparison catches a sum that follows W), and the shard-order virtual
    layout (its boundaries transformers' own) gives logits other than the tree layout's at W = 2."""
    from clusters import get_cluster

    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    tree, fold, order = ("virtual", 8, "tree"), ("fold", None, "order"), ("virtual", 8, "order")
    runs = {1: get_cluster(1).run(job_layout_bits, directory, [tree, fold]),
            2: cluster2.run(job_layout_bits, directory, [tree, fold, order]),
            4: cluster4.run(job_layout_bits, directory, [tree])}

    def whole(w: int, i: int) -> dict:
        ranks = [r[i] for r in runs[w]]
        assert all(r["tokens"] == ranks[0]["tokens"] for r in ranks)
        for r in ranks[1:]:
            for a, b in zip(r["logprobs"], ranks[0]["logprobs"]):
                np.testing.assert_array_equal(a, b)
        logits = np.concatenate([r["logits"] for r in ranks], axis=1)[:, :1024]  # rank order = vocabulary order
        return {"fuse": ranks[0]["fuse"], "logits": logits, "tokens": ranks[0]["tokens"],
                "logprobs": np.concatenate(ranks[0]["logprobs"])}

    trees = [whole(w, 0) for w in (1, 2, 4)]
    assert all(t["fuse"] for t in trees)
    for t in trees[1:]:
        np.testing.assert_array_equal(t["logits"], trees[0]["logits"])
        np.testing.assert_array_equal(t["logprobs"], trees[0]["logprobs"])
        assert t["tokens"] == trees[0]["tokens"]
    fold1, fold2, order2 = whole(1, 1), whole(2, 1), whole(2, 2)
    assert fold1["fuse"] and fold2["fuse"] and not order2["fuse"]
    assert (fold1["logits"] != fold2["logits"]).any(), "the fold layout gave the same bits at W = 1 and 2"
    assert (order2["logits"] != trees[1]["logits"]).any(), "the shard-order layout gave the tree layout's bits"


@pytest.mark.slow
def test_moe_boundary_is_local_add_norm(tmp_path, cluster2) -> None:  # noqa: ANN001
    """An expert-parallel MoE block's output is already whole: its boundary is the local canonical add + norm
    (no add_norm site), with the next layer's / the final norm's weight; in the fold and the tree layout."""
    directory = write_tiny_checkpoint("qwen3-moe-tiny", str(tmp_path), seed=5)
    o = [f"model.layers.{i}.self_attn.o_proj.add_norm" for i in (0, 1)]
    for layout in ((), (8, "tree")):
        for got in cluster2.run(job_boundaries, directory, "rl-bitwise", "float32", *layout):
            assert got["fuse"] and got["norm_sites"] == o and got["sites"] == [o[0], None, o[1], None]
            assert all(got["weights_ok"]) and got["counts"]["hf_norm"] == 0
            assert {d[1:] for d in got["add_norm_declared"].values()} == {(layout or (None, None))}


def _biased_llama(directory: str) -> str:
    """llama-tiny with biases on o_proj and down_proj (``attention_bias``, ``mlp_bias``), seeded."""
    import transformers

    cfg = tiny_config("llama-tiny")
    cfg.attention_bias = cfg.mlp_bias = True
    cfg._attn_implementation = "eager"
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # transformers initializes biases to zero, which would hide a dropped one
        for layer in model.model.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_biased_projection_boundary(tmp_path, cluster2) -> None:  # noqa: ANN001
    """A row-parallel projection with a bias keeps its all-reduce (+ bias after the sum) and then takes the local
    canonical add + norm: no add_norm site, the right norms (in the fold and the tree layout), and the engine still
    matches transformers."""
    directory = _biased_llama(str(tmp_path))
    for layout in ((), (8, "tree")):
        for got in cluster2.run(job_boundaries, directory, "rl-bitwise", "float32", *layout):
            assert got["fuse"] and got["norm_sites"] == [] and got["add_norm_collectives"] == {}
            assert got["sites"] == [None] * 4 and all(got["weights_ok"]) and got["counts"]["hf_norm"] == 0
    for engine_err, _, lp_err, tokens, ref_tokens in cluster2.run(job_against_unsharded, directory, "float32"):
        assert engine_err < 1e-4 and lp_err < 1e-4, (engine_err, lp_err)
        assert tokens == ref_tokens


@pytest.mark.slow
def test_auto_keeps_transformers_boundaries(tmp_path, cluster2) -> None:  # noqa: ANN001
    """numerics auto: no add_norm site, no fused call, every boundary through transformers' norm modules."""
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=5)
    for got in cluster2.run(job_boundaries, directory, "auto", "float32"):
        assert not got["fuse"] and got["add_norm_collectives"] == {} and got["sites"] == []
        assert got["counts"]["hf_norm"] == 5  # 2 layers x (input, post-attention) + the final norm


def test_head_count_refused_with_the_fix() -> None:
    cfg = tiny_config("llama-tiny")  # 24 attention heads, 12 KV heads, intermediate 384
    check_divisible(cfg, 3)
    check_divisible(cfg, 4)
    check_divisible(cfg, 24)  # each KV head replicated over 2 ranks
    with pytest.raises(ValueError, match=r"num_attention_heads=24 does not divide by 5.*\[1, 2, 3, 4, 6, 12, 24\]"):
        check_divisible(cfg, 5)
    with pytest.raises(ValueError, match=r"num_key_value_heads=12 is neither a multiple of 8 nor a divisor of it.*"
                                         r"world size in \[1, 2, 3, 4, 6, 12, 24\]"):
        check_divisible(cfg, 8)
    cfg.num_key_value_heads = 8
    with pytest.raises(ValueError, match=r"num_key_value_heads=8 is neither a multiple of 3.*world size in \[1, 2, 4, 8, 24\]"):
        check_divisible(cfg, 3)


def test_kv_replication_world_sizes_and_heads() -> None:
    """2 KV heads, 4 attention heads (qwen3-kv2-tiny): W = 4 replicates each KV head over 2 ranks; rank r holds KV
    head r // 2 (from the definition: r // (W / num_kv_heads)); W = 3 is refused with the W that work."""
    from detcomm.hf.shard import kv_head_of, world_sizes

    cfg = tiny_config("qwen3-kv2-tiny")
    assert world_sizes(cfg) == [1, 2, 4]
    assert [kv_head_of(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_of(r, 2, 2) for r in range(2)] == [(0, 1), (1, 1)]
    assert kv_head_of(0, 1, 2) == (0, 2)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 does not divide by 3.*world size in \[1, 2, 4\]"):
        check_divisible(cfg, 3)


def test_invariant_layouts_refuse_replicated_kv_heads() -> None:
    """The TP-size-invariant layouts keep whole KV heads per fixed head group: W > num_kv_heads is refused with
    the reason and the W that work for the layout, before anything is cut."""
    import transformers

    from detcomm.hf.layers import StepRows
    from detcomm.hf.shard import shard_model

    cfg = tiny_config("qwen3-kv2-tiny")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"layout='full_k' at W=4: .*whole KV heads.*fold' only.*W in \[1, 2\]"):
        shard_model(model, rank=0, world=4, step=StepRows(), layout="full_k", max_rows=64)


def test_unsupported_family_refused() -> None:
    import transformers

    with pytest.raises(ValueError, match="not supported"):
        check_divisible(transformers.GPT2Config(), 2)


def test_vocab_shard_width() -> None:
    assert vocab_shard_width(1024, 4) == 256
    assert vocab_shard_width(1000, 3) == 384  # ceil(1000 / 3) = 334, padded to a multiple of 64
    with pytest.raises(ValueError, match="too small"):
        vocab_shard_width(100, 4)
