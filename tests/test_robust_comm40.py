"""Issue 40's communicator items at W = 3 (and 4) on gloo: a declaration that differs on one rank after the first
shape's self-check is cached (8), a site too large for the device that must not poison the communicator (11), an
uneven all_to_all whose out_splits disagree with what the peers send (12), a site's shape argument that is not a
shape (14), and the vocabulary refusal that lists the W that work (16).

Numeric expectations are exact (integers and small sums of small integers in fp32; the fold through
tests/oracle.py), each with a negative control. The scenarios that hang or abort a rank in gloo without the fix
run one process per rank (tests/comm40_rank_job.py) with init's own short deadline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, to_bits, to_torch
from subproc import rank_jobs

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "comm40_rank_job.py"
W = 3


@pytest.fixture
def cluster3():  # noqa: ANN201
    from clusters import get_cluster

    return get_cluster(W)


def _ranks(scenario: str, out: Path, world: int = W, timeout_s: float = 120.0) -> list[dict | None]:
    """Run the scenario on one process per rank; what each rank wrote (None: it wrote nothing, e.g. it aborted)."""
    return rank_jobs(JOB, scenario, out, world=world, timeout_s=timeout_s)


def _fresh(numerics: str = "auto", **kw: object):  # type: ignore[no-untyped-def]
    import detcomm

    detcomm.shutdown()
    return detcomm.init(numerics=numerics, **kw)


# ---------------------------------------------------------------------------------------------------------
# 40.8: a declaration that differs on one rank raises CollectiveMismatch at the declaration, on every rank, even
# where the other ranks' self-check is cached

def test_a_differing_declaration_raises_at_the_declaration_on_every_rank(tmp_path: Path) -> None:
    results = _ranks("decl-cached", tmp_path)
    assert all(r is not None for r in results), results
    for r in results:
        assert r["raised"] == "CollectiveMismatch" and r.get("at") == "site", results  # type: ignore[index]
        msg = r["message"]  # type: ignore[index]
        assert "rank 1: declaring site 'b' as all_reduce sum float32[rows<=4, 16]" in msg, msg
        assert "rank 0: declaring site 'b' as all_reduce sum float32[rows<=4, 8]" in msg, msg
        assert r["seconds"] < 5.0, results  # type: ignore[index]  # well inside the 5 s deadline: no wait


def test_control_the_same_declaration_is_served(tmp_path: Path) -> None:
    results = _ranks("decl-cached-ok", tmp_path)
    for r in results:
        assert r is not None and r["raised"] is None, results
        assert r["sum"] == [float(W * (W + 1) // 2)] * 16, results


# ---------------------------------------------------------------------------------------------------------
# 40.11: a site too large for the device is refused by itself, before any self-check; a self-check that runs out
# of memory refuses its site only; a wrong bit still refuses the route (the negative control)

def _served(detcomm, name: str, width: int, rank: int, w: int) -> str:  # type: ignore[no-untyped-def]
    """'' when a new site of ``width`` is served the canonical fold (tests/oracle.py), else what happened."""
    bits = [ill_bits(3, width, "float32", seed=40 + width, rank=r) for r in range(w)]
    try:
        detcomm.site(name, collective="all_reduce", dtype=torch.float32, shape=width, max_rows=4)
        got = detcomm.all_reduce(to_torch(bits[rank], "float32"), name)
    except detcomm.DetcommError as e:
        return f"{type(e).__name__}: {e}"
    return "" if np.array_equal(to_bits(got), oracle.fold_oracle(bits, "float32")) else "not the canonical fold"


def job_oversized_site(rank: int, w: int) -> dict[str, str]:
    import detcomm
    import detcomm.selfcheck as sc

    _fresh("rl-bitwise")
    seen: dict[str, str] = {}
    try:
        detcomm.site("huge", collective="all_reduce", dtype=torch.float32, shape=2**40, max_rows=4)
        seen["huge"] = "accepted"
    except ValueError as e:
        seen["huge"] = "ValueError" if "bytes" in str(e) and "'huge'" in str(e) else f"ValueError without bytes: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the test
        seen["huge"] = f"{type(e).__name__}: {e}"
    seen["after huge"] = _served(detcomm, "after.huge", 24, rank, w)

    # A site that fits the device's memory but whose self-check runs out of it (planted: the allocator's error,
    # raised by every rank where the check builds its payload).
    real_payload, real_checks = sc._payload, sc._checks

    def payload(key, rows, **kw):  # type: ignore[no-untyped-def]
        if key.shape == (40,):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: "
                               "you tried to allocate 1099511627776 bytes.")
        return real_payload(key, rows, **kw)

    def checks(key, execute, **kw):  # type: ignore[no-untyped-def]
        return ["(c) planted wrong bits"] if key.shape == (41,) else real_checks(key, execute, **kw)

    sc._payload, sc._checks = payload, checks
    try:
        seen["oom"] = _served(detcomm, "oom", 40, rank, w).split(":")[0]
        seen["after oom"] = _served(detcomm, "after.oom", 25, rank, w)
        seen["bits"] = _served(detcomm, "bits", 41, rank, w).split(":")[0]
        seen["after bits"] = _served(detcomm, "after.bits", 26, rank, w).split(":")[0]
    finally:
        sc._payload, sc._checks = real_payload, real_checks
        detcomm.shutdown()
    return seen


def test_a_site_too_large_or_out_of_memory_refuses_that_site_only(cluster3) -> None:  # noqa: ANN001
    for seen in cluster3.run(job_oversized_site):
        assert seen == {"huge": "ValueError", "after huge": "", "oom": "RouteRefused", "after oom": "",
                        # negative control: a wrong bit refuses gather_fold for the next all_reduce sum site too
                        "bits": "RouteRefused", "after bits": "RouteRefused"}, seen


# ---------------------------------------------------------------------------------------------------------
# 40.12: an uneven all_to_all whose out_splits disagree with what the peers send raises on every rank

def test_all_to_all_out_splits_that_disagree_raise_on_every_rank(tmp_path: Path) -> None:
    results = _ranks("a2a-splits", tmp_path)
    assert all(r is not None for r in results), results  # no rank aborted inside gloo
    for r in results:
        assert r["raised"] == "CollectiveMismatch", results  # type: ignore[index]
        msg = r["message"]  # type: ignore[index]
        assert "rank 1 expects out_splits[0]=3 rows from rank 0, which sends it splits[1]=2" in msg, msg
        assert "rank 2 expects out_splits[1]=3 rows from rank 1, which sends it splits[2]=4" in msg, msg


def test_control_consistent_out_splits_deliver_every_row(tmp_path: Path) -> None:
    results = _ranks("a2a-splits-ok", tmp_path)
    for rank, r in enumerate(results):
        assert r is not None and r["raised"] is None, results
        # rank q sends q + rank + 1 rows holding 100 q + rank, in rank order
        assert r["rows"] == [float(100 * q + rank) for q in range(W) for _ in range(q + rank + 1)], results


# ---------------------------------------------------------------------------------------------------------
# 40.14: a site's shape argument that is not a shape is refused naming the argument and what it takes

def job_bad_shape(rank: int, w: int) -> list[str]:
    import detcomm

    _fresh("auto")
    seen = []
    for bad in (4.0, None, True, "8"):
        try:
            detcomm.site(f"bad.{bad!r}", collective="all_reduce", dtype=torch.float32, shape=bad, max_rows=4)  # type: ignore[arg-type]
            seen.append(f"{bad!r}: accepted")
        except TypeError as e:
            msg = str(e)
            ok = "shape=" in msg and "an int" in msg and "sequence of ints" in msg and repr(bad) in msg
            seen.append(f"{bad!r}: named" if ok else f"{bad!r}: {msg}")
    # control: an int and a sequence of ints are one shape; the site serves the exact sum
    a = detcomm.site("good", collective="all_reduce", dtype=torch.float32, shape=4, max_rows=4)
    b = detcomm.site("good", collective="all_reduce", dtype=torch.float32, shape=(4,), max_rows=4)
    got = detcomm.all_reduce(torch.full((2, 4), float(rank + 1)), "good")
    seen.append("control" if a is b and torch.equal(got, torch.full((2, 4), float(w * (w + 1) // 2))) else "bad control")
    detcomm.shutdown()
    return seen


def test_a_shape_that_is_not_a_shape_is_named(cluster3) -> None:  # noqa: ANN001
    for seen in cluster3.run(job_bad_shape):
        assert seen == ["4.0: named", "None: named", "True: named", "'8': named", "control"], seen


# ---------------------------------------------------------------------------------------------------------
# 40.16: the vocabulary refusal lists the world sizes that work (the bound is not monotonic)

def _works(vocab: int, w: int) -> bool:
    """Independent of detcomm.hf: the last rank's shard (ceil(vocab / W) padded up to 64) starts inside the vocab."""
    width = -(-vocab // w)
    width = (width + 63) // 64 * 64
    return (w - 1) * width < vocab


@pytest.mark.parametrize("vocab,world,listed", [(200, 3, "{1-2, 4}"), (1000, 5, "{1-4, 6, 8, 16}")])
def test_vocabulary_refusal_lists_the_world_sizes_that_work(vocab: int, world: int, listed: str) -> None:
    from detcomm.hf.layers import vocab_shard_width

    with pytest.raises(ValueError, match="too small") as e:
        vocab_shard_width(vocab, world)
    assert f"W in {listed}" in str(e.value), e.value
    assert "at most" not in str(e.value)
    names = {int(p) for part in listed.strip("{}").split(", ") for p in
             ([part] if "-" not in part else range(int(part.split("-")[0]), int(part.split("-")[1]) + 1))}
    for w in range(1, 4 * vocab // 64):  # every listed W works, every other W (up to far past the bound) does not
        assert (w in names) == _works(vocab, w), w
        if w in names:
            assert vocab_shard_width(vocab, w) * w >= vocab
    assert not _works(vocab, world)  # negative control: the refused size is refused by the oracle too


def test_vocabulary_w4_works_where_w3_does_not() -> None:
    from detcomm.hf.layers import vocab_shard_width

    assert vocab_shard_width(200, 4) == 64  # W = 4 works: 3 * 64 = 192 < 200
    with pytest.raises(ValueError, match=r"W in \{1-2, 4\}"):
        vocab_shard_width(200, 3)
