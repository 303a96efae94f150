"""launch/goals_table.py: the workspace speed goals read from the bench's JSON rows (synthetic rows here)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("goals_table", ROOT / "launch" / "goals_table.py")
assert _spec is not None and _spec.loader is not None
goals_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(goals_table)

KIB, MIB = 1 << 10, 1 << 20


def _nccl(impl: str, size: int, graph: float, eager: float = 50.0, env: dict | None = None) -> dict:
    return {"mode": "nccl", "world": 2, "bytes": size, "impl": impl, "nccl_env": env or {}, "eager_us": eager,
            "graph_us": graph}


def _verdicts(rows: list[dict]) -> dict[str, str]:
    return {e["measure"]: e["verdict"] for e in goals_table.goals(goals_table._rows([{"rows": rows}]))}


def test_verdicts_from_rows_and_what_is_missing() -> None:
    rows = [
        {"mode": "latency", "world": 1, "bytes": 64 * MIB, "algo": "one_shot", "graph_us": 40.0, "eager_us": 44.0},
        {"mode": "latency", "world": 1, "bytes": 64 * MIB, "algo": "copy", "graph_us": 36.0, "eager_us": 38.0},
        {"mode": "latency", "world": 8, "bytes": 16 * KIB, "algo": "one_shot", "graph_us": 13.2, "eager_us": 1.0},
        {"mode": "latency", "world": 8, "bytes": 16 * KIB, "algo": "lamport", "graph_us": 7.9, "eager_us": 1.0},
        _nccl("nccl", 16 * KIB, 10.0, eager=26.0),
        _nccl("lamport", 16 * KIB, 5.6),
        _nccl("detcomm", 16 * KIB, 5.8, eager=12.7),
        # a Ring row must not stand in for NCCL's default (its eager 10 us would make the eager goal a miss)
        _nccl("nccl", 16 * KIB, 30.0, eager=10.0, env={"NCCL_ALGO": "Ring"}),
        _nccl("gather_fold", 16 * KIB, math.nan),  # eager only: no graph value
        {"mode": "host", "world": 2, "bytes": 16 * KIB, "impl": "detcomm", "nccl_env": {}, "host_us": 9.5},
    ]
    v = _verdicts(rows)
    assert v["W=1 local one-shot 64 MiB / copy of the same bytes"] == "met"  # 1.11x
    assert v["W=2 16 KiB graph (one GPU per rank)"] == "missed"  # 0.56x of NCCL's default, above 5 us
    assert v["W=2 eager 16 KiB, detcomm.all_reduce / NCCL eager"] == "met"  # 0.49x
    assert v["W=8 streams of one GPU, 16 KiB graph (fastest kernel)"] == "met"  # the fastest kernel counts
    assert v["gather_fold 16 KiB graph / NCCL graph"] == "not measured"  # NaN is no value
    assert v["W=2 64 MiB graph, best variant / NCCL default"] == "not measured"
    assert v["host time of one eager detcomm.all_reduce, 16 KiB"] == "met"
    # the same rows with the W=2 16 KiB kernel faster: both parts of that goal hold
    rows[5] = _nccl("lamport", 16 * KIB, 4.9)
    assert _verdicts(rows)["W=2 16 KiB graph (one GPU per rank)"] == "met"


def test_main_reads_files_and_skips_missing_ones(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    f = tmp_path / "bench_nccl.json"
    f.write_text(json.dumps({"header": {}, "rows": [_nccl("nccl", 64 * MIB, 247.0), _nccl("two_shot", 64 * MIB, 250.0)]}))
    goals_table.main([str(f), str(tmp_path / "absent.json")])
    out = capsys.readouterr().out
    assert "| W=2 64 MiB graph, best variant / NCCL default | 250.0 / 247.0 us = 1.012x | <= 1.0x | missed |" in out
