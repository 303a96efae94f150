"""The bench's written outputs: the markdown tables (stdout and results.md), results.json, results.csv, and
the ratio summary (fold-route time over native time at 16 KiB, 256 KiB, 4 MiB and 64 MiB, per W).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from detcomm.tables import format_table

__all__ = ["CPU_NOTE", "RATIO_SIZES", "ratio_summary", "to_markdown", "write_outputs", "size_label", "load_result"]

RATIO_SIZES = (16 << 10, 256 << 10, 4 << 20, 64 << 20)
CPU_NOTE = ("Note: these are CPU timings (gloo processes sharing the host's cores with everything else): they are "
            "noise, good for checking that the sweep runs, not for comparing routes. Measure on GPUs "
            "(--device cuda) for ratios that mean something.")
_FOLD = {"all_reduce": ("gather_fold", "ipc_one_store", "ipc_one_shot", "ipc_two_shot"),
         "reduce_scatter": ("a2a_fold", "ipc_fold")}
_CSV_FIELDS = ("harness", "world", "collective", "route", "dtype", "hidden", "rows", "bytes", "status",
               "eager_median_us", "eager_p10_us", "eager_p90_us", "eager_n", "graph_median_us", "graph_p10_us",
               "graph_p90_us", "graph_n", "graph_note", "inplace_median_us", "inplace_p10_us", "inplace_p90_us",
               "inplace_n", "algbw_GBps", "busbw_GBps", "graph_algbw_GBps",
               "graph_busbw_GBps", "changed_frac", "max_ulps")


def size_label(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            v = nbytes / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{nbytes} B"


def _ok(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in points if p["status"] == "ok" and p["eager"]]


def _at_size(points: list[dict[str, Any]], target: int) -> dict[tuple[str, int], dict[str, Any]]:
    """The measured points nearest ``target`` bytes, per (dtype, hidden): exact first (bf16 x 4096 hits every
    ratio size exactly), else within a factor 1.5."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for p in points:
        d = abs(math.log(p["bytes"] / target))
        if d > math.log(1.5):
            continue
        k = (p["dtype"], p["hidden"])
        if k not in best or d < abs(math.log(best[k]["bytes"] / target)):
            best[k] = p
    return best


def _pick(points: list[dict[str, Any]], target: int) -> dict[str, Any] | None:
    near = _at_size(points, target)
    if not near:
        return None
    # Prefer bf16 at the smallest hidden size (the model width the sizes start from), exact sizes first.
    return min(near.values(), key=lambda p: (p["bytes"] != target, p["dtype"] != "bfloat16", p["hidden"]))


def ratio_summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (harness, W, collective, fold route, target size): the fold route's median over native's (default
    and Ring/Simple), eager and graph, measured at the same point; in-switch's status where it did not run."""
    pts = _ok(result["points"])
    mc = {(u["harness"], u["world"], u["collective"]): u["status"] for u in result["unavailable"]
          if u["route"] == "in_switch"}
    out = []
    for harness, world in sorted({(p["harness"], p["world"]) for p in result["points"]}):
        for coll, folds in _FOLD.items():
            for fold in folds:
                mine = [p for p in pts if (p["harness"], p["world"], p["collective"], p["route"]) ==
                        (harness, world, coll, fold)]
                if not mine:
                    continue
                for target in RATIO_SIZES:
                    p = _pick(mine, target)
                    row: dict[str, Any] = {"harness": harness, "world": world, "collective": coll, "route": fold,
                                           "target_bytes": target, "point": None}
                    if p is not None:
                        row["point"] = f"{p['dtype']} {p['rows']}x{p['hidden']} ({size_label(p['bytes'])})"
                    for base in ("native", "native_ring_simple"):
                        for mode in ("eager", "graph"):
                            row[f"vs_{base}_{mode}"] = None
                            if p is None:
                                continue
                            q = next((q for q in pts if (q["harness"], q["world"], q["collective"], q["route"],
                                                         q["dtype"], q["hidden"], q["rows"]) ==
                                      (harness, world, coll, base, p["dtype"], p["hidden"], p["rows"])), None)
                            if q is not None and p.get(mode) and q.get(mode):
                                row[f"vs_{base}_{mode}"] = p[mode]["median_us"] / q[mode]["median_us"]
                    row["vs_in_switch"] = mc.get((harness, world, coll), "not measured")
                    out.append(row)
    return out


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def _lat(s: dict[str, float] | None) -> str:
    return "—" if not s else f"{s['median_us']:.1f} [{s['p10_us']:.1f}, {s['p90_us']:.1f}]"


def _ulps(v: float | None) -> str:
    if v is None:
        return "—"
    return "inf" if math.isinf(v) else f"{v:.0f}"


def _frac(v: float | None) -> str:
    return "—" if v is None else (f"{v:.4f}" if v else "0")


def to_markdown(result: dict[str, Any], *, ratios: list[dict[str, Any]] | None = None) -> str:
    """Every table of one run as markdown."""
    m = result["meta"]
    lines = [f"## detcomm-bench: {m['hardware']}, torch {m['torch']}" + (f", CUDA {m['cuda']}" if m["cuda"] else ""),
             "", f"date {m['date']}; command `{m['command']}`; {m['elapsed_s']} s", "",
             "Latency in µs per call: median [p10, p90] over the timed calls (eager; graph = CUDA-graph replay), "
             "eager is out-of-place (every call writes a new output tensor); in-place = the public API's "
             "all_reduce(x, site, out=x) on the site routes (all-reduce only: the other collectives change the "
             "row count). "
             "algbw/busbw (GB/s, nccl-tests definitions) from the eager median. changed = fraction of the probe's "
             "elements whose bits change when the same rows sit at another offset or in another batch size; "
             "max ulps = largest distance from the canonical fold of the gathered inputs.", ""]
    if m.get("harnesses"):
        lines += [format_table(["harness", "setup"], [
            [s["harness"], ", ".join(f"{k}: {v}" for k, v in s.items() if k != "harness")] for s in m["harnesses"]],
            markdown=True, align="ll"), ""]
    points = []
    for p in result["points"]:
        # The full reason stays in the JSON/CSV; the table keeps its first words.
        graph = _lat(p["graph"]) if p["graph"] else (p["graph_note"].split(":")[0] or "—")
        points.append([p["harness"], p["world"], p["collective"], p["route"], p["dtype"], f"{p['rows']}×{p['hidden']}",
                       size_label(p["bytes"]), _lat(p["eager"]), _lat(p.get("inplace")),
                       graph, _f(p["algbw_GBps"], "{:.2f}"),
                       _f(p["busbw_GBps"], "{:.2f}"), _frac(p["changed_frac"]), _ulps(p["max_ulps"]), p["status"]])
    lines.append(format_table(["harness", "W", "collective", "route", "dtype", "rows×hidden", "size", "eager µs",
                               "in-place µs", "graph µs", "algbw", "busbw", "changed", "max ulps", "status"], points,
                              markdown=True, align="lrllllrlllrrrrl"))
    lines += ["", "### Routes not measured", "",
              format_table(["harness", "W", "collective", "route", "status"],
                           [[u["harness"], u["world"], u["collective"], u["route"], u["status"]]
                            for u in result["unavailable"]], markdown=True, align="lrlll")]
    ratios = ratio_summary(result) if ratios is None else ratios
    lines += ["", "### Fold-route time over native time (median, eager / graph)", ""]
    if any(r["harness"] == "gloo" for r in ratios):
        lines += [CPU_NOTE, ""]
    ratio_rows = []
    keys = sorted({(r["harness"], r["world"], r["collective"], r["route"]) for r in ratios},
                  key=lambda k: (k[0], k[1], k[2], FOLD_ORDER.index(k[3])))
    for k in keys:
        cells, ins = [], ""
        for s in RATIO_SIZES:
            r = next(r for r in ratios if (r["harness"], r["world"], r["collective"], r["route"], r["target_bytes"]) ==
                     (*k, s))
            ins = r["vs_in_switch"]
            if r["point"] is None:
                cells.append("not measured")
            elif r["vs_native_eager"] is None and r["vs_native_graph"] is None:
                cells.append("no native here")
            else:
                cell = f"{_f(r['vs_native_eager'], '{:.2f}')} / {_f(r['vs_native_graph'], '{:.2f}')}"
                cell += f" @{r['point'].split(' (')[0].replace('bfloat16', 'bf16').replace('float32', 'fp32')}"
                if r["vs_native_ring_simple_eager"] is not None:
                    cell += (f" (Ring/Simple {_f(r['vs_native_ring_simple_eager'], '{:.2f}')} / "
                             f"{_f(r['vs_native_ring_simple_graph'], '{:.2f}')})")
                cells.append(cell)
        ratio_rows.append([*k, *cells, ins])
    lines.append(format_table(["harness", "W", "collective", "fold route", *(size_label(s) for s in RATIO_SIZES),
                              "over in-switch"], ratio_rows, markdown=True,
                              align="lrll" + "r" * len(RATIO_SIZES) + "l"))
    return "\n".join(lines) + "\n"


FOLD_ORDER = ("gather_fold", "ipc_one_store", "ipc_one_shot", "ipc_two_shot", "a2a_fold", "ipc_fold")


def _csv_row(p: dict[str, Any]) -> dict[str, Any]:
    row = {k: p.get(k) for k in _CSV_FIELDS if k in p}
    for mode in ("eager", "graph", "inplace"):
        s = p.get(mode) or {}
        for stat in ("median_us", "p10_us", "p90_us", "n"):
            row[f"{mode}_{stat}"] = s.get(stat)
    return row


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def load_result(path: Path) -> dict[str, Any]:
    """A results.json read back as run_bench returned it (for re-rendering tables and plots without measuring)."""
    data = json.loads(Path(path).read_text())
    if not {"meta", "points", "unavailable"} <= set(data):
        raise ValueError(f"{path} is not a detcomm-bench results.json (needs meta, points, unavailable)")
    for p in data["points"]:
        if isinstance(p.get("max_ulps"), str):
            p["max_ulps"] = float(p["max_ulps"])
    return {k: data[k] for k in ("meta", "points", "unavailable")}


def write_outputs(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write results.json, results.csv and results.md under ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ratios = ratio_summary(result)
    paths = {"json": out_dir / "results.json", "csv": out_dir / "results.csv", "md": out_dir / "results.md"}
    # Strict JSON: an infinite ulp distance (NaN against a number) is written as the string "inf".
    paths["json"].write_text(json.dumps(_finite({**result, "ratios": ratios}), indent=1, allow_nan=False) + "\n")
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=_CSV_FIELDS)
        w.writeheader()
        for p in result["points"]:
            w.writerow(_csv_row(p))
        for u in result["unavailable"]:
            w.writerow({"harness": u["harness"], "world": u["world"], "collective": u["collective"],
                        "route": u["route"], "status": u["status"]})
    paths["md"].write_text(to_markdown(result, ratios=ratios))
    return paths
