"""all_reduce_residual_rmsnorm on a tree-order virtual-shard site (docs/spec.md §9.2 "Tree sites") on spawned gloo
processes at W = 1, 2, 4, through the public API (detcomm.site, detcomm.all_reduce_residual_rmsnorm).

The same V = 8 global fp32 partials are split over the ranks (rank r passes shards r*V/W .. (r+1)*V/W - 1 as
[V/W, rows, H]); every (y, r) is compared bit for bit with a numpy oracle computed in the test process from inputs
that never went through a collective: test_tree_fold's tree oracle (the definition, recursion for recursion) for
s, then tests/norm_oracle.py's residual add and RMSNorm. Routes: gather_fold (the CPU's choice) and a2a_fold
(forced; bf16 and fp16), rows alone, in batches and at offsets, bf16 / fp16 / fp32; the bits are identical at W = 1, 2, 4 and equal
the composition through the API (the tree site's all-reduce, then the canonical add + RMSNorm). Negative controls:
the payload's placed cancellations make the shard-order fold give other (y, r) (the oracle of that composition, and
a shard-order all_reduce_rmsnorm site, which detcomm serves as that composition); the fused tree variants'
self-check harness (route_impls/ipc_fold._proving, driven by selfcheck.run_check over a stand-in workspace that
folds on the host) refuses a "fused kernel" that folds the shard order, pairs other shards, folds in reverse or
drops the root's +0.0, and passes the right one. Wrong calls (dtype, shapes, a V the group cannot serve, rows, eps)
raise ValueError on one rank alone, before any communication (the other ranks' next call still pairs with its).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import norm_oracle
import oracle
from clusters import get_cluster
from datagen import to_bits, to_torch
from test_tree_fold import _wrong_tree, order_oracle, tree_oracle

V = 8
ROWS = 6
HIDDEN = 264  # 33 chunks of 8: the norm's lanes 0..32 own one chunk each, the rest none (+0.0)
DTYPES = ("bfloat16", "float16", "float32")
EPS = 1e-6
SEED = 20261229
# Row subsets a call carries: alone, in batches, at offsets (the last row holds a NaN partial).
BATCHES = ((0,), (4,), (2, 5), (5, 0, 3), tuple(range(ROWS)))
FULL = BATCHES[-1]
A2A_DTYPES = ("bfloat16", "float16")  # the forced a2a_fold site (test_tree_fold holds its tree in every dtype)
CHECK_HIDDEN = 16  # the self-check harness's rows: every placement of selfcheck._tree_placements at an even element


def _payload(dtype: str) -> dict[str, np.ndarray]:
    """Partials [V, ROWS, HIDDEN] fp32 bits: values at scales 2^-4..2^4 with bits below the dtype's precision, and
    per element: +big/-big on the last leaf of a tree node's left child and the first of its right child, with
    smalls elsewhere (the tree cancels them after each side absorbed its smalls, the shard-order fold at once and
    keeps the smalls after them), all -0.0 (+0.0 out), tiny negatives (-0.0 in bf16/fp16); one NaN with a payload
    in the last row. The residual [ROWS, HIDDEN] in the dtype is -0.0 on a quarter of the elements, so r = s bit
    for bit there; the weight [HIDDEN] in the dtype."""
    rng = np.random.default_rng([SEED, len(dtype)])
    m = ROWS * HIDDEN
    scale = np.float32(2.0) ** rng.integers(-4, 5, (V, m)).astype(np.float32)
    with np.errstate(all="ignore"):
        p = rng.standard_normal((V, m)).astype(np.float32) * scale
        p = (p * (np.float32(1) + rng.integers(-64, 65, (V, m)).astype(np.float32) * np.float32(2**-20)))
    p = p.astype(np.float32)
    kind = rng.integers(0, 8, m)
    kind[0] = 0
    big = np.float32(2.0**30)  # absorbs any small term in fp32
    for c in np.flatnonzero(kind <= 2):
        half = [1, 2, 4][int(rng.integers(0, 3))] if c else V // 2
        node = int(rng.integers(0, V // (2 * half))) * 2 * half
        p[:, c] = rng.standard_normal(V).astype(np.float32)
        p[node + half - 1, c], p[node + half, c] = big, -big
    p[:, kind == 3] = np.float32(-0.0)
    p[:, kind == 4] = -np.float32(1e-45) * rng.integers(1, 4, (V, int((kind == 4).sum()))).astype(np.float32)
    bits = p.view(np.uint32).reshape(V, ROWS, HIDDEN).copy()
    bits[5, ROWS - 1, 7] = 0xFFC0BEEF  # a negative NaN with a payload: canonical NaN in r, the whole row of y NaN
    with np.errstate(all="ignore"):
        res = (rng.standard_normal(m) * 0.125).astype(np.float32)
    res[rng.random(m) < 0.25] = np.float32(-0.0)
    res_bits = oracle.round_fp32_bits(res.view(np.uint32), dtype).reshape(ROWS, HIDDEN)
    w = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    return {"partials": bits, "residual": res_bits, "weight": oracle.round_fp32_bits(w.view(np.uint32), dtype)}


def _composition_oracle(s_bits: np.ndarray, pay: dict[str, np.ndarray], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    r = norm_oracle.residual_add_oracle(s_bits, pay["residual"], dtype)
    return norm_oracle.rms_norm_oracle(r, pay["weight"], dtype, dtype, EPS), r


PAYLOADS = {dt: _payload(dt) for dt in DTYPES}
EXPECTED = {dt: _composition_oracle(tree_oracle(p["partials"], dt), p, dt) for dt, p in PAYLOADS.items()}
ORDER = {dt: _composition_oracle(order_oracle(p["partials"], dt), p, dt) for dt, p in PAYLOADS.items()}

# ---------------------------------------------------------------------------------------------------------
# Jobs: fn(rank, world_size, ...) on every rank.


def _bad_calls(rank: int, w: int) -> list[tuple[str, str, str]]:
    """Wrong calls and declarations on this rank alone: each must raise before any communication."""
    import detcomm

    k = V // w
    x = torch.zeros(k, 2, 8)
    res = torch.zeros(2, 8, dtype=torch.bfloat16)
    wt = torch.ones(8, dtype=torch.bfloat16)
    cases: list[tuple[str, object]] = [
        ("x bf16", lambda: detcomm.all_reduce_residual_rmsnorm(x.to(torch.bfloat16), res, wt, eps=EPS, site="bad")),
        ("x lead", lambda: detcomm.all_reduce_residual_rmsnorm(torch.zeros(k + 1, 2, 8), res, wt, eps=EPS,
                                                                site="bad")),
        ("x width", lambda: detcomm.all_reduce_residual_rmsnorm(torch.zeros(k, 2, 9), res, wt, eps=EPS, site="bad")),
        ("x rows only", lambda: detcomm.all_reduce_residual_rmsnorm(res, res, wt, eps=EPS, site="bad")),
        ("rows", lambda: detcomm.all_reduce_residual_rmsnorm(torch.zeros(k, 5, 8), torch.zeros(5, 8, dtype=torch.bfloat16),
                                                             wt, eps=EPS, site="bad")),
        ("residual fp32", lambda: detcomm.all_reduce_residual_rmsnorm(x, res.float(), wt, eps=EPS, site="bad")),
        ("residual rows", lambda: detcomm.all_reduce_residual_rmsnorm(x, torch.zeros(3, 8, dtype=torch.bfloat16), wt,
                                                                      eps=EPS, site="bad")),
        ("weight", lambda: detcomm.all_reduce_residual_rmsnorm(x, res, wt[:7], eps=EPS, site="bad")),
        ("eps", lambda: detcomm.all_reduce_residual_rmsnorm(x, res, wt, eps=-1.0, site="bad")),
        ("V=6 tree", lambda: detcomm.site("bad.v6", collective="all_reduce_rmsnorm", dtype=torch.bfloat16, shape=8,
                                          max_rows=4, virtual_shards=6, shard_fold="tree")),
        ("ipc_fold", lambda: detcomm.site("bad.ipc", collective="all_reduce_rmsnorm", dtype=torch.bfloat16, shape=8,
                                          max_rows=4, virtual_shards=V, shard_fold="tree", route="ipc_fold")),
    ]
    if w > 1:  # V = W/2 cannot be split over the W ranks
        for fold in ("tree", "order"):
            cases.append((f"V<W {fold}", lambda fold=fold: detcomm.site(  # type: ignore[misc]
                f"bad.{fold}", collective="all_reduce_rmsnorm", dtype=torch.bfloat16, shape=8, max_rows=4,
                virtual_shards=w // 2, shard_fold=fold)))
    got = []
    for case, call in cases:
        try:
            call()  # type: ignore[operator]
        except (TypeError, ValueError) as e:
            got.append((case, type(e).__name__, str(e)))
        else:
            got.append((case, "no error", ""))
    return got


def job_tree_norm(rank: int, w: int, payloads: dict[str, dict[str, np.ndarray]]) -> dict[object, object]:
    """Every dtype x site x batch of all_reduce_residual_rmsnorm with self-checks on: tree sites on gather_fold
    (auto) and a2a_fold (forced), a shard-order site (the negative control), and the composition through the API;
    then wrong calls on rank 0 alone, and one more call on every rank."""
    import detcomm
    from detcomm.numerics.norm import add_rms_norm

    k = V // w
    comm = detcomm.init(numerics="rl-bitwise")
    out: dict[object, object] = {}
    sites = {"tree": {"shard_fold": "tree"}, "tree.a2a": {"shard_fold": "tree", "route": "a2a_fold"},
             "order": {"shard_fold": "order"}}
    for dt, pay in payloads.items():
        dtype = getattr(torch, dt)
        mine = to_torch(pay["partials"][rank * k : (rank + 1) * k], "float32").contiguous()
        residual, weight = to_torch(pay["residual"], dt), to_torch(pay["weight"], dt)
        for name, kw in sites.items():
            if name == "tree.a2a" and dt not in A2A_DTYPES:
                continue
            site = f"{name}.{dt}"
            detcomm.site(site, collective="all_reduce_rmsnorm", dtype=dtype, shape=(HIDDEN,), max_rows=ROWS,
                         virtual_shards=V, **kw)  # type: ignore[arg-type]
            for batch in BATCHES if name != "order" else (FULL,):
                rows = list(batch)
                y, r = detcomm.all_reduce_residual_rmsnorm(mine[:, rows].contiguous(), residual[rows].contiguous(),
                                                           weight, eps=EPS, site=site)
                out[(dt, name, batch)] = (to_bits(y), to_bits(r))
        detcomm.site(f"ar.{dt}", collective="all_reduce", dtype=dtype, shape=(HIDDEN,), max_rows=ROWS,
                     virtual_shards=V, shard_fold="tree")
        y, r = add_rms_norm(detcomm.all_reduce(mine, f"ar.{dt}"), residual, weight, eps=EPS)
        out[(dt, "composition", FULL)] = (to_bits(y), to_bits(r))
    out["routes"] = {d["site"]: (d["route"], d["selfcheck"], d["shard_fold"]) for d in comm.routes().as_dicts()}
    out["table"] = str(comm.routes())
    detcomm.site("bad", collective="all_reduce_rmsnorm", dtype=torch.bfloat16, shape=(8,), max_rows=4,
                 virtual_shards=V, shard_fold="tree")
    out["bad"] = _bad_calls(rank, w) if rank == 0 else []
    pay = payloads["bfloat16"]
    y, r = detcomm.all_reduce_residual_rmsnorm(
        to_torch(pay["partials"][rank * k : (rank + 1) * k], "float32").contiguous(), to_torch(pay["residual"],
        "bfloat16"), to_torch(pay["weight"], "bfloat16"), eps=EPS, site="tree.bfloat16")
    out["after"] = (to_bits(y), to_bits(r))
    detcomm.shutdown()
    return out


def job_fused_check(rank: int, w: int) -> dict[str, tuple[bool, str]]:
    """The fused tree variants' self-check (ipc_fold._proving under selfcheck.run_check, the tree payload) with
    a stand-in workspace whose all_reduce_tree folds the gathered partials on the host, and stand-in fused kernels:
    the right composition, and ones whose s is the shard-order fold, another pairing, a reversed fold or a tree
    without the root's +0.0. Each verdict, agreed across ranks."""
    import detcomm
    from detcomm.layout import Kind
    from detcomm.numerics.norm import add_rms_norm
    from detcomm.numerics.tree import tree_fold
    from detcomm.route_impls.ipc_fold import _proving
    from detcomm.selfcheck import CheckKey, run_check
    from detcomm.sites import Collective, ReduceOp, Route

    comm = detcomm.init(numerics="rl-bitwise", selfcheck=False)
    native = comm._native

    def shards(x: torch.Tensor) -> torch.Tensor:  # [V/W, rows, H] -> every rank's, [V, rows, H] in shard order
        return native.all_gather(x.contiguous()).view(-1, *x.shape[1:])

    def order(stacked: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros_like(stacked[0])
        for j in range(stacked.shape[0]):
            acc = acc + stacked[j]
        return acc

    out: dict[str, tuple[bool, str]] = {}
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        ws = SimpleNamespace(all_reduce_tree=lambda x, dtype, label: tree_fold(shards(x), dtype))
        for kind in ("right", "order", "pairing", "reversed", "no_plus_zero"):
            def fused(x: torch.Tensor, res: torch.Tensor, wt: torch.Tensor, eps: float, kind: str = kind,
                      dt: torch.dtype = dt) -> tuple[torch.Tensor, torch.Tensor]:
                stacked = shards(x)
                s = (tree_fold(stacked, dt) if kind == "right" else
                     order(stacked).to(dt) if kind == "order" else _wrong_tree(stacked, kind).to(dt))
                return add_rms_norm(s, res, wt, eps=eps)

            key = CheckKey(Route.IPC_FOLD, Collective.ALL_REDUCE_RMSNORM, ReduceOp.SUM, dt, (CHECK_HIDDEN,),
                           f"fused_{kind}", V, "tree")
            call = _proving(ws, fused, "check", dt, Kind.TREE)  # type: ignore[arg-type]
            res = run_check(key, lambda x, call=call: call(x, None), native=native, device=comm.device)  # type: ignore[misc]
            out[f"{kind}.{dt}"] = (res.passed, res.reason)
    detcomm.shutdown()
    return out


# ---------------------------------------------------------------------------------------------------------

_RESULTS: dict[int, list[dict[object, object]]] = {}


def _results(w: int) -> list[dict[object, object]]:
    if w not in _RESULTS:
        _RESULTS[w] = get_cluster(w).run(job_tree_norm, PAYLOADS, timeout_s=600)
    return _RESULTS[w]


def _same_on_every_rank(results: list[dict[object, object]], key: object) -> tuple[np.ndarray, np.ndarray]:
    y, r = results[0][key]  # type: ignore[misc]
    for other in results[1:]:
        oy, orr = other[key]  # type: ignore[misc]
        assert np.array_equal(oy, y) and np.array_equal(orr, r), f"{key}: ranks hold different bits"
    return y, r


def test_oracle_reaches_the_cases() -> None:
    """The comparisons are not vacuous: the shard-order composition gives other y and other r than the tree's in
    every dtype (the negative control's premise), r holds the canonical NaN and (bf16, fp16) a -0.0 sum kept by a
    -0.0 residual, a row of y is NaN; the oracle's s equals the package's reference tree."""
    from detcomm.numerics.tree import reference_tree

    for dt, (y, r) in EXPECTED.items():
        oy, orr = ORDER[dt]
        assert (oy != y).any() and (orr != r).any(), dt
        assert (r == oracle.CANONICAL_NAN[dt]).any() and (y[ROWS - 1] == oracle.CANONICAL_NAN[dt]).all(), dt
        if dt != "float32":  # a tiny negative s rounds to -0.0, and the -0.0 residual keeps it
            assert (r == 0x8000).any(), dt
        p = PAYLOADS[dt]["partials"]
        assert np.array_equal(to_bits(reference_tree(to_torch(p, "float32"), getattr(torch, dt))), tree_oracle(p, dt))


@pytest.mark.parametrize("w", [1, 2, 4])
def test_bits_equal_the_oracle_on_every_route(w: int) -> None:
    """Every route, batch and dtype: (y, r) equal the oracle's on every rank; the composition through the API (the
    tree all-reduce site, then add_rms_norm) gives the same bits; the shard-order site gives the shard-order
    composition's, not the tree's; the route table shows both tree sites self-checked, "8 tree"."""
    results = _results(w)
    for dt, (y_want, r_want) in EXPECTED.items():
        for name in ("tree", "tree.a2a") if dt in A2A_DTYPES else ("tree",):
            for batch in BATCHES:
                y, r = _same_on_every_rank(results, (dt, name, batch))
                rows = list(batch)
                assert np.array_equal(r, r_want[rows]), f"W={w} {dt} {name} rows {batch}: r differs"
                assert np.array_equal(y, y_want[rows]), f"W={w} {dt} {name} rows {batch}: y differs"
        y, r = _same_on_every_rank(results, (dt, "composition", FULL))
        assert np.array_equal(y, y_want) and np.array_equal(r, r_want), f"W={w} {dt}: the composition differs"
        y, r = _same_on_every_rank(results, (dt, "order", FULL))
        assert np.array_equal(y, ORDER[dt][0]) and np.array_equal(r, ORDER[dt][1]), f"W={w} {dt}: order site"
        assert not np.array_equal(r, r_want), f"W={w} {dt}: the shard-order site gave the tree's r"
    routes = results[0]["routes"]
    assert isinstance(routes, dict)
    assert routes["tree.bfloat16"] == ("gather_fold", "passed", "tree"), routes
    assert routes["tree.a2a.float16"] == ("a2a_fold", "passed", "tree"), routes
    assert routes["order.float32"] == ("gather_fold", "passed", "order"), routes
    assert "8 tree" in str(results[0]["table"]) and "composition" in str(results[0]["table"])


def test_the_same_bits_at_w_1_2_4() -> None:
    """Directly: the bits at W = 2 and 4 are W = 1's (implied by the oracle; checked as the claim reads)."""
    base = _results(1)[0]
    for w in (2, 4):
        got = _results(w)[0]
        for key, val in base.items():
            if isinstance(key, tuple):
                assert all(np.array_equal(a, b) for a, b in zip(got[key], val)), (w, key)  # type: ignore[call-overload]


@pytest.mark.parametrize("w", [1, 4])
def test_wrong_calls_raise_on_one_rank_before_any_communication(w: int) -> None:
    """Rank 0 alone makes each wrong call: a ValueError naming the fix, with no collective entered (every rank's
    next call pairs and gives the oracle's bits; a call that had communicated would have paired with it)."""
    results = _results(w)
    got = {case: (kind, msg) for case, kind, msg in results[0]["bad"]}  # type: ignore[union-attr]
    want = {
        "x bf16": "pass the GEMM's fp32 partials", "x lead": "stack this rank's shards on dim 0",
        "x width": "a virtual-shard call takes", "x rows only": "a virtual-shard call takes",
        "rows": "exceed the declared max_rows=4", "residual fp32": "residual must be the rows of the all-reduced sum",
        "residual rows": "residual must be the rows of the all-reduced sum", "weight": "last dimension",
        "eps": "eps must be finite", "V=6 tree": "V must be a power of two",
        "ipc_fold": "route='ipc_fold' is unavailable",
    }
    if w > 1:
        want["V<W tree"] = "W must be a power of two dividing V"
        want["V<W order"] = "is not divisible by the group's world size"
    assert set(got) == set(want), got
    for case, fragment in want.items():
        assert got[case][0] == "ValueError" and fragment in got[case][1], (case, got[case])
    y_want, r_want = EXPECTED["bfloat16"]
    for r in results:
        y, res = r["after"]  # type: ignore[misc]
        assert np.array_equal(y, y_want) and np.array_equal(res, r_want)


@pytest.mark.parametrize("w", [1, 4])
def test_fused_tree_self_check_refuses_wrong_kernels(w: int) -> None:
    """The fused variants' self-check passes the right composition and refuses, on every rank, a fused kernel
    whose all-reduce is the shard-order fold, another pairing, a reversed fold or a tree without +0.0, in every
    dtype (the residual's -0.0 on the payload's placed elements lets r show the fused s)."""
    for res in get_cluster(w).run(job_fused_check, timeout_s=300):
        for what, (passed, reason) in res.items():
            if what.startswith("right."):
                assert passed, (w, what, reason)
            else:
                assert not passed and "fused tree (y, r) differ from the composition's" in reason, (w, what, reason)
