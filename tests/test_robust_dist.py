"""Robustness on real gloo groups: cross-rank mismatch detection, capacity edges, adversarial values
through every CPU route, site/shape churn, a platform that lies to the self-checks, restart after a killed run,
and a soak. Expected bits always come from the numpy oracle (tests/oracle.py) on locally regenerated inputs.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch

import oracle
from datagen import DTYPES, ill_bits, random_bits, to_bits, to_torch


def _fresh(numerics: str = "auto", **kw: object):  # type: ignore[no-untyped-def]
    import detcomm

    detcomm.shutdown()
    return detcomm.init(numerics=numerics, **kw)


# ---------------------------------------------------------------------------------------------------------
# 1. Cross-rank mismatch detection

def _faulty_call(comm, rank: int, case: str) -> None:  # type: ignore[no-untyped-def]
    """Every rank makes one call; rank 1 makes it differently (undeclared sites: nothing is checked locally)."""
    bad = rank == 1
    rows, width, dtype, op, name = 4, 8, torch.float32, "sum", f"mm.{case}"
    if case == "op" and bad:
        op = "max"
    if case == "dtype" and bad:
        dtype = torch.bfloat16
    if case == "shape" and bad:
        width = 9
    if case == "rows" and bad:
        rows = 5
    if case in ("site", "skip") and bad:
        name = f"mm.{case}.other"
    x = torch.ones(rows, width, dtype=dtype)
    if case == "collective" and bad:
        comm.all_gather(x, site=name)
    elif case == "rows_per_rank":
        counts = [1] * comm.world_size if not bad else [1] * (comm.world_size - 1) + [2]
        comm.token_all_gather(torch.ones(counts[rank], width), site=name, rows_per_rank=counts)
    elif case == "skip":
        # Rank 1 skips the first call and makes the second: the two calls pair up, and the sites differ.
        if not bad:
            comm.all_reduce(x, site=f"mm.{case}.first")
        comm.all_reduce(x, site="mm.skip.second")
    else:
        comm.all_reduce(x, site=name, op=op)


def job_mismatch(rank: int, w: int, case: str) -> tuple[str, str, bool]:
    """(exception type, message, whether a correct call right after works). checking on through the env."""
    import detcomm

    os.environ["DETCOMM_CHECK"] = "1"
    try:
        comm = _fresh("auto")
    finally:
        del os.environ["DETCOMM_CHECK"]
    for _ in range(2):
        comm.all_reduce(torch.ones(2, 3), site="mm.warm")
    if case == "seq" and rank == 1:
        # A restarted worker: its communicator starts counting again (init itself is collective: the other ranks
        # would have to join it, so the restart is emulated by the counter).
        comm._verifier.seq = 0
    try:
        if case == "seq":
            comm.all_reduce(torch.ones(2, 3), site="mm.warm")
        else:
            _faulty_call(comm, rank, case)
        kind, msg = "none", ""
    except Exception as e:  # noqa: BLE001 - reported to the test
        kind, msg = type(e).__name__, str(e)
    # After a one-off mismatch the ranks are in step again (a restarted rank's sequence stays off: no retry).
    ok = case == "seq" or torch.equal(comm.all_reduce(torch.ones(3, 2), site="mm.after"), torch.full((3, 2), float(w)))
    detcomm.shutdown()
    return kind, msg, ok


# Per case: the text every rank's message must hold for rank 1's value (W = 3: ranks 0 and 2 agree).
_MISMATCH = {
    "op": "op: rank 0='sum', rank 1='max', rank 2='sum'",
    "dtype": "dtype: rank 0='float32', rank 1='bfloat16', rank 2='float32'",
    "shape": "shape: rank 0=(8,), rank 1=(9,), rank 2=(8,)",
    "rows": "rows: rank 0=4, rank 1=5, rank 2=4",
    "site": "site: rank 0='mm.site', rank 1='mm.site.other', rank 2='mm.site'",
    "collective": "collective: rank 0='all_reduce', rank 1='all_gather', rank 2='all_reduce'",
    "rows_per_rank": "rows_per_rank: rank 0='rows_per_rank=[1, 1, 1]', rank 1='rows_per_rank=[1, 1, 2]'",
    "skip": "site: rank 0='mm.skip.first', rank 1='mm.skip.second', rank 2='mm.skip.first'",
    "seq": "seq: rank 0=2, rank 1=0, rank 2=2",
}


@pytest.mark.parametrize("cluster", [3], indirect=True, ids=["W3"])
@pytest.mark.parametrize("case", sorted(_MISMATCH))
def test_mismatch_raises_on_every_rank_naming_site_seq_and_values(cluster, case: str) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    res = cluster.run(job_mismatch, case, timeout_s=60)
    assert time.monotonic() - t0 < 20  # no rank waited for a timeout
    for rank, (kind, msg, ok_after) in enumerate(res):
        assert kind == "CollectiveMismatch", (rank, kind, msg)
        assert _MISMATCH[case] in msg, msg
        assert "call #" in msg and ("'mm." in msg)
        assert ok_after, "the group was left unusable after the mismatch"


def job_check_off_by_default_and_options(rank: int, w: int) -> tuple[bool, bool, str]:
    import detcomm

    os.environ.pop("DETCOMM_CHECK", None)
    off = _fresh("auto")._verifier is None
    on = _fresh("auto", check=True)._verifier is not None
    detcomm.shutdown()
    try:
        detcomm.init(numerics="auto", timeout_s=5)  # the cluster's group exists already
        msg = "accepted"
    except ValueError as e:
        msg = str(e)
    detcomm.shutdown()
    return off, on, msg


@pytest.mark.parametrize("cluster", [2], indirect=True, ids=["W2"])
def test_check_is_off_by_default_and_timeout_needs_a_new_group(cluster) -> None:  # noqa: ANN001
    for off, on, msg in cluster.run(job_check_off_by_default_and_options):
        assert off and on
        assert "keeps its own timeout" in msg


def test_detcomm_check_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from detcomm.verify import check_from_env

    for raw, want in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("DETCOMM_CHECK", raw)
        assert check_from_env(None) is want
    assert check_from_env(False) is False
    monkeypatch.setenv("DETCOMM_CHECK", "maybe")
    with pytest.raises(ValueError, match="DETCOMM_CHECK"):
        check_from_env(None)


# ---------------------------------------------------------------------------------------------------------
# 4. Capacity edges: exactly up to max_rows, rejected beyond it before any message, never rerouted

_NATIVE_METHODS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "argmax", "exchange_splits",
                   "token_all_gather")


def _count_messages(comm) -> list[int]:  # type: ignore[no-untyped-def]
    """Count every call into the native backend (every route and the check go through it)."""
    n = [0]
    for m in _NATIVE_METHODS:
        real = getattr(comm._native, m)

        def counted(*a, _real=real, **k):  # type: ignore[no-untyped-def]
            n[0] += 1
            return _real(*a, **k)

        setattr(comm._native, m, counted)
    return n


def job_capacity(rank: int, w: int, numerics: str, check: bool) -> list[str]:
    """gather_fold (all-reduce) and a2a_fold (reduce-scatter) sites at and around max_rows."""
    import detcomm

    comm = _fresh(numerics, check=check)
    problems: list[str] = []
    m = 6 * w
    sites = {}
    for coll in ("all_reduce", "reduce_scatter"):
        for width in (1, 3, 77, 257):  # misaligned hidden sizes (not multiples of any vector width)
            name = f"cap.{coll}.{width}"
            detcomm.site(name, collective=coll, dtype=torch.bfloat16, shape=(width,), max_rows=m)
            sites[name] = (coll, width)
    table = str(comm.routes())
    sent = _count_messages(comm)
    for name, (coll, width) in sites.items():
        step = w if coll == "reduce_scatter" else 1  # a reduce-scatter's rows are a multiple of W
        for rows in (m - step, m):
            allb = [ill_bits(rows, width, "bfloat16", seed=rows + width, rank=r) for r in range(w)]
            out = to_bits(getattr(comm, coll)(to_torch(allb[rank], "bfloat16"), site=name))
            want = oracle.fold_oracle(allb, "bfloat16")
            if coll == "reduce_scatter":
                want = want[rank * rows // w : (rank + 1) * rows // w]
            if not np.array_equal(out, want):
                problems.append(f"{name} rows={rows}: != oracle")
        if rank == 0:  # only rank 0 makes the oversized calls: a message from it would pair with nothing
            before = sent[0]
            for rows in (m + step, 10 * m):
                try:
                    getattr(comm, coll)(torch.zeros(rows, width, dtype=torch.bfloat16), site=name)
                    problems.append(f"{name} rows={rows}: accepted beyond max_rows={m}")
                except ValueError as e:
                    if f"max_rows={m}" not in str(e) or name not in str(e):
                        problems.append(f"{name}: message does not name the site and max_rows: {e}")
            for bad, needle in ((torch.zeros(w, width, dtype=torch.float32), "dtype float32"),
                                (torch.zeros(w, width, dtype=torch.bfloat16, device="meta"), "move it with"),
                                (torch.zeros(w, 2 * width, dtype=torch.bfloat16)[:, ::2], "contiguous")):
                try:
                    getattr(comm, coll)(bad, site=name)
                    problems.append(f"{name}: accepted {needle}")
                except ValueError as e:
                    if needle not in str(e):
                        problems.append(f"{name}: {needle!r} not in {e}")
            if sent[0] != before:
                problems.append(f"{name}: {sent[0] - before} native calls made by rejected calls")
    if str(comm.routes()) != table:
        problems.append("the route table changed")
    detcomm.shutdown()
    return problems


@pytest.mark.parametrize("cluster", [3], indirect=True, ids=["W3"])
@pytest.mark.parametrize("check", [False, True], ids=["check-off", "check-on"])
def test_capacity_edges(cluster, check: bool) -> None:  # noqa: ANN001
    for problems in cluster.run(job_capacity, "rl-bitwise", check):
        assert problems == []


# ---------------------------------------------------------------------------------------------------------
# 5. Adversarial values through every CPU route

_NEAR_MAX = {"float32": 3.0e38, "bfloat16": 3.0e38, "float16": 6.0e4}


def adversarial_bits(rows: int, width: int, dtype: str, *, rank: int) -> np.ndarray:
    """Rows of: all -0.0, all zeros, ± subnormals, NaN with payloads and both signs, ± Inf, values near the
    dtype's max (their fp32 sums overflow to Inf in the fold, or to Inf only on rounding to bf16/fp16), and
    a random mix of all of them. Every rank regenerates every other rank's rows from (dtype, rank)."""
    rng = np.random.default_rng([606, rank, len(dtype)])
    sign = 1 << (31 if dtype == "float32" else 15)
    exp_mask = {"float32": 0x7F800000, "bfloat16": 0x7F80, "float16": 0x7C00}[dtype]
    with np.errstate(all="ignore"):
        near = (np.where(rng.random(width) < 0.5, -1.0, 1.0) * _NEAR_MAX[dtype] * (0.9 + 0.1 * rng.random(width)))
        near_bits = oracle.round_fp32_bits(near.astype(np.float32).view(np.uint32), dtype)
        same_sign = oracle.round_fp32_bits(np.full(width, _NEAR_MAX[dtype], np.float32).view(np.uint32), dtype)
    sub = rng.integers(1, 0x7F if dtype != "float32" else 0x7FFFFF, width)
    kinds = [
        np.full(width, sign),                                   # -0.0 on every rank: sum is +0.0
        np.zeros(width, dtype=np.int64),                        # all zeros
        np.where(rng.random(width) < 0.5, sign, 0) | sub,       # subnormals of both signs
        exp_mask | rng.integers(1, 0x3F, width) | np.where(rng.random(width) < 0.5, sign, 0),  # NaN payloads
        np.where(rng.random(width) < 0.5, sign, 0) | exp_mask,  # ± Inf (Inf - Inf on some columns: NaN)
        near_bits,                                              # near max, mixed signs
        same_sign,                                              # near max, one sign: overflows in the fold
    ]
    base = np.stack(kinds).astype(np.int64)
    pick = rng.integers(0, len(kinds), (rows - len(kinds), width))
    mixed = np.take_along_axis(base, pick, axis=0)
    return np.concatenate([base, mixed]).astype(oracle.BITS_DTYPE[dtype])


def job_adversarial(rank: int, w: int) -> list[str]:
    import detcomm

    comm = _fresh("rl-bitwise")
    problems: list[str] = []
    rows, width = 7 * w, 13
    for dtype in sorted(DTYPES):
        allb = [adversarial_bits(rows, width, dtype, rank=r) for r in range(w)]
        x = to_torch(allb[rank], dtype)
        fold = oracle.fold_oracle(allb, dtype)
        block = slice(rank * rows // w, (rank + 1) * rows // w)
        cases = {
            "all_reduce gather_fold": (comm.all_reduce, "all_reduce", None, "sum", fold),
            "reduce_scatter a2a_fold": (comm.reduce_scatter, "reduce_scatter", None, "sum", fold[block]),
            "reduce_scatter gather_fold": (comm.reduce_scatter, "reduce_scatter", "gather_fold", "sum", fold[block]),
            "max native": (comm.all_reduce, "all_reduce", None, "max", oracle.ordered_key_extreme_oracle(allb, dtype, "max")),
            "min native": (comm.all_reduce, "all_reduce", None, "min", oracle.ordered_key_extreme_oracle(allb, dtype, "min")),
        }
        for label, (fn, coll, route, op, want) in cases.items():
            name = f"adv.{label.replace(' ', '.')}.{dtype}"
            detcomm.site(name, collective=coll, dtype=DTYPES[dtype], shape=(width,), max_rows=rows, op=op, route=route)
            kw = {"op": op} if coll == "all_reduce" else {}
            got = to_bits(fn(x, site=name, **kw))
            want_route = label.split()[1]
            if comm.routes().as_dicts()[-1]["route"] != want_route:
                problems.append(f"{name}: route {comm.routes().as_dicts()[-1]['route']} != {want_route}")
            if not np.array_equal(got, want):
                problems.append(f"{name}: {int((got != want).sum())} elements != oracle")
        if not (np.isinf(oracle.widen(fold[6], dtype)).all()):
            problems.append(f"{dtype}: the one-sign near-max row did not overflow: the payload tests nothing")
    detcomm.shutdown()
    return problems


def test_adversarial_values_every_cpu_route(cluster3plus) -> None:  # noqa: ANN001
    for problems in cluster3plus.run(job_adversarial):
        assert problems == []


# ---------------------------------------------------------------------------------------------------------
# 6. Churn: site, shape, dtype and collective change on every call (with the cross-rank check on)

def job_churn(rank: int, w: int, calls: int) -> list[str]:
    import detcomm

    comm = _fresh("rl-bitwise", check=True)
    problems: list[str] = []
    widths = (1, 5, 64, 131)
    for i in range(calls):
        dtype = sorted(DTYPES)[i % 3]
        width = widths[(i // 3) % len(widths)]
        coll = ("all_reduce", "reduce_scatter", "all_gather")[(i // 12) % 3]
        rows = w * (1 + (i * 7) % 5)
        name = f"churn.{coll}.{dtype}.{width}"  # 36 sites, a different one on every call
        allb = [random_bits(rows, width, dtype, seed=i, rank=r) for r in range(w)]
        got = to_bits(getattr(comm, coll)(to_torch(allb[rank], dtype), site=name))
        if coll == "all_gather":
            want = np.concatenate(allb)
        else:
            want = oracle.fold_oracle(allb, dtype)
            if coll == "reduce_scatter":
                want = want[rank * rows // w : (rank + 1) * rows // w]
        if not np.array_equal(got, want):
            problems.append(f"call {i} {name} rows={rows}: != expected")
    if comm._verifier.seq != calls:
        problems.append(f"{comm._verifier.seq} calls checked, {calls} made")
    detcomm.shutdown()
    return problems


@pytest.mark.parametrize("cluster", [4], indirect=True, ids=["W4"])
def test_churn_sites_and_shapes_every_call(cluster) -> None:  # noqa: ANN001
    for problems in cluster.run(job_churn, 108):
        assert problems == []


# ---------------------------------------------------------------------------------------------------------
# 9. A lying platform: the gather under gather_fold (or the all-to-all under a2a_fold) reports success and
#    returns the ranks rotated. The self-checks must catch it, on every rank with the same verdict.

def _install_lie(where: str):  # type: ignore[no-untyped-def]
    """Patch the class; returns the function that undoes it."""
    from detcomm.route_impls.gather_fold import GatherFoldRoute
    from detcomm.route_impls.native import NativeRoute

    if where == "gather":
        real = GatherFoldRoute._gathered

        def rotated(self, x, guard):  # type: ignore[no-untyped-def]
            return torch.roll(real(self, x, guard), shifts=1, dims=0)

        GatherFoldRoute._gathered = rotated  # type: ignore[method-assign]
        return lambda: setattr(GatherFoldRoute, "_gathered", real)
    real_a2a = NativeRoute.all_to_all

    def rotated_a2a(self, x, ins, outs):  # type: ignore[no-untyped-def]
        out = real_a2a(self, x, ins, outs)
        # One block per source rank (the fold routes' messages carry their call-guard header; it rolls along).
        return torch.roll(out.reshape(self.world_size, -1), 1, 0).reshape(out.shape)

    NativeRoute.all_to_all = rotated_a2a  # type: ignore[method-assign]
    return lambda: setattr(NativeRoute, "all_to_all", real_a2a)


def job_lying(rank: int, w: int, where: str, liars: str, selfcheck: bool) -> tuple[str, str]:
    """(verdict, detail): 'refused' + the reason, or 'served' + whether the served bits equal the oracle."""
    import detcomm

    detcomm.shutdown()
    undo = _install_lie(where) if liars == "all" or rank == 1 else (lambda: None)
    try:
        try:
            detcomm.init(numerics="rl-bitwise", selfcheck=selfcheck)
        except detcomm.RouteRefused as e:
            return "refused", str(e)
        coll = "all_reduce" if where == "gather" else "reduce_scatter"
        allb = [ill_bits(3 * w, 40, "float32", seed=3, rank=r) for r in range(w)]
        got = to_bits(getattr(detcomm, coll)(to_torch(allb[rank], "float32"), site="lie"))
        want = oracle.fold_oracle(allb, "float32")
        if coll == "reduce_scatter":
            want = want[rank * 3 : (rank + 1) * 3]
        return "served", "oracle" if np.array_equal(got, want) else "wrong bits"
    finally:
        detcomm.shutdown()
        undo()


@pytest.mark.parametrize("cluster", [3], indirect=True, ids=["W3"])
@pytest.mark.parametrize("where, liars", [("gather", "all"), ("gather", "rank1"), ("a2a", "all")])
def test_lying_platform_is_refused_on_every_rank(cluster, where: str, liars: str) -> None:  # noqa: ANN001
    res = cluster.run(job_lying, where, liars, True)
    assert {v for v, _ in res} == {"refused"}, res
    assert len({d for _, d in res}) == 1, "ranks reached different verdicts"
    route = "gather_fold" if where == "gather" else "a2a_fold"
    assert f"{route}: " in res[0][1] and ("(c) differs" in res[0][1] or "(d) ranks hold" in res[0][1]), res[0][1]
    # Negative control: without the self-checks the same platform serves wrong bits.
    assert any(d == "wrong bits" for _, d in cluster.run(job_lying, where, liars, False))


# ---------------------------------------------------------------------------------------------------------
# 10. Soak: a random mix of sites, sizes and collectives on W = 4 with injected host delays

SOAK_S = float(os.environ.get("DETCOMM_SOAK_S", "40"))


def _resources() -> tuple[int, int, int]:
    """(open file descriptors, threads, resident bytes) of this process."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), rss


def job_soak(rank: int, w: int, seconds: float) -> dict[str, object]:
    import torch.distributed as dist

    import detcomm

    comm = _fresh("rl-bitwise", check=True)
    shared = random.Random(1234)  # the same call sequence on every rank
    own = random.Random(rank)  # host delays differ per rank
    calls = mismatches = 0
    slowest = 0.0
    baseline = None
    t_end = time.monotonic() + seconds
    batch = 0
    while True:
        for _ in range(25):
            coll = shared.choice(("all_reduce", "all_reduce", "reduce_scatter", "max", "all_gather", "token_all_gather"))
            dtype = shared.choice(sorted(DTYPES))
            width = shared.choice((1, 7, 64, 300))
            rows = w * shared.randint(1, 12)
            seed = shared.randrange(1 << 30)
            if own.random() < 0.2:
                time.sleep(own.random() * 0.004)
            allb = [ill_bits(rows, width, dtype, seed=seed, rank=r) for r in range(w)]
            x = to_torch(allb[rank], dtype)
            name = f"soak.{coll}.{dtype}.{width}"
            t0 = time.monotonic()
            if coll == "all_reduce":
                got, want = comm.all_reduce(x, site=name), oracle.fold_oracle(allb, dtype)
            elif coll == "max":
                got, want = comm.all_reduce(x, site=name, op="max"), oracle.ordered_key_extreme_oracle(allb, dtype, "max")
            elif coll == "reduce_scatter":
                n = rows // w
                got, want = comm.reduce_scatter(x, site=name), oracle.fold_oracle(allb, dtype)[rank * n : (rank + 1) * n]
            elif coll == "all_gather":
                got, want = comm.all_gather(x, site=name), np.concatenate(allb)
            else:
                counts = [(seed >> r) % 5 for r in range(w)]
                got = comm.token_all_gather(x[: counts[rank]].contiguous(), site=name, rows_per_rank=counts)
                want = np.concatenate([b[:c] for b, c in zip(allb, counts)])
            slowest = max(slowest, time.monotonic() - t0)
            calls += 1
            mismatches += int(not np.array_equal(to_bits(got), want))
        batch += 1
        if batch == 2:  # after the warm-up batches: sites declared, caches filled
            baseline = _resources()
        # Rank 0's clock decides for everyone, so every rank makes the same number of calls.
        stop = torch.tensor([int(rank == 0 and time.monotonic() > t_end)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() and batch > 2:
            break
    end = _resources()
    detcomm.shutdown()
    return {"calls": calls, "mismatches": mismatches, "slowest_s": slowest, "baseline": baseline, "end": end}


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [4], indirect=True, ids=["W4"])
def test_soak(cluster) -> None:  # noqa: ANN001
    res = cluster.run(job_soak, SOAK_S, timeout_s=SOAK_S + 120)
    print(f"soak W=4 {SOAK_S:g} s: {res[0]['calls']} calls per rank, slowest call {max(r['slowest_s'] for r in res):.3f} s")
    for r in res:
        assert r["mismatches"] == 0
        (fd0, th0, rss0), (fd1, th1, rss1) = r["baseline"], r["end"]
        assert fd1 <= fd0 + 2 and th1 <= th0 + 1, r
        assert rss1 - rss0 < 64 << 20, r
        assert r["slowest_s"] < 10, "a call came near the group's deadline"  # the clusters' timeout is 30 s


# ---------------------------------------------------------------------------------------------------------
# 7. Restart over stale state: after a killed run, a new group starts cleanly (CPU: LocalCluster's rendezvous
#    is a FileStore in a fresh temporary directory per cluster, removed at tear-down)

def job_die_mid_collective(rank: int, w: int) -> None:
    import signal

    import detcomm

    _fresh("rl-bitwise")
    x = torch.ones(8, 64)
    for i in range(1000):
        if rank == 1 and i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        detcomm.all_reduce(x, site="restart")


def job_restart_ok(rank: int, w: int) -> bool:
    import detcomm

    _fresh("rl-bitwise", check=True)
    allb = [ill_bits(5, 33, "bfloat16", seed=8, rank=r) for r in range(w)]
    ok = np.array_equal(to_bits(detcomm.all_reduce(to_torch(allb[rank], "bfloat16"), site="restart")),
                        oracle.fold_oracle(allb, "bfloat16"))
    detcomm.shutdown()
    return ok


def test_restart_after_killed_run() -> None:
    from detcomm._spawn import LocalCluster, RankFailed

    killed = LocalCluster(2, pg_timeout_s=5)
    stale = killed._dir
    with pytest.raises(RankFailed) as err:
        killed.run(job_die_mid_collective, timeout_s=8)
    assert err.value.torn_down and "process died" in err.value.failures[1]
    assert "Connection" in err.value.failures[0] or "Timed out" in err.value.failures[0]  # the survivor raised
    assert not os.path.exists(stale), "the killed run's rendezvous files were left behind"
    with LocalCluster(2, pg_timeout_s=5) as fresh:
        assert fresh._dir != stale
        assert fresh.run(job_restart_ok) == [True, True]
