"""TP-size invariance end to end (gloo on CPU, through detcomm-launch): the model probe's requests at W = 1 and
2 give identical token ids and logprob bits with virtual shards and with full-K, and differ in the plain fold
layout (the negative control); a W=1 trainer reproduces a W=2 server's logprobs by teacher forcing, and does
not in the fold layout. CI (.ci/probes.sh) runs the same at W = 1, 2, 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from subproc import ok, run_module

pytestmark = pytest.mark.slow

SMALL = ["--requests", "4", "--new-tokens", "5", "--max-prompt", "10"]




@pytest.mark.parametrize("flags", [["--virtual-shards", "4"], ["--full-k"], []], ids=["virtual", "full_k", "fold"])
def test_model_probe_across_widths(flags: list[str], tmp_path: Path) -> None:
    paths = []
    for w in (1, 2):
        p = tmp_path / f"w{w}.json"
        ok(run_module(["detcomm.launch", "--nproc", str(w), "--numerics", "rl-bitwise", "-m", "detcomm.probe", "model",
                  *SMALL, *flags, "--json", str(p)]))
        paths.append(str(p))
    runs = [json.loads(Path(p).read_text()) for p in paths]
    assert all(r["passed"] and r["layout"] == ("virtual" if flags and flags[0] == "--virtual-shards" else
                                               "full_k" if flags else "fold") for r in runs)
    assert all(len(req["logprob_bits"]) == 5 for r in runs for req in r["requests"])
    same = runs[0]["requests"] == runs[1]["requests"]
    proc = run_module(["detcomm.probe", "tp-compare", *paths])
    if flags:
        assert same and proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout
    else:  # negative control: the plain layer's sums follow W
        assert not same and proc.returncode == 1 and "DIFFERENT" in proc.stdout, proc.stdout


def test_align_trainer_matches_server(tmp_path: Path) -> None:
    for layout, flags in (("virtual", ["--virtual-shards", "4"]), ("fold", [])):
        out = tmp_path / f"{layout}.json"
        ok(run_module(["detcomm.launch", "--nproc", "2", "--numerics", "rl-bitwise", "-m", "detcomm.probe", "align",
                  "serve", *SMALL, *flags, "--out", str(out)]))
        proc = run_module(["detcomm.launch", "--nproc", "1", "--numerics", "rl-bitwise", "-m", "detcomm.probe", "align",
                     "train", "--server", str(out)])
        if layout == "virtual":
            assert "PASS: all 20 trainer logprobs" in ok(proc) and "backend=detcomm" in proc.stdout
        else:
            assert proc.returncode == 1 and "FAIL" in proc.stdout, proc.stdout


@pytest.mark.parametrize("flags", [["--virtual-shards", "8"], ["--full-k"]], ids=["virtual", "full_k"])
def test_hf_probe_across_widths(flags: list[str], tmp_path: Path) -> None:
    """The HF probe (a transformers Llama-architecture model sharded by detcomm.hf) in each invariant layout."""
    pytest.importorskip("transformers")
    paths = []
    for w in (1, 2):
        p = tmp_path / f"hf{w}.json"
        ok(run_module(["detcomm.launch", "--nproc", str(w), "--numerics", "rl-bitwise", "-m", "detcomm.probe", "hf",
                  *SMALL, *flags, "--json", str(p)]))
        paths.append(str(p))
    assert "PASS" in ok(run_module(["detcomm.probe", "tp-compare", *paths]))
