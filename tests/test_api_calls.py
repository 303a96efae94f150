"""The torch.distributed conveniences of the public API on real gloo groups (W = 2, 3, 4): out= and in-place
calls, op="avg" against its exact oracle, async_op work handles, the site passed positionally, an int shape,
and a second init on one group. Bits are compared with tests/oracle.py on inputs every rank regenerates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, to_bits, to_torch


def job_out_inplace_avg_async(rank: int, w: int, dtype: str) -> list[str]:
    import detcomm

    detcomm.shutdown()
    detcomm.init(numerics="rl-bitwise")
    problems: list[str] = []
    try:
        bits = [ill_bits(5, 12, dtype, seed=31, rank=r) for r in range(w)]
        x = to_torch(bits[rank], dtype)
        want_sum = oracle.fold_oracle(bits, dtype)
        # Site positional, shape given as an int.
        detcomm.site("api.ar", collective="all_reduce", dtype=x.dtype, shape=12, max_rows=8)
        out = torch.empty_like(x)
        got = detcomm.all_reduce(x, "api.ar", out=out)
        if got is not out or not np.array_equal(to_bits(out), want_sum):
            problems.append("out= did not receive the canonical fold")
        inplace = x.clone()
        if detcomm.all_reduce(inplace, "api.ar", out=inplace) is not inplace or not np.array_equal(to_bits(inplace), want_sum):
            problems.append("out=x (in place) is not the canonical fold")
        work = detcomm.all_reduce(x, "api.ar", async_op=True)
        if not isinstance(work, detcomm.Work) or not work.wait() or not work.is_completed():
            problems.append(f"async_op returned {work!r}")
        elif not np.array_equal(to_bits(work.result()[0]), want_sum):
            problems.append("async_op result is not the canonical fold")
        # op="avg": the fold in fp32, one division, one rounding.
        avg = detcomm.all_reduce(x, site="api.avg", op="avg")
        if not np.array_equal(to_bits(avg), oracle.avg_oracle(bits, dtype)):
            problems.append("avg differs from its oracle")
        if w >= 2 and np.array_equal(oracle.avg_oracle(bits, dtype), want_sum):
            problems.append("negative control: avg oracle equals the sum (the test could not see a wrong op)")
        # reduce_scatter avg with out=
        rs_bits = [ill_bits(3 * w, 12, dtype, seed=37, rank=r) for r in range(w)]
        rs_out = torch.empty(3, 12, dtype=x.dtype)
        detcomm.reduce_scatter(to_torch(rs_bits[rank], dtype), "api.rs", op="avg", out=rs_out)
        if not np.array_equal(to_bits(rs_out), oracle.avg_oracle(rs_bits, dtype)[3 * rank: 3 * rank + 3]):
            problems.append("reduce_scatter avg differs from its oracle")
        gathered = detcomm.all_gather(x, "api.ag", out=torch.empty(5 * w, 12, dtype=x.dtype))
        if not np.array_equal(to_bits(gathered), np.concatenate(bits)):
            problems.append("all_gather out= differs")
        # Bad buffers are refused before any message.
        for bad, err in ((torch.empty(4, 12, dtype=x.dtype), ValueError), (x[:, :6], ValueError), (3, TypeError)):
            try:
                detcomm.all_reduce(x, "api.ar", out=bad)  # type: ignore[arg-type]
                problems.append(f"out={bad!r:.30} accepted")
            except err:
                pass
        big = torch.empty(10, 12, dtype=x.dtype)
        try:
            detcomm.all_reduce(big[:5], "api.ar", out=big[2:7])
            problems.append("partially overlapping out accepted")
        except ValueError:
            pass
        # A second init on the same group raises and says what to do.
        try:
            detcomm.init(numerics="rl-bitwise")
            problems.append("second init accepted")
        except detcomm.DetcommError as e:
            if "get_communicator" not in str(e):
                problems.append(f"second init message: {e}")
    finally:
        detcomm.shutdown()
    return problems


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_out_inplace_avg_async(cluster, dtype: str) -> None:  # noqa: ANN001
    for problems in cluster.run(job_out_inplace_avg_async, dtype):
        assert problems == []


def test_avg_oracle_rounds_once_from_the_fp32_sum() -> None:
    # 1 + 2^-8 + 2^-8 in bf16 inputs: fp32 sum 1 + 2^-7, / 3 then one rounding; a sum rounded to bf16 first
    # and divided afterwards gives other bits on some inputs (the negative control of the definition).
    rng = np.random.default_rng(5)
    diff = 0
    for _ in range(200):
        xs = [rng.standard_normal(64).astype(np.float32).view(np.uint32) >> 16 for _ in range(3)]
        xs = [x.astype(np.uint16) for x in xs]
        good = oracle.avg_oracle(xs, "bfloat16")
        twice = oracle.round_fp32_bits(
            (oracle.widen(oracle.fold_oracle(xs, "bfloat16"), "bfloat16") / np.float32(3)).astype(np.float32).view(np.uint32),
            "bfloat16")
        diff += int((good != twice).sum())
    assert diff > 0


def job_wrong_site_same_shape(rank: int, w: int, guard: bool) -> str:
    """Rank 1 calls site "b" while the others call "a" (same shape, checking off)."""
    import detcomm

    detcomm.shutdown()
    comm = detcomm.init(numerics="rl-bitwise", check=False)
    try:
        for name in ("g.a", "g.b", "s.a", "s.b"):
            coll = "all_reduce" if name.startswith("g") else "reduce_scatter"
            comm.site(name, collective=coll, dtype=torch.float32, shape=(4,), max_rows=2 * w)
        if not guard:  # the negative control: the same routes called without the call guard's header
            for sc in comm._site_calls.values():
                backend = comm._impls[sc.bound.route]
                sc.header = None
                sc.bound = lambda x, a, b=backend, op=sc.site.op, c=sc.site.collective: (
                    b.all_reduce(x, op) if c.value == "all_reduce" else b.reduce_scatter(x, op))
        x = torch.full((w, 4), float(rank + 1))
        outcome = []
        for coll, prefix in (("all_reduce", "g"), ("reduce_scatter", "s")):
            name = f"{prefix}.b" if rank == 1 else f"{prefix}.a"
            try:
                getattr(detcomm, coll)(x, name)
                outcome.append("silent")
            except detcomm.CollectiveMismatch as e:
                ok = f"rank 1: site '{prefix}.b' call #1" in str(e) and f"rank 0: site '{prefix}.a' call #1" in str(e)
                outcome.append("raised" if ok else f"raised without names: {e}")
        return ",".join(outcome)
    finally:
        detcomm.shutdown()


def test_the_call_guard_catches_ranks_on_different_sites(cluster3plus) -> None:  # noqa: ANN001
    assert cluster3plus.run(job_wrong_site_same_shape, True) == ["raised,raised"] * cluster3plus.world_size
    # Without the header the same calls fold each other's data without a word.
    assert cluster3plus.run(job_wrong_site_same_shape, False) == ["silent,silent"] * cluster3plus.world_size
