"""detcomm.invariance: the ulp distance and its NaN rule against an independent numpy computation, the
compositions reaching every receiving rank, and the negative controls (in-process and on W=4 gloo ranks).

The oracle here orders bit patterns by their VALUE (numpy sorts the decoded floats, or walks them with
nextafter), never by the sign-magnitude arithmetic detcomm.invariance uses, so the two share no code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detcomm import invariance as inv
from detcomm.payload import ill_conditioned

# ------------------------------------------------------------------------------------------------ oracle


def _values16(dtype: str) -> np.ndarray:
    """Every 16-bit pattern's value as float64 (bf16: the pattern is the top half of an fp32)."""
    pats = np.arange(1 << 16, dtype=np.uint32)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns widen to quiet NaNs
        if dtype == "bfloat16":
            return (pats << np.uint32(16)).view(np.float32).astype(np.float64)
        return pats.astype(np.uint16).view(np.float16).astype(np.float64)


def _positions16(dtype: str) -> np.ndarray:
    """Position of each pattern in the value order of all non-NaN patterns, -0.0 just before +0.0 (NaNs: -1)."""
    vals = _values16(dtype)
    sign = (np.arange(1 << 16) >> 15) & 1
    ok = ~np.isnan(vals)
    order = np.lexsort((-sign[ok], vals[ok]))  # by value, then the negative zero first
    pos = np.full(1 << 16, -1, dtype=np.int64)
    pos[np.flatnonzero(ok)[order]] = np.arange(ok.sum())
    return pos


def _oracle16(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    pos, vals = _positions16(dtype), _values16(dtype)
    nan = np.isnan(vals[a]) | np.isnan(vals[b])
    dist = np.abs(pos[a] - pos[b]).astype(np.float64)
    return np.where(nan, np.where(a == b, 0.0, np.inf), dist)


def _to_torch16(p: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(p.astype(np.uint16).view(np.int16).copy()).view(dtype)


def _fp32_walk(start: np.float32, steps: int) -> np.float32:
    """``steps`` values up from ``start`` through the value order of fp32, -0.0 then +0.0."""
    x = np.float32(start)
    for _ in range(steps):
        if x == 0 and np.signbit(x):
            x = np.float32(0.0)
        else:
            nxt = np.nextafter(x, np.float32(np.inf), dtype=np.float32)
            x = np.float32(-0.0) if (x < 0 and nxt == 0) else nxt
    return x


# ---------------------------------------------------------------------------------------------- ulp + NaN


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ulp_distance_16bit_matches_value_order(dtype: str) -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 1 << 16, 20000)
    near = (a + rng.integers(-40, 41, a.size)) % (1 << 16)
    far = rng.integers(0, 1 << 16, a.size)
    special = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7F80 if dtype == "bfloat16" else 0x7C00,
                        0x7FC0 if dtype == "bfloat16" else 0x7E00, 0x7FC1 if dtype == "bfloat16" else 0x7E01, 0xFFC0])
    sa, sb = np.repeat(special, special.size), np.tile(special, special.size)
    tdt = getattr(torch, dtype)
    for x, y in ((a, near), (a, far), (sa, sb)):
        got = inv.ulp_distance(_to_torch16(x, tdt), _to_torch16(y, tdt)).numpy()
        np.testing.assert_array_equal(got, _oracle16(x, y, dtype))


def test_ulp_distance_fp32_matches_nextafter_walk() -> None:
    rng = np.random.default_rng(2)
    starts = [np.float32(-1.4e-45), np.float32(-0.0), np.float32(0.0), np.float32(-3e-45), np.float32(1.0),
              np.float32(-1.0), np.float32(3.0e38)] + [np.float32(v) for v in rng.standard_normal(40) * 1e-44]
    starts += [np.float32(v) for v in rng.standard_normal(40) * 10.0 ** rng.integers(-30, 30, 40)]
    for s in starts:
        k = int(rng.integers(0, 9))
        end = _fp32_walk(s, k)
        a = torch.tensor([s], dtype=torch.float32)
        b = torch.tensor([end], dtype=torch.float32)
        assert inv.ulp_distance(a, b).item() == k, (s, end, k)
        assert inv.ulp_distance(b, a).item() == k


def test_nan_rule_and_changed_agree() -> None:
    # Distance 0 exactly when the bits are identical: -0/+0 is a change of 1 ulp, NaNs of other bits are inf.
    f = torch.float32
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(f)[0].item()
    a = torch.tensor([0.0, -0.0, float("nan"), float("nan"), float("nan"), 1.0, float("inf")], dtype=f)
    b = torch.tensor([-0.0, -0.0, float("nan"), nan2, 2.0, 1.0, float("inf")], dtype=f)
    b[3] = torch.tensor([0x7FC00001], dtype=torch.int32).view(f)[0]
    assert inv.changed_mask(a, b).tolist() == [True, False, False, True, True, False, False]
    assert inv.ulp_distance(a, b).tolist() == [1.0, 0.0, 0.0, float("inf"), float("inf"), 0.0, 0.0]
    rng = np.random.default_rng(3)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        width = 32 if dt == torch.float32 else 16
        pats = rng.integers(0, 1 << width, (2, 5000), dtype=np.uint64)
        pats[1, ::3] = pats[0, ::3]  # a third identical
        view = np.int32 if width == 32 else np.int16
        x, y = (torch.from_numpy(p.astype(np.uint32 if width == 32 else np.uint16).view(view).copy()).view(dt) for p in pats)
        assert torch.equal(inv.ulp_distance(x, y) == 0, ~inv.changed_mask(x, y))
    # Negative control: the old bench rule (two NaNs are 0 apart whatever their bits) disagrees with "changed".
    assert inv.changed_mask(a[3:4], b[3:4]).item() and inv.ulp_distance(a[3:4], b[3:4]).item() != 0


def test_integers_and_mismatches() -> None:
    a, b = torch.tensor([3, -7, 5]), torch.tensor([3, 7, 4])
    assert inv.ulp_distance(a, b).tolist() == [0.0, 14.0, 1.0]
    assert inv.rows_changed(a, b) == 2
    with pytest.raises(ValueError, match="cannot compare"):
        inv.changed_mask(a, b.to(torch.int32))
    assert not inv.bits_equal(a, b.to(torch.int32))
    with pytest.raises(ValueError, match="not supported"):
        inv.bits(torch.zeros(2, dtype=torch.float64))


# ------------------------------------------------------------------------------------------- compositions


@pytest.mark.parametrize("w", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 16])
def test_reduce_scatter_compositions_reach_every_receiving_rank(w: int, n: int) -> None:
    for count in (4, None):
        comps = inv.compositions(n, collective="reduce_scatter", world_size=w, filler_rows=5, count=count)
        seen: dict[int, set[int]] = {i: set() for i in range(n)}
        for c in comps + tuple(inv.batch1(n, collective="reduce_scatter", world_size=w)):
            assert c.rows % w == 0
            for j, r in enumerate(c.receivers(w)):
                if c.index[j] < n:
                    seen[c.index[j]].add(r)
        assert all(s == set(range(w)) for s in seen.values()), (count, seen)
    if n >= 2 and w >= 2:  # some composition splits the probe over two receiving ranks
        full = inv.compositions(n, collective="reduce_scatter", world_size=w, filler_rows=5)
        assert any(len({c.receivers(w)[j] for j, i in enumerate(c.index) if i < n}) == 2 for c in full)


def test_all_reduce_compositions_are_the_placements() -> None:
    comps = inv.compositions(3, collective="all_reduce", world_size=4, filler_rows=2)
    assert [(c.rows, c.index.index(0)) for c in comps] == list(inv.placements(3))
    for c in comps:
        assert [i for i in c.index if i < 3] == [0, 1, 2] and all(i < 5 for i in c.index)
    with pytest.raises(ValueError, match="does not fit"):
        inv.place(4, 2, probe_rows=3, filler_rows=1)


def test_tally_counts_distinct_rows_and_repeated_rows() -> None:
    ref = torch.zeros(3, 4)
    t = inv.Tally(ref)
    out = torch.zeros(4, 4)
    out[1, 2] = 1.0  # pool row 0, placed twice in this batch: only the second copy changed
    t.add(out, inv.Composition((0, 0, 1, 3), 3))
    assert (t.rows_changed, t.elements_changed, t.placements) == (1, 1, 3)
    assert t.max_ulps == inv.ulp_distance(torch.tensor([1.0]), torch.tensor([0.0])).item()


# -------------------------------------------------------------------------------- in-process negative controls


def _pools(w: int, rows: int, width: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [ill_conditioned(rows, (width,), dtype, seed=11, rank=r, world_size=w) for r in range(w)]


def _ring_reduce_scatter(pools: list[torch.Tensor], comp: inv.Composition, w: int) -> torch.Tensor:
    """A ring reduce-scatter's order: block r is summed starting after rank r, in fp32, then rounded."""
    xs = [p[comp.tensor()] for p in pools]
    k = comp.rows // w
    out = []
    for r in range(w):
        acc = torch.zeros_like(xs[0][r * k:(r + 1) * k], dtype=torch.float32)
        for s in range(1, w + 1):
            acc = acc + xs[(r + s) % w][r * k:(r + 1) * k].float()
        out.append(acc.to(xs[0].dtype))
    return torch.cat(out)


def _canonical_reduce_scatter(pools: list[torch.Tensor], comp: inv.Composition, w: int) -> torch.Tensor:
    from detcomm.numerics.fold import reference_fold

    return reference_fold(torch.stack([p[comp.tensor()] for p in pools]), pools[0].dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_receiving_rank_dependence_is_caught_and_canonical_is_not(dtype: torch.dtype) -> None:
    w, n, filler = 4, 6, 8
    pools = _pools(w, n + filler, 64, dtype)
    comps = inv.compositions(n, collective="reduce_scatter", world_size=w, filler_rows=filler, count=4)
    for fn, moves in ((_ring_reduce_scatter, True), (_canonical_reduce_scatter, False)):
        def run(c: inv.Composition, fn=fn) -> torch.Tensor:  # noqa: ANN001
            return fn(pools, c, w)

        _, tally = inv.batch1_reference(run, n, collective="reduce_scatter", world_size=w)
        inv.measure(run, comps, tally=tally)
        assert (tally.rows_changed > 0) == moves and (tally.max_ulps > 0) == moves
        # The blind spot this module closes: compare each receiving rank only with its own batch-1 result.
        if moves:
            own = {}
            for c in inv.batch1(n, collective="reduce_scatter", world_size=w):
                out = run(c)
                for r in range(w):
                    own[(c.index[0], r)] = out[r]
            blind = 0
            for c in comps:
                out, rec = run(c), c.receivers(w)
                blind += sum(int(inv.changed_mask(out[j], own[(i, rec[j])]).any())
                             for j, i in enumerate(c.index) if i < n)
            assert blind == 0  # a ring's order follows the receiving rank only, so the old view read 0


# ------------------------------------------------------------------------------------ W=4 gloo ranks


def job_reduce_scatter(rank: int, w: int, route: str) -> tuple[int, int, float, int]:
    import detcomm

    comm = detcomm.init(numerics="auto")
    try:
        n, filler, width, dtype = 6, 8, 96, torch.float32
        name = f"inv.rs.{route}"
        comm.site(name, collective="reduce_scatter", dtype=dtype, shape=(width,), max_rows=4096, route=route)
        pool = ill_conditioned(n + filler, (width,), dtype, seed=5, rank=rank, world_size=w)

        def run(c: inv.Composition) -> torch.Tensor:
            out = comm.reduce_scatter(pool[c.tensor()].contiguous(), site=name)
            return inv.gather_whole(out, collective="reduce_scatter")

        _, first = inv.batch1_reference(run, n, collective="reduce_scatter", world_size=w)
        receivers_only = first.rows_changed
        comps = inv.compositions(n, collective="reduce_scatter", world_size=w, filler_rows=filler)
        tally = inv.measure(run, comps, tally=first).agreed(device=comm.device)
        routes = {e["site"]: e["route"] for e in comm.routes().as_dicts()}
        assert routes[name] == route, routes
        return tally.rows_changed, tally.elements_changed, tally.max_ulps, receivers_only
    finally:
        detcomm.shutdown()


@pytest.mark.slow
def test_native_reduce_scatter_caught_fold_routes_not_w4(cluster4) -> None:  # noqa: ANN001
    cluster = cluster4
    native = cluster.run(job_reduce_scatter, "native")
    assert len({r[:3] for r in native}) == 1  # the agreed tally is the same on every rank
    rows, elements, ulps, receivers_only = native[0]
    assert rows > 0 and elements > 0 and ulps >= 1, native[0]
    assert receivers_only > 0  # the same row alone, received by another rank, already has other bits
    for route in ("a2a_fold", "gather_fold"):
        for res in cluster.run(job_reduce_scatter, route):
            assert res == (0, 0, 0.0, 0), (route, res)
