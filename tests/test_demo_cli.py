"""The main job end to end: `detcomm demo` on 3 local gloo ranks (W >= 3, so the native route must move)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_three_ranks() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "detcomm", "demo", "--nproc", "3", "--hidden", "64"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "numerics=rl-bitwise backend=gloo W=3" in out
    assert "FAIL" not in out
    fold_rows = re.findall(r"^\s+\S+\s+(gather_fold|a2a_fold)\s+(\d+)/(\d+)", out, re.M)
    assert len(fold_rows) == 4 and all(changed == "0" for _, changed, _ in fold_rows)
    native = [int(c) for c in re.findall(r"^\s+o_proj\.\S+\s+native\s+(\d+)/", out, re.M)]
    assert len(native) == 2 and sum(native) > 0, out
    # Reduce-scatter rows are compared on whichever rank receives them: the native ring's order shows.
    native_rs = [int(c) for c in re.findall(r"^\s+down_proj\.rs\.\S+\s+native\s+(\d+)/", out, re.M)]
    assert len(native_rs) == 2 and sum(native_rs) > 0, out
    assert re.search(r"native route: [1-9]\d* rows changed", out)
