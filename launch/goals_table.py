"""The workspace speed goals (docs/performance.md, issue 12) from the bench's own JSON, one machine kind per call.

    python launch/goals_table.py gpu-out/bench_streams.json gpu-out/bench_nccl.json gpu-out/bench_gather_graph.json

Reads the rows `python -m detcomm.bench.ipc_kernels` writes (modes latency, nccl, host; any number of files, in
any order) and prints the goals table as markdown: the measured value, the goal and the verdict (met, missed, or
not measured when the files hold no row for it: the NVLink rows need two GPUs, the W = 8 row the streams bench).
Where several rows fit one value (NCCL's 16 KiB row is in both the nccl and the gather-graph runs), the fastest
counts, for NCCL too: the peer at its best, so a ratio never flatters the workspace.
`STAGES=bench bash launch/gpu_run.sh` calls it at the end, so one device call per machine kind fills the table.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

KIB, MIB = 1 << 10, 1 << 20
# The workspace's all-reduce kernels and the public call, as the bench names them.
KERNELS = ("lamport", "one_shot", "two_shot")
WORKSPACE = (*KERNELS, "detcomm", "detcomm_inplace")


def _rows(docs: Iterable[Any]) -> list[dict]:
    out: list[dict] = []
    for doc in docs:
        rows = doc["rows"] if isinstance(doc, dict) else doc
        out.extend(r for r in rows if r.get("nccl_env", {}) == {})  # NCCL's default protocol only
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
        verdict = "not measured" if value is None else ("met" if met else "missed")
        out.append({"measure": measure, "value": value or "-", "goal": goal, "verdict": verdict})

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
    lines = ["| measure | measured | goal | verdict |", "| --- | --- | --- | --- |"]
    lines += [f"| {e['measure']} | {e['value']} | {e['goal']} | {e['verdict']} |" for e in entries]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="JSON written by detcomm.bench.ipc_kernels (missing: skipped)")
    a = p.parse_args(argv)
    docs = [json.loads(f.read_text()) for f in a.files if f.exists()]
    print(to_markdown(goals(_rows(docs))))


if __name__ == "__main__":
    main()
