"""detcomm-launch's first-failure attribution (issue 40, items 17 and 18), at W = 3: a rank that finished its
program cleanly is no failure when a peer then exits with an error of its own; a rank that hangs before
``detcomm.init`` is named, by the ranks' PeerTimeout (``silent``) and by the launcher, instead of a rank that only
waited for it.

Oracle: the scenario itself says which rank failed (the job script makes exactly one rank exit non-zero or hang).
Negative controls: a clean exit that leaves a peer waiting (a lost-peer error after it) is still named first, and
a rank that raised an error of its own before the timeout is not displaced by the timeout's names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from detcomm.launch.environment import MULTICAST_OFF
from detcomm.launch.relay import failure_report

ROOT = Path(__file__).resolve().parents[1]


def _record(folder: Path, rank: int, t: float, error: str | None, status: int = 1,
            silent: tuple[int, ...] = ()) -> None:
    (folder / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world_size": 3, "time": t, "status": status if error else 0, "error": error,
        "returned": True, "silent": list(silent)}))


def test_clean_exits_before_a_peers_own_error_are_no_failure(tmp_path: Path) -> None:
    """Item 17: ranks 0 and 1 finished cleanly, then rank 2 exited with status 3: rank 2 failed first."""
    _record(tmp_path, 0, 1.0, None)
    _record(tmp_path, 1, 1.1, None)
    _record(tmp_path, 2, 2.0, "exited with status 3", status=3)
    (tmp_path / "failures.json").write_text(json.dumps({"2": 3}))
    lines = failure_report(tmp_path, 3)
    assert lines[-1] == ("detcomm-launch: rank 2 of 3 failed first: it exited with status 3; the whole group was "
                         "stopped (status 3)."), lines
    assert lines[0] == ("detcomm-launch: ranks 0, 1 finished cleanly (status 0) before rank 2 failed: a clean exit "
                        "is no failure"), lines
    assert not any("rank 0 of 3" in line for line in lines), lines
    # A raised error of rank 2's own: the same.
    _record(tmp_path, 2, 2.0, "Traceback\nValueError: bad input on rank 2\n")
    lines = failure_report(tmp_path, 1)
    assert lines[-3].startswith("detcomm-launch: rank 2 of 3 failed first;") and lines[-1] == \
        "[rank2]: ValueError: bad input on rank 2", lines


def test_negative_control_a_clean_exit_that_left_a_peer_waiting_is_named(tmp_path: Path) -> None:
    """The clean exit is the cause when the failure after it is a lost peer (the existing rule, kept)."""
    _record(tmp_path, 0, 1.0, None)
    _record(tmp_path, 1, 1.1, None)
    _record(tmp_path, 2, 2.0, "Traceback\nRuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234\n")
    lines = failure_report(tmp_path, 1)
    assert lines[-1].startswith("detcomm-launch: rank 0 of 3 ended first: it exited with status 0 while the other "
                                "ranks still ran"), lines


def test_a_rank_the_peer_timeout_names_is_blamed_not_the_waiter(tmp_path: Path) -> None:
    """Item 18: ranks 0 and 2 raised PeerTimeout naming rank 1 (silent), which the tear-down then stopped: rank 1
    failed first, with its stack at the SIGTERM (where it hung)."""
    err = "Traceback\ndetcomm.errors.PeerTimeout: detcomm.init on rank {}: ... rank 1 never reached detcomm.init\n"
    _record(tmp_path, 0, 5.0, err.format(0), silent=(1,))
    _record(tmp_path, 2, 5.1, err.format(2), silent=(1,))
    for r in range(3):
        (tmp_path / f"rank{r}.fault").write_text("")
    (tmp_path / "rank1.term").write_text("Current thread 0x1 (most recent call first):\n  File \"job.py\", line 4\n")
    os.utime(tmp_path / "rank1.term", (6.0, 6.0))
    lines = failure_report(tmp_path, 1)
    assert lines[-3].startswith("detcomm-launch: rank 1 of 3 failed first: it never arrived (rank 0's PeerTimeout "
                                "names it as the rank it waited for) and was stopped by signal SIGTERM"), lines
    assert lines[-1] == '[rank1]:   File "job.py", line 4', lines
    # Negative control: a rank that raised an error of its own is not displaced by a timeout naming it.
    _record(tmp_path, 1, 4.0, "Traceback\nValueError: rank 1's own error\n")
    assert "rank 1 of 3 failed first;" in failure_report(tmp_path, 1)[-3]
    _record(tmp_path, 1, 7.0, "Traceback\nValueError: rank 1's own error\n")  # later: no cause, and not blamed
    assert "rank 0 of 3 failed first;" in "\n".join(failure_report(tmp_path, 1))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for k in MULTICAST_OFF:
        env.pop(k, None)
    return env


def _launch(tmp_path: Path, job: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(job))
    return subprocess.run([sys.executable, "-m", "detcomm.launch", "--nproc", "3", str(script)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_launcher_names_the_rank_that_exited_non_zero_after_clean_peers(tmp_path: Path) -> None:
    """Item 17 end to end: ranks 0-1 finish cleanly, rank 2 then exits with status 3."""
    proc = _launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "2":
            time.sleep(3)
            sys.exit(3)
        """)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    last = proc.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("detcomm-launch: rank 2 of 3 failed first: it exited with status 3"), proc.stderr[-3000:]


@pytest.mark.slow
def test_launcher_and_peer_timeout_name_the_rank_that_never_reached_init(tmp_path: Path) -> None:
    """Item 18 end to end: rank 1 hangs before detcomm.init; ranks 0 and 2 time out in the rendezvous after 15 s.
    Their PeerTimeout names rank 1, and so does the launcher, with the line rank 1 hung at."""
    t0 = time.monotonic()
    proc = _launch(tmp_path, """
        import os, time
        import detcomm
        if os.environ["RANK"] == "1":
            time.sleep(600)  # hangs here, before detcomm.init
        try:
            detcomm.init(timeout_s=15)
        except detcomm.PeerTimeout as e:
            print("SILENT", e.silent, "|", e, flush=True)
            raise
        """)
    out = proc.stderr
    assert proc.returncode != 0, proc.stdout + out
    assert time.monotonic() - t0 < 200
    said = [line for line in proc.stdout.splitlines() if "SILENT" in line]
    assert len(said) == 2 and all("SILENT (1,) |" in line and "rank 1 never reached detcomm.init" in line
                                  for line in said), proc.stdout[-4000:]
    assert "detcomm-launch: rank 1 of 3 failed first: it never arrived" in out, out[-4000:]
    assert 'job.py", line 5' in out, out[-4000:]  # where rank 1 hung: its stack at the tear-down's SIGTERM
