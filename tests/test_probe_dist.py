"""The collective and model probes on real ranks (gloo on CPU), started by detcomm-launch and by torchrun.

The fold routes (rl-bitwise) must pass; the native route at W >= 3 must be caught (the negative control:
a probe that cannot see the native all-reduce's order move proves nothing when it passes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detcomm.envelope import MULTICAST_OFF_ENV

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# Smaller than the CLI defaults: the same mechanisms, a third of the time.
COLLECTIVES = ["--rows", "12", "--per-size", "1"]
MODEL = ["--requests", "6", "--new-tokens", "8", "--max-prompt", "14"]


def _run(args: list[str], *, torchrun: bool = False, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(MULTICAST_OFF_ENV)
    if torchrun:
        env.pop("DETCOMM_NUMERICS", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *args]
    else:
        cmd = [sys.executable, "-m", "detcomm.launch", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("world", [3, 4])
def test_collective_probe_fold_routes_pass(world: int, tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    proc = _run(["--nproc", str(world), "--numerics", "rl-bitwise", "-m", "detcomm.probe", "collectives",
                 *COLLECTIVES, "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = _json(out)
    assert res["passed"] and res["numerics"] == "rl-bitwise" and res["world_size"] == world
    sums = [s for s in res["sites"] if s["op"] == "sum"]
    assert {s["route"] for s in sums} <= {"gather_fold", "a2a_fold", "ipc_fold"}
    assert all(s["claim"] and s["rows_changed"] == 0 and s["rank_disagreements"] == 0 for s in res["sites"])
    assert "PASS" in proc.stdout


@pytest.mark.parametrize("world", [3, 4])
def test_collective_probe_catches_native(world: int, tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    proc = _run(["--nproc", str(world), "-m", "detcomm.probe", "collectives", *COLLECTIVES, "--numerics", "auto", "--route", "native",
                 "--json", str(out), "--expect-divergence"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sites = {s["site"]: s for s in _json(out)["sites"]}
    for name in ("o_proj", "o_proj.fp32", "down_proj.fp32"):
        assert sites[name]["route"] == "native" and not sites[name]["claim"]
        assert sites[name]["rows_changed"] > 0 and sites[name]["max_ulps"] >= 1
    if world == 4:
        # gloo's reduce-scatter folds each block in an order that follows the receiving rank: rows compared
        # wherever they land must show it (compared only on their own rank, they read 0).
        rs = sites["seq_parallel.reduce_scatter.fp32"]
        assert rs["route"] == "native" and rs["rows_changed"] > 0 and rs["max_ulps"] >= 1, rs
    # MAX and argmax stay exact on the native route: the probe must not flag them.
    assert sites["router.max"]["rows_changed"] == 0 and sites["lm_head.argmax"]["rows_changed"] == 0


@pytest.mark.parametrize("world", [3, 4])
def test_model_probe_fold_passes_and_native_diverges(world: int, tmp_path: Path) -> None:
    fold, native = tmp_path / "fold.json", tmp_path / "native.json"
    proc = _run(["--nproc", str(world), "--numerics", "rl-bitwise", "-m", "detcomm.probe", "model", *MODEL,
                 "--json", str(fold)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = _json(fold)
    assert res["passed"] and res["local_rows_invariant"] and res["ranks_agree"]
    assert res["routes"]["o_proj"] == "gather_fold" and all(not c["diverged"] for c in res["comparisons"])

    proc = _run(["--nproc", str(world), "-m", "detcomm.probe", "model", *MODEL, "--numerics", "auto", "--route", "native",
                 "--json", str(native)])
    assert proc.returncode != 0, "the model probe passed the native route: its negative control is blind"
    res = _json(native)
    assert res["routes"]["o_proj"] == "native" and not res["passed"]
    packed = [c for c in res["comparisons"] if c["comparison"].startswith("packed")]
    assert all(c["diverged"] for c in packed)
    # Run-to-run on the same schedule is stable even on the native route (it is not batch-invariant).
    assert all(not c["diverged"] for c in res["comparisons"] if c["comparison"].startswith("rerun"))
    assert "first divergence" in proc.stdout and "DIVERGED" in proc.stdout


def test_model_probe_catches_unpadded_local_gemms(tmp_path: Path) -> None:
    # Fold routes, but local GEMMs at the real row count: the CPU GEMM's own row-count classes must show.
    # Whether this CPU's GEMM has such classes is the BLAS's business: map them first (docs/spec.md §7 (row-count mapper)'s mapper).
    import torch

    from detcomm.probe.rows import map_rows, matmul_op

    torch.set_num_threads(1)
    op, _ = matmul_op(128, 128, dtype=torch.float32, device="cpu", seed=0)
    if not map_rows(op, torch.randn(32, 128), max_rows=32).boundaries:
        pytest.skip("this CPU's fp32 GEMM is row-count invariant up to 32 rows: nothing for --no-pad to expose")
    out = tmp_path / "nopad.json"
    proc = _run(["--nproc", "2", "--numerics", "rl-bitwise", "-m", "detcomm.probe", "model", *MODEL, "--no-pad",
                 "--json", str(out)])
    assert proc.returncode != 0 and not _json(out)["passed"]


def test_plain_torchrun_runs_the_model_probe(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    proc = _run(["--nproc-per-node", "3", "-m", "detcomm.probe", "model", *MODEL, "--json", str(out)], torchrun=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = _json(out)
    assert res["numerics"] == "rl-bitwise" and res["passed"]  # the probe's default without a launcher
