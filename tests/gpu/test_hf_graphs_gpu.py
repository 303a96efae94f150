"""detcomm.hf's steps captured in CUDA graphs and replayed (ServingConfig.cuda_graphs) on cuda:0, W = 1 and 2
processes sharing the GPU over gloo (their sites on the CUDA-IPC workspace, ipc_fold: capturable): the replayed
engine gives the eager engine's bits (cuda_graphs=False, fresh tensors) on tests/test_hf_graphs.py's steps (a packed
prefill, decode alone and packed, every real row's logits, the sampled tokens and logprob rows) and generate of
several prompts alone and packed; one graph is captured per row count (its body runs twice then: the side-stream
warm-up and the capture; never on a replay). In the tree layout too. Negative control: the replayed engine with its
buffers not refreshed after the first step must give other bits (a replay that ignored the buffers, or read others
than it was captured on, would pass it). A host-staged group (workspace off: gather_fold through host memory) runs
"auto" eagerly with the route named, and cuda_graphs=True is refused there; so is the torch attention. The probe
decoder (detcomm.probe.model.TPTransformer, bf16) replays its eager bits too, fold W = 1, 2 and tree W = 1 (captured:
the native transport is a local copy at W = 1) and W = 2 (eager). The head inside the step (next_tokens: greedy
and seeded sampling) replays the eager head's bits; captured with the step at W = 1, eager after it at W = 2."""

from __future__ import annotations

import pytest
import torch

import test_hf_graphs as t
import test_probe_graphs as p
from clusters import get_cluster
from detcomm.hf import write_tiny_checkpoint

pytestmark = pytest.mark.gpu


def job_graphs(rank: int, w: int, directory: str, layout: dict, workspace: bool | None = None,
               control: bool = False, dtype: str = "float32") -> dict:
    # positional options: LocalCluster.run passes a job's arguments positionally
    import numpy as np

    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    kw = {} if workspace is None else {"workspace": workspace}
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise", device="cuda:0", **kw)
    out: dict = {}
    try:
        serving = dict(t_pad=64, max_context=64, block_size=t.BLOCK, num_blocks=64)
        load = lambda: load_causal_lm(directory, dtype=getattr(torch, dtype))  # noqa: E731
        eager = TPCausalLM(load(), ServingConfig(**serving, cuda_graphs=False), **layout)
        lm = TPCausalLM(load(), ServingConfig(**serving), **layout)
        out["mode"], out["reason"] = lm.cuda_graphs, lm.graphs_reason
        out["head_graphs"], out["head_reason"] = lm.head_graphs, lm.head_graphs_reason
        try:
            required = TPCausalLM(load(), ServingConfig(**serving, cuda_graphs=True), **layout)
            out["required"] = ""
            del required
        except ValueError as e:
            out["required"] = str(e)
        body_keys: list = []
        if lm._graphs is not None:
            body = lm._graphs.body
            lm._graphs.body = lambda key: body_keys.append(key) or body(key)  # type: ignore[method-assign]
        forwards = [0]
        forward = lm.forward

        def counting(*a, **k):  # noqa: ANN002, ANN003, ANN202
            forwards[0] += 1
            return forward(*a, **k)

        lm.forward = counting  # type: ignore[method-assign]
        next_tokens = lm.next_tokens

        def counting_tokens(segs, **k):  # noqa: ANN001, ANN003, ANN202
            # a step with sampling rows runs the body once (step + head); one without calls forward (counted there)
            forwards[0] += any(seg.sample for seg in segs)
            return next_tokens(segs, **k)

        lm.next_tokens = counting_tokens  # type: ignore[method-assign]
        if control:  # the buffers keep the first step's values
            upload, calls = lm._inputs.upload, [0]

            def first_only() -> None:
                calls[0] += 1
                if calls[0] == 1:
                    upload()

            lm._inputs.upload = first_only  # type: ignore[method-assign]
        got_eager, got = t._drive(eager), t._drive(lm)
        # the head inside the step (next_tokens, greedy and sampled): replayed == eager, and == forward + head
        tok_eager, tok = t._drive_tokens(eager), t._drive_tokens(lm)
        out["head_same"] = {k: t._same(tok_eager[k], tok[k]) for k in ("greedy", "sampled", "generate", "agree")}
        out["head"] = t._head_checks(tok)
        out["captures"], out["keys"] = lm.graph_captures, list(lm._graphs.keys()) if lm._graphs else []
        out["body_keys"], out["forwards"] = body_keys, forwards[0]
        lm.release_graphs()
    finally:
        detcomm.shutdown()
    out["same_steps"] = [all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(f, s))
                         for f, s in zip(got_eager["steps"], got["steps"])]
    out["same_gen"] = [f[0] == s[0] and np.array_equal(f[1], s[1]) for f, s in zip(got_eager["generate"], got["generate"])]
    out["alone_packed"] = (got["generate"][0][0] == got["generate"][1][0]
                           and np.array_equal(got["generate"][0][1], got["generate"][1][1]))
    return out


@pytest.mark.parametrize(("layout", "world", "dtype"), [("fold", 1, "float32"), ("fold", 1, "bfloat16"),
                                                        ("fold", 2, "float32"), ("tree", 2, "float32")])
def test_replayed_graphs_give_the_eager_bits(layout: str, world: int, dtype: str, tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    for r in get_cluster(world).run(job_graphs, directory, t.LAYOUTS[layout], None, False, dtype):
        assert r["mode"] is True and r["reason"] is None, r["reason"]
        assert r["required"] == ""  # cuda_graphs=True accepted where auto captures
        assert all(r["same_steps"]) and len(r["same_steps"]) == 6, r["same_steps"]
        assert all(r["same_gen"]) and len(r["same_gen"]) == 4 and r["alone_packed"], r["same_gen"]
        # One graph per row count: its body ran twice (warm-up, capture), every later step of it replayed.
        keys = r["keys"]
        assert r["captures"] == len(keys) == len(set(keys)) >= 5, keys
        # (the keys mix row counts and the head's (rows, S, sampled) tuples: compared as text)
        assert sorted(map(repr, r["body_keys"])) == sorted(map(repr, keys * 2)), (r["body_keys"], keys)
        assert r["forwards"] > len(keys), r  # replays happened
        assert all(r["head_same"].values()), r["head_same"]
        h = r["head"]
        assert all(h["agree"]) and h["sampled_alone_packed"] and h["in_step_callback"] and h["other_seed_differs"], h
        # W = 1: the head's gathers are local copies, captured with the step; W = 2 sharing the GPU: they stage
        # through host memory, so the head runs eagerly after the captured step (same bits, reason named)
        assert r["head_graphs"] is (world == 1), r["head_reason"]
        assert any(isinstance(k, (list, tuple)) for k in keys) is (world == 1), keys
        if world > 1:
            assert "host memory" in r["head_reason"], r["head_reason"]


def test_negative_control_stale_buffers_change_the_replayed_bits(tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    for r in get_cluster(1).run(job_graphs, directory, {}, None, True):
        assert r["mode"] is True
        assert r["same_steps"][0] and not all(r["same_steps"][1:]) and not all(r["same_gen"]), r


def test_auto_runs_eagerly_on_a_host_staged_group(tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    for r in get_cluster(2).run(job_graphs, directory, {}, False):
        assert r["mode"] is False and "host memory" in r["reason"] and "CaptureThroughHost" in r["reason"], r["reason"]
        assert "cuda_graphs=True" in r["required"] and "host memory" in r["required"]
        assert r["captures"] == 0 and len(r["body_keys"]) == r["forwards"]  # the body ran once a step, eagerly
        assert all(r["same_steps"]) and all(r["same_gen"]) and r["alone_packed"]
        assert all(r["head_same"].values()), r["head_same"]


def job_torch_attention(rank: int, w: int, directory: str) -> str | None:
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise", device="cuda:0")
    try:
        lm = TPCausalLM(load_causal_lm(directory, dtype=torch.float32),
                        ServingConfig(t_pad=64, max_context=64, attention_impl="torch"))
        return lm.graphs_reason
    finally:
        detcomm.shutdown()


def test_auto_runs_the_torch_attention_eagerly(tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    (reason,) = get_cluster(1).run(job_torch_attention, directory)
    assert reason is not None and "attention_impl='torch'" in reason


def job_probe_graphs(rank: int, w: int, layout: str, virtual_shards: int | None, shard_fold: str) -> dict:
    """The probe decoder (detcomm.probe.model.TPTransformer): cuda_graphs=False against "auto" (captured)."""
    import numpy as np

    import detcomm
    from detcomm.probe.model import ModelConfig, TPTransformer

    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise", device="cuda:0")
    try:
        cfg = ModelConfig(t_pad=64, max_context=64, block_size=4, num_blocks=64, dtype=torch.bfloat16)
        models = []
        for mode in (False, "auto"):
            m = TPTransformer(cfg, device="cuda:0", layout=layout, virtual_shards=virtual_shards,  # type: ignore[arg-type]
                              shard_fold=shard_fold, cuda_graphs=mode)
            m.declare_sites()
            models.append(m)
        got = [p._drive(m) for m in models]
        toks = [p._drive_tokens(m) for m in models]
        out = {"mode": models[1].cuda_graphs, "reason": models[1].graphs_reason, "captures": models[1].graph_captures,
               "head_graphs": models[1].head_graphs}
        models[1].release_graphs()
    finally:
        detcomm.shutdown()
    out["same"] = [all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(f, s))
                   for f, s in zip(*got)]
    out["same_tokens"] = [all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(f, s))
                          for f, s in zip(*toks)]
    out["agree"] = [x[3] for m in toks for x in m[:-1]]
    return out


# The tree layout's vocabulary-parallel embedding gathers on the native route, which ranks sharing one GPU stage
# through host memory: "auto" must run that decoder eagerly and name the site (seen on one H100, 2026-12-07). At
# W = 1 the native transport is a local copy (route_impls/native.py): the tree layout captures.
@pytest.mark.parametrize(("layout", "v", "fold", "world", "captured"),
                         [("fold", None, "order", 1, True), ("fold", None, "order", 2, True),
                          ("virtual", 8, "tree", 1, True), ("virtual", 8, "tree", 2, False)])
def test_probe_decoder_replayed_graphs_give_the_eager_bits(layout: str, v: int | None, fold: str, world: int,
                                                           captured: bool) -> None:
    for r in get_cluster(world).run(job_probe_graphs, layout, v, fold):
        assert len(r["same"]) == 6 and all(r["same"]), r["same"]
        assert len(r["same_tokens"]) == 6 and all(r["same_tokens"]), r["same_tokens"]
        assert len(r["agree"]) == 10 and all(r["agree"]), r["agree"]
        if captured:
            assert r["mode"] is True and r["reason"] is None, r["reason"]
            assert r["captures"] >= 3, r
            assert r["head_graphs"] is (world == 1), r
        else:
            assert r["mode"] is False and "embed.gather" in r["reason"], r["reason"]
            assert r["captures"] == 0, r
