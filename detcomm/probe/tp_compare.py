"""``python -m detcomm.probe tp-compare A.json B.json ...``: the same requests at different TP widths W.

Reads the ``--json`` files of ``detcomm.probe model`` (or ``hf``: its "alone" run) runs of one request set at different W and
compares every request's token ids and logprob bit patterns with the first file's. In a TP-size-invariant
layout (``--virtual-shards V`` or ``--full-k``) nothing may differ (exit 1 otherwise); in the plain layout
(fold at each W) the bits must differ across W, and ``--expect-divergence`` makes that the exit status (the
negative control). One process, no process group.

    for w in 1 2 4; do detcomm-launch --nproc $w -m detcomm.probe model --virtual-shards 8 --json vs$w.json; done
    python -m detcomm.probe tp-compare vs1.json vs2.json vs4.json

The tree order (``--virtual-shards 8 --shard-fold tree``) compares the same way at W = 1, 2, 4.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ..tables import format_table
from .table import emit

__all__ = ["load", "compare", "main", "TABLE_HEADERS"]

TABLE_HEADERS = ["comparison", "layout", "sampling", "diverged", "tokens equal", "logprob bits equal",
                 "first divergence"]


def load(path: str) -> dict[str, Any]:
    """A probe's JSON; ValueError when it has no per-request records (written by an older probe)."""
    with open(path) as f:
        run = json.load(f)
    if "requests" not in run:
        raise ValueError(f"{path}: no per-request records: rerun the probe with --json PATH")
    run["requests"] = [_alone(r) for r in run["requests"]]
    return run


def _alone(record: dict[str, Any]) -> dict[str, Any]:
    """A request's tokens and logprob bits: the model probe stores them at the top, the HF probe per run (its
    "alone" run is the reference)."""
    return {**record, **record["runs"]["alone"]} if "runs" in record else record


def _label(run: dict[str, Any]) -> str:
    layout = run.get("layout", "fold")
    if layout != "virtual":
        return layout
    return f"virtual V={run['virtual_shards']}" + (" tree" if run.get("shard_fold") == "tree" else "")


def _first(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        if ta != tb:
            return f"token {i}: id {ta} vs {tb}"
        if a["logprob_bits"][i] != b["logprob_bits"][i]:
            return f"token {i}: logprob {a['logprob_bits'][i]} vs {b['logprob_bits'][i]}"
    if len(a["tokens"]) != len(b["tokens"]):
        return "length"
    return None


def compare(runs: Sequence[tuple[str, dict[str, Any]]]) -> tuple[list[list[str]], bool]:
    """Table rows comparing every run with the first, per sampling mode, and whether anything differed.
    ValueError when the runs are not of one request set."""
    ref_name, ref = runs[0]
    key = [(r["rid"], r["prompt"], r["temperature"], r["seed"]) for r in ref["requests"]]
    rows, differed = [], False
    for name, run in runs[1:]:
        if [(r["rid"], r["prompt"], r["temperature"], r["seed"]) for r in run["requests"]] != key:
            raise ValueError(f"{name} holds other requests than {ref_name}: run both with the same --seed, "
                             "--requests, --new-tokens and --max-prompt")
        label = f"W={run['world_size']} vs W={ref['world_size']}"
        layout = _label(run) if _label(run) == _label(ref) else f"{_label(run)} vs {_label(ref)}"
        for mode, temp in (("greedy", 0.0), ("temperature 1", 1.0)):
            pairs = [(a, b) for a, b in zip(run["requests"], ref["requests"]) if a["temperature"] == temp]
            firsts = [(a["rid"], _first(a, b)) for a, b in pairs]
            bad = [(rid, f) for rid, f in firsts if f is not None]
            differed |= bool(bad)
            tok = all(a["tokens"] == b["tokens"] for a, b in pairs)
            lp = all(a["logprob_bits"] == b["logprob_bits"] for a, b in pairs)
            rows.append([label, layout, mode, f"{len(bad)}/{len(pairs)}", "yes" if tok else "NO",
                         "yes" if lp else "NO", f"req {bad[0][0]} {bad[0][1]}" if bad else "-"])
    return rows, differed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m detcomm.probe tp-compare", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN.json", help="--json files of one request set at different W")
    p.add_argument("--expect-divergence", action="store_true",
                   help="negative control: exit 0 only if some token or logprob bit differs across the runs")
    ns = p.parse_args(argv)
    if len(ns.runs) < 2:
        p.error("give at least two runs")
    runs = [(path, load(path)) for path in ns.runs]
    rows, differed = compare(runs)
    widths = ", ".join(str(r["world_size"]) for _, r in runs)
    verdict = ("DIFFERENT across W" if differed else "PASS: identical token ids and logprob bits at W = " + widths)
    if ns.expect_divergence:
        verdict += " (negative control: a difference expected)"
    emit(format_table(TABLE_HEADERS, rows, title=f"TP-size comparison of {len(runs)} runs (W = {widths})"), verdict)
    if ns.expect_divergence:
        return 0 if differed else 1
    return 1 if differed else 0


if __name__ == "__main__":
    sys.exit(main())
