"""The speed goals of the workspace's all-reduce and of the fused all-reduce + norm, read from the benches' own
JSON, one machine kind per call.

    python bench/goals_table.py gpu-out/bench_streams.json gpu-out/bench_nccl.json gpu-out/fused/fused.json

Reads the rows `python bench/ipc_kernels.py` writes (modes latency, nccl, host) and the records of the
fused benches (`python bench/norm.py --fused`, one rank per GPU, and `bench/fused_streams.py --json`, W
ranks as streams of one GPU), any number of files in any order, and prints each goals table as markdown: the
measured value, the goal and the verdict (met, missed, or not measured when the files hold no row for it: the
NVLink rows need two GPUs, the W = 8 row the streams bench, the NCCL + torch comparison the multi-GPU fused bench).
Where several rows fit one value (NCCL's 16 KiB row is in both the nccl and the gather-graph runs), the fastest
counts, for NCCL too: the peer at its best, so a ratio never flatters the workspace.
`STAGES=bench bash gpu/run.sh` calls it at the end, so one device call per machine kind fills the tables.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from detcomm.tables import format_table

KIB, MIB = 1 << 10, 1 << 20
# The workspace's all-reduce kernels and the public call, as the bench names them.
KERNELS = ("one_store", "one_shot", "two_shot")
WORKSPACE = (*KERNELS, "detcomm", "detcomm_inplace")


def _rows(docs: Iterable[Any]) -> list[dict]:
    out: list[dict] = []
    for doc in docs:
        if isinstance(doc, dict) and "records" in doc:
            continue  # a fused bench's records: fused_goals
        rows = doc["rows"] if isinstance(doc, dict) else doc
        out.extend(r for r in rows if r.get("nccl_env", {}) == {})  # NCCL's default protocol only
    return out


def _entry(measure: str, goal: str, value: str | None, met: bool | None) -> dict[str, str]:
    """One row of a goals table: "not measured" when there is no value, else met or missed."""
    verdict = "not measured" if value is None else ("met" if met else "missed")
    return {"measure": measure, "value": value or "-", "goal": goal, "verdict": verdict}


# Decode sizes for the fused goal: the rows of one decode step of a small batch.
DECODE_ROWS = 8


def _records(docs: Iterable[Any]) -> list[dict]:
    """The fused benches' records, each tagged with where it ran ("one GPU per rank" or "streams of one GPU")."""
    out: list[dict] = []
    for doc in docs:
        if isinstance(doc, dict) and "records" in doc:
            where = "streams of one GPU" if doc.get("setting") == "streams" else "one GPU per rank"
            out.extend({**r, "where": where} for r in doc["records"] if "hidden" in r)
    return out


def _median(rec: dict, col: str) -> float | None:
    v = rec.get(col)
    if isinstance(v, dict):
        v = v.get("median_us")
    return None if v is None or math.isnan(v) else float(v)


def fused_goals(records: list[dict]) -> list[dict[str, str]]:
    """The fused all-reduce + norm's goals, per place the fused bench ran: fused / unfused at decode sizes (rows <= DECODE_ROWS, the
    worst shape counts), fused / NCCL + torch's norm on every shape (the worst counts), and the bits."""
    out = []
    for where in ("one GPU per rank", "streams of one GPU"):
        recs = [r for r in records if r["where"] == where]

        def add(measure: str, goal: str, value: str | None, met: bool | None, where: str = where) -> None:
            out.append(_entry(f"{measure} ({where})", goal, value, met))

        dec = [(r, _median(r, "fused"), _median(r, "unfused")) for r in recs if r["rows"] <= DECODE_ROWS]
        ratios = [f / u for _, f, u in dec if f is not None and u is not None]
        add(f"fused / unfused, decode sizes (rows <= {DECODE_ROWS})", "<= 0.7x",
            f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} shapes" if ratios else None,
            max(ratios) <= 0.7 if ratios else None)
        peer = [f / n for r in recs if (f := _median(r, "fused")) is not None and (n := _median(r, "nccl_torch"))]
        add("fused / NCCL all-reduce + torch's add and rms_norm, every shape", "<= 1.0x (never slower)",
            f"{min(peer):.2f}-{max(peer):.2f}x over {len(peer)} shapes" if peer else None,
            max(peer) <= 1.0 if peer else None)
        same = [bool(r.get("fused_equals_unfused")) and not r.get("fused_row0_changed") for r in recs]
        add("bits: fused == unfused on every shape (and row 0 alone == in the batch, where checked)", "always",
            f"{sum(same)} of {len(same)} shapes" if same else None, all(same) if same else None)
    return out


def _value(rows: list[dict], mode: str, world: int, size: int, impls: Iterable[str], key: str) -> float | None:
    """The smallest `key` of the rows that match (NaN, e.g. an eager-only route's graph time, is no value)."""
    vals = [r[key] for r in rows if r["mode"] == mode and r["world"] == world and r["bytes"] == size
            and r.get("impl", r.get("algo")) in impls and key in r and not math.isnan(r[key])]
    return min(vals) if vals else None


def goals(rows: list[dict]) -> list[dict[str, str]]:
    """One entry per goal: measure, value, goal, verdict."""
    out = []

    def add(measure: str, goal: str, value: str | None, met: bool | None) -> None:
        out.append(_entry(measure, goal, value, met))

    ws, cp = (_value(rows, "latency", 1, 64 * MIB, (k,), "graph_us") for k in ("one_shot", "copy"))
    add("W=1 local one-shot 64 MiB / copy of the same bytes", "<= 1.25x",
        None if ws is None or cp is None else f"{ws:.1f} / {cp:.1f} us = {ws / cp:.2f}x",
        None if ws is None or cp is None else ws / cp <= 1.25)
    best, nccl = _value(rows, "nccl", 2, 16 * KIB, WORKSPACE, "graph_us"), _value(rows, "nccl", 2, 16 * KIB, ("nccl",),
                                                                                   "graph_us")
    add("W=2 16 KiB graph (one GPU per rank)", "<= 5 us and <= 0.55x NCCL default",
        None if best is None or nccl is None else f"{best:.1f} us vs NCCL {nccl:.1f} = {best / nccl:.2f}x",
        None if best is None or nccl is None else best <= 5.0 and best / nccl <= 0.55)
    best, nccl = _value(rows, "nccl", 2, 64 * MIB, WORKSPACE, "graph_us"), _value(rows, "nccl", 2, 64 * MIB, ("nccl",),
                                                                                   "graph_us")
    add("W=2 64 MiB graph, best variant / NCCL default", "<= 1.0x",
        None if best is None or nccl is None else f"{best:.1f} / {nccl:.1f} us = {best / nccl:.3f}x",
        None if best is None or nccl is None else best / nccl <= 1.0)
    pub, nccl = _value(rows, "nccl", 2, 16 * KIB, ("detcomm",), "eager_us"), _value(rows, "nccl", 2, 16 * KIB,
                                                                                     ("nccl",), "eager_us")
    add("W=2 eager 16 KiB, detcomm.all_reduce / NCCL eager", "<= 0.6x",
        None if pub is None or nccl is None else f"{pub:.1f} / {nccl:.1f} us = {pub / nccl:.2f}x",
        None if pub is None or nccl is None else pub / nccl <= 0.6)
    w8 = _value(rows, "latency", 8, 16 * KIB, KERNELS, "graph_us")
    add("W=8 streams of one GPU, 16 KiB graph (fastest kernel)", "<= 8 us",
        None if w8 is None else f"{w8:.1f} us", None if w8 is None else w8 <= 8.0)
    gf, nccl = _value(rows, "nccl", 2, 16 * KIB, ("gather_fold",), "graph_us"), _value(rows, "nccl", 2, 16 * KIB,
                                                                                        ("nccl",), "graph_us")
    add("gather_fold 16 KiB graph / NCCL graph", "<= 2x",
        None if gf is None or nccl is None else f"{gf:.1f} / {nccl:.1f} us = {gf / nccl:.2f}x",
        None if gf is None or nccl is None else gf / nccl <= 2.0)
    host = _value(rows, "host", 2, 16 * KIB, ("detcomm",), "host_us")
    add("host time of one eager detcomm.all_reduce, 16 KiB", "<= 10 us", None if host is None else f"{host:.1f} us",
        None if host is None else host <= 10.0)
    return out


def to_markdown(entries: list[dict[str, str]]) -> str:
    return format_table(("measure", "measured", "goal", "verdict"),
                        [[e["measure"], e["value"], e["goal"], e["verdict"]] for e in entries], markdown=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path,
                   help="JSON written by bench/ipc_kernels.py or the fused benches (missing: skipped)")
    a = p.parse_args(argv)
    docs = [json.loads(f.read_text()) for f in a.files if f.exists()]
    print("Workspace all-reduce:\n")
    print(to_markdown(goals(_rows(docs))))
    print("\nFused all-reduce + residual add + RMSNorm:\n")
    print(to_markdown(fused_goals(_records(docs))))


if __name__ == "__main__":
    main()
