"""The call path's failure contract at W = 3 on gloo (issue 27's call-path items): threads, mismatched calls on
every route, autograd inputs, init's cross-rank agreement, errors that name site, call, rank and cause, string
dtypes, shutdown, and the process-wide state init changes. Numeric expectations come from numpy (exact integer
sums, tests/oracle.py for the fold), each with a negative control that shows the check can fail.

Cluster jobs share one W = 3 group (tests/clusters.py); the scenarios that kill, freeze or re-create the group
run one process per rank (tests/calls_rank_job.py) with init's own deadline.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, to_bits, to_torch
from detcomm.envelope import MULTICAST_OFF_ENV
from subproc import rank_jobs

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "calls_rank_job.py"
W = 3


@pytest.fixture
def cluster3():  # noqa: ANN201
    from clusters import get_cluster

    return get_cluster(W)


def _fresh(numerics: str = "auto", **kw: object):  # type: ignore[no-untyped-def]
    import detcomm

    detcomm.shutdown()
    return detcomm.init(numerics=numerics, **kw)


def _ranks(scenario: str, out: Path, world: int = W, timeout_s: float = 120.0) -> list[dict | None]:
    """Run the scenario on one process per rank; what each rank wrote (None: it wrote nothing)."""
    return rank_jobs(JOB, scenario, out, world=world, timeout_s=timeout_s)


# ---------------------------------------------------------------------------------------------------------
# Item 1: two threads on one communicator never get a wrong result

def test_a_second_thread_is_refused_not_served_wrong_bits(tmp_path: Path) -> None:
    results = _ranks("threads", tmp_path)
    assert all(r is not None for r in results), results
    for r in results:
        assert r["wrong"] == 0, results  # type: ignore[index]
    errors = [e for r in results for e in r["errors"]]  # type: ignore[index]
    assert "ConcurrentCall" in errors, results
    assert set(errors) <= {"ConcurrentCall", "CollectiveMismatch", "PeerTimeout", "CollectiveFailed"}, results


# ---------------------------------------------------------------------------------------------------------
# Item 2 (and 14: names and user call numbers): mismatched calls on every route raise on every rank

def job_mismatch_every_route(rank: int, w: int, guarded: bool) -> list[str]:
    """Rank 1 makes a different call of the same size; checking off. guarded=False removes the call guard's
    header (the negative control: the same calls then return mixed data)."""
    import detcomm

    outcome: list[str] = []
    cases = ("auto all_reduce", "auto max", "auto all_gather", "rl all_gather", "rl max", "token rows_per_rank")
    for case in cases:
        comm = _fresh("rl-bitwise" if case.startswith("rl") else "auto", check=False)
        op = "max" if "max" in case else "sum"
        coll = "all_gather" if "all_gather" in case else "all_reduce"
        x = torch.full((2, 8), float(10 * rank + 1))
        if case.startswith("token"):
            counts = [2, 1, 2] if rank != 0 else [2, 2, 2]  # rank 0 holds a stale count for rank 1
            x = torch.full((counts[rank], 8), float(rank + 1))
            comm.site("m.tok", collective="token_all_gather", dtype=torch.float32, shape=(8,), max_rows=4)
            call = lambda: detcomm.token_all_gather(x, "m.tok", rows_per_rank=counts)  # noqa: E731
        else:
            for name in ("m.a", "m.b"):
                comm.site(name, collective=coll, dtype=torch.float32, shape=(8,), max_rows=4, op=op)
            name = "m.b" if rank == 1 else "m.a"
            fn = getattr(detcomm, coll)
            call = (lambda: fn(x, name, op=op)) if coll == "all_reduce" else (lambda: fn(x, name))  # noqa: E731
        if not guarded:
            for sc in comm._site_calls.values():
                sc.header = None
        try:
            call()
            outcome.append(f"{case}: silent")
        except detcomm.CollectiveMismatch as e:
            msg = str(e)
            if case.startswith("token"):
                ok = "rows_per_rank=[2, 2, 2]" in msg and "rows_per_rank=[2, 1, 2]" in msg
            else:
                ok = "rank 1: site 'm.b' call #1" in msg and "rank 0: site 'm.a' call #1" in msg
            outcome.append(f"{case}: raised" if ok else f"{case}: raised without names: {msg}")
    detcomm.shutdown()
    return outcome


def test_mismatched_calls_raise_on_every_rank_on_every_route(cluster3) -> None:  # noqa: ANN001
    for outcome in cluster3.run(job_mismatch_every_route, True):
        assert all(o.endswith(": raised") for o in outcome), outcome


def test_negative_control_without_the_header_the_mismatch_is_silent(cluster3) -> None:  # noqa: ANN001
    for outcome in cluster3.run(job_mismatch_every_route, False):
        assert all(o.endswith(": silent") for o in outcome), outcome


def job_size_mismatch(rank: int, w: int) -> str:
    """Rank 1 passes a different row count to an undeclared all_gather site, checking off: messages of
    different sizes, which gloo aborts on unless the ranks compare first."""
    import detcomm

    _fresh("auto", check=False)
    try:
        detcomm.all_gather(torch.ones(3 if rank == 1 else 2, 8), "sz.ag")
        return "silent"
    except detcomm.CollectiveMismatch as e:
        return "raised" if "rows 3" in str(e) and "rows 2" in str(e) else f"raised without rows: {e}"
    finally:
        detcomm.shutdown()


def test_a_message_size_mismatch_is_a_python_error_on_every_rank(cluster3) -> None:  # noqa: ANN001
    assert cluster3.run(job_size_mismatch) == ["raised"] * W


# ---------------------------------------------------------------------------------------------------------
# Item 4: requires_grad inputs are refused with the fix, served under no_grad

def job_requires_grad(rank: int, w: int) -> list[str]:
    import detcomm

    _fresh("rl-bitwise")
    problems = []
    bits = [ill_bits(3, 8, "float32", seed=5, rank=r) for r in range(w)]
    want = oracle.fold_oracle(bits, "float32")
    x = to_torch(bits[rank], "float32").requires_grad_(True)
    for label, call in (("all_reduce", lambda: detcomm.all_reduce(x, "g.ar")),
                        ("all_gather", lambda: detcomm.all_gather(x, "g.ag"))):
        try:
            call()
            problems.append(f"{label}: a requires_grad input was accepted")
        except ValueError as e:
            if "torch.no_grad()" not in str(e) or "detach()" not in str(e):
                problems.append(f"{label}: {e}")
    with torch.no_grad():
        got = detcomm.all_reduce(x, "g.ar")
    if not np.array_equal(to_bits(got), want):
        problems.append("under no_grad: not the canonical fold")
    if np.array_equal(to_bits(x.detach()), want):
        problems.append("negative control: the input already holds the result")
    detcomm.shutdown()
    return problems


def test_requires_grad_is_refused_with_the_fix(cluster3) -> None:  # noqa: ANN001
    assert cluster3.run(job_requires_grad) == [[]] * W


# ---------------------------------------------------------------------------------------------------------
# Item 13: init compares the envelope and the checking mode before any collective

def job_init_disagrees(rank: int, w: int, what: str) -> str:
    import detcomm

    detcomm.shutdown()
    kw: dict[str, object] = {"numerics": "auto", "check": False}
    if rank == 1:
        kw["numerics" if what == "numerics" else "check"] = "rl-bitwise" if what == "numerics" else True
    try:
        detcomm.init(**kw)  # type: ignore[arg-type]
        detcomm.shutdown()
        return "accepted"
    except detcomm.CollectiveMismatch as e:
        field = "numerics: rank 0=auto, rank 1=rl-bitwise" if what == "numerics" else "check: rank 0=False, rank 1=True"
        return "raised" if field in str(e) else f"raised without the field: {e}"


@pytest.mark.parametrize("what", ["numerics", "check"])
def test_init_refuses_ranks_with_different_envelopes_or_checking(cluster3, what: str) -> None:  # noqa: ANN001
    assert cluster3.run(job_init_disagrees, what) == ["raised"] * W


# ---------------------------------------------------------------------------------------------------------
# Items 12, 14 (messages), 16 (integer wrap), issue 25 item 8 (process-wide state)

def job_string_dtype(rank: int, w: int) -> list[str]:
    import detcomm

    _fresh("rl-bitwise")
    problems = []
    s = detcomm.site("sd.ar", collective="all_reduce", dtype="bfloat16", shape=(8,), max_rows=4)
    if s.dtype is not torch.bfloat16:
        problems.append(f"dtype {s.dtype!r}")
    bits = [ill_bits(3, 8, "bfloat16", seed=9, rank=r) for r in range(w)]
    got = detcomm.all_reduce(to_torch(bits[rank], "bfloat16"), "sd.ar")
    if not np.array_equal(to_bits(got), oracle.fold_oracle(bits, "bfloat16")):
        problems.append("not the canonical fold")
    # A later site of another dtype still takes the fold route (nothing was refused for the group).
    detcomm.site("sd.f32", collective="all_reduce", dtype=torch.float32, shape=(8,), max_rows=4)
    routes = {e.site.name: e.decision.route.value for e in detcomm.routes().entries}
    if routes != {"sd.ar": "gather_fold", "sd.f32": "gather_fold"}:
        problems.append(f"routes {routes}")
    for bad, err in ((object(), TypeError), ("bfloat17", ValueError)):
        try:
            detcomm.site("sd.bad", collective="all_reduce", dtype=bad, shape=(8,), max_rows=4)  # type: ignore[arg-type]
            problems.append(f"{bad!r} accepted")
        except err:
            pass
    detcomm.shutdown()
    return problems


def test_string_dtypes_declare_sites(cluster3) -> None:  # noqa: ANN001
    assert cluster3.run(job_string_dtype) == [[]] * W


def job_messages(rank: int, w: int) -> list[str]:
    import detcomm

    problems = []
    _fresh("rl-bitwise")
    # A declaration that differs across ranks: named as such, not a route refusal.
    try:
        detcomm.site("dm.x", collective="all_reduce", dtype=torch.bfloat16 if rank == 1 else torch.float32,
                     shape=(8,), max_rows=4)
        problems.append("a declaration mismatch was accepted")
    except detcomm.CollectiveMismatch as e:
        if "rank 1: declaring site 'dm.x' as all_reduce sum bfloat16" not in str(e):
            problems.append(f"declaration mismatch: {e}")
    except detcomm.RouteRefused as e:
        problems.append(f"declaration mismatch reported as RouteRefused: {e}")
    # A first call with another trailing shape on one rank: every rank's site named.
    try:
        detcomm.all_reduce(torch.ones(2, 9 if rank == 1 else 8), "dm.shape")
        problems.append("a trailing-shape mismatch was accepted")
    except detcomm.CollectiveMismatch as e:
        if "rank 1: declaring site 'dm.shape' as all_reduce sum float32[rows<=8192, 9]" not in str(e) or "<id" in str(e):
            problems.append(f"trailing shape: {e}")
    # An implicit declaration says so, and where, when a later call contradicts it.
    detcomm.all_reduce(torch.ones(2, 8), "dm.implicit")
    try:
        detcomm.all_reduce(torch.ones(2, 6), "dm.implicit")
        problems.append("a contradicting call was accepted")
    except ValueError as e:
        if "declared implicitly by its first call (" not in str(e) or "test_robust_calls.py:" not in str(e):
            problems.append(f"implicit: {e}")
    detcomm.shutdown()
    try:
        detcomm.all_reduce(torch.ones(2, 8), "dm.implicit")
        problems.append("a call after shutdown was accepted")
    except detcomm.DetcommError as e:
        if "shut down" not in str(e):
            problems.append(f"after shutdown: {e}")
    return problems


def test_messages_name_the_cause(cluster3) -> None:  # noqa: ANN001
    assert cluster3.run(job_messages) == [[]] * W


def job_int_wrap(rank: int, w: int) -> list[str]:
    """docs/spec.md §2: integer sums wrap (two's complement), as NCCL's do."""
    import detcomm

    _fresh("rl-bitwise")
    problems = []
    ins = [np.full((2, 4), 100 + r, dtype=np.int8) for r in range(w)]
    got = detcomm.all_reduce(torch.from_numpy(ins[rank].copy()), "iw.i8").numpy()
    wrapped = np.sum(np.stack(ins), axis=0, dtype=np.int8)  # numpy's int8 sum wraps
    if not np.array_equal(got, wrapped):
        problems.append(f"{got.tolist()} != wrapped {wrapped.tolist()}")
    if np.array_equal(got, np.sum(np.stack(ins), axis=0, dtype=np.int64)):
        problems.append("negative control: the exact (unwrapped) sum matches")
    detcomm.shutdown()
    return problems


def test_integer_sums_wrap_as_documented(cluster3) -> None:  # noqa: ANN001
    assert cluster3.run(job_int_wrap) == [[]] * W


def job_process_state(rank: int, w: int) -> list[str]:
    import detcomm

    detcomm.shutdown()
    for k in MULTICAST_OFF_ENV:
        os.environ.pop(k, None)
    torch.backends.cuda.matmul.allow_tf32 = True
    before = dict(os.environ)
    problems = []
    detcomm.init(numerics="rl-bitwise")
    changed = {k for k in MULTICAST_OFF_ENV if os.environ.get(k) == MULTICAST_OFF_ENV[k]}
    if not changed or torch.backends.cuda.matmul.allow_tf32:
        problems.append("negative control: init changed neither the environment nor TF32")
    os.environ["CALLER_SET_AFTER_INIT"] = "1"
    detcomm.shutdown()
    after = dict(os.environ)
    if after.pop("CALLER_SET_AFTER_INIT", None) != "1":
        problems.append("shutdown dropped a variable the caller set after init")
    if after != before:
        problems.append(f"environment not restored: {set(after.items()) ^ set(before.items())}")
    if not torch.backends.cuda.matmul.allow_tf32:
        problems.append("TF32 not restored")
    os.environ.pop("CALLER_SET_AFTER_INIT", None)
    return problems


def test_shutdown_restores_what_init_changed(cluster3) -> None:  # noqa: ANN001
    assert cluster3.run(job_process_state) == [[]] * W


# ---------------------------------------------------------------------------------------------------------
# Items 7, 10, 11: a group init creates (one process per rank)

def test_an_early_shutdown_is_named_on_every_rank(tmp_path: Path) -> None:
    results = _ranks("early-shutdown", tmp_path)
    for r, res in enumerate(results):
        assert res is not None and res["raised"] == "CollectiveMismatch", results
        assert "shutdown()" in res["message"] and f"rank {r}:" in res["message"], results


@pytest.mark.parametrize("scenario", ["die", "die-check"])
def test_peer_death_names_site_call_rank_and_cause(scenario: str, tmp_path: Path) -> None:
    results = _ranks(scenario, tmp_path)
    for r in (0, 2):
        res = results[r]
        # The peer's sockets closed: the library fails at once, and that is the cause named (with checking on
        # too: not a timeout that never happened).
        assert res is not None and res["raised"] == "CollectiveFailed", results
        msg = res["message"]
        assert "site 'x', call #" in msg and f"on rank {r} of 3" in msg and "failed in torch.distributed" in msg, results


def test_a_rank_that_exits_before_init_is_named(tmp_path: Path) -> None:
    results = _ranks("exit-before-init", tmp_path)
    for r in (0, 2):
        res = results[r]
        assert res is not None and res["raised"] == "PeerTimeout", results
        # Which wait notices first is timing: the env:// rendezvous (a rank exited before init) or the group's
        # join, which names the ranks whose arrival key is missing (issue 40.18); rank 1 is among them either way.
        m = res["message"]
        assert "joined the rendezvous" in m and ("exited" in m or "never reached detcomm.init" in m), results
        assert "exited" in m or "1" in m.split("never reached")[0], results


def test_init_registers_the_group_it_creates(tmp_path: Path) -> None:
    results = _ranks("init-twice", tmp_path)
    assert results == [{"initialized": True, "second": "DetcommError", "after_shutdown": False,
                        "seconds": r["seconds"]} for r in results], results  # type: ignore[index]
