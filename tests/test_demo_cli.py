"""The ``detcomm`` command: ``detcomm routes`` (parsing, and the runtime's own decisions for a live group of a
kind) and ``detcomm demo`` end to end on 3 local gloo ranks (W >= 3, so the native route must move), also
under a deadline too short to finish."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from detcomm.cli import SiteSpec, main, parse_site

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec, want", [
    ("o:all_reduce:bf16:4096:2048", SiteSpec("o", "all_reduce", "bfloat16", (4096,), 2048, "sum")),
    ("o:all-reduce:bfloat16:4,128:64:max", SiteSpec("o", "all_reduce", "bfloat16", (4, 128), 64, "max")),
    ("o:reduce_scatter:fp16:4x128:8", SiteSpec("o", "reduce_scatter", "float16", (4, 128), 8, "sum")),
    ("t:token_all_gather:long::2048", SiteSpec("t", "token_all_gather", "int64", (), 2048, "sum")),
    ("a:argmax:fp32:(19008):16:max", SiteSpec("a", "argmax", "float32", (19008,), 16, "max")),
])
def test_site_spellings(spec: str, want: SiteSpec) -> None:
    assert parse_site(spec) == want


@pytest.mark.parametrize("spec, match", [
    ("g:all_gather:bf16:4096:8:sum", "all_gather moves data and takes no reduce op; drop ':sum'"),
    ("a:argmax:bf16:4096:8:min", "argmax is a MAX reduction"),
    ("o:all_reduce:bf17:4096:8", "dtype 'bf17' is not one of"),
    ("o:all_reduce:bf16:4096:0", "MAX_ROWS '0' must be a positive integer"),
    ("o:all_reduce:bf16:40a6:8", "shape '40a6' must be integers"),
    ("o:allreduce2:bf16:4096:8", "collective 'allreduce2' is not one of"),
    ("o:all_reduce:bf16", "expected NAME:COLLECTIVE:DTYPE:SHAPE:MAX_ROWS"),
])
def test_site_refusals(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_site(spec)


def _routes(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, str]]:
    assert main(["routes", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_routes_say_what_a_live_group_of_the_kind_chooses(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DETCOMM_NUMERICS", raising=False)
    sites = ["--site", "small:all_reduce:bf16:4096:2048", "--site", "big:all_reduce:bf16:4096:16384",
             "--site", "rs:reduce_scatter:bf16:4096:64"]
    # One NCCL node under the default envelope (rl-bitwise): the workspace arms, small sites go to ipc_fold.
    nccl = {r["site"]: r for r in _routes(capsys, "--backend", "nccl", *sites)}
    # Where it does not arm, a 16 MiB site at W = 8 is above rs_ag_fold's break-even (route.py).
    assert (nccl["small"]["route"], nccl["small"]["condition"]) == ("ipc_fold", "if the workspace arms; else rs_ag_fold")
    # Above the armed rows an all-reduce stays on the workspace, chunked (a row fits one launch), as init decides.
    assert (nccl["big"]["route"], nccl["big"]["condition"]) == ("ipc_fold", "if the workspace arms; else rs_ag_fold")
    assert "chunked" in nccl["big"]["why"]
    assert (nccl["rs"]["route"], nccl["rs"]["condition"]) == ("ipc_fold", "if the workspace arms; else a2a_fold")
    # Several nodes, or gloo: no workspace, and no claim about one.
    for args in (("--backend", "nccl", "--nodes", "2"), ("--backend", "gloo")):
        rows = {r["site"]: r for r in _routes(capsys, *args, *sites)}
        assert [rows[s]["route"] for s in ("small", "big", "rs")] == ["rs_ag_fold", "rs_ag_fold", "a2a_fold"]
        assert all(r["condition"] == "" for r in rows.values())
        assert ("ranks on several hosts" if "--nodes" in args else "CPU group") in rows["small"]["why"]
    # numerics=auto: the native reduction; an exported DETCOMM_NUMERICS is the default, a contradicting flag fails.
    assert _routes(capsys, "--numerics", "auto", *sites)[0]["route"] == "native"
    monkeypatch.setenv("DETCOMM_NUMERICS", "auto")
    assert _routes(capsys, *sites)[0]["route"] == "native"
    assert main(["routes", "--numerics", "rl-bitwise", *sites]) == 2
    assert "contradicts DETCOMM_NUMERICS=auto" in capsys.readouterr().err


def test_routes_table_and_refusal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DETCOMM_NUMERICS", raising=False)
    assert main(["routes", "--backend", "gloo", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "numerics=rl-bitwise backend=gloo W=4" in out and "workspace: CPU group" in out
    assert "static view: the workspace is probed" not in out
    assert main(["routes", "--site", "g:all_gather:bf16:4096:8:sum"]) == 2
    assert "takes no reduce op" in capsys.readouterr().err


def _demo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "detcomm", "demo", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=timeout, cwd=ROOT)


def test_demo_three_ranks() -> None:
    proc = _demo("--nproc", "3", "--hidden", "64")
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
    # Progress while it runs: one line per step on stderr.
    assert re.search(r"^detcomm demo: \[\d+/\d+\] ", proc.stderr, re.M), proc.stderr


def test_demo_deadline_names_the_setting() -> None:
    proc = _demo("--nproc", "2", "--hidden", "64", "--timeout", "0.5", timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--timeout 0.5" in proc.stderr and "raise it" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_and_readme_agree_on_the_main_job(capsys) -> None:  # noqa: ANN001
    """`detcomm --help` names the same main job as the README's first set-up command."""
    from pathlib import Path

    from detcomm.cli import main

    main_job = "detcomm-launch --nproc 4 --numerics rl-bitwise -m detcomm.probe model"
    try:
        main(["--help"])
    except SystemExit:
        pass
    assert main_job in capsys.readouterr().out
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f".venv/bin/{main_job}" in readme
