"""Run a ``python -m`` command of the package from the repository root, as a user would (the multicast-off
environment of docs/spec.md §8 added), for the tests that drive the launcher and the probes end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from detcomm.envelope import MULTICAST_OFF_ENV

ROOT = Path(__file__).resolve().parents[1]


def run_module(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m ARGS`` in the repository root; stdout and stderr captured as text."""
    env = dict(os.environ)
    env.update(MULTICAST_OFF_ENV)
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> str:
    """The command's stdout, after asserting it exited 0 (the tails of both streams otherwise)."""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def rank_jobs(job: Path, scenario: str, out: Path, *, world: int, timeout_s: float) -> list[dict | None]:
    """Run ``job scenario out`` as ``world`` rank processes (env:// on a free port); what each rank wrote to
    ``out/rank<r>.json`` (None: it wrote nothing, e.g. it aborted)."""
    from detcomm.launch.mpi_bootstrap import free_port

    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", **MULTICAST_OFF_ENV)
    for k in ("DETCOMM_CHECK", "DETCOMM_NUMERICS", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    procs = [subprocess.Popen([sys.executable, str(job), scenario, str(out)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT) for r in range(world)]
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
            for r in range(world)]
