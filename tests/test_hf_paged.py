"""detcomm.hf's engine on the paged attention (issue 42), end to end on spawned gloo ranks at W = 2, 3 and 4: a
request's logprob bits (every vocabulary entry of every sampled row) are the same whether its prompt is
prefilled in one chunk or in chunks that do not align with the KV blocks beside other requests' rows, whether it
is decoded alone or packed with other requests in shuffled order, and whether its rows are computed step by step
or in ONE teacher-forced forward over prompt + generated tokens (the trainer's path, issue 43). Mistral's sliding
window (48) binds: the prompt is 50 tokens. The oracle is the request alone (bits); the negative control swaps in
a split-KV attention that splits a row's keys when the step has one row (as flash-decoding does, to fill the
device) and must fail the same comparison; the engine's blocks all go back to its allocator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from detcomm.hf import write_tiny_checkpoint

pytestmark = pytest.mark.slow

A = [(7 * i + 3) % 1000 + 1 for i in range(50)]  # 50 tokens: past Mistral's window of 48 once decoding
B = [5, 77, 300, 2, 999, 41, 12, 640, 8]
C = [11, 500, 23, 901, 4]
NEW = 4
BLOCK = 4  # chunks of 20 / 20 / 10 rows start inside blocks


def split_kv_attend(kv, layer, q, k, v, step, *, scale, window):  # noqa: ANN001, ANN201
    """The negative control's attention: each row in fp32 over its visible keys, read through the block table;
    in a step of one row its keys are split in two halves whose softmax statistics are merged (what a
    split-KV kernel chosen from the batch does), one pass otherwise. Exact arithmetic, batch-dependent order."""
    kv.cache.write(layer, k, v, block_tables=step.block_tables, row_request=step.row_request, positions=step.positions)
    rows, heads, _ = q.shape
    group = heads // kv.cache.k.shape[3]
    bs = kv.block_size
    out = torch.empty_like(q)
    for i in range(rows):
        r, p = int(step.row_request[i]), int(step.positions[i])
        lo = 0 if window is None else max(0, p - window + 1)
        pos = torch.arange(lo, p + 1, device=q.device)
        blocks = step.block_tables[r][pos // bs]
        keys = kv.cache.k[layer, blocks, pos % bs].float().repeat_interleave(group, dim=1)  # [n, heads, hd]
        vals = kv.cache.v[layer, blocks, pos % bs].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), keys) * scale  # [heads, n]
        n = len(pos)
        cuts = [(0, n // 2), (n // 2, n)] if rows == 1 and n >= 2 else [(0, n)]
        parts = []
        for a, b in cuts:
            m = s[:, a:b].amax(dim=1, keepdim=True)
            e = torch.exp(s[:, a:b] - m)
            parts.append((m, e.sum(dim=1, keepdim=True), torch.einsum("hn,nhd->hd", e, vals[a:b])))
        big = torch.stack([m for m, _, _ in parts]).amax(dim=0)
        total = sum(l * torch.exp(m - big) for m, l, _ in parts)
        acc = sum(x * torch.exp(m - big) for m, _, x in parts)
        out[i] = (acc / total).to(q.dtype)
    return out


def job_paged_bits(rank: int, w: int, directory: str, control: bool, device: str = "cpu") -> dict:
    """Request A's greedy tokens and the bits of its sampled rows' logprobs: alone, chunked and packed, teacher
    forced; whether every block went back to the allocator; the logits against transformers' own model.
    ``device`` "cuda": the engine on the GPU (the W ranks share it; tests/gpu/test_hf_engine_gpu.py)."""
    import detcomm
    from detcomm.hf import ServingConfig, StepLogits, TPCausalLM, load_causal_lm
    from detcomm.tp import Segment

    torch.set_num_threads(1)
    detcomm.init(numerics="rl-bitwise", device=device)
    try:
        # The control's attention reads rows back to the host, which a CUDA graph cannot hold: it runs eagerly.
        lm = TPCausalLM(load_causal_lm(directory, dtype=torch.float32),
                        ServingConfig(t_pad=64, max_context=64, block_size=BLOCK, num_blocks=64,
                                      cuda_graphs=False if control else "auto"))
        if control:
            lm.kv.attend = lambda *a, **kw: split_kv_attend(lm.kv, *a, **kw)  # type: ignore[method-assign]
        free0 = lm.kv.allocator.available

        def run(steps_of) -> tuple[list[int], np.ndarray]:  # noqa: ANN001
            """Drive lm.forward over the steps ``steps_of(tables, toks)`` yields (lists of (request, Segment)),
            collecting request A's sampled tokens and logprob rows; frees every request at the end."""
            tables = {name: lm.new_cache() for name in "ABC"}
            toks: dict[str, list[int]] = {name: [] for name in "ABC"}
            rows = []
            for work in steps_of(tables, toks):
                logits, picks = lm.forward([seg for _, seg in work])
                greedy, lps = lm.greedy(logits), lm.logprobs(logits)
                for j, k in enumerate(picks):
                    name = work[k][0]
                    toks[name].append(int(greedy[j]))
                    if name == "A":
                        rows.append(lps[j].cpu().numpy().view(np.uint32).copy())
            for t in tables.values():
                lm.free_cache(t)
            return toks["A"], np.stack(rows)

        def decode(name: str, tables, toks) -> tuple[str, Segment]:  # noqa: ANN001
            prompt = {"A": A, "B": B, "C": C}[name]
            return name, Segment(tables[name], [toks[name][-1]], len(prompt) + len(toks[name]) - 1)

        def alone(tables, toks):  # noqa: ANN001, ANN202
            yield [("A", Segment(tables["A"], A, 0))]
            for _ in range(NEW - 1):
                yield [decode("A", tables, toks)]

        def packed(tables, toks):  # noqa: ANN001, ANN202
            yield [("B", Segment(tables["B"], B, 0)), ("A", Segment(tables["A"], A[:20], 0, sample=False))]
            yield [decode("B", tables, toks), ("A", Segment(tables["A"], A[20:40], 20, sample=False)),
                   ("C", Segment(tables["C"], C, 0))]
            yield [decode("C", tables, toks), ("A", Segment(tables["A"], A[40:], 40)), decode("B", tables, toks)]
            for i in range(NEW - 1):
                order = ["C", "A", "B"] if i % 2 else ["B", "C", "A"]
                yield [decode(n, tables, toks) for n in order]

        tok_alone, lp_alone = run(alone)
        tok_packed, lp_packed = run(packed)
        # Teacher forcing: one forward over A + its tokens (no sampling segment), the sampled rows' logprobs.
        table = lm.new_cache()
        seq = A + tok_alone[:-1]
        logits, _ = lm.forward([Segment(table, seq, 0, sample=False)])
        rows = torch.arange(len(A) - 1, len(seq), device=lm.device)
        lp_forced = lm.logprobs(StepLogits(logits.buf, rows)).cpu().numpy().view(np.uint32)
        lm.free_cache(table)
        freed = lm.kv.allocator.available == free0
        # The window is applied: this rank's logit shard of the sequence against transformers' unsharded model,
        # with its window and (the check's control) without it.
        v0, width = rank * lm.shards.vocab_width, lm.shards.vocab_width
        ref_model = load_causal_lm(directory, dtype=torch.float32)
        with torch.no_grad():
            ref = ref_model(torch.tensor([seq])).logits[0, :, v0 : v0 + width]
            ref_model.config.sliding_window = None
            unwindowed = ref_model(torch.tensor([seq])).logits[0, :, v0 : v0 + width]
        mine = logits.buf[: len(seq), : ref.shape[1]].cpu()
        err, window_effect = float((mine - ref).abs().max()), float((unwindowed - ref).abs().max())
    finally:
        detcomm.shutdown()
    return {"tokens": (tok_alone, tok_packed), "packed": int((lp_packed != lp_alone).sum()),
            "forced": int((lp_forced != lp_alone).sum()), "rows": lp_alone.shape, "freed": freed,
            "impl": lm.attention_impl, "windows": lm._layer_window, "err": err, "window_effect": window_effect}


def test_logprob_bits_do_not_depend_on_chunking_packing_or_teacher_forcing(tmp_path, cluster) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("mistral-tiny", str(tmp_path), seed=3)
    for r in cluster.run(job_paged_bits, directory, False):
        assert r["impl"] == "torch"
        assert r["rows"] == (NEW, 1024)
        assert r["tokens"][0] == r["tokens"][1]
        assert r["packed"] == 0 and r["forced"] == 0, r
        assert r["freed"]
        assert r["windows"] == [48, 48]
        assert r["err"] < 1e-4 < r["window_effect"], r  # to rounding of transformers' model, window included


def test_negative_control_split_kv_by_batch_size_fails(tmp_path, cluster) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("mistral-tiny", str(tmp_path), seed=3)
    for r in cluster.run(job_paged_bits, directory, True):
        # Alone, A's decode steps have one row (split), packed three (one pass): the bits must differ.
        assert r["packed"] > 0, r
        assert r["freed"]


def test_generate_frees_blocks_and_refuses_a_cache_too_small(tmp_path, cluster2) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    for r in cluster2.run(job_generate_blocks, directory):
        assert r["same"] and r["freed"]
        assert "raise ServingConfig.num_blocks" in r["refused"]


def job_generate_blocks(rank: int, w: int, directory: str) -> dict:
    """generate alone == generate among others, every block back afterwards; a call whose requests cannot all
    fit the cache is refused before any step."""
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    torch.set_num_threads(1)
    detcomm.init(numerics="rl-bitwise")
    try:
        # 16 blocks of 4: the three short requests fit (4 blocks each), two of A (14 each) do not.
        lm = TPCausalLM(load_causal_lm(directory, dtype=torch.float32),
                        ServingConfig(t_pad=64, max_context=64, block_size=BLOCK, num_blocks=16))
        alone = lm.generate([B], max_new_tokens=NEW)[0]
        among = lm.generate([C, B, C[::-1]], max_new_tokens=NEW)[1]
        same = alone[0] == among[0] and bool((alone[1].view(torch.int32) == among[1].view(torch.int32)).all())
        freed = lm.kv.allocator.available == 16
        try:
            lm.generate([A] * 2, max_new_tokens=NEW)
            refused = ""
        except ValueError as e:
            refused = str(e)
    finally:
        detcomm.shutdown()
    return {"same": same, "freed": freed, "refused": refused}


def test_serving_geometry_refused_with_the_fix() -> None:
    """ServingConfig.check refuses what the paged cache cannot serve, before anything is sharded; the defaults
    and a power-of-two block size pass (so the refusals are not of every geometry)."""
    from detcomm.hf import ServingConfig

    ServingConfig().check()
    ServingConfig(max_context=128, block_size=32, num_blocks=4, attention_impl="torch").check()
    with pytest.raises(ValueError, match="block_size must be a power of two.*got 12"):
        ServingConfig(block_size=12).check()
    with pytest.raises(ValueError, match=r"num_blocks=3 cannot hold one request of max_context=128 \(4 blocks"):
        ServingConfig(max_context=128, block_size=32, num_blocks=3).check()
    with pytest.raises(ValueError, match=r"impl must be one of \('torch', 'triton'\).*got 'flash'"):
        ServingConfig(attention_impl="flash").check()
