"""TP-size invariance end to end (gloo on CPU, through detcomm-launch): the model probe's requests at W = 1, 2
and 4 give identical token ids and logprob bits with virtual shards and with full-K, and differ in the plain fold
layout at W = 1 and 2 (the negative control); a W=1 trainer reproduces a W=4 server's logprobs by teacher
forcing, and does not in the fold layout. (The README's tour runs the virtual-shard widths again with the
probe's default sizes; the HF probe's layouts run at W = 1 and 2 here, the tree order's in test_tree_probe.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from subproc import ok, run_module

pytestmark = pytest.mark.slow

SMALL = ["--requests", "4", "--new-tokens", "5", "--max-prompt", "10"]




# The invariant layouts at W = 1, 2 and 4 (W >= 3: a fold of three or more addends has orders to get wrong; V = 8
# gives every rank 2 or more shards); the negative control needs one pair of widths whose bits differ.
@pytest.mark.parametrize(("flags", "widths"), [(["--virtual-shards", "8"], (1, 2, 4)), (["--full-k"], (1, 2, 4)),
                                               ([], (1, 2))], ids=["virtual", "full_k", "fold"])
def test_model_probe_across_widths(flags: list[str], widths: tuple[int, ...], tmp_path: Path) -> None:
    paths = []
    for w in widths:
        p = tmp_path / f"w{w}.json"
        ok(run_module(["detcomm.launch", "--nproc", str(w), "--numerics", "rl-bitwise", "-m", "detcomm.probe", "model",
                  *SMALL, *flags, "--json", str(p)]))
        paths.append(str(p))
    runs = [json.loads(Path(p).read_text()) for p in paths]
    assert all(r["passed"] and r["layout"] == ("virtual" if flags and flags[0] == "--virtual-shards" else
                                               "full_k" if flags else "fold") for r in runs)
    assert all(len(req["logprob_bits"]) == 5 for r in runs for req in r["requests"])
    same = all(r["requests"] == runs[0]["requests"] for r in runs[1:])
    proc = run_module(["detcomm.probe", "tp-compare", *paths])
    if flags:
        assert same and proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout
    else:  # negative control: the plain layer's sums follow W
        assert not same and proc.returncode == 1 and "DIFFERENT" in proc.stdout, proc.stdout


def test_align_trainer_matches_server(tmp_path: Path) -> None:
    """A W=4 server (W >= 3; V = 8, two shards a rank); the same code serves any W, and the widths' bits agree
    (test_model_probe_across_widths)."""
    for layout, flags in (("virtual", ["--virtual-shards", "8"]), ("fold", [])):
        out = tmp_path / f"{layout}.json"
        ok(run_module(["detcomm.launch", "--nproc", "4", "--numerics", "rl-bitwise", "-m", "detcomm.probe", "align",
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
