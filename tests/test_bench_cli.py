"""detcomm-bench --quick on CPU (gloo, W=4): the outputs exist and parse. Not a timing test: no number is
compared with a threshold, only the shape of what was written and the bench's own claims about bits (the fold
routes move no bits; the multicast rows say why they did not run)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("matplotlib", reason="detcomm-bench writes PNG plots with matplotlib")
pytest.importorskip("tqdm", reason="detcomm-bench shows a tqdm progress bar")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "detcomm.bench", "--quick", "--no-progress", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return out, proc.stdout


def test_quick_writes_every_output(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    for name in ("results.json", "results.csv", "results.md", "latency_vs_size.png", "divergence_vs_size.png",
                 "ratio_vs_size.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_quick_json_parses_and_covers_the_routes(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    data = json.loads((out / "results.json").read_text())
    assert {"meta", "points", "unavailable", "ratios"} <= set(data)
    pts = data["points"]
    assert pts and all(p["status"] == "ok" and p["harness"] == "gloo" and p["world"] == 4 for p in pts)
    measured = {(p["collective"], p["route"]) for p in pts}
    assert measured == {("all_reduce", "native"), ("all_reduce", "gather_fold"), ("reduce_scatter", "native"),
                        ("reduce_scatter", "a2a_fold"), ("all_gather", "native")}
    for p in pts:
        assert p["eager"]["n"] >= 50
        assert p["eager"]["p10_us"] <= p["eager"]["median_us"] <= p["eager"]["p90_us"]
        assert p["algbw_GBps"] > 0 and p["busbw_GBps"] > 0
    # Same sizes for every route: each route's (dtype, hidden, rows) set equals native's for its collective.
    for coll in ("all_reduce", "reduce_scatter"):
        sizes = {r: {(p["dtype"], p["hidden"], p["rows"]) for p in pts if p["collective"] == coll and p["route"] == r}
                 for r in {p["route"] for p in pts if p["collective"] == coll}}
        assert len({frozenset(s) for s in sizes.values()}) == 1, sizes
    # The canonical-fold routes move no bits and equal the canonical fold.
    for p in pts:
        if p["route"] in ("gather_fold", "a2a_fold"):
            assert p["changed_frac"] == 0 and p["max_ulps"] == 0, p
    unavailable = {(u["collective"], u["route"]): u["status"] for u in data["unavailable"]}
    assert unavailable[("all_reduce", "in_switch")].startswith("unavailable: ")
    assert unavailable[("all_gather", "multicast_gather")].startswith("unavailable: ")
    assert unavailable[("all_reduce", "native_ring_simple")] == "n/a on gloo (NCCL_ALGO/NCCL_PROTO are NCCL's)"
    assert unavailable[("all_reduce", "ipc_one_shot")].startswith("unavailable: ")
    assert {r["route"] for r in data["ratios"]} == {"gather_fold", "a2a_fold"}


def test_quick_csv_and_markdown_parse(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    data = json.loads((out / "results.json").read_text())
    with (out / "results.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(data["points"]) + len(data["unavailable"])
    for r in rows[:len(data["points"])]:
        float(r["eager_median_us"]), float(r["busbw_GBps"])
    md = (out / "results.md").read_text()
    assert md in stdout  # the markdown tables go to stdout as well
    table = [line for line in md.splitlines() if line.startswith("| gloo | 4 |")]
    assert len(table) >= len(data["points"]) and all(line.count("|") >= 15 for line in table[:len(data["points"])])
    assert "### Fold-route time over native time" in md
