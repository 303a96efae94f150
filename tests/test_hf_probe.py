"""The HF probe through detcomm-launch (torchrun, gloo on CPU): bitwise at W=4 under rl-bitwise, its layer
boundaries fused (the add_norm sites in the route table), with the JSON record per request (token ids and logprob
bits in hex); the native negative control (transformers' boundaries, no add_norm site) must diverge at W=3; and at
W=4 with 2 KV heads (replicated over 2 ranks each), dense and MoE, loaded sliced, with their native controls.
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

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SMALL = ["--requests", "6", "--new-tokens", "6", "--max-prompt", "14"]


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(MULTICAST_OFF_ENV)
    return subprocess.run([sys.executable, "-m", "detcomm.launch", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_hf_probe_bitwise_w4(tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    proc = _launch(["--nproc", "4", "--numerics", "rl-bitwise", "-m", "detcomm.probe", "hf", "--config", "qwen3-tiny",
                    "--dtype", "bfloat16", *SMALL, "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "PASS" in proc.stdout
    res = json.loads(out.read_text())
    assert res["passed"] and res["local_rows_invariant"] and res["world_size"] == 4
    assert res["routes"]["model.layers.1.self_attn.o_proj"] in ("gather_fold", "ipc_fold")
    fused = {s: r for s, r in res["routes"].items() if s.endswith(".add_norm")}
    assert sorted(fused) == [f"model.layers.{i}.{m}.add_norm" for i in (0, 1) for m in ("mlp.down_proj", "self_attn.o_proj")]
    assert set(fused.values()) <= {"gather_fold", "ipc_fold"}
    for req in res["requests"]:
        runs = req["runs"]
        assert len(runs["alone"]["tokens"]) == 6
        assert all(len(b) == 10 and b.startswith("0x") for b in runs["alone"]["logprob_bits"])
        assert all(runs[k] == runs["alone"] for k in ("packed #1", "packed #2", "rerun"))


def test_hf_probe_native_diverges_w3(tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    proc = _launch(["--nproc", "3", "--numerics", "auto", "-m", "detcomm.probe", "hf", "--config", "llama-tiny", "--route", "native",
                    *SMALL, "--json", str(out), "--expect-divergence"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert not res["passed"] and res["numerics"] == "auto"
    assert not any(s.endswith(".add_norm") for s in res["routes"])
    assert any(c["diverged"] for c in res["comparisons"] if "vs alone" in c["comparison"])


def test_hf_probe_replicated_kv_heads_moe_w4(tmp_path: Path) -> None:
    """Qwen2-MoE with 2 KV heads over 4 ranks (each replicated twice), experts spread, loaded sliced: bitwise
    alone, packed and rerun under rl-bitwise; the native all-reduce (numerics auto) is the negative control and
    must diverge. (The dense qwen3-kv2-tiny runs the same pair in .ci/hf.sh.)"""
    config, extra = "qwen2-moe-kv2-tiny", ["--ep", "--expert-block", "16"]
    small = ["--requests", "4", "--new-tokens", "4", "--max-prompt", "12"]
    out = tmp_path / "hf.json"
    proc = _launch(["--nproc", "4", "--numerics", "rl-bitwise", "-m", "detcomm.probe", "hf", "--config", config,
                    "--dtype", "bfloat16", *small, *extra, "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["passed"] and res["local_rows_invariant"] and res["world_size"] == 4 and res["load"] == "sliced"
    assert "heads=4/kv 2" in proc.stdout
    for req in res["requests"]:
        assert all(req["runs"][k] == req["runs"]["alone"] for k in ("packed #1", "packed #2", "rerun"))
    ctl = tmp_path / "native.json"
    proc = _launch(["--nproc", "4", "--numerics", "auto", "-m", "detcomm.probe", "hf", "--config", config, "--dtype",
                    "bfloat16", "--route", "native", *small, *extra, "--json", str(ctl), "--expect-divergence"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(ctl.read_text())
    assert not res["passed"] and any(c["diverged"] for c in res["comparisons"] if "vs alone" in c["comparison"])
