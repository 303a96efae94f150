"""``detcomm.shutdown()`` frees the process group detcomm.init created, by reference counting alone.

A group that outlives shutdown (held by a reference cycle) is finalized at interpreter exit, where gloo's worker
threads can abort the process after the job printed its result: CI saw README probes print PASS and then die of
SIGABRT ("terminate called without an active exception"). The cause was a reference cycle through every declared
site's call path (its call-guard proof stored as a bound method of itself); the job here runs with the garbage
collector off and asserts that no gloo thread is left after shutdown, on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from subproc import rank_jobs

JOB = Path(__file__).with_name("shutdown_job.py")


def _gloo(names: list[str]) -> list[str]:
    return [n for n in names if "gloo" in n]


@pytest.mark.parametrize("mode", ["guard", "check"])
@pytest.mark.parametrize("world", [3, 4])
def test_shutdown_leaves_no_gloo_thread(world: int, mode: str, tmp_path: Path) -> None:
    reports = rank_jobs(JOB, mode, tmp_path, world=world, timeout_s=240)
    assert all(r is not None for r in reports), f"a rank wrote no report: {reports}"
    for r in reports:
        # The control: gloo's threads exist while the group lives, so their absence afterwards means something.
        assert _gloo(r["during"]), f"rank {r['rank']}: no gloo thread while the group lived: {r['during']}"
        assert not _gloo(r["after"]), (
            f"rank {r['rank']}: gloo threads outlive detcomm.shutdown() ({_gloo(r['after'])}): something still "
            "holds the process group (a reference cycle: run with gc.DEBUG_SAVEALL to find it)")
