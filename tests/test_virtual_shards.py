"""Virtual-shard sites (docs/spec.md §9.1) on spawned gloo processes at W = 1, 2, 3, 4.

The same V = 12 global fp32 partials (every W here divides 12) are split over the ranks, rank r passing shards
r*V/W .. (r+1)*V/W - 1; every result is compared bit for bit with the numpy oracle (tests/oracle.py: the fold of
the V shards from +0.0 in fp32, one rounding to the dtype, canonical NaN), computed in the test process from
inputs that never went through a collective, and with the results at the other W. Negative controls: the
plain fold of per-rank pre-summed partials and the native route's library sum change with W; a self-check fed
a route that folds the shards out of order refuses it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, to_bits, to_torch
from detcomm._spawn import LocalCluster

V = 12
ROWS = 12  # divisible by every W, for the reduce-scatter
N = 33  # not divisible by 2 or 4: a2a_fold's all-reduce pads its last column block
DTYPES = ("bfloat16", "float16", "float32")
SEED = 20261130


def _partials(dtype: str) -> np.ndarray:
    """[V, ROWS, N] fp32 bits: the dtype's ill-conditioned values widened, with fp32 bits below the dtype's
    precision, and adversarial columns: cancelling ±big pairs on two random shards, all -0.0, tiny negatives
    (a negative sum that rounds to -0.0), overflow to Inf and an order-dependent overflow, NaN with payloads,
    Inf - Inf and a lone Inf."""
    rng = np.random.default_rng([SEED, len(dtype)])
    base = np.stack([oracle.widen(ill_bits(ROWS, N, dtype, seed=SEED, rank=s), dtype) for s in range(V)])
    with np.errstate(all="ignore"):
        p = (base * (np.float32(1) + rng.integers(-64, 65, base.shape).astype(np.float32) * np.float32(2**-20)))
    p = p.astype(np.float32).reshape(V, -1)
    m = p.shape[1]
    kind = rng.integers(0, 14, m)
    big = np.float32(3e4 if dtype == "float16" else 1e30)
    huge = np.float32(3.0e38)
    a = rng.integers(0, V, m)
    b = (a + 1 + rng.integers(0, V - 1, m)) % V
    cols = np.arange(m)
    for c in cols[kind == 0]:  # +big and -big on two shards, small values elsewhere: the result names the order
        p[:, c] = rng.standard_normal(V).astype(np.float32)
        p[a[c], c], p[b[c], c] = big, -big
    p[:, kind == 1] = np.float32(-0.0)
    p[:, kind == 2] = -np.float32(1e-45) * rng.integers(1, 4, (V, int((kind == 2).sum()))).astype(np.float32)
    for c in cols[kind == 3]:  # +huge +huge -huge: Inf or finite depending on the order of the shards
        p[:, c] = np.float32(0)
        p[a[c], c], p[b[c], c], p[(b[c] + 1) % V, c] = huge, huge, -huge
    pv = p.view(np.uint32)
    for c in cols[kind == 4]:  # a NaN with a payload (and a sign) on one shard
        pv[a[c], c] = np.uint32(0xFFC00000 | int(rng.integers(1, 1 << 22)))
    for c in cols[kind == 5]:
        p[a[c], c], p[b[c], c] = np.inf, -np.inf
    for c in cols[kind == 6]:
        p[a[c], c] = -np.inf
    return pv.reshape(V, ROWS, N).copy()


PARTIALS = {dt: _partials(dt) for dt in DTYPES}


def _oracle(dtype: str) -> np.ndarray:
    acc = oracle.fold_oracle(list(PARTIALS[dtype]), "float32")  # fp32 in, fp32 out: no rounding yet
    return oracle.round_fp32_bits(acc, dtype)


EXPECTED = {dt: _oracle(dt) for dt in DTYPES}

# ---------------------------------------------------------------------------------------------------------
# Jobs: fn(rank, world_size, ...) on every rank.


def job_bits(rank: int, w: int, partials: dict[str, np.ndarray]) -> dict[tuple[str, str, str], np.ndarray]:
    """Every dtype x collective x route of a virtual-shard site, the plain fold of pre-summed partials, and the
    native route's library sum (numerics auto): each rank's result bits."""
    import detcomm

    k = V // w
    out: dict[tuple[str, str, str], np.ndarray] = {}
    detcomm.init(numerics="rl-bitwise", selfcheck=False)
    for dt, bits in partials.items():
        dtype = getattr(torch, dt)
        mine = to_torch(bits[rank * k : (rank + 1) * k], "float32").contiguous()
        for coll in ("all_reduce", "reduce_scatter"):
            for route in ("gather_fold", "a2a_fold"):
                name = f"{coll}.{route}.{dt}"
                detcomm.site(name, collective=coll, dtype=dtype, shape=(N,), max_rows=ROWS, route=route,
                             virtual_shards=V)
                fn = detcomm.all_reduce if coll == "all_reduce" else detcomm.reduce_scatter
                out[(dt, coll, route)] = to_bits(fn(mine, name))
        # Negative control: each rank sums its own shards (fp32, in order), rounds, then the plain canonical fold
        # over the W ranks.
        acc = torch.zeros(ROWS, N)
        for j in range(k):
            acc += mine[j]
        out[(dt, "presum", "gather_fold")] = to_bits(detcomm.all_reduce(acc.to(dtype), f"plain.{dt}"))
    detcomm.shutdown()
    detcomm.init(numerics="auto", selfcheck=False)
    for dt, bits in partials.items():
        mine = to_torch(bits[rank * k : (rank + 1) * k], "float32").contiguous()
        detcomm.site(f"native.{dt}", collective="all_reduce", dtype=getattr(torch, dt), shape=(N,), max_rows=ROWS,
                     route="native", virtual_shards=V)
        out[(dt, "all_reduce", "native")] = to_bits(detcomm.all_reduce(mine, f"native.{dt}"))
    detcomm.shutdown()
    return out


def job_selfcheck(rank: int, w: int) -> dict[str, object]:
    """Declare a virtual-shard site with self-checks on; report its check and table row, and the verdict of
    the same check run against the route with this rank's shards reversed (must fail)."""
    import detcomm
    from detcomm.selfcheck import CheckKey, run_check
    from detcomm.sites import NO_ARGS, Collective, ReduceOp, Route

    comm = detcomm.init(numerics="rl-bitwise")
    site = detcomm.site("sc.o_proj", collective="all_reduce", dtype=torch.bfloat16, shape=(7,), max_rows=64,
                        virtual_shards=V)
    detcomm.site("sc.rs", collective="reduce_scatter", dtype=torch.float16, shape=(5,), max_rows=64, virtual_shards=V)
    checks = [(c.label, c.passed, c.key.virtual_shards) for c in comm.checks() if c.key.virtual_shards == V]
    row = next(d for d in comm.routes().as_dicts() if d["site"] == "sc.o_proj")
    bound = comm._bound["sc.o_proj"]
    bad = run_check(CheckKey(Route.GATHER_FOLD, Collective.ALL_REDUCE, ReduceOp.SUM, torch.bfloat16, (7,),
                             "reversed", V),
                    lambda x: bound(x.flip(0).contiguous(), NO_ARGS), native=comm._native, device=comm.device)
    text = str(comm.routes())
    detcomm.shutdown()
    return {"checks": checks, "row": row, "bad": (bad.passed, bad.reason), "table": text, "site": site.describe()}


def job_errors(rank: int, w: int) -> list[tuple[str, str, str]]:
    """Every refusal, raised before any communication on every rank; then a valid call still works."""
    import detcomm

    detcomm.init(numerics="rl-bitwise", selfcheck=False, check=True)  # the valid call also passes the call check
    got: list[tuple[str, str, str]] = []
    bf16 = torch.bfloat16

    def expect(case: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
        except (TypeError, ValueError) as e:
            got.append((case, type(e).__name__, str(e)))
        else:
            got.append((case, "no error", ""))

    def site(name: str, **kw: object):  # type: ignore[no-untyped-def]
        args: dict[str, object] = {"collective": "all_reduce", "dtype": bf16, "shape": (8,), "max_rows": 4,
                                   "virtual_shards": 4}
        args.update(kw)
        return lambda: detcomm.site(name, **args)  # type: ignore[arg-type]

    expect("indivisible", site("e1", virtual_shards=3))
    expect("zero", site("e2", virtual_shards=0))
    expect("not int", site("e3", virtual_shards=4.0))
    expect("avg", site("e4", op="avg"))
    expect("max", site("e5", op="max"))
    expect("all_gather", site("e6", collective="all_gather"))
    expect("int dtype", site("e7", dtype=torch.int32))
    expect("ipc_fold", site("e8", route="ipc_fold"))  # no workspace on a gloo CPU group
    expect("ipc_fold rs", site("e8rs", collective="reduce_scatter", route="ipc_fold"))
    expect("native bitwise", site("e9", route="native"))
    detcomm.site("ok", collective="all_reduce", dtype=bf16, shape=(8,), max_rows=4, virtual_shards=4)
    detcomm.site("ok.rs", collective="reduce_scatter", dtype=bf16, shape=(8,), max_rows=4, virtual_shards=4)
    good = torch.arange(2 * 4 * 8, dtype=torch.float32).view(2, 4, 8) * (rank + 1)
    expect("bf16 partials", lambda: detcomm.all_reduce(good.to(bf16), "ok"))
    expect("leading dim", lambda: detcomm.all_reduce(torch.zeros(4, 4, 8), "ok"))
    expect("trailing shape", lambda: detcomm.all_reduce(torch.zeros(2, 4, 9), "ok"))
    expect("call op max", lambda: detcomm.all_reduce(good, "ok", op="max"))
    expect("call op avg", lambda: detcomm.all_reduce(good, "ok", op="avg"))
    expect("wrong collective", lambda: detcomm.reduce_scatter(good, "ok"))
    expect("rows > max_rows", lambda: detcomm.all_reduce(torch.zeros(2, 5, 8), "ok"))
    expect("rs rows", lambda: detcomm.reduce_scatter(torch.zeros(2, 3, 8), "ok.rs"))
    expect("out dtype", lambda: detcomm.all_reduce(good, "ok", out=torch.empty(4, 8)))
    expect("not a tensor", lambda: detcomm.all_reduce(good.tolist(), "ok"))  # type: ignore[arg-type]
    y = detcomm.all_reduce(good, "ok", out=torch.empty(4, 8, dtype=bf16))
    # Small integers: the fp32 fold is exact, so the result is the exact sum rounded once.
    want = torch.arange(2 * 4 * 8, dtype=torch.float32).view(2, 4, 8).sum(0) * sum(range(1, w + 1))
    got.append(("valid call after the refusals", "ok" if torch.equal(y, want.to(bf16)) else "WRONG", ""))
    detcomm.shutdown()
    # The fold routes' always-on call guard (call checking off): ranks calling different virtual-shard sites of
    # the same shape all raise instead of folding each other's partials.
    detcomm.init(numerics="rl-bitwise", selfcheck=False)
    for coll, route in (("all_reduce", "gather_fold"), ("all_reduce", "a2a_fold"), ("reduce_scatter", "a2a_fold")):
        for name in ("m0", "m1"):
            detcomm.site(f"{name}.{coll}.{route}", collective=coll, dtype=bf16, shape=(8,), max_rows=4,
                         virtual_shards=4, route=route)
        fn = detcomm.all_reduce if coll == "all_reduce" else detcomm.reduce_scatter
        try:
            fn(good, f"m{rank % 2}.{coll}.{route}")
        except detcomm.CollectiveMismatch as e:
            got.append((f"mismatch {coll} {route}", "CollectiveMismatch", str(e)))
        else:
            got.append((f"mismatch {coll} {route}", "no error", ""))
    detcomm.shutdown()
    return got


# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster1() -> Iterator[LocalCluster]:
    """A world of one: a TP=1 trainer folds all V shards locally."""
    c = LocalCluster(1, pg_timeout_s=30.0)
    yield c
    c.close()


_RESULTS: dict[int, list[dict[tuple[str, str, str], np.ndarray]]] = {}


def _results(cluster: LocalCluster) -> list[dict[tuple[str, str, str], np.ndarray]]:
    w = cluster.world_size
    if w not in _RESULTS:
        _RESULTS[w] = cluster.run(job_bits, PARTIALS, timeout_s=300)
    return _RESULTS[w]


def _whole(results: list[dict], key: tuple[str, str, str]) -> np.ndarray:
    """The full [ROWS, N] result: rank 0's for an all-reduce (after checking every rank holds the same bits),
    the ranks' row blocks in rank order for a reduce-scatter."""
    if key[1] == "reduce_scatter":
        return np.concatenate([r[key] for r in results])
    for r in results[1:]:
        assert np.array_equal(r[key], results[0][key]), f"{key}: ranks hold different bits"
    return results[0][key]


def _check_oracle(cluster: LocalCluster) -> None:
    results = _results(cluster)
    for dt in DTYPES:
        for coll in ("all_reduce", "reduce_scatter"):
            for route in ("gather_fold", "a2a_fold"):
                got = _whole(results, (dt, coll, route))
                bad = int((got != EXPECTED[dt]).sum())
                assert bad == 0, f"W={cluster.world_size} {dt} {coll} {route}: {bad} elements differ from the oracle"


def test_oracle_self_consistency() -> None:
    """The payload reaches what it is for (so the oracle comparisons are not vacuous), and the documented
    reference (detcomm.numerics.fold.reference_fold of all V partials) is the oracle's fold."""
    from detcomm.numerics.fold import reference_fold

    for dt in DTYPES:
        exp = EXPECTED[dt]
        nan = oracle.CANONICAL_NAN[dt]
        assert (exp == nan).any(), dt
        ref = to_bits(reference_fold(to_torch(PARTIALS[dt], "float32"), getattr(torch, dt)))
        assert np.array_equal(ref, exp), dt
    sign = {"bfloat16": 0x8000, "float16": 0x8000, "float32": 0x80000000}
    for dt in ("bfloat16", "float16"):
        assert (EXPECTED[dt] == sign[dt]).any(), f"{dt}: no negative sum rounds to -0.0"
    assert (EXPECTED["bfloat16"] == 0x7F80).any(), "no sum overflows to +Inf"


def test_bits_equal_oracle_w1(cluster1: LocalCluster) -> None:
    _check_oracle(cluster1)


def test_bits_equal_oracle(cluster: LocalCluster) -> None:
    _check_oracle(cluster)


def test_same_bits_across_w_and_negative_controls(cluster1: LocalCluster, cluster2: LocalCluster,
                                                  cluster3plus: LocalCluster) -> None:
    by_w = {c.world_size: _results(c) for c in (cluster1, cluster2, cluster3plus)}
    for dt in DTYPES:
        for coll in ("all_reduce", "reduce_scatter"):
            for route in ("gather_fold", "a2a_fold"):
                ref = _whole(by_w[1], (dt, coll, route))
                for w, res in by_w.items():
                    assert np.array_equal(_whole(res, (dt, coll, route)), ref), f"{dt} {coll} {route}: W={w} != W=1"
        # Without virtual shards the bits follow W: the plain fold of per-rank pre-summed (and rounded) partials,
        # and the native route's library sum of per-rank pre-folded partials, which equals the fold over the V
        # shards at W = 1 only (up to NaN bits: the native route does not canonicalize NaN).
        presum = {w: _whole(res, (dt, "presum", "gather_fold")) for w, res in by_w.items()}
        native = {w: _whole(res, (dt, "all_reduce", "native")) for w, res in by_w.items()}
        both_nan = np.isnan(oracle.widen(native[1], dt)) & np.isnan(oracle.widen(EXPECTED[dt], dt))
        assert ((native[1] == EXPECTED[dt]) | both_nan).all(), dt
        ws = sorted(by_w)
        for w in ws[1:]:
            assert (presum[w] != EXPECTED[dt]).sum() > 0, f"{dt}: pre-summed plain fold at W={w} did not change"
            assert (native[w] != EXPECTED[dt]).sum() > 0, f"{dt}: native at W={w} did not change"
        assert (presum[ws[1]] != presum[ws[2]]).sum() > 0, f"{dt}: pre-summed W={ws[1]} == W={ws[2]}"


@pytest.mark.parametrize("w", [1, 4])
def test_selfcheck_proves_the_site(w: int, cluster1: LocalCluster, cluster4: LocalCluster) -> None:
    res = (cluster1 if w == 1 else cluster4).run(job_selfcheck, timeout_s=300)
    for r in res:
        assert r["checks"] == [(f"gather_fold: all_reduce sum bfloat16[7] virtual_shards={V}", True, V),
                               (f"a2a_fold: reduce_scatter sum float16[5] virtual_shards={V}", True, V)], r["checks"]
        assert r["row"]["selfcheck"] == "passed" and r["row"]["route"] == "gather_fold"
        assert r["row"]["virtual_shards"] == V and "virtual_shards" in r["table"]
        assert r["site"].endswith(f"virtual_shards={V}")
        passed, reason = r["bad"]
        # Negative control: the same check, fed the route with each rank's shards reversed, refuses it.
        assert not passed and "(c)" in reason, reason


def test_refusals(cluster2: LocalCluster) -> None:
    for res in cluster2.run(job_errors, timeout_s=300):
        got = {case: (kind, msg) for case, kind, msg in res}
        want = {
            "indivisible": ("ValueError", ["V=3", "W=2", "multiple of every TP size", "e.g. 8"]),
            "zero": ("ValueError", [">= 1", "e.g. 8"]),
            "not int": ("TypeError", ["must be an int"]),
            "avg": ("ValueError", ["op='sum'"]),
            "max": ("ValueError", ["op='sum'"]),
            "all_gather": ("ValueError", ["all_reduce, reduce_scatter and all_reduce_rmsnorm"]),
            "int dtype": ("ValueError", ["float dtype"]),
            "ipc_fold": ("ValueError", ["route='ipc_fold' is unavailable", "gather_fold"]),
            "ipc_fold rs": ("ValueError", ["all_reduce sites only", "a2a_fold"]),
            "native bitwise": ("ValueError", ["numerics='auto'"]),
            "bf16 partials": ("ValueError", ["fp32 partials", "dtype bfloat16"]),
            "leading dim": ("ValueError", ["V/W=2", "[4, 4, 8]"]),
            "trailing shape": ("ValueError", ["V/W=2", "[2, 4, 9]"]),
            "call op max": ("ValueError", ["op must be 'sum'"]),
            "call op avg": ("ValueError", ["op must be 'sum'"]),
            "wrong collective": ("ValueError", ["declare another site"]),
            "rows > max_rows": ("ValueError", ["max_rows=4"]),
            "rs rows": ("ValueError", ["divisible by the world size 2", "pad to 4"]),
            "out dtype": ("ValueError", ["out must be a bfloat16 tensor of shape [4, 8]"]),
            "not a tensor": ("TypeError", ["expected a torch.Tensor"]),
            "valid call after the refusals": ("ok", []),
            "mismatch all_reduce gather_fold": ("CollectiveMismatch", ["m0.all_reduce.gather_fold", "m1."]),
            "mismatch all_reduce a2a_fold": ("CollectiveMismatch", ["m0.all_reduce.a2a_fold", "m1."]),
            "mismatch reduce_scatter a2a_fold": ("CollectiveMismatch", ["m0.reduce_scatter.a2a_fold", "m1."]),
        }
        assert set(got) == set(want)
        for case, (kind, fragments) in want.items():
            assert got[case][0] == kind, (case, got[case])
            for f in fragments:
                assert f in got[case][1], (case, f, got[case][1])


def test_bench_tp_layouts_runs(cluster2: LocalCluster) -> None:
    """The bench's job at a tiny size: every layout timed at every row count, and its byte counts are the
    formulas of docs/spec.md §9.1 (no timing is asserted)."""
    from detcomm.bench import tp_layouts

    cfg = {"hidden": 64, "k": 128, "iters": 2, "rounds": 1, "rows": (1, 4), "virtual_shards": 8, "device": "cpu"}
    rows = cluster2.run(tp_layouts.job, cfg, timeout_s=300)[0]
    assert sorted((r["rows"], r["layout"]) for r in rows) == sorted((n, name) for n in (1, 4) for name in tp_layouts.LAYOUTS)
    r, h, k, w, v = 4, 64, 128, 2, 8
    want = {"native": 2 * (w - 1) / w * r * h * 2, "fold": (w - 1) * r * h * 2, "vs_gather": (w - 1) * v / w * r * h * 4,
            "vs_a2a": (w - 1) / w * r * h * (4 * v / w + 2), "full_k": (w - 1) / w * r * (k + h) * 2,
            "vs_tree": (w - 1) * r * h * 4, "vs_tree_a2a": (w - 1) / w * r * h * (4 + 2)}
    for row in rows:
        if row["rows"] == r:
            assert row["received_bytes"] == want[row["layout"]], row
            assert row["median_us"] > 0 and row["route"]
    assert "| 2 | 4 |" in tp_layouts.format_rows(rows)


def test_detcomm_routes_shows_virtual_shards(capsys: pytest.CaptureFixture[str]) -> None:
    """``detcomm routes`` takes ``:vs=V``, shows the column and refuses a W that does not divide V."""
    import json

    from detcomm.cli import main, parse_site

    assert parse_site("o:all_reduce:bf16:4096:64:sum:vs=8").virtual_shards == 8
    assert parse_site("o:reduce_scatter:bf16:4096:64:vs=8").virtual_shards == 8
    assert parse_site("o:all_reduce:bf16:4096:64").virtual_shards is None
    assert main(["routes", "--world-size", "4", "--json", "--site", "o:all_reduce:bf16:4096:64:vs=8",
                 "--site", "r:reduce_scatter:bf16:4096:64:vs=8"]) == 0
    rows = {r["site"]: r for r in json.loads(capsys.readouterr().out)}
    # One NCCL node: the workspace folds a virtual all-reduce (else gather_fold); reduce-scatter stays on a2a_fold.
    assert (rows["o"]["route"], rows["o"]["virtual_shards"], rows["o"]["condition"]) == (
        "ipc_fold", "8", "if the workspace arms; else gather_fold")
    assert (rows["r"]["route"], rows["r"]["virtual_shards"]) == ("a2a_fold", "8")
    assert main(["routes", "--world-size", "3", "--site", "o:all_reduce:bf16:4096:64:vs=8"]) == 2
    assert "V=8 is not divisible by the group's world size W=3" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_fold_leaf_folds_the_shards() -> None:
    """On a GPU the gather/all-to-all folds run the CUDA fold leaf: V = 12 shards take two leaf calls (8, then
    the accumulator and 4 more); the bits must be the oracle's."""
    pytest.importorskip("cupy")
    from detcomm.numerics.cuda_leaf import LEAF
    from detcomm.numerics.fold import fold_shards

    for dt in DTYPES:
        got = fold_shards(to_torch(PARTIALS[dt], "float32").cuda(), getattr(torch, dt), LEAF.fold)
        assert np.array_equal(to_bits(got), EXPECTED[dt]), dt
