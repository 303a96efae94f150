"""gather_fold and a2a_fold captured in one CUDA graph on an NCCL group, replayed with new inputs (an in-place
call, whose copy back into x is captured too, among them).

Every result is compared bit for bit with the numpy oracle (tests/oracle.py) on ill-conditioned inputs with
signed zeros, subnormals, cancellation and non-canonical NaN payloads. Negative control: a replay after new
inputs must change the outputs (a graph that replays stale values, or reads a buffer other than the captured
one, fails it). W = 1 (a one-rank NCCL group on one GPU) always; W = 2 where two GPUs exist.

The capture uses capture_error_mode="thread_local": torch's NCCL watchdog thread queries events of earlier
work while the main thread captures, which the default global mode reports as a capture error on torch
versions where the watchdog does not switch its own mode. detcomm's routes do nothing on other threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import capture_and_replay

import oracle
from datagen import ill_bits, to_torch
from detcomm._spawn import LocalCluster

pytestmark = pytest.mark.gpu

_NAN = {"bfloat16": 0xFFC1, "float16": 0xFE01, "float32": 0xFFC00001}  # negative quiet NaNs with a payload


def _payload(rows: int, width: int, dtype: str, seed: int, rank: int) -> np.ndarray:
    bits = ill_bits(rows, width, dtype, seed=seed, rank=rank).copy()
    if rank == 0:
        bits.reshape(-1)[3::17] = _NAN[dtype]
    return bits


def job_fold_capture(rank: int, w: int) -> list[str]:
    import detcomm

    comm = detcomm.init(numerics="rl-bitwise", workspace=False)
    dev = comm.device
    problems: list[str] = []
    sites = {  # name: (collective, dtype, rows, route)
        "cap.ar": ("all_reduce", "bfloat16", 6, "gather_fold"),
        "cap.ar32": ("all_reduce", "float32", 3, "gather_fold"),
        "cap.ip": ("all_reduce", "float16", 5, "gather_fold"),
        "cap.rs": ("reduce_scatter", "bfloat16", 4 * w, "a2a_fold"),
    }
    width = 40
    for name, (coll, dt, rows, route) in sites.items():
        detcomm.site(name, collective=coll, dtype=getattr(torch, dt), shape=(width,), max_rows=rows, route=route)
    got_routes = {e.site.name: e.decision.route.value for e in detcomm.routes().entries}
    for name, (_, _, _, route) in sites.items():
        if got_routes.get(name) != route:
            problems.append(f"{name}: route {got_routes.get(name)}, expected {route}")

    def want(name: str, seed: int) -> np.ndarray:
        coll, dt, rows, _ = sites[name]
        full = oracle.fold_oracle([_payload(rows, width, dt, seed, r) for r in range(w)], dt)
        return full[rank * rows // w:(rank + 1) * rows // w] if coll == "reduce_scatter" else full

    static = {name: to_torch(_payload(rows, width, dt, 0, rank), dt).to(dev)
              for name, (_, dt, rows, _) in sites.items()}

    def calls() -> dict[str, torch.Tensor]:
        return {
            "cap.ar": detcomm.all_reduce(static["cap.ar"], "cap.ar"),
            "cap.ar32": detcomm.all_reduce(static["cap.ar32"], "cap.ar32"),
            "cap.ip": detcomm.all_reduce(static["cap.ip"], "cap.ip", out=static["cap.ip"]),
            "cap.rs": detcomm.reduce_scatter(static["cap.rs"], "cap.rs"),
        }

    def refill(seed: int) -> None:
        for name, (_, dt, rows, _) in sites.items():
            static[name].copy_(to_torch(_payload(rows, width, dt, seed, rank), dt).to(dev))

    found, outs = capture_and_replay(calls, refill, want, seeds=(1, 2, 3))
    problems += found
    if outs["cap.ip"] is not static["cap.ip"]:
        problems.append("cap.ip: the in-place call did not return x")
    detcomm.shutdown()
    return problems


def _run(w: int) -> None:
    from detcomm.envelope import envelope_environment

    with LocalCluster(w, backend="nccl", pg_timeout_s=60, env=envelope_environment("rl-bitwise")) as c:
        assert c.run(job_fold_capture, timeout_s=120) == [[]] * w


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fold_routes_capture_and_replay_one_rank() -> None:
    _run(1)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fold_routes_capture_and_replay_two_ranks() -> None:
    _run(2)
