"""Host memory at load, sliced (detcomm/hf/memory.py through detcomm-launch, gloo on CPU): at W = 4 a rank's
high-water mark over the load stays below 0.6 of the checkpoint's bytes (a 225 MB bf16 Llama: its slices are a
quarter, plus the replicated norms and one slice's mapped pages). Negative control: the same measurement at W = 1,
where the one rank reads every tensor, must exceed 0.6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detcomm.envelope import MULTICAST_OFF_ENV

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
LIMIT = 0.6


def _measure(nproc: int, model: str, out: Path) -> list[float]:
    env = dict(os.environ)
    env.update(MULTICAST_OFF_ENV)
    proc = subprocess.run([sys.executable, "-m", "detcomm.launch", "--nproc", str(nproc), "--numerics", "rl-bitwise",
                           "-m", "detcomm.hf.memory", "--model", model, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == nproc and res["load"] == "sliced"
    return [r["peak_added_bytes"] / res["checkpoint_bytes"] for r in res["ranks"]]


def test_sliced_load_peak_below_limit(tmp_path: Path) -> None:
    from detcomm.hf.memory import write_checkpoint

    model = write_checkpoint("llama-200m", str(tmp_path / "ckpt"))
    assert os.path.getsize(os.path.join(model, "model.safetensors")) > 200e6
    ratios = _measure(4, model, tmp_path / "w4.json")
    assert len(ratios) == 4 and all(0 < r < LIMIT for r in ratios), ratios
    whole = _measure(1, model, tmp_path / "w1.json")  # negative control: one rank holds the whole model
    assert whole[0] > LIMIT, whole
