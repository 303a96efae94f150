"""The probe decoder (detcomm.probe.model.TPTransformer) on static step buffers (cuda_graphs="auto": what a CUDA
graph captures, run eagerly on CPU) against its fresh-tensor steps (cuda_graphs=False), on spawned gloo ranks at
W = 1, 2 and 3 (the invariant layouts at W dividing their 8 blocks), in every layout: the sampled rows' logit shards, greedy tokens and logprob bits of a
packed prefill, decode steps alone and packed, and a teacher-forced forward_all. Negative control: buffers not
refreshed after the first step (the token ids) give other bits. The decision is made at declare_sites (the sites' routes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clusters import get_cluster


def _drive(model) -> list:  # noqa: ANN001
    from detcomm.tp import Segment

    def bits(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).cpu().contiguous().numpy().view(np.uint32).copy()

    out = []
    a, b = model.new_cache(), model.new_cache()
    pa, pb = [3, 9, 27, 81, 243, 729, 1000], [5, 50, 500]
    steps = [[Segment(b, pb, 0), Segment(a, pa[:4], 0, sample=False)], [Segment(a, pa[4:], 4)]]
    toks: dict[str, int] = {}
    for segs in steps:
        shard, picks = model.forward(segs)
        out.append((bits(shard), picks, model.greedy(shard).tolist(), bits(model.logprobs(shard))))
    toks = {"a": int(out[1][2][0]), "b": int(out[0][2][0])}
    for i in range(3):
        segs = [Segment(a, [toks["a"]], len(pa) + i)] if i == 0 else [Segment(b, [toks["b"]], len(pb) + i - 1),
                                                                     Segment(a, [toks["a"]], len(pa) + i)]
        shard, picks = model.forward(segs)
        greedy = model.greedy(shard).tolist()
        out.append((bits(shard), picks, greedy, bits(model.logprobs(shard))))
        toks["a"] = greedy[-1]
        if i:
            toks["b"] = greedy[0]
    model.free_cache(a)
    model.free_cache(b)
    c = model.new_cache()
    out.append((bits(model.forward_all([Segment(c, pa + pb, 0, sample=False)])),))
    model.free_cache(c)
    return out


SEED = 7


def _drive_tokens(model) -> list:  # noqa: ANN001
    """The head inside the step (``next_tokens``) on _drive's prefill and decode segments (fresh caches): greedy
    steps, then sampled ones (T = 1 for both requests, then T = 0 beside T = 1), each with forward + greedy /
    logprobs and the host formula of the sampler (``logprobs / T + keyed_gumbel(key)``, argmax) on a twin cache as
    the reference. Per step: (next_tokens' tokens, logprob bits, picks) and whether the reference agreed; then a
    sampled step with another key must pick other tokens somewhere."""
    from detcomm.numerics.sampling import keyed_gumbel, sample_key
    from detcomm.tp import Segment

    def bits(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).cpu().contiguous().numpy().view(np.uint32).copy()

    out = []
    a, b, ra, rb = (model.new_cache() for _ in range(4))
    pa, pb = [3, 9, 27, 81, 243, 729, 1000], [5, 50, 500]

    def step(segs: list, ref: list, keys: list | None = None, temps: list | None = None) -> list[int]:  # noqa: ANN001
        got = model.next_tokens(segs, keys=keys, temperatures=temps)
        toks, lps, picks = got.tokens, got.logprobs, got.picks
        shard, rpicks = model.forward(ref)
        full = model.logprobs(shard)
        if keys is None:
            want = model.greedy(shard)
        else:
            rows = []
            for i, (k, t) in enumerate(zip(keys, temps)):
                noise = keyed_gumbel(torch.tensor([k], device=full.device), model.cfg.vocab)[0]
                rows.append(torch.argmax(full[i] / t + noise) if t > 0 else torch.argmax(full[i]))
            want = torch.stack(rows)
        agree = (toks == want.tolist() and picks == rpicks
                 and np.array_equal(bits(full.gather(1, want[:, None])[:, 0]), bits(lps)))
        out.append((toks, bits(lps), picks, agree))
        return toks

    g = step([Segment(b, pb, 0), Segment(a, pa[:4], 0, sample=False)],
             [Segment(rb, pb, 0), Segment(ra, pa[:4], 0, sample=False)])
    tb = g[0]
    ta = step([Segment(a, pa[4:], 4)], [Segment(ra, pa[4:], 4)])[0]
    for i, temps in enumerate(([1.0, 1.0], [0.0, 1.0], None)):
        pos_a, pos_b = len(pa) + i, len(pb) + i
        keys = None if temps is None else [sample_key(SEED, 1, pos_b + 1), sample_key(SEED, 0, pos_a + 1)]
        tb, ta = step([Segment(b, [tb], pos_b), Segment(a, [ta], pos_a)],
                      [Segment(rb, [tb], pos_b), Segment(ra, [ta], pos_a)], keys, temps)
    # other keys for the same rows (their caches hold these positions already: the same values are rewritten)
    picked = [tuple(model.next_tokens([Segment(b, [tb], len(pb) + 2), Segment(a, [ta], len(pa) + 2)],
                                      keys=[sample_key(s, 1, 0), sample_key(s, 0, 0)], temperatures=[1.0, 1.0]).tokens)
              for s in range(SEED, SEED + 6)]
    out.append((len(set(picked)) > 1,))
    for t in (a, b, ra, rb):
        model.free_cache(t)
    return out


def job_probe_static(rank: int, w: int, layout: str, virtual_shards: int | None, shard_fold: str,
                     control: bool) -> dict:
    import detcomm
    from detcomm.probe.model import ModelConfig, TPTransformer

    torch.set_num_threads(1)
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise")
    try:
        cfg = ModelConfig(t_pad=32, max_context=64, block_size=4, num_blocks=64)
        models = []
        for mode in (False, "auto"):
            m = TPTransformer(cfg, layout=layout, virtual_shards=virtual_shards, shard_fold=shard_fold,  # type: ignore[arg-type]
                              cuda_graphs=mode)
            m.declare_sites()
            models.append(m)
        fresh, static = models
        if control:  # the token ids keep the first step's values (the rest is refreshed: the rows stay valid)
            upload, first = static._inputs.upload, []

            def stale_ids() -> None:
                ids = static._inputs.host["ids"]
                if first:
                    ids[:] = first[0]
                else:
                    first.append(ids.copy())
                upload()

            static._inputs.upload = stale_ids  # type: ignore[method-assign]
        got_fresh, got_static = _drive(fresh), _drive(static)
        tok_fresh, tok_static = _drive_tokens(fresh), _drive_tokens(static)
        modes = (fresh.graphs_reason, static.cuda_graphs, static.graphs_reason)
    finally:
        detcomm.shutdown()
    same = [all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(f, s))
            for f, s in zip(got_fresh, got_static)]
    same_tokens = [all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(f, s))
                   for f, s in zip(tok_fresh, tok_static)]
    return {"same": same, "modes": modes, "same_tokens": same_tokens,
            "agree": [t[3] for t in tok_fresh[:-1]] + [t[3] for t in tok_static[:-1]],
            "key_matters": (tok_fresh[-1][0], tok_static[-1][0])}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "v", "fold", "w"), [("fold", None, "order", 1), ("fold", None, "order", 3),
                                                        ("virtual", 8, "order", 2), ("virtual", 8, "tree", 1),
                                                        ("full_k", None, "order", 2)])
def test_probe_static_buffers_give_the_fresh_bits(layout: str, v: int | None, fold: str, w: int) -> None:
    for r in get_cluster(w).run(job_probe_static, layout, v, fold, False):
        assert r["modes"][0] == "cuda_graphs=False" and r["modes"][1] is False
        assert "CUDA graphs need a CUDA device" in r["modes"][2]
        assert len(r["same"]) == 6 and all(r["same"]), r["same"]
        # the head inside the step: static == fresh, each == forward + greedy / logprobs or the sampler's formula
        assert len(r["same_tokens"]) == 6 and all(r["same_tokens"]), r["same_tokens"]
        assert len(r["agree"]) == 10 and all(r["agree"]), r["agree"]
        assert all(r["key_matters"]), r["key_matters"]  # control: the keys reach the tokens


@pytest.mark.slow
def test_probe_negative_control_stale_buffers() -> None:
    (r,) = get_cluster(1).run(job_probe_static, "fold", None, "order", True)
    assert r["same"][0] and not all(r["same"][1:]), r["same"]
    assert not all(r["same_tokens"][1:]), r["same_tokens"]  # the head reads the stale ids too


def test_probe_refuses_a_bad_graph_mode() -> None:
    from detcomm.probe.model import ModelConfig, TPTransformer

    with pytest.raises(ValueError, match="cuda_graphs must be 'auto', True or False"):
        TPTransformer(ModelConfig(), cuda_graphs="yes")
