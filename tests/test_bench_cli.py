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
    assert measured == {("all_reduce", "native"), ("all_reduce", "gather_fold"), ("all_reduce", "rs_ag_fold"),
                        ("reduce_scatter", "native"),
                        ("reduce_scatter", "a2a_fold"), ("all_gather", "native")}
    for p in pts:
        assert p["eager"]["n"] >= 50
        assert p["eager"]["p10_us"] <= p["eager"]["median_us"] <= p["eager"]["p90_us"]
        assert p["algbw_GBps"] > 0 and p["busbw_GBps"] > 0
        # In place (out=x, the public API) exactly where the collective keeps the row count.
        if p["collective"] == "all_reduce":
            assert p["inplace"]["n"] >= 50 and p["inplace"]["median_us"] > 0, p
        else:
            assert p["inplace"] is None, p
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


def test_quick_ratio_table_says_cpu_timings_are_noise(quick_run: tuple[Path, str]) -> None:
    from detcomm.bench.report import CPU_NOTE

    _, stdout = quick_run
    ratios = stdout[stdout.index("### Fold-route time over native time"):]
    assert CPU_NOTE in ratios


def test_nccl_tests_style_size_sweep() -> None:
    from detcomm.bench.cli import _nbytes, byte_sweep

    assert [_nbytes(t) for t in ("8", "64K", "128M", "1G", "2kb")] == [8, 64 << 10, 128 << 20, 1 << 30, 2 << 10]
    shapes = byte_sweep(8, 128 << 20, 2, dtypes=("bfloat16", "float32"), hidden=4096, group=4)
    for dtype, elem, top in (("bfloat16", 2, 128 << 20), ("float32", 4, 128 << 20)):
        mine = [(h, r) for d, h, r in shapes if d == dtype]
        sizes = [h * r * elem for h, r in mine]
        # Every power of two from 8 B (fp32: from 8 B = 2 values) up to 128 MiB, once, in order.
        assert sizes == [1 << i for i in range(3, 28)], (dtype, sizes)
        # Whole 4096-wide rows from one row up; shorter messages are 4 rows (reduce-scatter splits them) or one.
        assert all(h == 4096 for h, r in mine if h * r * elem >= 4096 * elem)
        assert all(r in (1, 4) for h, r in mine if h < 4096)
        assert sizes[-1] == top
    assert byte_sweep(64, 256, 4, dtypes=("bfloat16",), hidden=16, group=2) == [("bfloat16", 16, 2), ("bfloat16", 16, 8)]
    with pytest.raises(ValueError, match="larger than"):
        byte_sweep(1024, 8, 2, dtypes=("bfloat16",), hidden=4096, group=4)


def test_size_sweep_reaches_the_bench_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from detcomm.bench import cli, sweep

    seen = {}

    def fake_run(cfg: sweep.BenchConfig) -> dict:
        seen["cfg"] = cfg
        return {"meta": {"hardware": "x", "torch": "t", "cuda": None, "date": "d", "command": cfg.command,
                         "elapsed_s": 0.0}, "points": [], "unavailable": []}

    monkeypatch.setattr(sweep, "run_bench", fake_run)
    assert cli.main(["--device", "cpu", "-b", "8K", "-e", "32K", "-f", "2", "--dtypes", "bfloat16", "--no-plots",
                     "--no-progress", "--out", str(tmp_path)]) == 0
    cfg = seen["cfg"]
    assert cfg.shapes() == [("bfloat16", 4096, 1), ("bfloat16", 4096, 2), ("bfloat16", 4096, 4)]
    assert cfg.rows == (1, 2, 4) and cfg.hidden == (4096,)
    with pytest.raises(SystemExit):
        cli.main(["-b", "8K", "--out", str(tmp_path)])  # -e missing
