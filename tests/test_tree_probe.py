"""The tree order end to end (gloo on CPU, through detcomm-launch): the model probe's requests in the layout
``--virtual-shards 8 --shard-fold tree`` (its layer boundaries fused all_reduce_residual_rmsnorm calls on tree
sites) give identical token ids and logprob bits at W = 1, 2 and 4, on gather_fold and with the row-parallel sums
forced onto a2a_fold (the HF probe's at W = 1 and 2); a W = 1 trainer reproduces W = 2 and W = 4
servers' sampling-time logprobs by teacher forcing in that layout. The negative controls of the layouts (the
plain fold differs across W) are tests/test_probe_tp.py's; the tree's own (the shard-order fold gives other
bits) are tests/test_tree_fold.py's. (CI runs these through the README's test command.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from subproc import ok, run_module

pytestmark = pytest.mark.slow

SMALL = ["--requests", "4", "--new-tokens", "5", "--max-prompt", "10"]
TREE = ["--virtual-shards", "8", "--shard-fold", "tree"]




def _launch(w: int, *args: str) -> str:
    return ok(run_module(["detcomm.launch", "--nproc", str(w), "--numerics", "rl-bitwise", "-m", "detcomm.probe", *args]))


def test_model_probe_tree_across_widths(tmp_path: Path) -> None:
    paths = []
    for w, route in ((1, None), (2, None), (4, None), (4, "a2a_fold")):
        p = tmp_path / f"tree{w}{route or ''}.json"
        _launch(w, "model", *SMALL, *TREE, *(["--route", route] if route else []), "--json", str(p))
        paths.append(str(p))
    runs = [json.loads(Path(p).read_text()) for p in paths]
    assert all(r["passed"] and r["layout"] == "virtual" and r["shard_fold"] == "tree" for r in runs)
    assert [r["routes"]["o_proj"] for r in runs] == ["gather_fold", "gather_fold", "gather_fold", "a2a_fold"]
    # The layer boundaries are fused calls on tree sites (docs/spec.md §9.2 "Tree sites"), on the sums' route.
    assert [r["routes"]["down_proj.add_norm"] for r in runs] == ["gather_fold"] * 3 + ["a2a_fold"]
    assert all(r["requests"] == runs[0]["requests"] for r in runs[1:])
    out = ok(run_module(["detcomm.probe", "tp-compare", *paths]))
    assert "virtual V=8 tree" in out and "PASS: identical token ids and logprob bits at W = 1, 2, 4, 4" in out


def test_align_trainer_matches_tree_servers(tmp_path: Path) -> None:
    for w in (2, 4):
        out = tmp_path / f"serve{w}.json"
        assert "layout=virtual V=8 tree" in _launch(w, "align", "serve", *SMALL, *TREE, "--out", str(out))
        got = _launch(1, "align", "train", "--server", str(out))
        assert "PASS: all 20 trainer logprobs" in got and "layout=virtual V=8 tree" in got, got


def test_shard_fold_needs_virtual_shards() -> None:
    proc = run_module(["detcomm.launch", "--nproc", "1", "--numerics", "rl-bitwise", "-m", "detcomm.probe", "model",
                 *SMALL, "--shard-fold", "tree"])
    assert proc.returncode != 0 and "pass --virtual-shards V too" in proc.stdout + proc.stderr


def test_hf_probe_tree_across_widths(tmp_path: Path) -> None:
    """The HF probe (a transformers Llama-architecture model sharded by detcomm.hf) in the tree layout."""
    pytest.importorskip("transformers")
    paths = []
    for w in (1, 2):
        p = tmp_path / f"hf{w}.json"
        _launch(w, "hf", *SMALL, *TREE, "--json", str(p))
        paths.append(str(p))
    assert json.loads(Path(paths[1]).read_text())["shard_fold"] == "tree"
    out = ok(run_module(["detcomm.probe", "tp-compare", *paths]))
    assert "virtual V=8 tree" in out and "PASS" in out


def test_hf_moe_probe_tree_across_widths(tmp_path: Path) -> None:
    """An MoE model (Qwen2-MoE: routed experts, the sigmoid-gated shared expert, a dense layer 0) in the tree layout:
    W = 1 and W = 4 with a random expert placement give the same bits (docs/spec.md §9.5). Negative control: the
    plain fold layout of the same model differs between W = 1 and W = 2 (o_proj's sum follows W)."""
    pytest.importorskip("transformers")
    moe = ["--config", "qwen2-moe-tiny"]
    paths = {}
    for name, w, extra in (("tree1", 1, TREE), ("tree4", 4, [*TREE, "--ep", "--placement-seed", "1"]),
                           ("fold1", 1, []), ("fold2", 2, [])):
        paths[name] = str(tmp_path / f"{name}.json")
        _launch(w, "hf", *moe, *SMALL, *extra, "--json", paths[name])
    out = ok(run_module(["detcomm.probe", "tp-compare", paths["tree1"], paths["tree4"]]))
    assert "virtual V=8 tree" in out and "PASS: identical token ids and logprob bits at W = 1, 4" in out
    proc = run_module(["detcomm.probe", "tp-compare", paths["fold1"], paths["fold2"], "--expect-divergence"])
    assert proc.returncode == 0 and "DIFFERENT" in proc.stdout, proc.stdout
