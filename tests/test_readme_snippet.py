"""The README's "Using it" snippet is launch/examples/quickstart.py, verbatim, and that script runs: under
detcomm-launch at W=3 on CPU (gloo), where it also asserts that rows reduced alone and inside a larger batch
give identical bits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "examples" / "quickstart.py"
_BLOCK = re.compile(r"<!-- quickstart:start -->\n```python\n(.*?)```\n<!-- quickstart:end -->", re.S)


def readme_snippet(text: str) -> str:
    m = _BLOCK.search(text)
    assert m is not None, ("README.md has no ```python block between <!-- quickstart:start --> and "
                           "<!-- quickstart:end -->")
    return m.group(1)


def test_readme_snippet_is_the_script_verbatim() -> None:
    script = SCRIPT.read_text()
    assert readme_snippet((ROOT / "README.md").read_text()) == script
    # The comparison sees a one-character change.
    edited = f"<!-- quickstart:start -->\n```python\n{script.replace('max_rows=2048', 'max_rows=2049')}```\n<!-- quickstart:end -->"
    assert readme_snippet(edited) != script


def test_quickstart_runs_under_the_launcher_at_w3() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DETCOMM_NUMERICS"}
    proc = subprocess.run([sys.executable, "-m", "detcomm.launch", "--nproc", "3", str(SCRIPT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank0]: W=3: 8 rows reduced alone and inside a batch of 13 -> identical bits" in proc.stdout, proc.stdout
    assert re.search(r"^\[rank0\]: layers\.o_proj\s+all_reduce\s+sum\s+bfloat16\s+4096\s+2048\s+rs_ag_fold\s+passed",
                     proc.stdout, re.M), proc.stdout
