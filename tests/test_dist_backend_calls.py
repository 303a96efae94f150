"""The "detcomm" torch.distributed backend's own calls on real spawned gloo ranks (issue 40: items 1, 2, 6, 7, 9,
10, 13, 20): calls the backend serves itself (an empty tensor, fp64, integers, PRODUCT, a reduce's root, a
barrier) take part in the call guard, so ranks making different calls all raise ``CollectiveMismatch`` naming
each rank's call instead of pairing their data with another call's; collectives write a non-contiguous view
exactly; PRODUCT is the rank-order product of docs/spec.md §1.1; PREMUL_SUM's factor is read on torches without
``ReduceOp.factor``.

Every numeric check compares bits with an oracle computed locally from every rank's inputs (tests/oracle.py's
widening and rounding, numpy's IEEE fp32 / fp64 products), and each has its negative control: plain gloo
writes the strided view wrong; another rank order moves the product's bits.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch

import oracle
from datagen import random_bits, to_bits, to_torch

# A fresh group per scenario with a short deadline: a call that pairs with another rank's different call (what
# these tests provoke) must raise, not wait; on a backend without the guard the wait ends here as a gloo error.
_DEADLINE = timedelta(seconds=20)


def _fresh():  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    import detcomm.dist_backend  # noqa: F401 - registers the backend

    return dist.new_group(backend="detcomm", timeout=_DEADLINE)


def _drop(pg) -> None:  # type: ignore[no-untyped-def]
    """Destroy a group after a scenario; its communicator may have counted a mismatched call (its close then
    raises CollectiveMismatch on every rank, as documented), which is not what these tests look at."""
    import torch.distributed as dist

    from detcomm.errors import DetcommError

    try:
        dist.destroy_process_group(pg)
    except DetcommError:
        pass


def _raised(fn) -> str:  # type: ignore[no-untyped-def]
    """``fn()``'s error as "Type: message", or "" when it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(e).__name__}: {e}"
    return ""


def job_mismatch(rank: int, w: int, scenario: str) -> str:
    """Rank 1 (or rank 0) makes a different call than its peers, after the peers' site is warm."""
    import torch.distributed as dist

    pg = _fresh()
    dist.all_reduce(torch.ones(8), group=pg)  # the fp32 SUM site of 8 elements is warm on every rank
    dist.all_reduce(torch.ones(8, dtype=torch.float64), group=pg)

    def call() -> None:
        if scenario == "empty":  # item 1
            dist.all_reduce(torch.ones(0) if rank == 1 else torch.ones(8), group=pg)
        elif scenario == "empty-reduce-scatter":  # item 1
            n = 0 if rank == 1 else 8
            dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * w), group=pg)
        elif scenario == "fp64":  # item 2
            dist.all_reduce(torch.ones(8, dtype=torch.float64 if rank == 0 else torch.float32), group=pg)
        elif scenario == "fp64-sizes":  # item 2
            dist.all_reduce(torch.ones(9 if rank == 0 else 8, dtype=torch.float64), group=pg)
        elif scenario == "int64":  # item 7
            dist.all_reduce(torch.ones(8, dtype=torch.int64 if rank == 0 else torch.float32), group=pg)
        elif scenario == "extra-before-barrier":  # item 9
            if rank == 0:
                dist.all_reduce(torch.ones(8), group=pg)
            dist.barrier(group=pg)
        elif scenario == "reduce-dst":  # item 13
            dist.reduce(torch.ones(8), dst=0 if rank == 0 else 1, group=pg)
        else:
            raise AssertionError(scenario)

    err = _raised(call)
    _drop(pg)
    return err


# scenario -> what every rank's error must name (each rank's call, as the guard prints it)
_NAMED = {
    "empty": ["rank 1: dist.all_reduce(float32[0] on cpu, op=SUM)", "torch.all_reduce.sum.float32.8"],
    "empty-reduce-scatter": ["rank 1: dist.reduce_scatter(float32[0] on cpu, op=SUM)",
                             "rank 0: site 'torch.reduce_scatter.sum.float32.8' call #1 "
                             "(dist.reduce_scatter(float32[8] on cpu, op=SUM))"],
    "fp64": ["rank 0: dist.all_reduce(float64[8] on cpu, op=SUM)", "rank 1: site 'torch.all_reduce.sum.float32.8'"],
    "fp64-sizes": ["rank 0: dist.all_reduce(float64[9] on cpu, op=SUM)",
                   "rank 1: dist.all_reduce(float64[8] on cpu, op=SUM)"],
    "int64": ["rank 0: dist.all_reduce(int64[8] on cpu, op=SUM)", "rank 1: site 'torch.all_reduce.sum.float32.8'"],
    "extra-before-barrier": ["rank 0: site 'torch.all_reduce.sum.float32.8'", "rank 1: dist.barrier()"],
    "reduce-dst": ["rank 0: dist.reduce(float32[8] on cpu, op=SUM, dst=0)",
                   "rank 1: dist.reduce(float32[8] on cpu, op=SUM, dst=1)"],
}


@pytest.mark.parametrize("scenario", list(_NAMED))
def test_a_call_only_some_ranks_make_raises_on_every_rank(scenario: str) -> None:
    from clusters import get_cluster

    errors = get_cluster(3).run(job_mismatch, scenario, timeout_s=90)
    for rank, err in enumerate(errors):
        assert err.startswith("CollectiveMismatch"), (rank, err)
        for part in _NAMED[scenario]:
            assert part in err, (rank, part, err)


def job_agreeing_calls(rank: int, w: int) -> dict[str, object]:
    """The positive side of the scenarios above: the same calls made by every rank return the right values."""
    import torch.distributed as dist

    pg = _fresh()
    out: dict[str, object] = {}
    e = torch.ones(0)
    dist.all_reduce(e, group=pg)
    shard = torch.empty(0)
    dist.reduce_scatter_tensor(shard, torch.ones(0), group=pg)
    out["empty"] = (e.numel(), shard.numel())
    # fp64: the rank-order fold from +0.0 in fp64, against numpy's fp64 additions in that order.
    vals = [np.random.default_rng([4, q]).standard_normal(16) * 10.0 ** np.random.default_rng([5, q]).uniform(
        -8, 8, 16) for q in range(w)]
    want = np.zeros(16)
    for v in vals:
        want = want + v
    d = torch.from_numpy(vals[rank].copy())
    dist.all_reduce(d, group=pg)
    out["fp64"] = bool(np.array_equal(d.numpy().view(np.uint64), want.view(np.uint64)))
    rev = np.zeros(16)
    for v in vals[::-1]:
        rev = rev + v
    out["fp64 discriminates"] = not np.array_equal(rev.view(np.uint64), want.view(np.uint64))
    i = torch.full((8,), rank + 1, dtype=torch.int64)
    dist.all_reduce(i, group=pg)
    out["int64"] = i.tolist()
    r = torch.full((8,), float(rank + 1))
    dist.reduce(r, dst=1, group=pg)
    out["reduce"] = r.tolist()
    dist.barrier(group=pg)
    _drop(pg)
    return out


def test_the_same_calls_on_every_rank_still_return_the_canonical_result() -> None:
    from clusters import get_cluster

    w = 3
    for rank, r in enumerate(get_cluster(w).run(job_agreeing_calls)):
        assert r["empty"] == (0, 0)
        assert r["fp64"] and r["fp64 discriminates"], r
        assert r["int64"] == [w * (w + 1) // 2] * 8
        assert r["reduce"] == ([float(w * (w + 1) // 2)] if rank == 1 else [float(rank + 1)]) * 8


# -- item 6: collectives writing into a non-contiguous view ------------------------------------------------------
def job_strided_views(rank: int, w: int, kind: str) -> dict[str, bool]:
    """Each collective that writes a caller's tensor, handed a column of a [4, 3] base (stride 3): the column
    must hold the result and the other columns must be untouched. The expected values are built locally."""
    import torch.distributed as dist

    pg = _fresh() if kind == "detcomm" else dist.new_group(backend="gloo", timeout=_DEADLINE)

    def base() -> torch.Tensor:
        return torch.arange(12, dtype=torch.float32).view(4, 3) + 100 * rank

    def column_is(b: torch.Tensor, col: int, want: torch.Tensor) -> bool:
        ref = base()
        ref[:, col] = want
        return bool(torch.equal(b, ref))

    ok: dict[str, bool] = {}
    b = base()
    dist.broadcast(b[:, 1], src=2, group=pg)
    ok["broadcast"] = column_is(b, 1, torch.arange(4, dtype=torch.float32) * 3 + 1 + 200)
    if kind == "gloo":  # the negative control: gloo's broadcast (its recv refuses a strided tensor outright)
        dist.destroy_process_group(pg)
        return ok
    bs = [base() for _ in range(w)]
    dist.all_gather([x[:, 2] for x in bs], torch.full((4,), float(rank)), group=pg)
    ok["all_gather"] = all(column_is(x, 2, torch.full((4,), float(q))) for q, x in enumerate(bs))
    b = base()
    dist.all_to_all_single(b[:, 0][: w], torch.full((w,), float(rank)), group=pg)
    want = base()[:, 0].clone()
    want[:w] = torch.arange(w, dtype=torch.float32)
    ok["all_to_all_single"] = column_is(b, 0, want)
    b = base()
    dist.scatter(b[:, 1], [torch.full((4,), float(q + 7)) for q in range(w)] if rank == 0 else None, src=0,
                 group=pg)
    ok["scatter"] = column_is(b, 1, torch.full((4,), float(rank + 7)))
    i = (torch.arange(12, dtype=torch.int64).view(4, 3) + 100 * rank)
    dist.all_reduce(i[:, 1], group=pg)
    ref = torch.arange(12, dtype=torch.int64).view(4, 3) + 100 * rank
    ref[:, 1] = sum(torch.arange(4, dtype=torch.int64) * 3 + 1 + 100 * q for q in range(w))
    ok["int all_reduce"] = bool(torch.equal(i, ref))
    b = base()
    if rank == 0:
        dist.send(torch.full((4,), 5.0), dst=1, group=pg)
    elif rank == 1:
        dist.recv(b[:, 2], src=0, group=pg)
    ok["recv"] = column_is(b, 2, torch.full((4,), 5.0)) if rank == 1 else True
    _drop(pg)
    return ok


def test_collectives_write_a_strided_view_exactly() -> None:
    from clusters import get_cluster

    for r in get_cluster(3).run(job_strided_views, "detcomm"):
        assert all(r.values()), [k for k, v in r.items() if not v]


def test_negative_control_gloo_writes_a_strided_broadcast_wrong() -> None:
    from clusters import get_cluster

    results = get_cluster(3).run(job_strided_views, "gloo")
    assert not all(r["broadcast"] for r in results)


# -- item 20: PRODUCT ------------------------------------------------------------------------------------------------
_SPECIAL_F32 = [float("nan"), -0.0, 0.0, float("inf"), 1e-30, -3.0, 1e30, 0.5]  # NaN, signed zeros, inf * 0, ...


def _product_inputs(w: int, dtype: str, n: int) -> list[np.ndarray]:
    rows = [random_bits(1, n, dtype, seed=17, rank=q).reshape(-1) for q in range(w)]
    for q in range(w):  # the last len(_SPECIAL) elements: rank q holds the special values rotated by q
        rot = np.roll(np.array(_SPECIAL_F32, dtype=np.float32), q)
        rows[q][-len(rot):] = oracle.round_fp32_bits(rot.view(np.uint32), dtype)
    return rows


def _product_oracle(rows: list[np.ndarray], dtype: str) -> np.ndarray:
    """docs/spec.md §1.1: acc = 1.0 (fp32); acc = fp32(acc * widen(x_r)) for r in rank order; one rounding to
    the dtype; NaN canonical (round_fp32_bits). numpy's float32 multiply is one IEEE rounding, no flush."""
    acc = np.ones(rows[0].shape, dtype=np.float32)
    with np.errstate(all="ignore"):
        for x in rows:
            acc = (acc * oracle.widen(x, dtype)).astype(np.float32)
    return oracle.round_fp32_bits(acc.view(np.uint32), dtype)


def _stepwise_rounded(rows: list[np.ndarray], dtype: str) -> np.ndarray:
    """A wrong product: the accumulator rounded to the dtype after every step."""
    acc = oracle.round_fp32_bits(np.ones(rows[0].shape, dtype=np.float32).view(np.uint32), dtype)
    with np.errstate(all="ignore"):
        for x in rows:
            prod = (oracle.widen(acc, dtype) * oracle.widen(x, dtype)).astype(np.float32)
            acc = oracle.round_fp32_bits(prod.view(np.uint32), dtype)
    return acc


def job_product(rank: int, w: int) -> dict[str, bool]:
    import torch.distributed as dist

    pg = _fresh()
    ok: dict[str, bool] = {}
    n = 8 * w * 4
    for dtype in ("float32", "bfloat16", "float16"):
        rows = _product_inputs(w, dtype, n)
        want = _product_oracle(rows, dtype)
        x = to_torch(rows[rank], dtype)
        dist.all_reduce(x, op=dist.ReduceOp.PRODUCT, group=pg)
        ok[f"all_reduce {dtype}"] = bool(np.array_equal(to_bits(x), want))
        shard = torch.empty(n // w, dtype=x.dtype)
        dist.reduce_scatter_tensor(shard, to_torch(rows[rank], dtype), op=dist.ReduceOp.PRODUCT, group=pg)
        ok[f"reduce_scatter {dtype}"] = bool(np.array_equal(to_bits(shard), want.reshape(w, -1)[rank]))
        r = to_torch(rows[rank], dtype)
        dist.reduce(r, dst=w - 1, op=dist.ReduceOp.PRODUCT, group=pg)
        ok[f"reduce {dtype}"] = bool(np.array_equal(to_bits(r), want if rank == w - 1 else rows[rank]))
        # Negative control: the check can fail. fp32: another rank order moves bits; bf16 / fp16 (whose W
        # mantissas' product an fp32 accumulator nearly holds): rounding each step to the dtype moves them.
        ok[f"discriminates {dtype}"] = not np.array_equal(
            _product_oracle(rows[::-1], dtype) if dtype == "float32" else _stepwise_rounded(rows, dtype), want)
    # fp64: the product in fp64, rank order.
    vals = [np.random.default_rng([6, q]).standard_normal(32) for q in range(w)]
    want64 = np.ones(32)
    for v in vals:
        want64 = want64 * v
    d = torch.from_numpy(vals[rank].copy())
    dist.all_reduce(d, op=dist.ReduceOp.PRODUCT, group=pg)
    ok["fp64"] = bool(np.array_equal(d.numpy().view(np.uint64), want64.view(np.uint64)))
    _drop(pg)
    return ok


@pytest.mark.parametrize("w", [3, 4])
def test_product_is_the_rank_order_product(w: int) -> None:
    from clusters import get_cluster

    for r in get_cluster(w).run(job_product):
        assert all(r.values()), [k for k, v in r.items() if not v]


# -- item 10: PREMUL_SUM on a torch without ReduceOp.factor (before 2.13) ------------------------------------------
def job_premul_without_factor_attribute(rank: int, w: int) -> dict[str, bool]:
    """torch 2.4 .. 2.12's ReduceOp has no ``factor`` property: remove torch 2.13's for this call, as those
    versions are, and check PREMUL_SUM still folds (FSDP2's set_gradient_divide_factor takes this path)."""
    import torch.distributed as dist

    from test_dist_backend import job_premul

    prop = dist.ReduceOp.__dict__.get("factor")
    if prop is not None:
        delattr(dist.ReduceOp, "factor")
    try:
        assert not hasattr(dist._make_nccl_premul_sum(0.5), "factor")
        return job_premul(rank, w, 1.0 / 3.0)
    finally:
        if prop is not None:
            dist.ReduceOp.factor = prop  # type: ignore[attr-defined]


def test_premul_sum_reads_its_factor_without_reduce_op_factor() -> None:
    from clusters import get_cluster

    for r in get_cluster(3).run(job_premul_without_factor_attribute):
        assert all(r.values()), [k for k, v in r.items() if not v]
