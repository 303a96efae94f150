"""Run a ``python -m`` command of the package from the repository root, as a user would (the multicast-off
environment of docs/spec.md §8 added), for the tests that drive the launcher and the probes end to end."""

from __future__ import annotations

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
