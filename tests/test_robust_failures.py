"""Deadlines and peer death on real process groups created by ``detcomm.init(timeout_s=...)`` (the
1-3): a rank that never arrives, one that is frozen, and one SIGKILLed mid-collective on the native and the
gather_fold routes. The survivors must raise within the deadline; under detcomm-launch the group must go
down with a non-zero exit naming the dead rank. The ranks run tests/robust_rank_job.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from detcomm.deadline import REPORT_GRACE_S, STORE_REPLY_S
from detcomm.envelope import MULTICAST_OFF_ENV
from detcomm.launch.mpi_bootstrap import free_port

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "robust_rank_job.py"
DEADLINE_S = 3.0  # robust_rank_job.DEADLINE_S
SLACK_S = 7.0  # a loaded 2-core CI machine
REPORT_S = REPORT_GRACE_S + STORE_REPLY_S  # the timeout report's bounded waits on the store


def _run_ranks(scenario: str, out: Path, world: int = 3, faulty: int = 1) -> float:
    """Start the ranks, wait for the survivors (all but ``faulty``), kill the faulty rank if it still lives.
    Returns the seconds the survivors took."""
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=str(ROOT), **MULTICAST_OFF_ENV)
    env.pop("DETCOMM_CHECK", None)
    procs = [subprocess.Popen([sys.executable, str(JOB), scenario, str(out)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT) for r in range(world)]
    t0 = time.monotonic()
    try:
        for r, p in enumerate(procs):
            if r != faulty:
                p.wait(timeout=90)
        return time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _survivors(out: Path, world: int = 3, faulty: int = 1) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world) if r != faulty]


@pytest.mark.parametrize("scenario", ["absent-check", "absent"])
def test_rank_that_never_arrives_hits_the_deadline(scenario: str, tmp_path: Path) -> None:
    _run_ranks(scenario, tmp_path)
    for s in _survivors(tmp_path):
        took = s["ended"] - s["started"]
        assert DEADLINE_S - 0.5 < took < DEADLINE_S + SLACK_S, s
        if scenario == "absent-check":
            assert s["raised"] == "PeerTimeout", s
            assert "site 'x', call #1" in s["message"] and "within 3 s" in s["message"], s
        else:  # the library's timeout, translated: the site, the call and the rank that never arrived
            assert s["raised"] == "PeerTimeout", s
            assert "site 'x', call #2" in s["message"] and "rank(s) [1] did not report a timeout" in s["message"], s


@pytest.mark.parametrize("scenario", ["die-native", "die-gather_fold", "freeze-gather_fold"])
def test_survivors_raise_when_a_peer_dies_mid_collective(scenario: str, tmp_path: Path) -> None:
    _run_ranks(scenario, tmp_path)
    killed_at = float((tmp_path / "killed_at").read_text())
    for s in _survivors(tmp_path):
        assert s["route"] == scenario.split("-")[1]
        # gloo's "connection closed" for a dead peer becomes CollectiveFailed, detcomm's PeerTimeout when the
        # deadline ends the wait.
        assert s["raised"] in ("CollectiveFailed", "PeerTimeout"), s
        assert s["ended"] - killed_at < DEADLINE_S + SLACK_S, s
    if scenario.startswith("freeze"):  # open sockets: only the deadline ends the wait, and it names rank 1
        timed_out = [s for s in _survivors(tmp_path) if s["raised"] == "PeerTimeout"]
        assert timed_out, _survivors(tmp_path)
        for s in timed_out:
            assert "rank(s) [1] did not report a timeout" in s["message"], s
            assert s["ended"] - killed_at > DEADLINE_S - 0.5, s


def test_frozen_store_host_still_lets_the_survivors_raise(tmp_path: Path) -> None:
    # Without torchrun the rendezvous store lives in rank 0: frozen, it takes the bytes of the survivors'
    # timeout report into its socket buffers and never answers. The survivors must still raise within the
    # deadline plus the report's bounded waits, naming the store that did not answer.
    _run_ranks("freeze0-gather_fold", tmp_path, faulty=0)
    killed_at = float((tmp_path / "killed_at").read_text())
    for s in _survivors(tmp_path, faulty=0):
        assert s["raised"] == "PeerTimeout", s
        assert s["ended"] - killed_at < DEADLINE_S + REPORT_S + SLACK_S, s
        assert "the rendezvous store (127.0.0.1:" in s["message"] and "did not answer within 4 s" in s["message"], s


@pytest.mark.slow
@pytest.mark.parametrize("scenario, cause", [
    ("die-native", "it was killed by signal SIGKILL, without a Python error"),
    ("abort-native", "it died of signal SIGABRT"),
    ("exit0-native", "it exited with status 0 while the other ranks still ran"),
    ("exit0hard-native", "it exited early (status 0, through os._exit: its program did not return)"),
])
def test_launcher_names_the_rank_that_died_first_and_how(scenario: str, cause: str, tmp_path: Path) -> None:
    # The survivors raise their consequence (a reset connection, a timeout) as an uncaught error would: the
    # launcher must still name rank 1, the one that died, and how.
    env = dict(os.environ, ROBUST_RERAISE="1")
    env.pop("DETCOMM_CHECK", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "detcomm.launch", "--nproc", "3", str(JOB), scenario, str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    verb = "ended" if scenario.startswith("exit0") else "failed"  # a status-0 exit, early: no failure of its own
    report = [line for line in proc.stderr.splitlines() if line.startswith("detcomm-launch: rank ")]
    assert len(report) == 1 and report[0].startswith(f"detcomm-launch: rank 1 of 3 {verb} first: {cause}"), out[-3000:]
    assert "rank 0 of 3 failed first" not in out and "rank 2 of 3 failed first" not in out
    if scenario.startswith("abort"):  # its own Python stack, from faulthandler, is the last thing printed
        assert "[rank1]: Fatal Python error: Aborted" in proc.stderr, out[-3000:]
        assert proc.stderr.rstrip().splitlines()[-1].startswith("[rank1]: "), out[-3000:]
    assert elapsed < 150, f"the group took {elapsed:.0f} s to go down"  # 45 s of it: starting ranks when loaded


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH (apt-get install openmpi-bin)")
@pytest.mark.parametrize("scenario, cause", [
    ("die-native", "failed first: it was killed by signal SIGKILL"),
    ("exit0hard-native", "ended first: it exited early (status 0, through os._exit: its program did not return)"),
])
def test_mpi_launcher_names_the_rank_that_died_first(scenario: str, cause: str, tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    env = dict(os.environ, ROBUST_RERAISE="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("DETCOMM_CHECK", None)
    proc = subprocess.run([sys.executable, "-m", "detcomm.launch", "--nproc", "3", "--launcher", "mpi", str(JOB),
                           scenario, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    report = [line for line in proc.stderr.splitlines() if line.startswith("detcomm-launch: rank ")]
    assert len(report) == 1 and report[0].startswith(f"detcomm-launch: rank 1 of 3 {cause}"), out[-3000:]
