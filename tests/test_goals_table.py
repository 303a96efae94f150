"""bench/goals_table.py: the workspace speed goals read from the bench's JSON rows (synthetic rows here)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("goals_table", ROOT / "bench" / "goals_table.py")
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
        {"mode": "latency", "world": 8, "bytes": 16 * KIB, "algo": "one_store", "graph_us": 7.9, "eager_us": 1.0},
        _nccl("nccl", 16 * KIB, 10.0, eager=26.0),
        _nccl("one_store", 16 * KIB, 5.6),
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
    rows[5] = _nccl("one_store", 16 * KIB, 4.9)
    assert _verdicts(rows)["W=2 16 KiB graph (one GPU per rank)"] == "met"


def test_main_reads_files_and_skips_missing_ones(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    f = tmp_path / "bench_nccl.json"
    f.write_text(json.dumps({"header": {}, "rows": [_nccl("nccl", 64 * MIB, 247.0), _nccl("two_shot", 64 * MIB, 250.0)]}))
    goals_table.main([str(f), str(tmp_path / "absent.json")])
    out = capsys.readouterr().out
    assert "| W=2 64 MiB graph, best variant / NCCL default | 250.0 / 247.0 us = 1.012x | <= 1.0x | missed |" in out


def _fused(hidden: int, rows: int, fused: float, unfused: float, nccl: float | None = None, same: bool = True) -> dict:
    rec = {"hidden": hidden, "rows": rows, "fused": {"median_us": fused}, "unfused": {"median_us": unfused},
           "fused_equals_unfused": same, "fused_row0_changed": 0}
    if nccl is not None:
        rec["nccl_torch"] = {"median_us": nccl}
    return rec


def _fused_verdicts(docs: list[dict]) -> dict[str, tuple[str, str]]:
    return {e["measure"]: (e["verdict"], e["value"])
            for e in goals_table.fused_goals(goals_table._records(docs))}


def test_fused_goals_per_place_worst_shape_counts() -> None:
    gpus = {"records": [{"routes": "..."},  # bench.norm's leading entry is not a record
                        _fused(4096, 1, 6.0, 9.0, nccl=20.0), _fused(4096, 8, 6.2, 9.0, nccl=21.0),
                        _fused(4096, 64, 12.0, 12.5, nccl=11.0)]}  # a large shape: outside the decode goal
    streams = {"setting": "streams", "records": [_fused(4096, 1, 9.8, 10.8), _fused(8192, 8, 13.2, 12.9)]}
    v = _fused_verdicts([gpus, streams])
    decode = "fused / unfused, decode sizes (rows <= 8)"
    peer = "fused / NCCL all-reduce + torch's add and rms_norm, every shape"
    bits = "bits: fused == unfused on every shape (and row 0 alone == in the batch, where checked)"
    assert v[f"{decode} (one GPU per rank)"] == ("met", "0.67-0.69x over 2 shapes")
    assert v[f"{peer} (one GPU per rank)"] == ("missed", "0.30-1.09x over 3 shapes")  # 64 rows: 12.0 vs 11.0
    assert v[f"{bits} (one GPU per rank)"][0] == "met"
    assert v[f"{decode} (streams of one GPU)"] == ("missed", "0.91-1.02x over 2 shapes")
    assert v[f"{peer} (streams of one GPU)"][0] == "not measured"  # no NCCL beside two streams of one GPU
    # one decode shape above 0.7x makes the goal a miss; one shape whose bits differ fails the bits line
    gpus["records"][3] = _fused(4096, 64, 12.0, 12.5, nccl=13.0)
    gpus["records"].append(_fused(8192, 1, 7.5, 10.0, nccl=21.0, same=False))
    v = _fused_verdicts([gpus])
    assert v[f"{decode} (one GPU per rank)"] == ("missed", "0.67-0.75x over 3 shapes")
    assert v[f"{peer} (one GPU per rank)"][0] == "met"
    assert v[f"{bits} (one GPU per rank)"] == ("missed", "3 of 4 shapes")
    assert _fused_verdicts([])[f"{decode} (one GPU per rank)"][0] == "not measured"


def test_main_prints_both_tables(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    f = tmp_path / "fused_streams.json"
    f.write_text(json.dumps({"setting": "streams", "records": [_fused(4096, 1, 6.0, 10.0)]}))
    goals_table.main([str(f)])
    out = capsys.readouterr().out
    assert "Workspace all-reduce:" in out and "Fused all-reduce + residual add + RMSNorm:" in out
    assert "| fused / unfused, decode sizes (rows <= 8) (streams of one GPU) | 0.60-0.60x over 1 shapes | <= 0.7x | met |" in out
