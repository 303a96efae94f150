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


SEED = 5


def _drive_tokens(lm) -> dict:  # noqa: ANN001
    """The head inside the step (``next_tokens``): a packed prefill (one prompt chunked), decode steps alone and
    packed (both orders), greedy, each step beside forward + greedy + logprobs of the same segments on twin caches
    (the eager head before this change); two sampled decode steps (T = 1 for both requests, then T = 0 beside
    T = 0.5) beside the sampler's formula on the twins (``logprobs / T + keyed_gumbel(key)``, argmax); then
    generate with in-step sampling at T = 1 alone and packed, the same sampling through a host callback, and a
    run with another seed."""
    from detcomm.numerics.sampling import keyed_gumbel, sample_key
    from detcomm.tp import Segment

    out: dict = {"greedy": [], "sampled": [], "agree": []}
    a, b, ra, rb = (lm.new_cache() for _ in range(4))
    twin = {id(a): ra, id(b): rb}
    vocab = lm.shards.vocab

    def step(segs: list, keys: list | None = None, temps: list | None = None) -> list[int]:  # noqa: ANN001
        got = lm.next_tokens(segs, keys=keys, temperatures=temps)
        out["sampled" if keys else "greedy"].append((got.tokens, _bits(got.logprobs), got.picks))
        logits, picks = lm.forward([Segment(twin[id(s.blocks)], s.tokens, s.start, s.sample) for s in segs])
        full = lm.logprobs(logits)
        if keys is None:
            want = lm.greedy(logits)
        else:
            want = torch.stack([torch.argmax(full[i] / t + keyed_gumbel(torch.tensor([k], device=full.device), vocab)[0]) if t > 0
                                else torch.argmax(full[i]) for i, (k, t) in enumerate(zip(keys, temps))])
        out["agree"].append(got.tokens == want.tolist() and got.picks == picks
                            and np.array_equal(_bits(full.gather(1, want[:, None])[:, 0]), _bits(got.logprobs)))
        return got.tokens

    pa, pb = PROMPTS[0], PROMPTS[1]
    tb = step([Segment(b, pb, 0), Segment(a, pa[:6], 0, sample=False)])[0]
    ta, tb = step([Segment(a, pa[6:], 6), Segment(b, [tb], len(pb))])
    pos_a, pos_b = len(pa), len(pb) + 1
    for _ in range(2):
        ta = step([Segment(a, [ta], pos_a)])[0]
        pos_a += 1
    for i in range(2):
        segs = [Segment(b, [tb], pos_b), Segment(a, [ta], pos_a)]
        g = step(segs if i else segs[::-1])
        tb, ta = (g[0], g[1]) if i else (g[1], g[0])
        pos_a, pos_b = pos_a + 1, pos_b + 1
    for temps in ([1.0, 1.0], [0.0, 0.5]):
        tb, ta = step([Segment(b, [tb], pos_b), Segment(a, [ta], pos_a)],
                      [sample_key(SEED, 1, pos_b + 1), sample_key(SEED, 0, pos_a + 1)], temps)
        pos_a, pos_b = pos_a + 1, pos_b + 1
    for t in (a, b, ra, rb):
        lm.free_cache(t)

    def callback(request: int, position: int, logprobs: torch.Tensor) -> int:
        noise = keyed_gumbel(torch.tensor([sample_key(SEED, request, position)], device=logprobs.device), vocab)[0]
        return int(torch.argmax(logprobs / 1.0 + noise))

    gen = [lm.generate([PROMPTS[0]], max_new_tokens=NEW, temperature=1.0, seed=SEED),
           lm.generate(PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=SEED),
           lm.generate(PROMPTS, max_new_tokens=NEW, sampler=callback),
           lm.generate(PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=SEED + 1)]
    out["generate"] = [[(t, _bits(lp)) for t, lp in g] for g in gen]
    return out


def _same(x: object, y: object) -> bool:
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and np.array_equal(x, y)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return x == y


def _head_checks(tokens: dict) -> dict:
    """next_tokens against the eager head on twin caches (``_drive_tokens``' agree), the sampled generate against
    its host-callback twin, alone against packed, and against another seed."""
    alone, packed, callback, other = tokens["generate"]
    return {"agree": tokens["agree"], "n_sampled": len(tokens["sampled"]),
            "sampled_alone_packed": _same(alone[0], packed[0]), "in_step_callback": _same(packed, callback),
            "other_seed_differs": not _same([t for t, _ in packed], [t for t, _ in other])}


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
        tok_fresh, tok_static = _drive_tokens(fresh), _drive_tokens(static)
        if control:  # the keys field keeps the first sampled step's keys: sampling must read them from the buffers
            static._inputs.upload = upload
            keys_upload, first_keys = static._inputs.upload, []

            def stale_keys() -> None:
                k = static._inputs.host["keys"]
                if first_keys:
                    k[:] = first_keys[0]
                elif k.any():
                    first_keys.append(k.copy())
                keys_upload()

            static._inputs.upload = stale_keys  # type: ignore[method-assign]
            tok_stale = _drive_tokens(static)
    finally:
        detcomm.shutdown()
    same_steps = [bool(all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(f, s)))
                  for f, s in zip(got_fresh["steps"], got_static["steps"])]
    same_gen = [f[0] == s[0] and np.array_equal(f[1], s[1]) for f, s in zip(got_fresh["generate"], got_static["generate"])]
    head = {"fresh": _head_checks(tok_fresh),
            "same": {k: _same(tok_fresh[k], tok_static[k]) for k in ("greedy", "sampled", "generate", "agree")}}
    if not control:
        head["static"] = _head_checks(tok_static)
    else:
        head["stale_keys_same"] = _same(tok_fresh["generate"][1], tok_stale["generate"][1])
    return {"head": head, "modes": modes, "same_steps": same_steps, "same_gen": same_gen,
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
        # The head inside the step: static buffers == fresh tensors, greedy == forward + greedy + logprobs,
        # in-step sampling == the host callback's formula, alone == packed, and the seed reaches the tokens.
        head = r["head"]
        assert all(head["same"].values()), head["same"]
        for side in ("fresh", "static"):
            h = head[side]
            assert len(h["agree"]) == 8 and all(h["agree"]), (side, h)
            assert h["n_sampled"] == 2 and h["sampled_alone_packed"] and h["in_step_callback"], (side, h)
            assert h["other_seed_differs"], (side, h)


@pytest.mark.slow
def test_negative_control_buffers_not_refreshed_change_the_bits(tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    for r in get_cluster(1).run(job_static_vs_fresh, directory, {}, True):
        assert r["same_steps"][0]  # the first step's buffers were copied
        assert not all(r["same_steps"][1:]) and not all(r["same_gen"]), r
        # the head's keys read from a stale buffer: the sampled tokens are no longer the fresh engine's
        assert r["head"]["stale_keys_same"] is False, r["head"]


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
        out["head_sites"] = {h: comm.capture_refusal(h, library=False) for h in lm.head_sites()}
        comm.device = torch.device("cpu")
        lm.device = torch.device("cuda", 0)
        out["torch_attention"] = lm._graph_refusal()
    finally:
        comm.device = torch.device("cpu")
        detcomm.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("w", [1, 2])
def test_refusals_name_the_site_and_the_fix(w: int, tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    r = get_cluster(w).run(job_refusals, directory)[0]
    assert "cuda_graphs=True" in r["required"] and "CUDA graphs need a CUDA device" in r["required"], r
    assert "cuda_graphs='auto'" in r["required"]
    assert "not declared" in r["undeclared"] and "detcomm.site" in r["undeclared"]
    assert "CUDA graphs capture CUDA work only" in r["cpu_site"]
    assert r["route"] != "ipc_fold"  # a CPU group's route, so the staged reason applies to it
    assert "attention_impl='torch'" in r["torch_attention"] and "attention_impl='triton'" in r["torch_attention"]
    if w == 1:  # one rank: every route's transport is a local copy, so nothing refuses (no library, no staging)
        assert r["staged"] is None and r["unstaged"] is None and r["unstaged_auto"] is None, r
        assert set(r["head_sites"].values()) == {None}, r["head_sites"]
        return
    assert "host memory" in r["staged"] and r["route"] in r["staged"] and "CaptureThroughHost" in r["staged"], r
    assert "workspace_max_rows" in r["staged"] and "NCCL" in r["staged"]
    assert r["unstaged"] is None
    assert "detcomm.shutdown() waits" in r["unstaged_auto"] and "release_graphs()" in r["unstaged_auto"], r
    assert all("detcomm.shutdown() waits" in (v or "") for v in r["head_sites"].values()), r["head_sites"]


def job_w1_local(rank: int, w: int, directory: str) -> dict:
    """The tree layout at W = 1 (whose embed.gather is a native all_gather): which sites auto would refuse on a
    CUDA group over NCCL (the facts patched in; nothing runs on a device), how many library calls a step and its
    head make, and their bits against the same steps with the transport forced through the library."""
    import torch.distributed as dist

    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm
    from detcomm.route_impls import native
    from detcomm.tp import Segment

    torch.set_num_threads(1)
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    comm = detcomm.init(numerics="rl-bitwise")
    calls = [0]
    real = (native.all_gather_flat, dist.all_reduce, dist.all_to_all_single)

    def counting(fn):  # noqa: ANN001, ANN202
        def wrapped(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls[0] += 1
            return fn(*a, **k)
        return wrapped

    native.all_gather_flat = counting(real[0])
    dist.all_reduce, dist.all_to_all_single = counting(real[1]), counting(real[2])
    out: dict = {}
    try:
        lm = TPCausalLM(load_causal_lm(directory, dtype=torch.float32), ServingConfig(t_pad=64, max_context=64),
                        layout="virtual", virtual_shards=4, shard_fold="tree")
        sites = lm.step_sites() + lm.head_sites()
        out["routes"] = {e.site.name: e.decision.route.value for e in comm.routes().entries if e.site.name in sites}
        comm.device = torch.device("cuda", 0)
        out["refusals"] = {s: comm.capture_refusal(s, library=False) for s in sites}
        comm.device = torch.device("cpu")
        got = []
        for local in (True, False):
            comm._native.local = local  # False: the library's W = 1 collectives, the path before this change
            before = calls[0]
            table = lm.new_cache()
            logits, _ = lm.forward([Segment(table, PROMPTS[0], 0)])
            toks = lm.next_tokens([Segment(table, [3], len(PROMPTS[0]))])
            lm.free_cache(table)
            got.append((_bits(logits.buf), toks.tokens, _bits(toks.logprobs), calls[0] - before))
        out["same_bits"] = all(_same(x, y) for x, y in zip(got[0][:3], got[1][:3]))
        out["library_calls"] = (got[0][3], got[1][3])
    finally:
        native.all_gather_flat = real[0]
        dist.all_reduce, dist.all_to_all_single = real[1], real[2]
        comm.device = torch.device("cpu")
        comm._native.local = comm.world_size == 1
        detcomm.shutdown()
    return out


@pytest.mark.slow
def test_tree_layout_at_w1_calls_no_library_and_captures(tmp_path) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    (r,) = get_cluster(1).run(job_w1_local, directory)
    assert "native" in set(r["routes"].values()), r["routes"]  # embed.gather / the head's gathers: native routes
    assert all(v is None for v in r["refusals"].values()), r["refusals"]
    assert r["same_bits"], r
    local, library = r["library_calls"]
    assert local == 0 and library > 0, r["library_calls"]  # control: the library path does call it


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
