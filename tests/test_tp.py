"""detcomm.tp: the TP-size-invariant layers give the same bits at W = 1, 2, 3, 4 (gloo on CPU).

Each layer's output at every W is compared with an oracle built in the parent process from inputs that never
went through a collective:

* virtual shards: the numpy canonical fold (tests/oracle.py) of the V per-shard fp32 partials, rounded once;
* full-K: the TP=1 value, full-K GEMMs on the same fixed column blocks;
* the vocabulary head: a reference of the log-softmax definition of docs/spec.md ("TP-size invariance:
  layouts") whose sums, tree and fold are numpy float32 operations (exp and log are the platform's, applied
  to the same fixed shapes);
* the embedding: the table's rows; seeded sampling: the full-vocabulary Gumbel-max.

Negative controls: the fold layout's bits follow W (they differ from the TP=1 value); a fold in another
order and a head with W-dependent blocks differ from their oracles (the comparisons can fail).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import oracle
from datagen import to_bits
from detcomm._spawn import LocalCluster

K, N, V, T, ROWS = 96, 48, 12, 8, 5  # V = 12 fixed shards/blocks: every W in 1..4 divides it
HID, VOCAB = 16, 120
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def cluster1() -> Iterator[LocalCluster]:
    """W = 1: the trainer's width (the shared fixtures start at 2)."""
    c = LocalCluster(1, pg_timeout_s=30.0)
    yield c
    c.close()


def _data(dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] and W [K, N], with a spread of scales so that sums in another order round differently."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, K, generator=g) * torch.exp(torch.randn(T, K, generator=g) * 2)
    w = torch.randn(K, N, generator=g) / K**0.5
    return x.to(DT[dtype]), w


def _logits() -> torch.Tensor:
    """[T, VOCAB] fp32 logits with near-twin columns (close maxima) and a wide range."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(T, VOCAB // 2, generator=g) * 6
    return torch.cat([base, base * (1 + 2.0**-20 * torch.randn(T, VOCAB // 2, generator=g))], dim=1)


# ---------------------------------------------------------------------------------------------------------
# The job: every layer at this W, results as raw bits.

def job_layers(rank: int, w: int) -> dict[str, np.ndarray]:
    import detcomm
    from detcomm.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead

    torch.set_num_threads(1)
    detcomm.shutdown()
    detcomm.init(numerics="rl-bitwise")
    out: dict[str, np.ndarray] = {}
    try:
        lo, hi = rank * K // w, (rank + 1) * K // w
        for dtype in DT:
            x, wt = _data(dtype)
            xl = x[:, lo:hi].contiguous()
            for layout in ("virtual", "full_k", "fold"):
                lin = RowParallelLinear(wt, site=f"t.{layout}.{dtype}", layout=layout, max_rows=T, dtype=DT[dtype],
                                        virtual_shards=V if layout == "virtual" else None,
                                        blocks=V if layout == "full_k" else None)
                lin.declare()
                out[f"{layout}.{dtype}"] = to_bits(lin(xl, ROWS))
                if layout == "virtual":  # the row alone: no other row may reach its bits
                    out[f"virtual1.{dtype}"] = to_bits(lin(xl, 1))
            col = ColumnParallelLinear(wt, blocks=V, dtype=DT[dtype])
            local = col(x)
            out[f"column.{dtype}"] = to_bits(detcomm.all_gather(local.contiguous(), site=f"t.col.{dtype}")
                                             .view(w, T, N // w).transpose(0, 1).reshape(T, N))
        # The vocabulary head on given logits (its arithmetic, not the GEMM's), and its sampling.
        logits = _logits()
        head = VocabParallelHead(torch.zeros(HID, VOCAB), blocks=V, t_pad=T)
        head.declare()
        shard = logits[:ROWS, head.vocab_start : head.vocab_start + head.vocab_local].contiguous()
        out["logprobs"] = to_bits(head.logprobs(shard))
        out["greedy"] = head.greedy(shard).numpy()
        lp_shard = head.logprobs_shard(shard)
        out["sample"] = head.sample(lp_shard, temperatures=[1.0, 0.0, 0.7, 1.0, 1.0], keys=[1, 2, 3, 4, 5]).numpy()
        table = _logits()[:, :HID].repeat(VOCAB // T, 1)  # [VOCAB, HID]
        emb = VocabParallelEmbedding(table, site="t.embed", max_rows=T)
        emb.declare()
        out["embed"] = to_bits(emb(torch.tensor([0, 119, 61, 60, 7, 7, 33, 90])))
    finally:
        detcomm.shutdown()
    return out


# ---------------------------------------------------------------------------------------------------------
# Oracles (parent process).

def _virtual_oracle(dtype: str, rows: int, order: range | None = None) -> np.ndarray:
    x, wt = _data(dtype)
    kv = K // V
    torch.set_num_threads(1)
    parts = [to_bits(torch.matmul(x.float()[:, v * kv : (v + 1) * kv].contiguous(),
                                  wt.to(DT[dtype]).float()[v * kv : (v + 1) * kv].contiguous())[:rows])
             for v in (order or range(V))]
    acc = oracle.fold_oracle(parts, "float32")
    return oracle.round_fp32_bits(acc, dtype).astype(np.uint16 if dtype == "bfloat16" else np.uint32)


def _full_k_oracle(dtype: str) -> np.ndarray:
    """The TP=1 value: full-K GEMMs on the V fixed column blocks."""
    x, wt = _data(dtype)
    wt = wt.to(DT[dtype])
    b = N // V
    torch.set_num_threads(1)
    return to_bits(torch.cat([torch.matmul(x, wt[:, j * b : (j + 1) * b].contiguous()) for j in range(V)], dim=1))


def _logprob_reference(logits: np.ndarray, blocks: int, t_pad: int) -> np.ndarray:
    """The log-softmax definition: per block max and halving-tree sum of exp, blocks folded in order."""
    n, vocab = logits.shape
    bw = vocab // blocks
    p = max(64, 1 << (bw - 1).bit_length())
    buf = np.zeros((t_pad, vocab), np.float32)
    buf[:n] = logits
    ms, ss = [], []
    for b in range(blocks):
        blk = np.full((t_pad, p), -np.inf, np.float32)
        blk[:, :bw] = buf[:, b * bw : (b + 1) * bw]
        m = blk.max(axis=1, keepdims=True)
        e = torch.exp(torch.from_numpy(blk - m)).numpy()  # the platform's exp on the head's [t_pad, p] shape
        while e.shape[1] > 1:
            h = e.shape[1] // 2
            e = (e[:, :h] + e[:, h:]).astype(np.float32)
        ms.append(m[:, 0])
        ss.append(e[:, 0])
    mb = np.full((t_pad, blocks), -np.inf, np.float32)
    mb[:n] = np.stack(ms, 1)[:n]
    sb = np.zeros((t_pad, blocks), np.float32)
    sb[:n] = np.stack(ss, 1)[:n]
    big = mb.max(axis=1, keepdims=True)
    scale_in = np.full((t_pad, 64 * ((blocks + 63) // 64)), -np.inf, np.float32)
    with np.errstate(invalid="ignore"):  # the filler rows' -inf - -inf; real rows are finite
        scale_in[:, :blocks] = mb - big
    c = (sb * torch.exp(torch.from_numpy(scale_in)).numpy()[:, :blocks]).astype(np.float32)
    acc = np.zeros(t_pad, np.float32)
    for b in range(blocks):
        acc = (acc + c[:, b]).astype(np.float32)
    log_in = np.ones((t_pad, 64), np.float32)
    log_in[:, 0] = acc
    lse = torch.log(torch.from_numpy(log_in)).numpy()[:n, 0]
    return (((logits - big[:n]).astype(np.float32) - lse[:, None]).astype(np.float32)).view(np.uint32)


def _gumbel_argmax(lp: np.ndarray, temperature: float, key: int) -> int:
    if temperature == 0.0:
        return int(np.argmax(lp))
    g = torch.Generator().manual_seed(key)
    u = torch.rand(lp.shape[0], generator=g, dtype=torch.float32).clamp_min(1e-30)
    noise = (-torch.log(-torch.log(u))).numpy()
    return int(np.argmax((lp / np.float32(temperature)).astype(np.float32) + noise))


# ---------------------------------------------------------------------------------------------------------
# Tests.

def _check(res: list[dict[str, np.ndarray]], w: int) -> None:
    for r in res[1:]:  # every rank holds the same bits
        for k, v in res[0].items():
            assert np.array_equal(r[k], v), k
    got = res[0]
    for dtype in DT:
        assert np.array_equal(got[f"virtual.{dtype}"], _virtual_oracle(dtype, ROWS)), (dtype, w)
        assert np.array_equal(got[f"virtual1.{dtype}"], got[f"virtual.{dtype}"][:1])
        assert np.array_equal(got[f"full_k.{dtype}"], _full_k_oracle(dtype)[:ROWS]), (dtype, w)
        # Column-parallel on fixed blocks: the same GEMMs, so the same columns as the full-K oracle's.
        assert np.array_equal(got[f"column.{dtype}"], _full_k_oracle(dtype)), (dtype, w)
    logits = _logits()[:ROWS].numpy()
    lp_ref = _logprob_reference(logits, V, T)
    assert np.array_equal(got["logprobs"], lp_ref), w
    assert np.array_equal(got["greedy"], np.argmax(logits, axis=1))
    lps = lp_ref.view(np.float32)
    want = [_gumbel_argmax(lps[i], t, k) for i, (t, k) in enumerate(zip([1.0, 0.0, 0.7, 1.0, 1.0], [1, 2, 3, 4, 5]))]
    assert got["sample"].tolist() == want
    table = _logits()[:, :HID].repeat(VOCAB // T, 1)
    assert np.array_equal(got["embed"], to_bits(table[torch.tensor([0, 119, 61, 60, 7, 7, 33, 90])]))
    if w > 1:  # negative control: the plain layer's bits follow W
        for dtype in DT:
            assert not np.array_equal(got[f"fold.{dtype}"], _plain_tp1(dtype)[:ROWS]), (dtype, w)


def _plain_tp1(dtype: str) -> np.ndarray:
    x, wt = _data(dtype)
    return to_bits(torch.matmul(x, wt.to(DT[dtype])))


def test_layers_w1(cluster1: LocalCluster) -> None:
    res = cluster1.run(job_layers, timeout_s=120)
    _check(res, 1)
    for dtype in DT:  # at W = 1 the plain layer is the TP=1 GEMM rounded once more through the fold
        assert np.array_equal(res[0][f"fold.{dtype}"], _plain_tp1(dtype)[:ROWS])


def test_layers_equal_across_w(cluster) -> None:  # noqa: ANN001
    _check(cluster.run(job_layers, timeout_s=120), cluster.world_size)


def test_oracles_resolve_order() -> None:
    """Negative controls of the oracles: the virtual fold in reverse shard order (fp32: bf16's rounding hides
    it on these rows), and the head with one block per rank of W = 4, give other bits than the definitions (so
    the comparisons above can fail)."""
    assert not np.array_equal(_virtual_oracle("float32", ROWS, range(V - 1, -1, -1)), _virtual_oracle("float32", ROWS))
    logits = _logits()[:ROWS].numpy()
    assert not np.array_equal(_logprob_reference(logits, 4, T), _logprob_reference(logits, V, T))


def test_layout_arguments() -> None:
    from detcomm.tp import RowParallelLinear, VocabParallelHead

    _, wt = _data("float32")
    with pytest.raises(ValueError, match="does not divide the 12 fixed blocks"):
        RowParallelLinear(wt, site="x", layout="virtual", max_rows=T, virtual_shards=V, rank=0, world=8)
    with pytest.raises(ValueError, match="virtual_shards is given exactly"):
        RowParallelLinear(wt, site="x", layout="fold", max_rows=T, virtual_shards=V, rank=0, world=2)
    with pytest.raises(ValueError, match="layout must be one of"):
        RowParallelLinear(wt, site="x", layout="rows", max_rows=T, rank=0, world=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not tile"):
        VocabParallelHead(torch.zeros(HID, VOCAB), blocks=7, t_pad=T, rank=0, world=1)


def test_tp_compare(tmp_path, capsys) -> None:  # noqa: ANN001
    """tp-compare passes identical runs, catches one flipped logprob bit (and exits 0 on it only with
    --expect-divergence), and refuses runs of other requests."""
    import json

    from detcomm.probe.tp_compare import main

    req = {"rid": 0, "prompt": [1, 2], "temperature": 0.0, "seed": 5, "tokens": [7, 8], "logprob_bits": ["0xbf800000", "0xc0000000"]}
    paths = []
    for w, lp in ((1, "0xc0000000"), (2, "0xc0000000"), (4, "0xc0000001")):
        p = tmp_path / f"r{w}.json"
        p.write_text(json.dumps({"world_size": w, "layout": "full_k", "virtual_shards": None,
                                 "requests": [{**req, "logprob_bits": ["0xbf800000", lp]}]}))
        paths.append(str(p))
    assert main(paths[:2]) == 0 and "PASS" in capsys.readouterr().out
    assert main(paths) == 1
    assert "token 1: logprob 0xc0000001 vs 0xc0000000" in capsys.readouterr().out
    assert main([*paths, "--expect-divergence"]) == 0
    assert main([*paths[:2], "--expect-divergence"]) == 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"world_size": 2, "requests": [{**req, "seed": 6}]}))
    with pytest.raises(ValueError, match="holds other requests"):
        main([paths[0], str(other)])
