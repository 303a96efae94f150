"""rs_ag_fold on real spawned gloo processes at W = 3 and 4: the bits against the numpy oracle (tests/oracle.py,
written from docs/spec.md §1, sharing no code with the package's fold), with negative controls.

Every rank regenerates every other rank's input from (seed, rank) (tests/datagen.py), so no expected value went
through a collective. W = 2 is left out on purpose: a + b == b + a hides every ordering bug.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import oracle
from datagen import DTYPES, ill_bits, to_bits, to_torch

_SIGN = {"float32": 1 << 31, "bfloat16": 1 << 15, "float16": 1 << 15}
_EXP = {"float32": 0x7F800000, "bfloat16": 0x7F80, "float16": 0x7C00}


def _specials(rows: int, width: int, dtype: str, *, seed: int, rank: int) -> np.ndarray:
    """ill_bits with ±0, subnormals, ±Inf and NaNs of several payloads and signs sprinkled in; row 0 is -0.0 on
    every rank (its sum must be +0.0)."""
    b = ill_bits(rows, width, dtype, seed=seed, rank=rank).copy()
    rng = np.random.default_rng([seed, 4242, rank])
    s, e = _SIGN[dtype], _EXP[dtype]
    specials = [0, s, 1, s | 1, 3, e, s | e, e | 1, s | e | 3]
    pick = rng.random(b.shape) < 0.25
    b[pick] = rng.choice(specials, size=int(pick.sum()))
    b[0, :] = s
    return b


def _reversed_oracle(inputs: list[np.ndarray], dtype: str) -> np.ndarray:
    """The fold in the wrong rank order (W-1 .. 0): the negative control of the comparison."""
    return oracle.fold_oracle(list(reversed(inputs)), dtype)


# (rows of the base block, row width, offset in the batch, extra filler rows): a row alone, rows in batches at
# offsets, widths the W = 3 and 4 do not divide, a message smaller than W elements.
CASES = [(1, 7, 0, 0), (3, 13, 2, 9), (5, 64, 7, 40), (1, 1, 0, 0), (2, 4097, 1, 3)]


def job_oracle(rank: int, w: int, dtype: str) -> list[str]:
    """Every case on a site forced onto rs_ag_fold, SUM and AVG, against the oracle; the base rows folded alone
    must equal the same rows inside the batch. Returns the problems found (empty: all bits equal)."""
    import detcomm

    comm = detcomm.init(numerics="rl-bitwise")
    problems: list[str] = []
    try:
        for op in ("sum", "avg"):
            name = f"rsag.{dtype}.{op}"
            for i, (rows, width, off, extra) in enumerate(CASES):
                site = f"{name}.{width}"
                comm.site(site, collective="all_reduce", dtype=DTYPES[dtype], shape=(width,), op=op,
                          max_rows=rows + extra, route="rs_ag_fold")
                total = rows + extra

                def batch(r: int, rows: int = rows, width: int = width, off: int = off, total: int = total,
                          i: int = i) -> np.ndarray:
                    base = _specials(rows, width, dtype, seed=100 + i, rank=r)
                    fill = ill_bits(total, width, dtype, seed=200 + i, rank=r).copy()
                    fill[off : off + rows] = base
                    return fill

                inputs = [batch(r) for r in range(w)]
                fold = oracle.fold_oracle if op == "sum" else oracle.avg_oracle
                expected = fold(inputs, dtype)
                got = to_bits(detcomm.all_reduce(to_torch(inputs[rank], dtype), site=site, op=op))
                if not np.array_equal(got, expected):
                    problems.append(f"{op} case {i}: {int((got != expected).sum())} elements differ from the oracle")
                alone = to_bits(detcomm.all_reduce(to_torch(inputs[rank][off : off + rows], dtype), site=site, op=op))
                if not np.array_equal(alone, got[off : off + rows]):
                    problems.append(f"{op} case {i}: the rows alone differ from the same rows in the batch")
                if op == "sum" and not (got[off] == 0).all():
                    problems.append(f"case {i}: a sum of -0.0 on every rank is not +0.0")
        routes = {d["site"]: d["route"] for d in comm.routes().as_dicts()}
        if {r for s, r in routes.items() if s.startswith("rsag.")} != {"rs_ag_fold"}:
            problems.append(f"routes: {routes}")
    finally:
        detcomm.shutdown()
    return problems


def job_negative_zero_avg(rank: int, w: int) -> tuple[int, int]:
    """AVG of a sum of -2^-149 (fp32): the division by W rounds to -0.0, a result that the all-gather must move
    verbatim (and that the oracle computes too). Returns (got bits, oracle bits) of the element."""
    import detcomm

    comm = detcomm.init(numerics="rl-bitwise")
    try:
        comm.site("nz", collective="all_reduce", dtype=torch.float32, shape=(5,), op="avg", max_rows=3,
                  route="rs_ag_fold")
        inputs = [np.zeros((3, 5), np.uint32) for _ in range(w)]
        inputs[0][1, 2] = 0x80000001  # -2^-149 on rank 0, +0.0 elsewhere
        got = to_bits(detcomm.all_reduce(to_torch(inputs[rank], "float32"), site="nz", op="avg"))
        return int(got[1, 2]), int(oracle.avg_oracle(inputs, "float32")[1, 2])
    finally:
        detcomm.shutdown()


def job_negative_controls(rank: int, w: int) -> tuple[bool, bool, bool]:
    """(the route equals the oracle, the reversed-order oracle differs from the route, a route variant whose leaf
    folds in reversed rank order differs from the oracle) on an ill-conditioned payload."""
    import detcomm
    from detcomm.numerics.fold import Leaf, portable_fold
    from detcomm.route_impls.rs_ag_fold import RsAgFoldRoute
    from detcomm.sites import ReduceOp

    comm = detcomm.init(numerics="rl-bitwise")
    try:
        inputs = [ill_bits(64, 129, "bfloat16", seed=3, rank=r) for r in range(w)]
        x = to_torch(inputs[rank], "bfloat16")
        good = RsAgFoldRoute(comm._native, comm.leaf).all_reduce(x, ReduceOp.SUM)
        rev_leaf = Leaf("reversed", lambda s, d: portable_fold(s.flip(0), d))
        bad = RsAgFoldRoute(comm._native, rev_leaf).all_reduce(x, ReduceOp.SUM)
        expected = oracle.fold_oracle(inputs, "bfloat16")
        return (bool(np.array_equal(to_bits(good), expected)),
                not np.array_equal(to_bits(good), _reversed_oracle(inputs, "bfloat16")),
                not np.array_equal(to_bits(bad), expected))
    finally:
        detcomm.shutdown()


class _Counting:
    """A NativeRoute stand-in that counts the bytes this rank receives from the other ranks."""

    def __init__(self, native) -> None:  # type: ignore[no-untyped-def]  # noqa: ANN001
        self.native, self.world_size, self.rank, self.stage = native, native.world_size, native.rank, native.stage
        self.received = 0
        self.collectives = 0

    def all_to_all(self, x, ins, outs):  # type: ignore[no-untyped-def]  # noqa: ANN001
        out = self.native.all_to_all(x, ins, outs)
        self.received += out.numel() * out.element_size() * (self.world_size - 1) // self.world_size
        self.collectives += 1
        return out

    def all_gather(self, x):  # type: ignore[no-untyped-def]  # noqa: ANN001
        out = self.native.all_gather(x)
        self.received += x.numel() * x.element_size() * (self.world_size - 1)
        self.collectives += 1
        return out


def job_bytes(rank: int, w: int) -> tuple[int, int, int, int]:
    """Bytes received per rank (from the other ranks) by rs_ag_fold and gather_fold for one 4 MiB bf16 message,
    payload only (the call guard's 16 bytes per message left out: guard=None), and their collective counts."""
    import detcomm
    from detcomm.route_impls.gather_fold import GatherFoldRoute
    from detcomm.route_impls.rs_ag_fold import RsAgFoldRoute
    from detcomm.sites import ReduceOp

    comm = detcomm.init(numerics="rl-bitwise", selfcheck=False)
    try:
        x = torch.ones(512, 4096, dtype=torch.bfloat16)
        rs, ga = _Counting(comm._native), _Counting(comm._native)
        a = RsAgFoldRoute(rs, comm.leaf).all_reduce(x, ReduceOp.SUM)  # type: ignore[arg-type]
        b = GatherFoldRoute(ga, comm.leaf).all_reduce(x, ReduceOp.SUM)  # type: ignore[arg-type]
        assert torch.equal(a, b)
        return rs.received, ga.received, rs.collectives, ga.collectives
    finally:
        detcomm.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_rs_ag_fold_equals_oracle(cluster3plus, dtype: str) -> None:  # noqa: ANN001
    assert cluster3plus.run(job_oracle, dtype, timeout_s=600) == [[]] * cluster3plus.world_size


def test_negative_zero_result_moved_verbatim(cluster3plus) -> None:  # noqa: ANN001
    got = cluster3plus.run(job_negative_zero_avg)
    assert got == [(0x80000000, 0x80000000)] * cluster3plus.world_size


def test_negative_controls(cluster3plus) -> None:  # noqa: ANN001
    assert cluster3plus.run(job_negative_controls) == [(True, True, True)] * cluster3plus.world_size


def test_bytes_received_per_rank(cluster3plus) -> None:  # noqa: ANN001
    w = cluster3plus.world_size
    n = 512 * 4096
    c = -(-n // w)  # a block's elements, the last block padded where W does not divide the message
    rs, ga, n_rs, n_ga = cluster3plus.run(job_bytes)[0]
    assert (rs, n_rs) == (2 * (w - 1) * c * 2, 2) and (ga, n_ga) == ((w - 1) * n * 2, 1)
    assert rs / ga == pytest.approx(2 / w, rel=1e-5)  # a ring's 2(W-1)/W of the message against W-1


def job_norm_composition(rank: int, w: int) -> tuple[bool, bool, str]:
    """all_reduce_residual_rmsnorm on a site forced onto rs_ag_fold: (equals the numpy composition oracle, the
    oracle over a rotated rank order differs: its negative control, the site's route)."""
    import detcomm
    import norm_oracle
    from datagen import random_bits

    dtype, hidden, eps = "bfloat16", 1001, 1e-6
    comm = detcomm.init(numerics="rl-bitwise")
    try:
        comm.site("rsag.norm", collective="all_reduce_rmsnorm", dtype=torch.bfloat16, shape=(hidden,), max_rows=9,
                  route="rs_ag_fold")
        xs = [ill_bits(9, hidden, dtype, seed=61, rank=r) for r in range(w)]
        res = random_bits(9, hidden, dtype, seed=62, rank=0)
        wt = random_bits(1, hidden, dtype, seed=63, rank=0)[0]
        y, r = detcomm.all_reduce_residual_rmsnorm(to_torch(xs[rank], dtype), to_torch(res, dtype),
                                                   to_torch(wt, dtype), eps=eps, site="rsag.norm")
        y_exp, r_exp = norm_oracle.composition_oracle(xs, res, wt, dtype, dtype, eps)
        y_rot, r_rot = norm_oracle.composition_oracle(xs[1:] + xs[:1], res, wt, dtype, dtype, eps)
        ok = bool(np.array_equal(to_bits(y), y_exp) and np.array_equal(to_bits(r), r_exp))
        caught = not (np.array_equal(to_bits(y), y_rot) and np.array_equal(to_bits(r), r_rot))
        route = {d["site"]: d["route"] for d in comm.routes().as_dicts()}["rsag.norm"]
        return ok, caught, str(route)
    finally:
        detcomm.shutdown()


def test_norm_composition_on_rs_ag_fold(cluster3plus) -> None:  # noqa: ANN001
    assert cluster3plus.run(job_norm_composition) == [(True, True, "rs_ag_fold")] * cluster3plus.world_size
