"""MoE dispatch and combine (detcomm/moe.py): exact bits against the numpy oracle (tests/moe_oracle.py),
independent of the expert placement (replicas included), the replica rule's keys, the source rank, the
token's offset and its co-batch, at W = 2, 3, 4 on gloo; the rank-order combine as the negative control.

Every token's data is a function of its global id (`_pool`), so the parent process computes the oracle from
inputs that never went through a collective.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import moe_oracle
import oracle
from datagen import DTYPES, ill_bits, random_bits, to_bits, to_torch

E, K, H, F, BLOCK = 6, 4, 16, 24, 8
N_PROBE = 24
POOL = 256
CONFIGS = ((11, 0), (29, 1))  # (placement seed, batch-layout seed): two placements, two co-batch layouts
KINDS = ("scale", "mlp")


def _pool(dtype: str) -> dict[str, np.ndarray]:
    """Per global token id: its row, top-k expert ids (some zero/identity slots), fp32 weights, shared row."""
    rng = np.random.default_rng(1234)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(POOL)]).astype(np.int64)
    special = rng.random((POOL, K))
    ids[special < 0.08] = -1
    ids[(special >= 0.08) & (special < 0.14)] = -2
    w = (rng.standard_normal((POOL, K)) * 10.0 ** rng.uniform(-2, 2, (POOL, K))).astype(np.float32)
    w[rng.random((POOL, K)) < 0.03] = np.nan  # on a zero-expert slot it must be ignored, elsewhere it gives NaN
    return {
        "tokens": ill_bits(POOL, H, dtype, seed=1, rank=0),
        "ids": ids,
        "weights": w.view(np.uint32),
        "shared": random_bits(POOL, H, dtype, seed=2, rank=0),
        "scale": random_bits(E, H, dtype, seed=3, rank=0),
    }


def _layout(w: int, layout_seed: int) -> list[list[int]]:
    """Each rank's batch as global ids: the probe tokens spread over ranks at random offsets among fillers
    (distinct per layout); in layout 1 the last rank carries no tokens at all."""
    rng = np.random.default_rng([77, layout_seed, w])
    probe = rng.permutation(N_PROBE)
    holders = w - 1 if layout_seed == 1 else w
    parts = np.split(probe, np.sort(rng.integers(0, N_PROBE + 1, holders - 1)))
    parts += [probe[:0]] * (w - holders)
    next_filler = N_PROBE + 100 * layout_seed
    batches = []
    for r, part in enumerate(parts):
        n_fill = 0 if (layout_seed == 1 and r == w - 1) else int(rng.integers(1, 8))
        fill = np.arange(next_filler, next_filler + n_fill)
        next_filler += n_fill
        b = np.concatenate([part, fill]).astype(np.int64)
        batches.append(rng.permutation(b).tolist())
    return batches


class TinyExperts:
    """A tiny SwiGLU expert MLP per expert (these tests' model): weights from ``seed``, shared by
    every replica, so a replica computes the same function. ``__call__(e, x)`` is an ``expert_fn`` for
    ``run_experts_blocked``: ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]`` in ``dtype``."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, *, seed: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        gen = torch.Generator().manual_seed(seed)
        scale = hidden ** -0.5

        def mat(a: int, b: int) -> torch.Tensor:
            return (torch.randn(num_experts, a, b, generator=gen) * scale).to(device, dtype)

        self.w1, self.w3, self.w2 = mat(hidden, ffn), mat(hidden, ffn), mat(ffn, hidden)

    def __call__(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]


def _experts(kind: str, dtype: str, pool: dict[str, np.ndarray]):  # type: ignore[no-untyped-def]
    if kind == "mlp":
        return TinyExperts(E, H, F, seed=5, dtype=DTYPES[dtype])
    scale = to_torch(pool["scale"], dtype)
    return lambda e, x: (x.float() * scale[e].float()).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Jobs: fn(rank, world_size, ...) on every rank.

def job_moe(rank: int, w: int, numerics: str, orders: tuple[str, ...]) -> dict[tuple, dict[int, bytes]]:
    """Every (dtype, expert kind, config, order): this rank's tokens' output bits by global id."""
    import detcomm
    from detcomm.moe import Placement, moe_combine, moe_dispatch, moe_site, run_experts_blocked

    detcomm.shutdown()
    comm = detcomm.init(numerics=numerics)
    results: dict[tuple, dict[int, bytes]] = {}
    refused = False
    _caller_errors(w)
    for dtype in ("bfloat16", "float32"):
        pool = _pool(dtype)
        site = moe_site(f"moe.{dtype}", dtype=DTYPES[dtype], hidden=H, top_k=K, max_tokens=64)
        for kind in KINDS:
            experts = _experts(kind, dtype, pool)
            for pseed, lseed in CONFIGS:
                placement = Placement.random(E, w, seed=pseed, max_replicas=min(3, w))
                gids = np.array(_layout(w, lseed)[rank], dtype=np.int64)
                tokens = to_torch(pool["tokens"][gids].reshape(-1, H), dtype)
                ids = torch.from_numpy(pool["ids"][gids].reshape(-1, K))
                weights = torch.from_numpy(pool["weights"][gids].reshape(-1, K).view(np.float32))
                shared = to_torch(pool["shared"][gids].reshape(-1, H), dtype) if kind == "scale" else None
                token_ids = torch.from_numpy(gids) if lseed == 0 else None
                d = moe_dispatch(tokens, ids, placement=placement, site=site, token_ids=token_ids)
                assert set(d.expert_ids.tolist()) <= set(placement.experts_on(rank))
                y = run_experts_blocked(d.rows, d.expert_ids, experts, block=BLOCK)
                for order in orders:
                    out = moe_combine(y, weights, d.handle, site=site, shared=shared, combine_order=order)
                    bits = to_bits(out)
                    results[(dtype, kind, pseed, order)] = {int(g): bits[i].tobytes() for i, g in enumerate(gids)}
                if comm.resolved.bitwise and not refused:
                    try:
                        moe_combine(y, weights, d.handle, site=site, shared=shared, combine_order="rank")
                    except ValueError as e:
                        refused = "combine_order='slot'" in str(e) and "numerics='auto'" in str(e)
                    assert refused, "the rank-order combine was not refused under a bitwise envelope"
    detcomm.shutdown()
    return results


def _caller_errors(w: int) -> None:
    """Wrong calls raise on every rank before any communication (a hang here would be a failure)."""
    from detcomm.moe import Placement, moe_dispatch

    tokens, ids = torch.zeros(3, H), torch.zeros(3, K, dtype=torch.int64)
    cases = [
        (ValueError, "placement is for", dict(placement=Placement.round_robin(E, w + 1))),
        (ValueError, "expert ids must be", dict(ids=ids + E)),
        (ValueError, "expert_ids must be int64", dict(ids=ids.int())),
        (ValueError, "token_ids must be", dict(token_ids=torch.arange(2))),
        (TypeError, "placement must be", dict(placement={0: [0]})),
    ]
    for exc, text, kw in cases:
        with pytest.raises(exc, match=text):
            moe_dispatch(tokens, kw.get("ids", ids), placement=kw.get("placement", Placement.round_robin(E, w)),
                         site="moe.errors", token_ids=kw.get("token_ids"))
    import detcomm

    rows = torch.zeros(w, H)
    with pytest.raises(ValueError, match="out_splits is for an uneven all_to_all"):
        detcomm.all_to_all(rows, "moe.errors.a2a", out_splits=[1] * w)
    with pytest.raises(ValueError, match=f"out_splits has {w + 1} entries"):
        detcomm.all_to_all(rows, "moe.errors.a2a", splits=[1] * w, out_splits=[1] * (w + 1))
    with pytest.raises(ValueError, match="out_splits must be non-negative"):
        detcomm.all_to_all(rows, "moe.errors.a2a", splits=[1] * w, out_splits=[-1] * w)
    # A caller that knows the counts (here: every rank sends one row to each) gets the exchange's result.
    got = detcomm.all_to_all(torch.arange(w, dtype=torch.float32)[:, None].expand(w, H).contiguous() + 10 * dist.get_rank(),
                             "moe.errors.a2a", splits=[1] * w, out_splits=[1] * w)
    assert got[:, 0].tolist() == [10.0 * q + dist.get_rank() for q in range(w)]


# ---------------------------------------------------------------------------------------------------------
# The parent: the oracle, from the pool alone.

def _expected(dtype: str, kind: str, gids: list[int]) -> np.ndarray:
    pool = _pool(dtype)
    g = np.array(gids)
    ids = pool["ids"][g]
    tok = pool["tokens"][g]
    if kind == "scale":
        y = np.stack([moe_oracle.scale_expert_oracle(tok, pool["scale"][np.maximum(ids[:, j], 0)], dtype)
                      for j in range(K)], axis=1)
    else:
        # The MLP alone on each token (row 0 of a zero block): what row invariance promises for any batch.
        experts = _experts(kind, dtype, pool)
        rows = []
        for t, e_row in zip(tok, ids):
            x = torch.zeros(BLOCK, H, dtype=DTYPES[dtype])
            x[0] = to_torch(t[None], dtype)[0]
            rows.append(np.stack([to_bits(experts(int(e), x))[0] if e >= 0 else np.zeros(H, t.dtype) for e in e_row]))
        y = np.stack(rows)
    return moe_oracle.combine_oracle(y, pool["weights"][g], ids, tok, dtype,
                                     shared_bits=pool["shared"][g] if kind == "scale" else None)


def _merge(per_rank: list[dict[tuple, dict[int, bytes]]]) -> dict[tuple, dict[int, bytes]]:
    merged: dict[tuple, dict[int, bytes]] = {}
    for res in per_rank:
        for key, by_gid in res.items():
            merged.setdefault(key, {}).update(by_gid)
    return merged


def _check_against_oracle(merged: dict[tuple, dict[int, bytes]], order: str) -> None:
    for dtype in ("bfloat16", "float32"):
        for kind in KINDS:
            a, b = (merged[(dtype, kind, p, order)] for p, _ in CONFIGS)
            probe = list(range(N_PROBE))
            assert all(a[g] == b[g] for g in probe), f"{dtype} {kind}: a probe token moved with placement/batch"
            for by_gid in (a, b):
                gids = sorted(by_gid)
                exp = _expected(dtype, kind, gids)
                got = np.stack([np.frombuffer(by_gid[g], dtype=exp.dtype) for g in gids])
                bad = np.nonzero((got != exp).any(axis=1))[0]
                assert not bad.size, f"{dtype} {kind}: tokens {[gids[i] for i in bad]} differ from the oracle"


def test_placement_and_batch_invariant_bits(cluster) -> None:  # noqa: ANN001
    merged = _merge(cluster.run(job_moe, "rl-bitwise", ("slot",), timeout_s=300))
    _check_against_oracle(merged, "slot")


def test_rank_order_combine_moves_bits(cluster3plus) -> None:  # noqa: ANN001
    """Negative control: under auto the engines' rank-order sum changes probe tokens' bits between the two
    (placement, co-batch) configs; the slot-order combine on the same run still matches the oracle."""
    merged = _merge(cluster3plus.run(job_moe, "auto", ("slot", "rank"), timeout_s=300))
    _check_against_oracle(merged, "slot")
    moved = 0
    for dtype in ("bfloat16", "float32"):
        for kind in KINDS:
            a, b = (merged[(dtype, kind, p, "rank")] for p, _ in CONFIGS)
            moved += sum(a[g] != b[g] for g in range(N_PROBE))
    assert moved > 0, "the rank-order combine did not move any bits: the test data cannot tell the orders apart"


# ---------------------------------------------------------------------------------------------------------
# Local (no ranks).

def test_slot_fold_is_not_fused_and_matches_the_oracle() -> None:
    """The combine's arithmetic on one rank against the numpy oracle, including a case built so that a fused
    multiply-add gives 2^-30 where two rounded ops give +0.0; torch.addcmul (fused) is the negative control."""
    from detcomm.moe import slot_fold

    p = np.float32(1 + 2**-7) * np.float32(1 + 2**-12 + 2**-23)  # rounded product P; exact is P + 2^-30
    w = np.array([[p, 1 + 2**-12 + 2**-23]], dtype=np.float32)
    y = np.array([[[-1.0], [1 + 2**-7]]], dtype=np.float32)
    ids = np.array([[0, 1]])
    got = slot_fold(torch.from_numpy(w), torch.from_numpy(y), torch.from_numpy(ids))
    exp = moe_oracle.combine_oracle(y.view(np.uint32), w.view(np.uint32), ids, np.zeros((1, 1), np.uint32), "float32")
    assert got.item() == 0.0 and exp.view(np.float32).item() == 0.0
    fused = torch.addcmul(torch.tensor([-float(p)]), torch.tensor([float(w[0, 1])]), torch.tensor([float(y[0, 1, 0])]))
    assert fused.item() == 2.0**-30  # a fused fold would fail this oracle
    for dtype in ("bfloat16", "float16", "float32"):
        pool = _pool("float32" if dtype == "float16" else dtype)
        rng = np.random.default_rng(5)
        ybits = ill_bits(64 * K, H, dtype, seed=8, rank=1).reshape(64, K, H)
        ids = pool["ids"][:64]
        tok = ill_bits(64, H, dtype, seed=9, rank=0)
        yt = to_torch(ybits.reshape(-1, H), dtype).view(64, K, H).clone()
        yt[torch.from_numpy(ids == -2)] = to_torch(tok, dtype)[torch.from_numpy(np.nonzero(ids == -2)[0])]
        shared = random_bits(64, H, dtype, seed=int(rng.integers(100)), rank=0)
        got = to_bits(slot_fold(torch.from_numpy(pool["weights"][:64].view(np.float32)), yt, torch.from_numpy(ids),
                                shared=to_torch(shared, dtype)))
        exp = moe_oracle.combine_oracle(ybits, pool["weights"][:64], ids, tok, dtype, shared_bits=shared)
        assert np.array_equal(got, exp), dtype
        assert (got == oracle.CANONICAL_NAN[dtype]).any()  # NaN weights reached the fold, canonicalized


def test_placement_rules() -> None:
    from detcomm.moe import Placement

    p = Placement.random(8, 4, seed=3, max_replicas=3)
    assert p == Placement.random(8, 4, seed=3, max_replicas=3) and p != Placement.random(8, 4, seed=4, max_replicas=3)
    assert any(len(h) > 1 for h in p.hosts)
    e = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7] * 3)
    keys = torch.arange(24)
    got = p.replica_ranks(e, keys).tolist()
    assert got == [p.hosts[i][(k + i) % len(p.hosts[i])] for i, k in zip(e.tolist(), keys.tolist())]
    assert Placement.round_robin(5, 2).hosts == ((0,), (1,), (0,), (1,), (0,))
    with pytest.raises(ValueError, match="no host"):
        Placement(2, ((0,), ()))
    with pytest.raises(ValueError, match="distinct ascending"):
        Placement(2, ((1, 0),))
    with pytest.raises(ValueError, match="distinct ascending"):
        Placement(2, ((2,),))
    with pytest.raises(TypeError):
        Placement(2, ([0],))  # type: ignore[arg-type]
