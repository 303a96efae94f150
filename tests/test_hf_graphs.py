"""detcomm.hf's steps on static buffers (ServingConfig.cuda_graphs, detcomm.numerics.step_graph) on CPU: what a
CUDA graph captures, run eagerly. On spawned gloo ranks (W = 1 and 3) an engine on the static buffers ("auto": no
capture on CPU) and one on fresh tensors (cuda_graphs=False, the step before graphs) give the same bits: every
row's logits of a prefill and of decode steps, alone and packed, and generate's tokens and logprob bits of several
prompts alone and packed, in three layouts (fold with fused boundaries, fold with transformers' own boundaries,
the tree layout). The buffers the step body reads sit at the same addresses for every step of one row count (the
shape key), which is what a replay needs; the sites a step calls are the ones ``step_sites`` names (what the
capture decision reads). Negative control: a static engine whose buffers are not refreshed after its first step
must give other bits. The refusals (a bad mode, an NCCL call under "auto", cuda_graphs=True on CPU, an undeclared site, the reasons'
wording on a host-staged group and for the torch attention) are checked with their fixes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from clusters import get_cluster
from detcomm.hf import write_tiny_checkpoint

PROMPTS = [[5, 77, 300, 2, 999, 41, 12, 640, 8, 3, 700, 15], [11, 500, 23, 901, 4], [7, 7, 8, 9, 600, 31, 2]]
NEW = 4
BLOCK = 4


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy().view(np.uint32).copy()


def _drive(lm) -> dict:  # noqa: ANN001
    """One engine's outputs: a packed prefill step (two prompts, one chunked), decode steps alone and packed
    (every real row's logit bits and the sampling rows), then generate alone and packed."""
    from detcomm.tp import Segment

    out: dict = {"steps": []}
    a, b = lm.new_cache(), lm.new_cache()
    toks = {}

    def step(segs: list) -> list[int]:  # noqa: ANN001
        logits, picks = lm.forward(segs)
        rows = sum(len(s.tokens) for s in segs)
        greedy = lm.greedy(logits)
        lps = lm.logprobs(logits)
        out["steps"].append((_bits(logits.buf[:rows]), logits.rows.tolist(), picks, greedy.tolist(), _bits(lps)))
        return greedy.tolist()

    pa, pb = PROMPTS[0], PROMPTS[1]
    g = step([Segment(b, pb, 0), Segment(a, pa[:6], 0, sample=False)])  # prefill: b whole, a's first chunk
    toks["b"] = g[0]
    g = step([Segment(a, pa[6:], 6), Segment(b, [toks["b"]], len(pb))])  # a's last chunk beside b's decode
    toks["a"], toks["b"] = g
    for i in range(2):  # decode alone, then packed (two orders)
        g = step([Segment(a, [toks["a"]], len(pa) + 1 + i)])
        toks["a"] = g[0]
    for i in range(2):
        segs = [Segment(b, [toks["b"]], len(pb) + 1 + i), Segment(a, [toks["a"]], len(pa) + 3 + i)]
        g = step(segs if i else segs[::-1])
        toks["b"], toks["a"] = (g[0], g[1]) if i else (g[1], g[0])
    lm.free_cache(a)
    lm.free_cache(b)
    gen_alone = lm.generate([PROMPTS[0]], max_new_tokens=NEW)
    gen_packed = lm.generate(PROMPTS, max_new_tokens=NEW)
    out["generate"] = [(t, _bits(lp)) for t, lp in gen_alone + gen_packed]
    return out


def job_static_vs_fresh(rank: int, w: int, directory: str, layout: dict, control: bool) -> dict:
    """The same steps on a static-buffer engine and a fresh-tensor one (the same checkpoint, the same sites)."""
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    torch.set_num_threads(1)
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    comm = detcomm.init(numerics="rl-bitwise")
    try:
        serving = dict(t_pad=64, max_context=64, block_size=BLOCK, num_blocks=64)
        fresh = TPCausalLM(load_causal_lm(directory, dtype=torch.float32),
                           ServingConfig(**serving, cuda_graphs=False), **layout)
        static = TPCausalLM(load_causal_lm(directory, dtype=torch.float32), ServingConfig(**serving), **layout)
        modes = (fresh.cuda_graphs, fresh.graphs_reason, static.cuda_graphs, static.graphs_reason)
        # The shape key's property: the body reads the same tensors for every step of one row count.
        seen: dict[int, set] = {}
        body = static._body

        def recording(ids, pos, step, kv, rows):  # noqa: ANN001, ANN202
            addr = tuple((t.data_ptr(), tuple(t.shape)) for t in (ids, pos, step.block_tables, step.row_request,
                                                                   step.positions))
            seen.setdefault(rows, set()).add(addr)
            return body(ids, pos, step, kv, rows)

        static._body = recording  # type: ignore[method-assign]
        # Which sites one step calls, counted on the communicator, against step_sites().
        got_fresh = _drive(fresh)
        mid = {n: sc.calls for n, sc in comm._site_calls.items()}
        from detcomm.tp import Segment

        table = static.new_cache()
        static.forward([Segment(table, PROMPTS[2], 0)])
        called = [n for n, sc in comm._site_calls.items() if sc.calls > mid.get(n, 0)]
        static.free_cache(table)
        if control:  # from here on the buffers keep the first step's values
            upload = static._inputs.upload
            calls = [0]

            def first_only() -> None:
                calls[0] += 1
                if calls[0] == 1:
                    upload()

            static._inputs.upload = first_only  # type: ignore[method-assign]
        got_static = _drive(static)
    finally:
        detcomm.shutdown()
    same_steps = [bool(all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(f, s)))
                  for f, s in zip(got_fresh["steps"], got_static["steps"])]
    same_gen = [f[0] == s[0] and np.array_equal(f[1], s[1]) for f, s in zip(got_fresh["generate"], got_static["generate"])]
    return {"modes": modes, "same_steps": same_steps, "same_gen": same_gen,
            "addresses": {r: len(a) for r, a in seen.items()}, "keys": sorted(seen),
            "called": sorted(called), "step_sites": sorted(set(static.step_sites())),
            "alone_packed": got_static["generate"][0][0] == got_static["generate"][1][0]
            and np.array_equal(got_static["generate"][0][1], got_static["generate"][1][1])}


LAYOUTS = {"fold": {}, "fold-unfused": {"route": "gather_fold"},
           "tree": {"layout": "virtual", "virtual_shards": 4, "shard_fold": "tree"}}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "w"), [("fold", 1), ("fold", 3), ("fold-unfused", 1), ("fold-unfused", 3),
                                           ("tree", 1), ("tree", 2)])  # the tree: power-of-two W dividing V
def test_static_buffers_give_the_fresh_steps_bits(w: int, layout: str, tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    for r in get_cluster(w).run(job_static_vs_fresh, directory, LAYOUTS[layout], False):
        assert r["modes"][0] is False and r["modes"][1] == "cuda_graphs=False"
        assert r["modes"][2] is False and "CUDA graphs need a CUDA device" in r["modes"][3], r["modes"]
        assert len(r["same_steps"]) == 6 and all(r["same_steps"]), r["same_steps"]
        assert len(r["same_gen"]) == 4 and all(r["same_gen"]), r["same_gen"]
        assert r["alone_packed"]
        assert all(n == 1 for n in r["addresses"].values()), r["addresses"]  # one address set per row count
        assert {1, 2, 7, 12} <= set(r["keys"]), r["keys"]
        assert r["called"] == r["step_sites"], (r["called"], r["step_sites"])


@pytest.mark.slow
def test_negative_control_buffers_not_refreshed_change_the_bits(tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    for r in get_cluster(1).run(job_static_vs_fresh, directory, {}, True):
        assert r["same_steps"][0]  # the first step's buffers were copied
        assert not all(r["same_steps"][1:]) and not all(r["same_gen"]), r


def job_refusals(rank: int, w: int, directory: str) -> dict:
    """The refusals and reasons of the capture decision, on a CPU group (the CUDA facts patched in where the
    wording of a CUDA group's reason is checked: nothing runs on a device)."""
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    torch.set_num_threads(1)
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    comm = detcomm.init(numerics="rl-bitwise")
    out: dict = {}
    try:
        try:
            TPCausalLM(load_causal_lm(directory, dtype=torch.float32),
                       ServingConfig(t_pad=64, max_context=64, cuda_graphs=True))
        except ValueError as e:
            out["required"] = str(e)
        lm = TPCausalLM(load_causal_lm(directory, dtype=torch.float32), ServingConfig(t_pad=64, max_context=64))
        try:
            comm.capture_refusal("no.such.site")
        except ValueError as e:
            out["undeclared"] = str(e)
        site = lm.step_sites()[1]
        out["cpu_site"] = comm.capture_refusal(site)
        out["route"] = next(e.decision.route.value for e in comm.routes().entries if e.site.name == site)
        # A CUDA group staging through host memory (gloo, ranks sharing a GPU): the route's fact, read ahead.
        comm.device, comm._native.stage = torch.device("cuda", 0), True
        out["staged"] = comm.capture_refusal(site)
        comm._native.stage = False  # a group whose library moves CUDA tensors itself (NCCL)
        out["unstaged"] = comm.capture_refusal(site)
        out["unstaged_auto"] = comm.capture_refusal(site, library=False)  # what "auto" asks: no NCCL captured
        comm.device = torch.device("cpu")
        lm.device = torch.device("cuda", 0)
        out["torch_attention"] = lm._graph_refusal()
    finally:
        comm.device = torch.device("cpu")
        detcomm.shutdown()
    return out


@pytest.mark.slow
def test_refusals_name_the_site_and_the_fix(tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    (r,) = get_cluster(1).run(job_refusals, directory)
    assert "cuda_graphs=True" in r["required"] and "CUDA graphs need a CUDA device" in r["required"], r
    assert "cuda_graphs='auto'" in r["required"]
    assert "not declared" in r["undeclared"] and "detcomm.site" in r["undeclared"]
    assert "CUDA graphs capture CUDA work only" in r["cpu_site"]
    assert r["route"] != "ipc_fold"  # a CPU group's route, so the staged reason applies to it
    assert "host memory" in r["staged"] and r["route"] in r["staged"] and "CaptureThroughHost" in r["staged"], r
    assert "workspace_max_rows" in r["staged"] and "NCCL" in r["staged"]
    assert r["unstaged"] is None
    assert "detcomm.shutdown() waits" in r["unstaged_auto"] and "release_graphs()" in r["unstaged_auto"], r
    assert "attention_impl='torch'" in r["torch_attention"] and "attention_impl='triton'" in r["torch_attention"]


def test_serving_config_refuses_a_bad_graph_mode() -> None:
    from detcomm.hf import ServingConfig

    for mode in ("auto", True, False):
        ServingConfig(cuda_graphs=mode).check()
    for bad in ("on", 1, None):
        with pytest.raises(ValueError, match="cuda_graphs must be 'auto', True or False"):
            ServingConfig(cuda_graphs=bad).check()  # type: ignore[arg-type]


def test_step_inputs_one_copy_fixed_addresses_and_graphs_refused_on_cpu() -> None:
    from detcomm.numerics.step_graph import StepGraphs, StepInputs

    inputs = StepInputs({"a": (4,), "b": (2, 3)}, device=torch.device("cpu"))
    addr = {n: t.data_ptr() for n, t in inputs.dev.items()}
    for value in (1, 2):
        host = inputs.begin()
        host["a"][:] = value
        host["b"][:] = np.arange(6).reshape(2, 3) * value
        assert not bool((inputs.dev["a"] == value).all())  # nothing moves before upload
        inputs.upload()
        assert inputs.dev["a"].tolist() == [value] * 4 and inputs.dev["b"].tolist() == [[0, value, 2 * value],
                                                                                         [3 * value, 4 * value, 5 * value]]
        assert {n: t.data_ptr() for n, t in inputs.dev.items()} == addr
    calls = []
    eager = StepGraphs(lambda key: calls.append(key) or key, device=torch.device("cpu"), capture=False)
    assert [eager(k) for k in (3, 3, 5)] == [3, 3, 5] and calls == [3, 3, 5] and eager.captures == 0
    with pytest.raises(ValueError, match="CUDA graphs capture CUDA work only"):
        StepGraphs(lambda key: key, device=torch.device("cpu"), capture=True)
