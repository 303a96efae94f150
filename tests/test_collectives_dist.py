"""Distributed tests on real spawned gloo processes at W = 2, 3, 4 (tests/conftest.py's clusters).

Every numeric check compares bits with the numpy oracle (tests/oracle.py) computed locally from inputs every
rank regenerates for every other rank (tests/datagen.py), so no expected value ever went through a collective.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import oracle
from datagen import DTYPES, ill_bits, random_bits, to_bits, to_torch

# ---------------------------------------------------------------------------------------------------------
# Jobs: run on every rank as fn(rank, world_size, *args). They keep one communicator per envelope alive
# across jobs of a worker so a property test does not pay the startup self-checks for every example.


def _comm(numerics: str, **switches: object):  # type: ignore[no-untyped-def]
    import detcomm

    want = (numerics, tuple(sorted(switches.items())))
    if detcomm.is_initialized():
        comm = detcomm.get_communicator()
        if getattr(comm, "_test_key", None) == want:
            return comm
        detcomm.shutdown()
    comm = detcomm.init(numerics=numerics, **switches)
    comm._test_key = want
    return comm


def _shutdown() -> None:
    import detcomm

    detcomm.shutdown()


def job_fold_case(rank: int, w: int, coll: str, dtype: str, rows: int, width: int, offset: int, extra: int,
                  seed: int, ill: bool) -> tuple[str, bool, bool, bytes]:
    """Reduce `rows` base rows placed at `offset` in a batch of rows+extra rows; compare with the oracle."""
    comm = _comm("rl-bitwise")
    gen = ill_bits if ill else random_bits
    blocks = w if coll == "reduce_scatter" else 1
    total = rows + extra

    def batch_bits(r: int) -> np.ndarray:
        base = gen(blocks * rows, width, dtype, seed=seed, rank=r).reshape(blocks, rows, width)
        fill = gen(blocks * total, width, dtype, seed=seed + 1, rank=r).reshape(blocks, total, width).copy()
        fill[:, offset : offset + rows] = base
        return fill.reshape(blocks * total, width)

    all_bits = [batch_bits(r) for r in range(w)]
    x = to_torch(all_bits[rank], dtype)
    site = f"{coll}.{dtype}.{width}"
    if coll == "reduce_scatter":
        out = comm.reduce_scatter(x, site=site)
        expected = oracle.fold_oracle(all_bits, dtype)[rank * total : (rank + 1) * total]
    else:
        out = comm.all_reduce(x, site=site)
        expected = oracle.fold_oracle(all_bits, dtype)
    got = to_bits(out)
    # The base rows alone, folded by the oracle without any filler: row independence.
    base_only = oracle.fold_oracle([b.reshape(blocks, total, width)[:, offset : offset + rows].reshape(-1, width)
                                    for b in all_bits], dtype)
    if coll == "reduce_scatter":
        base_only = base_only.reshape(blocks, rows, width)[rank]
    route = comm.routes().as_dicts()
    route_of = {d["site"]: d["route"] for d in route}[site]
    return (str(route_of), bool(np.array_equal(got, expected)),
            bool(np.array_equal(got[offset : offset + rows], base_only)), got.tobytes())


def job_prefix_parent(rank: int, w: int, dtype: str, width: int) -> tuple[bool, bool]:
    comm = _comm("rl-bitwise")
    parent_bits = ill_bits(2048, width, dtype, seed=11, rank=rank)
    parent = comm.all_reduce(to_torch(parent_bits, dtype), site=f"pp.{dtype}")
    prefix = comm.all_reduce(to_torch(parent_bits[:1664], dtype), site=f"pp.{dtype}")
    expected = oracle.fold_oracle([ill_bits(2048, width, dtype, seed=11, rank=r) for r in range(w)], dtype)
    return (bool(np.array_equal(to_bits(prefix), to_bits(parent)[:1664])),
            bool(np.array_equal(to_bits(parent), expected)))


def job_compositions(rank: int, w: int, numerics: str, route: str | None, dtype: str, width: int) -> int:
    """Rows changed against the batch-1 reference when 8 base rows move through batches and offsets."""
    import detcomm

    comm = _comm(numerics)
    name = f"comp.{route}.{dtype}.{width}"
    comm.site(name, collective="all_reduce", dtype=DTYPES[dtype], shape=(width,), max_rows=4096, route=route)
    base = ill_bits(8, width, dtype, seed=5, rank=rank)
    ref = np.concatenate([to_bits(detcomm.all_reduce(to_torch(base[i : i + 1], dtype), site=name)) for i in range(8)])
    changed = 0
    for k, (total, off) in enumerate(((8, 0), (9, 1), (33, 7), (128, 100), (1000, 501), (3001, 2222))):
        batch = ill_bits(total, width, dtype, seed=50 + k, rank=rank).copy()
        batch[off : off + 8] = base
        got = to_bits(detcomm.all_reduce(to_torch(batch, dtype), site=name))[off : off + 8]
        changed += int((got != ref).any(axis=1).sum())
    return changed


def job_specials(rank: int, w: int, dtype: str) -> tuple[bool, bool, bytes]:
    """±0, subnormals, NaN (with payloads and signs), ±Inf through both fold routes vs the oracle."""
    comm = _comm("rl-bitwise")
    rows, width = 4 * w, 16

    def bits(r: int) -> np.ndarray:
        rng = np.random.default_rng([77, r])
        b = ill_bits(rows, width, dtype, seed=9, rank=r).copy()
        sign = 1 << (31 if dtype == "float32" else 15)
        exp_mask = 0x7F800000 if dtype == "float32" else (0x7F80 if dtype == "bfloat16" else 0x7C00)
        specials = [0, sign, 1, sign | 1, exp_mask, sign | exp_mask, exp_mask | 1, sign | exp_mask | 3]
        pick = rng.random(b.shape) < 0.3
        b[pick] = rng.choice(specials, size=int(pick.sum()))
        b[0, :] = sign  # a row of -0.0 on every rank: the sum must be +0.0
        return b

    all_bits = [bits(r) for r in range(w)]
    x = to_torch(all_bits[rank], dtype)
    ar = to_bits(comm.all_reduce(x, site=f"sp.ar.{dtype}"))
    rs = to_bits(comm.reduce_scatter(x, site=f"sp.rs.{dtype}"))
    expected = oracle.fold_oracle(all_bits, dtype)
    n = rows // w
    ok_ar = bool(np.array_equal(ar, expected)) and bool((ar[0] == 0).all())
    ok_rs = bool(np.array_equal(rs, expected[rank * n : (rank + 1) * n]))
    return ok_ar, ok_rs, ar.tobytes()


def job_max_min_argmax_int(rank: int, w: int, numerics: str) -> list[str]:
    """MAX/MIN (NaN, ±0), argmax (ties, ±0) and integer sums: exact, rank-identical, batch-invariant."""
    import torch.distributed as dist

    comm = _comm(numerics)
    problems = []
    for dtype in sorted(DTYPES):
        def bits(r: int, rows: int = 12, seed: int = 21) -> np.ndarray:
            rng = np.random.default_rng([seed, r])
            b = ill_bits(rows, 10, dtype, seed=seed, rank=r).copy()
            nan = oracle.CANONICAL_NAN[dtype] | 1 | (1 << (31 if dtype == "float32" else 15))
            b[rng.random(b.shape) < 0.05] = nan
            return b
        for op in ("max", "min"):
            allb = [bits(r) for r in range(w)]
            got = to_bits(comm.all_reduce(to_torch(allb[rank], dtype), site=f"mm.{op}.{dtype}", op=op))
            if not np.array_equal(got, oracle.ordered_key_extreme_oracle(allb, dtype, op)):
                problems.append(f"{op} {dtype} != oracle")
            # the same rows inside a bigger batch
            big = [np.concatenate([bits(r, 5, 99), b]) for r, b in enumerate(allb)]
            got2 = to_bits(comm.all_reduce(to_torch(big[rank], dtype), site=f"mm.{op}.{dtype}", op=op))[5:]
            if not np.array_equal(got2, got):
                problems.append(f"{op} {dtype} moved with the batch")
        # argmax over a vocabulary split in W shards with exact ties across shards and signed zeros
        vs = 9
        rng = np.random.default_rng(5)
        full = rng.integers(-2, 3, size=(7, vs * w)).astype(np.float32)
        full[full == 0] = np.where(rng.random(int((full == 0).sum())) < 0.5, -0.0, 0.0)
        full_t = torch.from_numpy(full).to(DTYPES[dtype])
        shard = full_t[:, rank * vs : (rank + 1) * vs].contiguous()
        idx = comm.argmax(shard, site=f"am.{dtype}", vocab_start=rank * vs)
        if not torch.equal(idx, torch.argmax(full_t.float(), dim=-1)):
            problems.append(f"argmax {dtype} != torch.argmax of the full row")
    ints = torch.arange(10, dtype=torch.int64) * (rank + 1) + 2**62
    s = comm.all_reduce(ints, site="int.sum")
    expect = sum(torch.arange(10, dtype=torch.int64) * (r + 1) + 2**62 for r in range(w))
    if not torch.equal(s, expect):
        problems.append("int64 sum (with wrap-around) wrong")
    # all ranks hold identical bits for the float MAX
    out = comm.all_reduce(torch.tensor([-0.0, 0.0, float("nan")]) * (rank + 1), site="mm.rank", op="max")
    everyone: list[object] = [None] * w
    dist.all_gather_object(everyone, to_bits(out).tobytes())
    if len(set(everyone)) != 1:  # type: ignore[arg-type]
        problems.append("ranks disagree on MAX bits")
    return problems


def job_data_movement(rank: int, w: int) -> list[str]:
    comm = _comm("rl-bitwise")
    problems = []
    x = torch.arange(6, dtype=torch.float32).view(3, 2) + 100 * rank
    g = comm.all_gather(x, site="dm.ag")
    if not torch.equal(g, torch.cat([torch.arange(6, dtype=torch.float32).view(3, 2) + 100 * r for r in range(w)])):
        problems.append("all_gather")
    counts = [r % 3 for r in range(w)]
    t = torch.full((counts[rank], 4), rank, dtype=torch.int64)
    tg = comm.token_all_gather(t, site="dm.tag", rows_per_rank=counts)
    if not torch.equal(tg, torch.cat([torch.full((c, 4), r, dtype=torch.int64) for r, c in enumerate(counts)])):
        problems.append("token_all_gather")
    even = torch.arange(2 * w, dtype=torch.bfloat16).view(w, 2) + 10 * rank
    a = comm.all_to_all(even, site="dm.a2a")
    if not torch.equal(a, torch.stack([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.bfloat16) + 10 * r for r in range(w)])):
        problems.append("all_to_all even")
    splits = [(rank + q) % 3 for q in range(w)]  # rank sends (rank+q)%3 rows to rank q
    rows = torch.cat([torch.full((n, 3), 10 * rank + q, dtype=torch.float32) for q, n in enumerate(splits)])
    u = comm.all_to_all(rows, site="dm.a2a.uneven", splits=splits)
    expect = torch.cat([torch.full(((r + rank) % 3, 3), 10 * r + rank, dtype=torch.float32) for r in range(w)])
    if not torch.equal(u, expect):
        problems.append("all_to_all uneven")
    if not torch.equal(x, torch.arange(6, dtype=torch.float32).view(3, 2) + 100 * rank):
        problems.append("input was modified")
    return problems


class _Rotated:
    """A deliberately non-canonical fold: rank order rotated by one (starts at rank 1)."""

    @staticmethod
    def fold(stacked: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        from detcomm.numerics.fold import reference_fold

        return reference_fold(torch.roll(stacked, shifts=-1, dims=0), out_dtype)


def _fold_from_x0(stacked: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A non-canonical fold that starts from x0 instead of +0.0 (-0.0 sums stay -0.0)."""
    acc = stacked[0].to(torch.float32).clone()
    for r in range(1, stacked.shape[0]):
        acc.add_(stacked[r].to(torch.float32))
    return acc.to(out_dtype)


def job_bad_leaf(rank: int, w: int, which: str) -> str:
    import detcomm
    from detcomm.numerics.fold import BATCH_INVARIANT, Leaf, Priority, register_leaf, unregister_leaf

    _shutdown()
    fn = _Rotated.fold if which == "rotated" else _fold_from_x0
    register_leaf(Leaf(f"bad_{which}", fold=fn, priority=Priority.VENDOR, features=frozenset({BATCH_INVARIANT})))
    try:
        detcomm.init(numerics="rl-bitwise")
    except detcomm.RouteRefused as e:
        return str(e)
    finally:
        unregister_leaf(f"bad_{which}")
        detcomm.shutdown()
    return "init succeeded"


def job_missing_leaf(rank: int, w: int) -> tuple[str, bool]:
    import detcomm
    from detcomm.numerics.fold import Leaf, register_leaf, registered_leaves, unregister_leaf

    _shutdown()
    saved = registered_leaves()
    for leaf in saved:
        unregister_leaf(leaf.name)
    register_leaf(Leaf("featureless", fold=saved[-1].fold))
    try:
        try:
            detcomm.init(numerics="rl-bitwise")
            msg = "init succeeded"
        except RuntimeError as e:
            msg = str(e)
        comm = detcomm.init(numerics="auto")  # auto requires no feature
        ok = comm.leaf.name == "featureless"
        detcomm.shutdown()
        return msg, ok
    finally:
        unregister_leaf("featureless")
        for leaf in saved:
            register_leaf(leaf)


def job_bad_inputs(rank: int, w: int) -> list[tuple[str, str]]:
    """Rank 0 makes each bad call alone; every rank then runs a real collective. A bad call that had
    reached any communication would pair with that collective and fail or hang."""
    import detcomm

    comm = _comm("rl-bitwise")
    comm.site("bad.o_proj", collective="all_reduce", dtype=torch.bfloat16, shape=(8,), max_rows=4)
    comm.site("bad.rs", collective="reduce_scatter", dtype=torch.float32, shape=(8,), max_rows=64)
    comm.site("bad.tag", collective="token_all_gather", dtype=torch.float32, shape=(2,), max_rows=3)
    bf = torch.zeros(2, 8, dtype=torch.bfloat16)
    cases = [
        ("unsupported dtype", lambda: detcomm.all_reduce(torch.zeros(2, 8, dtype=torch.complex64), site="bad.x")),
        ("dtype contradicts", lambda: detcomm.all_reduce(torch.zeros(2, 8), site="bad.o_proj")),
        ("shape contradicts", lambda: detcomm.all_reduce(torch.zeros(2, 9, dtype=torch.bfloat16), site="bad.o_proj")),
        ("op contradicts", lambda: detcomm.all_reduce(bf, site="bad.o_proj", op="max")),
        ("collective contradicts", lambda: detcomm.all_gather(bf, site="bad.o_proj")),
        ("too many rows", lambda: detcomm.all_reduce(torch.zeros(5, 8, dtype=torch.bfloat16), site="bad.o_proj")),
        ("rs rows", lambda: detcomm.reduce_scatter(torch.zeros(w * 2 + 1, 8), site="bad.rs")),
        ("wrong device", lambda: detcomm.all_reduce(torch.zeros(2, 8, dtype=torch.bfloat16, device="meta"), site="bad.o_proj")),
        ("non-contiguous", lambda: detcomm.all_reduce(torch.zeros(8, 2, dtype=torch.bfloat16).t(), site="bad.o_proj")),
        ("unknown op", lambda: detcomm.all_reduce(bf, site="bad.o_proj", op="prod")),
        ("0-d", lambda: detcomm.all_reduce(torch.tensor(1.0), site="bad.scalar")),
        ("redeclare", lambda: detcomm.site("bad.o_proj", collective="all_reduce", dtype=torch.bfloat16, shape=(16,), max_rows=4)),
        ("rows_per_rank", lambda: detcomm.token_all_gather(torch.zeros(1, 2), site="bad.tag", rows_per_rank=[2] * w)),
        ("rows_per_rank len", lambda: detcomm.token_all_gather(torch.zeros(1, 2), site="bad.tag", rows_per_rank=[1])),
        ("a2a splits", lambda: detcomm.all_to_all(torch.zeros(w + 1, 2), site="bad.a2a", splits=[1] * w)),
        ("a2a even", lambda: detcomm.all_to_all(torch.zeros(w + 1, 2), site="bad.a2a2")),
        ("argmax vocab_start", lambda: detcomm.argmax(torch.zeros(2, 4), site="bad.am", vocab_start=-1)),
        ("argmax dims", lambda: detcomm.argmax(torch.zeros(2, 4, 1), site="bad.am", vocab_start=0)),
        ("undeclared too big", lambda: detcomm.all_reduce(torch.zeros(9000, 1), site="bad.big")),
        ("not a tensor", lambda: detcomm.all_reduce([1.0], site="bad.list")),  # type: ignore[arg-type]
        ("site type", lambda: detcomm.all_reduce(bf, site=3)),  # type: ignore[arg-type]
        ("forced native under bitwise", lambda: detcomm.site("bad.native", collective="all_reduce", dtype=torch.float32, shape=(4,), max_rows=4, route="native")),
    ]
    out = []
    for label, call in cases:
        msg = "no error"
        if rank == 0:
            try:
                call()
            except (ValueError, TypeError) as e:
                msg = f"{type(e).__name__}: {e}"
        ok = comm.all_reduce(torch.ones(1, 8, dtype=torch.bfloat16), site="bad.o_proj")
        assert ok.float().sum().item() == 8 * w
        out.append((label, msg))
    return out


def job_route_per_row_count(rank: int, w: int) -> tuple[set[str], set[str]]:
    comm = _comm("rl-bitwise")
    comm.site("rc.ar", collective="all_reduce", dtype=torch.bfloat16, shape=(4,), max_rows=64)
    comm.site("rc.rs", collective="reduce_scatter", dtype=torch.bfloat16, shape=(4,), max_rows=64 * w)
    used: list[str] = []
    # Spy on the bound routes: every call of a site goes through exactly the object routing bound once.
    originals = dict(comm._bound)  # a view: name -> SiteCall.bound

    def spy(bound):  # type: ignore[no-untyped-def]
        def call(x, args):  # type: ignore[no-untyped-def]
            used.append(bound.route.value)
            return bound(x, args)
        return call

    for name, bound in originals.items():
        comm._site_calls[name].bound = spy(bound)
    try:
        for rows in range(1, 65):
            comm.all_reduce(torch.ones(rows, 4, dtype=torch.bfloat16), site="rc.ar")
        ar = set(used)
        used.clear()
        for rows in range(1, 65):
            comm.reduce_scatter(torch.ones(rows * w, 4, dtype=torch.bfloat16), site="rc.rs")
        return ar, set(used)
    finally:
        for name, bound in originals.items():
            comm._site_calls[name].bound = bound


def job_init_timing(rank: int, w: int) -> tuple[float, int]:
    import time

    import detcomm

    _shutdown()
    t = time.perf_counter()
    comm = detcomm.init(numerics="rl-bitwise")
    secs = time.perf_counter() - t
    n = len(comm.checks())
    detcomm.shutdown()
    return secs, n


# ---------------------------------------------------------------------------------------------------------
# Tests

@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(coll=st.sampled_from(["all_reduce", "reduce_scatter"]), dtype=st.sampled_from(sorted(DTYPES)),
       rows=st.integers(1, 40), width=st.sampled_from([1, 3, 16, 77]), offset=st.integers(0, 17),
       extra=st.integers(0, 30), seed=st.integers(0, 2**16), ill=st.booleans())
def test_fold_routes_equal_oracle(cluster, coll, dtype, rows, width, offset, extra, seed, ill) -> None:  # noqa: ANN001
    offset = min(offset, extra)
    res = cluster.run(job_fold_case, coll, dtype, rows, width, offset, extra, seed, ill)
    for route, ok_full, ok_base, _ in res:
        assert route == ("gather_fold" if coll == "all_reduce" else "a2a_fold")
        assert ok_full, "differs from the oracle"
        assert ok_base, "the base rows' bits depend on their neighbours"
    if coll == "all_reduce":
        assert len({r[3] for r in res}) == 1, "ranks hold different bits"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prefix_vs_parent(cluster, dtype: str) -> None:  # noqa: ANN001
    for prefix_ok, parent_ok in cluster.run(job_prefix_parent, dtype, 64):
        assert parent_ok and prefix_ok


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_native_is_caught_moving_rows_and_fold_is_not(cluster3plus, dtype: str) -> None:  # noqa: ANN001
    """Negative control: gloo's ring all-reduce at W >= 3 changes a row's bits with the batch; the same
    measurement on the fold route finds nothing."""
    native = cluster3plus.run(job_compositions, "auto", None, dtype, 256)
    assert native[0] > 0, "the native route never moved a row: the payload is too benign to test anything"
    fold = cluster3plus.run(job_compositions, "auto", "gather_fold", dtype, 256)
    assert fold == [0] * cluster3plus.world_size


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_signed_zeros_subnormals_nan_inf(cluster, dtype: str) -> None:  # noqa: ANN001
    res = cluster.run(job_specials, dtype)
    for ok_ar, ok_rs, _ in res:
        assert ok_ar and ok_rs
    assert len({r[2] for r in res}) == 1


@pytest.mark.parametrize("numerics", ["auto", "rl-bitwise"])
def test_max_min_argmax_int_exact(cluster, numerics: str) -> None:  # noqa: ANN001
    for problems in cluster.run(job_max_min_argmax_int, numerics):
        assert problems == []


def test_data_movement(cluster) -> None:  # noqa: ANN001
    for problems in cluster.run(job_data_movement):
        assert problems == []


@pytest.mark.parametrize("which", ["rotated", "from_x0"])
def test_selfcheck_refuses_non_canonical_leaf(cluster3plus, which: str) -> None:  # noqa: ANN001
    msgs = cluster3plus.run(job_bad_leaf, which)
    assert all(m != "init succeeded" for m in msgs), msgs
    assert len(set(msgs)) == 1, "ranks reached different verdicts"
    assert "gather_fold" in msgs[0] and "(c) differs from the reference" in msgs[0]


def test_selfcheck_refuses_rotated_leaf_at_w2(cluster) -> None:  # noqa: ANN001
    if cluster.world_size != 2:
        pytest.skip("W=3 and 4 run in test_selfcheck_refuses_non_canonical_leaf")
    # At W = 2 a rotated order is a + b vs b + a: identical bits, so only the -0.0 start can be caught.
    msgs = cluster.run(job_bad_leaf, "from_x0")
    assert all("differs from the reference" in m for m in msgs)


def test_bitwise_envelope_requires_batch_invariant_leaf(cluster) -> None:  # noqa: ANN001
    for msg, auto_ok in cluster.run(job_missing_leaf):
        assert "no fold leaf for device type 'cpu' declares the features ['batch_invariant']" in msg
        assert auto_ok


def test_bad_inputs_raise_before_any_communication(cluster) -> None:  # noqa: ANN001
    res = cluster.run(job_bad_inputs)
    expected = {
        "unsupported dtype": "not supported", "dtype contradicts": "dtype float32 != bfloat16",
        "shape contradicts": "trailing shape (9,) != (8,)", "op contradicts": "op max != sum",
        "collective contradicts": "collective all_gather != all_reduce", "too many rows": "exceed the declared max_rows=4",
        "rs rows": "divisible by the world size", "wrong device": "move it with x.to",
        "non-contiguous": "pass x.contiguous()", "unknown op": "unknown op 'prod'", "0-d": "0-d tensor",
        "redeclare": "contradicts it", "rows_per_rank": "rows_per_rank[0]", "rows_per_rank len": "has 1 entries",
        "a2a splits": "splits sum to", "a2a even": "needs rows divisible", "argmax vocab_start": "non-negative int",
        "argmax dims": "[rows, vocab_shard]", "undeclared too big": "default max_rows",
        "not a tensor": "expected a torch.Tensor", "site type": "site must be a site name",
        "forced native under bitwise": "not batch-invariant",
    }
    got = dict(res[0])
    assert set(got) == set(expected)
    for label, needle in expected.items():
        assert needle in got[label], (label, got[label])
        assert "'bad." in got[label] or label in ("site type",), got[label]  # the message names the site
    assert all(m == "no error" for _, m in res[1])


def test_route_same_for_every_row_count(cluster) -> None:  # noqa: ANN001
    for ar, rs in cluster.run(job_route_per_row_count):
        assert ar == {"gather_fold"} and rs == {"a2a_fold"}


def test_startup_selfcheck_cost(cluster) -> None:  # noqa: ANN001
    res = cluster.run(job_init_timing)
    secs = max(s for s, _ in res)
    assert all(n == 6 for _, n in res)  # AR + RS for three dtypes
    print(f"W={cluster.world_size}: init(rl-bitwise) with self-checks took {secs * 1e3:.0f} ms")
