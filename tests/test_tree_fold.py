"""The tree order over virtual shards (docs/spec.md §9.1 "The tree order") on spawned gloo processes at
W = 1, 2, 4, and its refusal at W = 3.

The same V = 8 global fp32 partials are split over the ranks (rank r passes shards r*V/W .. (r+1)*V/W - 1). Every
result is compared bit for bit with a numpy oracle written here from the definition (a recursive balanced tree of
fp32 additions, +0.0 at the root, one rounding by integer arithmetic, canonical NaN), computed in the test process
from inputs that never went through a collective: every route forced (gather_fold, a2a_fold), all-reduce and
reduce-scatter, rows alone, in batches and at offsets, widths 1, 7 and 13. Negative controls: the payload's placed
cancellations make the shard-order fold give other bits than the tree (checked against the oracle of the fold, and
the shard-order site's results are shown to differ), and the self-check refuses a route that folds in shard order,
one that pairs other shards, and one that drops the root's +0.0, at W = 1 and W = 4.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import oracle
from clusters import get_cluster
from datagen import ill_bits, to_bits, to_torch
from detcomm._spawn import LocalCluster

V = 8
ROWS = 8  # divisible by every W here, for the reduce-scatter
WIDTHS = (1, 7, 13)  # 7 and 13: a2a_fold's all-reduce pads its last column block at W = 2 and 4
DTYPES = ("bfloat16", "float16", "float32")
SEED = 20261202
# Row subsets a call carries (all-reduce): alone, in batches, at offsets; reduce-scatter takes 4 or 8 rows.
BATCHES = ((0,), (5,), (3, 4), (7, 0, 2), (6, 1, 4, 3, 0), tuple(range(ROWS)))
RS_BATCHES = ((1, 6, 3, 0), tuple(range(ROWS)))


def _partials(dtype: str, width: int) -> np.ndarray:
    """[V, ROWS, width] fp32 bits: the dtype's ill-conditioned values widened, with fp32 bits below the dtype's
    precision, and adversarial elements: +big/-big placed on the two sides of each tree node with small values
    elsewhere (the tree and the shard-order fold disagree), on two random shards, all -0.0, tiny negatives,
    subnormal fp32, order-dependent overflow, NaN with payloads, Inf - Inf and a lone Inf."""
    rng = np.random.default_rng([SEED, len(dtype), width])
    base = np.stack([oracle.widen(ill_bits(ROWS, width, dtype, seed=SEED + width, rank=s), dtype) for s in range(V)])
    with np.errstate(all="ignore"):
        p = base * (np.float32(1) + rng.integers(-64, 65, base.shape).astype(np.float32) * np.float32(2**-20))
    p = p.astype(np.float32).reshape(V, -1)
    m = p.shape[1]
    kind = rng.integers(0, 12, m)
    kind[0] = 0  # every width has a placed cancellation
    big = np.float32(2.0**14 if dtype == "float16" else 2.0**100)
    huge = np.float32(3.0e38)
    a = rng.integers(0, V, m)
    b = (a + 1 + rng.integers(0, V - 1, m)) % V
    for c in range(m):
        k = kind[c]
        if k in (0, 1):  # the last leaf of a left child and the first of its right sibling, smalls elsewhere
            half = V // 2 if c == 0 else [1, 2, 4][int(rng.integers(0, 3))]
            node = int(rng.integers(0, V // (2 * half))) * 2 * half
            p[:, c] = rng.standard_normal(V).astype(np.float32) * np.float32(2.0**-12 if dtype == "float16" else 1)
            p[node + half - 1, c], p[node + half, c] = big, -big
        elif k == 2:  # two random shards
            p[:, c] = rng.standard_normal(V).astype(np.float32)
            p[a[c], c], p[b[c], c] = big, -big
        elif k == 3:
            p[:, c] = np.float32(-0.0)
        elif k == 4:  # tiny negatives: a negative sum that rounds to -0.0 in bf16/fp16
            p[:, c] = -np.float32(1e-45) * rng.integers(1, 4, V).astype(np.float32)
        elif k == 5:  # +huge +huge -huge: Inf or finite depending on the grouping
            p[:, c] = np.float32(0)
            p[a[c], c], p[b[c], c], p[(b[c] + 1) % V, c] = huge, huge, -huge
    pv = p.view(np.uint32)
    for c in np.flatnonzero(kind == 6):  # a NaN with a payload (and a sign) on one shard
        pv[a[c], c] = np.uint32(0xFFC00000 | int(rng.integers(1, 1 << 22)))
    for c in np.flatnonzero(kind == 7):
        p[a[c], c], p[b[c], c] = np.inf, -np.inf
    for c in np.flatnonzero(kind == 8):
        p[a[c], c] = -np.inf
    for c in np.flatnonzero(kind == 9):  # fp32 subnormals of both signs
        pv[:, c] = rng.integers(1, 1 << 23, V).astype(np.uint32) | (rng.integers(0, 2, V).astype(np.uint32) << 31)
    return pv.reshape(V, ROWS, width).copy()


def tree_oracle(leaves: np.ndarray, dtype: str) -> np.ndarray:
    """The definition: leaves [V, ...] fp32 bits; T(i, 1) = p_i, T(i, n) = T(i, n/2) + T(i + n/2, n/2) in fp32
    (numpy's float32 add: one IEEE RN addition, no FMA, no flush); fp32 root + 0.0, one rounding, canonical NaN."""
    f = leaves.view(np.float32)

    def t(i: int, n: int) -> np.ndarray:
        if n == 1:
            return f[i]
        with np.errstate(all="ignore"):
            return (t(i, n // 2) + t(i + n // 2, n // 2)).astype(np.float32)

    with np.errstate(all="ignore"):
        acc = (t(0, leaves.shape[0]) + np.float32(0.0)).astype(np.float32)
    return oracle.round_fp32_bits(acc.view(np.uint32), dtype)


def order_oracle(leaves: np.ndarray, dtype: str) -> np.ndarray:
    """The shard-order fold of the same leaves (the negative control's bits)."""
    return oracle.round_fp32_bits(oracle.fold_oracle(list(leaves), "float32"), dtype)


PARTIALS = {(dt, n): _partials(dt, n) for dt in DTYPES for n in WIDTHS}
EXPECTED = {key: tree_oracle(p, key[0]) for key, p in PARTIALS.items()}

# ---------------------------------------------------------------------------------------------------------
# Jobs: fn(rank, world_size, ...) on every rank.


def job_bits(rank: int, w: int, partials: dict[tuple[str, int], np.ndarray]) -> dict[tuple, np.ndarray]:
    """Every dtype x width x collective x route x batch of a tree site, the same calls on a shard-order site
    (the negative control), and the native route forced under numerics='auto': each rank's result bits."""
    import detcomm

    k = V // w
    out: dict[tuple, np.ndarray] = {}
    detcomm.init(numerics="rl-bitwise", selfcheck=False)
    for (dt, n), bits in partials.items():
        dtype = getattr(torch, dt)
        mine = to_torch(bits[rank * k : (rank + 1) * k], "float32").contiguous()
        for coll in ("all_reduce", "reduce_scatter"):
            fn = detcomm.all_reduce if coll == "all_reduce" else detcomm.reduce_scatter
            for route in ("gather_fold", "a2a_fold", None):
                for fold in ("tree", "order"):
                    if fold == "order" and route is not None:
                        continue
                    name = f"{coll}.{route}.{fold}.{dt}.{n}"
                    detcomm.site(name, collective=coll, dtype=dtype, shape=(n,), max_rows=ROWS, route=route,
                                 virtual_shards=V, shard_fold=fold)
                    for batch in BATCHES if coll == "all_reduce" else RS_BATCHES:
                        x = mine[:, list(batch)].contiguous()
                        out[(dt, n, coll, str(route), fold, batch)] = to_bits(fn(x, name))
    detcomm.shutdown()
    detcomm.init(numerics="auto", selfcheck=False)
    for (dt, n), bits in partials.items():
        mine = to_torch(bits[rank * k : (rank + 1) * k], "float32").contiguous()
        name = f"native.{dt}.{n}"
        detcomm.site(name, collective="all_reduce", dtype=getattr(torch, dt), shape=(n,), max_rows=ROWS,
                     route="native", virtual_shards=V, shard_fold="tree")
        out[(dt, n, "all_reduce", "native", "tree", BATCHES[-1])] = to_bits(detcomm.all_reduce(mine, name))
    detcomm.shutdown()
    return out


def _wrong_tree(stacked: torch.Tensor, kind: str) -> torch.Tensor:
    """Mutant folds of [V, ...] fp32 leaves: another pairing (i with i + V/2 first), the shard order reversed, and
    the tree without the +0.0 at its root."""
    if kind == "pairing":
        level = stacked
        while level.shape[0] > 1:
            h = level.shape[0] // 2
            level = level[:h] + level[h:]
        return level[0]
    if kind == "reversed":
        acc = torch.zeros_like(stacked[0])
        for j in range(stacked.shape[0] - 1, -1, -1):
            acc = acc + stacked[j]
        return acc
    assert kind == "no_plus_zero"
    level = stacked
    while level.shape[0] > 1:
        level = level[0::2] + level[1::2]
    return level[0]


def job_selfcheck(rank: int, w: int) -> dict[str, object]:
    """Declare tree sites with self-checks on; report their checks and table rows, and the verdicts of the tree's
    check run against mutant routes (the shard-order fold, another pairing, a reversed fold, no +0.0): all must
    fail."""
    import detcomm
    from detcomm.selfcheck import CheckKey, run_check
    from detcomm.sites import Collective, ReduceOp, Route

    comm = detcomm.init(numerics="rl-bitwise")
    detcomm.site("sc.o_proj", collective="all_reduce", dtype=torch.bfloat16, shape=(1,), max_rows=64,
                 virtual_shards=V, shard_fold="tree")
    detcomm.site("sc.rs", collective="reduce_scatter", dtype=torch.float16, shape=(1,), max_rows=64,
                 virtual_shards=V, shard_fold="tree")
    detcomm.site("sc.order", collective="all_reduce", dtype=torch.bfloat16, shape=(1,), max_rows=64,
                 virtual_shards=V)
    checks = sorted((c.label, c.passed) for c in comm.checks() if c.key.virtual_shards == V)
    rows = {d["site"]: d for d in comm.routes().as_dicts() if str(d["site"]).startswith("sc.")}
    text = str(comm.routes())
    native = comm._native
    bad: dict[str, tuple[bool, str]] = {}
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        key = CheckKey(Route.GATHER_FOLD, Collective.ALL_REDUCE, ReduceOp.SUM, dt, (1,), "mutant", V, "tree")

        def mutant(x: torch.Tensor, kind: str, dt: torch.dtype = dt) -> torch.Tensor:
            stacked = native.all_gather(x).view(-1, *x.shape[1:])  # [V, rows, 1]: the shards in order
            if kind == "order":
                acc = torch.zeros_like(stacked[0])
                for j in range(stacked.shape[0]):
                    acc = acc + stacked[j]
                return acc.to(dt)
            return _wrong_tree(stacked, kind).to(dt)

        for kind in ("order", "pairing", "reversed", "no_plus_zero"):
            res = run_check(key, lambda x, kind=kind: mutant(x, kind), native=native, device=comm.device)
            bad[f"{kind}.{dt}"] = (res.passed, res.reason)
    detcomm.shutdown()
    return {"checks": checks, "rows": rows, "bad": bad, "table": text}


def job_bytes(rank: int, w: int, rows: int, hidden: int) -> dict[str, int]:
    """Bytes this rank receives in one gather_fold call of a tree site and of a shard-order site (every all-gather
    the call makes, its call guard's headers included), counted at the library boundary."""
    import detcomm

    comm = detcomm.init(numerics="rl-bitwise", selfcheck=False)
    native = comm._native
    got = {"n": 0}
    gather = native.all_gather

    def counted(x: torch.Tensor) -> torch.Tensor:
        got["n"] += (w - 1) * x.numel() * x.element_size()
        return gather(x)

    native.all_gather = counted  # type: ignore[method-assign]
    out: dict[str, int] = {}
    x = torch.randn(V // w, rows, hidden)
    for fold in ("tree", "order"):
        detcomm.site(f"b.{fold}", collective="all_reduce", dtype=torch.bfloat16, shape=(hidden,), max_rows=rows,
                     route="gather_fold", virtual_shards=V, shard_fold=fold)
        got["n"] = 0
        detcomm.all_reduce(x, f"b.{fold}")
        out[fold] = got["n"]
    native.all_gather = gather  # type: ignore[method-assign]
    detcomm.shutdown()
    return out


def job_refusal(rank: int, w: int) -> list[tuple[str, str, str]]:
    """Declaring tree sites that cannot be served: each refusal on every rank, before any communication."""
    import detcomm

    detcomm.init(numerics="rl-bitwise", selfcheck=False)
    got: list[tuple[str, str, str]] = []
    for case, kw in (("V=8 at W", {"virtual_shards": 8}), ("V=6", {"virtual_shards": 6}),
                     ("ipc_fold", {"virtual_shards": 8, "route": "ipc_fold"}),
                     ("no virtual shards", {"virtual_shards": None}), ("unknown fold", {"shard_fold": "pairs"})):
        args: dict[str, object] = {"collective": "all_reduce", "dtype": torch.bfloat16, "shape": (8,), "max_rows": 4,
                                   "shard_fold": "tree"}
        args.update(kw)
        try:
            detcomm.site(f"t.{case}", **args)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            got.append((case, type(e).__name__, str(e)))
        else:
            got.append((case, "no error", ""))
    detcomm.shutdown()
    return got


# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster1() -> Iterator[LocalCluster]:
    """A world of one: a TP=1 trainer folds the whole tree locally."""
    c = LocalCluster(1, pg_timeout_s=30.0)
    yield c
    c.close()


_RESULTS: dict[int, list[dict[tuple, np.ndarray]]] = {}


def _results(cluster: LocalCluster) -> list[dict[tuple, np.ndarray]]:
    w = cluster.world_size
    if w not in _RESULTS:
        _RESULTS[w] = cluster.run(job_bits, PARTIALS, timeout_s=600)
    return _RESULTS[w]


def _whole(results: list[dict], key: tuple) -> np.ndarray:
    """The batch's full result: rank 0's for an all-reduce (after checking every rank holds the same bits), the
    ranks' row blocks in rank order for a reduce-scatter."""
    if key[2] == "reduce_scatter":
        return np.concatenate([r[key] for r in results])
    for r in results[1:]:
        assert np.array_equal(r[key], results[0][key]), f"{key}: ranks hold different bits"
    return results[0][key]


def _check(results: list[dict], w: int) -> None:
    for (dt, n), exp in EXPECTED.items():
        for coll in ("all_reduce", "reduce_scatter"):
            for route in ("gather_fold", "a2a_fold", "None"):
                for batch in BATCHES if coll == "all_reduce" else RS_BATCHES:
                    got = _whole(results, (dt, n, coll, route, "tree", batch))
                    want = exp[list(batch)]
                    bad = int((got != want).sum())
                    assert bad == 0, f"W={w} {dt} width {n} {coll} {route} rows {batch}: {bad} elements differ"


def test_oracle_reaches_the_cases() -> None:
    """The payload reaches what it is for, so the comparisons are not vacuous: canonical NaN, -0.0 from a
    negative sum, Inf, and (the negative control's premise) the shard-order fold's bits differ from the tree's
    in every dtype and width. The package's two forms of the tree equal the oracle."""
    from detcomm.numerics.tree import reference_tree, tree_fold

    for (dt, n), exp in EXPECTED.items():
        p = PARTIALS[(dt, n)]
        assert (order_oracle(p, dt) != exp).any(), f"{dt} width {n}: the shard order gives the tree's bits"
        t = to_torch(p, "float32")
        assert np.array_equal(to_bits(tree_fold(t, getattr(torch, dt))), exp), (dt, n)
        assert np.array_equal(to_bits(reference_tree(t, getattr(torch, dt))), exp), (dt, n)
    for dt in DTYPES:
        every = np.concatenate([EXPECTED[(dt, n)].reshape(-1) for n in WIDTHS])
        assert (every == oracle.CANONICAL_NAN[dt]).any(), dt
        assert (every == {"float32": 0, "bfloat16": 0, "float16": 0}[dt]).any(), dt
    for dt in ("bfloat16", "float16"):
        every = np.concatenate([EXPECTED[(dt, n)].reshape(-1) for n in WIDTHS])
        assert (every == 0x8000).any(), f"{dt}: no negative sum rounds to -0.0"
        assert (every == (0x7F80 if dt == "bfloat16" else 0x7C00)).any(), f"{dt}: no +Inf"


def test_oracle_can_fail() -> None:
    """The oracle tells trees apart: the shard-order fold, the stride pairing and a tree without +0.0 each
    differ from it on this payload (a sum of -0.0 is -0.0 without the root's +0.0)."""
    p = PARTIALS[("bfloat16", 13)]
    t = to_torch(p, "float32")
    for kind in ("pairing", "reversed", "no_plus_zero"):
        got = to_bits(_wrong_tree(t, kind).to(torch.bfloat16))
        nan = np.isnan(oracle.widen(got, "bfloat16")) & np.isnan(oracle.widen(EXPECTED[("bfloat16", 13)], "bfloat16"))
        assert ((got != EXPECTED[("bfloat16", 13)]) & ~nan).any(), kind


def test_bits_w1(cluster1: LocalCluster) -> None:
    _check(_results(cluster1), 1)


@pytest.mark.parametrize("w", [2, 4])
def test_bits_equal_oracle(w: int) -> None:
    _check(_results(get_cluster(w)), w)


def test_same_bits_across_w_and_negative_controls(cluster1: LocalCluster) -> None:
    """The tree's bits are the same at W = 1, 2, 4 on every route (each equals the oracle, tests above); the shard-order site's are the order oracle's,
    not the tree's (negative control); the native route sums the W subtree roots in the library's order."""
    by_w = {1: _results(cluster1), 2: _results(get_cluster(2)), 4: _results(get_cluster(4))}
    full = BATCHES[-1]
    native_moved = 0
    for (dt, n), exp in EXPECTED.items():
        for w, res in by_w.items():
            order = _whole(res, (dt, n, "all_reduce", "None", "order", full))
            assert np.array_equal(order, order_oracle(PARTIALS[(dt, n)], dt)), (w, dt, n)
            assert (order != exp).any(), f"W={w} {dt} width {n}: the shard-order site gave the tree's bits"
            native = _whole(res, (dt, n, "all_reduce", "native", "tree", full))
            if w == 1:  # one rank: the whole tree, rounded once, but no +0.0 and NaN not canonical
                fin = np.isfinite(oracle.widen(exp, dt)) & (oracle.widen(exp, dt) != 0)
                assert np.array_equal(native[fin], exp[fin]), (dt, n)
            if w == 4:
                native_moved += int((native != exp).sum())
    assert native_moved > 0, "the native route's library sum of 4 subtree roots gave the tree's bits everywhere"


def test_routes_table_and_selfcheck() -> None:
    """Self-checked on declaration at W = 1 and 4; the route table says "8 tree"; the tree's check refuses the
    shard-order fold, another pairing, a reversed fold and a tree without +0.0 (every dtype, width 1)."""
    for w in (1, 4):
        c = LocalCluster(1, pg_timeout_s=30.0) if w == 1 else get_cluster(4)
        try:
            res = c.run(job_selfcheck, timeout_s=600)
        finally:
            if w == 1:
                c.close()
        for r in res:
            assert r["checks"] == sorted([
                (f"gather_fold: all_reduce sum bfloat16[1] virtual_shards={V} shard_fold=tree", True),
                (f"a2a_fold: reduce_scatter sum float16[1] virtual_shards={V} shard_fold=tree", True),
                (f"gather_fold: all_reduce sum bfloat16[1] virtual_shards={V}", True)]), r["checks"]
            row = r["rows"]["sc.o_proj"]
            assert (row["route"], row["selfcheck"], row["shard_fold"]) == ("gather_fold", "passed", "tree")
            assert r["rows"]["sc.order"]["shard_fold"] == "order"
            assert f"{V} tree" in r["table"]
            for what, (passed, reason) in r["bad"].items():
                assert not passed and "(c)" in reason, (w, what, reason)


def test_refusals() -> None:
    """W = 3 cannot run a tree of a power-of-two V (the message names shard_fold='order'), V must be a power of
    two, the workspace refuses the tree (no tree kernels), and shard_fold needs virtual shards."""
    for w in (3, 2):
        for res in get_cluster(w).run(job_refusal, timeout_s=300):
            got = {case: (kind, msg) for case, kind, msg in res}
            want = {
                "V=8 at W": ("ValueError", ["W=3", "power of two dividing V=8", "shard_fold='order'", "e.g. 24"])
                if w == 3 else ("no error", []),
                "V=6": ("ValueError", ["power of two", "virtual_shards=6", "shard_fold='order'"]),
                "ipc_fold": ("ValueError", ["power of two dividing V=8"] if w == 3 else
                             ["route='ipc_fold' is unavailable", "no CUDA-IPC workspace"]),
                "no virtual shards": ("ValueError", ["declare virtual_shards=V"]),
                "unknown fold": ("ValueError", ["shard_fold must be one of"]),
            }
            for case, (kind, fragments) in want.items():
                assert got[case][0] == kind, (w, case, got[case])
                for f in fragments:
                    assert f in got[case][1], (w, case, f, got[case][1])


def test_detcomm_routes_shows_the_tree(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from detcomm.cli import main, parse_site

    assert parse_site("o:all_reduce:bf16:4096:64:sum:vs=8:fold=tree").shard_fold == "tree"
    assert parse_site("o:all_reduce:bf16:4096:64:vs=8").shard_fold == "order"
    with pytest.raises(ValueError, match="order or tree"):
        parse_site("o:all_reduce:bf16:4096:64:vs=8:fold=pairs")
    assert main(["routes", "--world-size", "4", "--json", "--site", "o:all_reduce:bf16:4096:64:vs=8:fold=tree",
                 "--site", "r:reduce_scatter:bf16:4096:64:vs=8:fold=tree"]) == 0
    rows = {r["site"]: r for r in json.loads(capsys.readouterr().out)}
    # The workspace's tree kernels where it arms, else gather_fold; reduce-scatter on a2a_fold.
    assert (rows["o"]["route"], rows["o"]["virtual_shards"], rows["o"]["condition"]) == (
        "ipc_fold", "8 tree", "if the workspace arms; else gather_fold")
    assert "tree kernels" in rows["o"]["why"]
    assert (rows["r"]["route"], rows["r"]["virtual_shards"]) == ("a2a_fold", "8 tree")
    assert main(["routes", "--world-size", "3", "--site", "o:all_reduce:bf16:4096:64:vs=8:fold=tree"]) == 2
    assert "shard_fold='order'" in capsys.readouterr().err


@pytest.mark.parametrize("w", [2, 4])
def test_gather_fold_bytes(w: int) -> None:
    """gather_fold receives one fp32 row per peer for a tree site and V/W for a shard-order site (docs/spec.md
    §9.1's wire cost), plus at most a few hundred bytes of call-guard headers."""
    rows, hidden = 16, 256
    for r in get_cluster(w).run(job_bytes, rows, hidden, timeout_s=300):
        tree, order = (w - 1) * rows * hidden * 4, (w - 1) * (V // w) * rows * hidden * 4
        assert tree <= r["tree"] < tree + 512, (w, r, tree)
        assert order <= r["order"] < order + 512, (w, r, order)


@pytest.mark.gpu
def test_cuda_tree_bits_and_graph_capture() -> None:
    """On a GPU the tree's torch adds give the oracle's bits (no FMA, no flush), and the fold replays inside a
    CUDA graph with the same bits (the host routes' local part is capturable)."""
    from detcomm.numerics.tree import subtree, tree_fold

    for (dt, n), exp in EXPECTED.items():
        leaves = to_torch(PARTIALS[(dt, n)], "float32").cuda()
        assert np.array_equal(to_bits(tree_fold(leaves, getattr(torch, dt))), exp), (dt, n)
        # W = 4 in one process: four subtree roots, then the top levels.
        roots = torch.stack([subtree(leaves[2 * r : 2 * r + 2]) for r in range(4)])
        assert np.array_equal(to_bits(tree_fold(roots, getattr(torch, dt))), exp), (dt, n)
        static = leaves.clone()
        tree_fold(static, getattr(torch, dt))  # outside capture first: the canonical NaN is cached per device
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tree_fold(static, getattr(torch, dt))
        static.copy_(leaves)
        graph.replay()
        torch.cuda.synchronize()
        assert np.array_equal(to_bits(out), exp), (dt, n)
