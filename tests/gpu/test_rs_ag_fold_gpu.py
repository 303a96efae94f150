"""rs_ag_fold on a GPU: 4 processes sharing one GPU (gloo staging, CUDA tensors, the CUDA fold leaf) simulating
two hosts (DETCOMM_HOSTS), and a CUDA-graph capture of the route on a one-rank NCCL group.

Every result is compared bit for bit with the numpy oracle (tests/oracle.py) on ill-conditioned inputs with
signed zeros, subnormals, cancellation and non-canonical NaN payloads. Negative controls: a leaf that folds in
reversed rank order must differ from the oracle; a graph replay after new inputs must change the outputs.

The capture uses capture_error_mode="thread_local" (tests/gpu/test_fold_capture.py says why).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from harness import capture_and_replay

import oracle
from datagen import ill_bits, to_bits, to_torch
from detcomm._spawn import LocalCluster

pytestmark = pytest.mark.gpu

_NAN = {"bfloat16": 0xFFC1, "float16": 0xFE01, "float32": 0xFFC00001}  # negative quiet NaNs with a payload


def _payload(rows: int, width: int, dtype: str, seed: int, rank: int) -> np.ndarray:
    bits = ill_bits(rows, width, dtype, seed=seed, rank=rank).copy()
    if rank == 0:
        bits.reshape(-1)[3::17] = _NAN[dtype]
    bits[0, :] = 0x8000 if dtype != "float32" else 0x80000000  # -0.0 everywhere: the sum is +0.0
    return bits


def job_two_hosts_one_gpu(rank: int, w: int) -> list[str]:
    import detcomm
    from detcomm.numerics.fold import Leaf, portable_fold
    from detcomm.route_impls.rs_ag_fold import RsAgFoldRoute
    from detcomm.sites import ReduceOp

    os.environ["DETCOMM_HOSTS"] = "a,a,b,b"
    problems: list[str] = []
    try:
        comm = detcomm.init(numerics="rl-bitwise", device="cuda:0")
        try:
            if comm._workspace is not None or "several hosts" not in comm.caps.workspace_reason:
                problems.append(f"the workspace armed across simulated hosts: {comm.caps.workspace_reason}")
            for dtype in ("bfloat16", "float16", "float32"):
                # 1 MiB of bf16 at max_rows: above the two-host break-even at W = 4, so the router picks it.
                comm.site(f"g.{dtype}", collective="all_reduce", dtype=getattr(torch, dtype), shape=(1021,),
                          max_rows=512)
            routes = {e["site"]: e["route"] for e in comm.routes().as_dicts()}
            if {routes[f"g.{d}"] for d in ("bfloat16", "float16", "float32")} != {"rs_ag_fold"}:
                problems.append(f"routes: {routes}")
            for dtype in ("bfloat16", "float16", "float32"):
                for rows, seed in ((1, 1), (7, 2), (512, 3)):
                    inputs = [_payload(rows, 1021, dtype, seed, r) for r in range(w)]
                    x = to_torch(inputs[rank], dtype).to("cuda:0")
                    got = detcomm.all_reduce(x, site=f"g.{dtype}")
                    if not got.is_cuda or not np.array_equal(to_bits(got), oracle.fold_oracle(inputs, dtype)):
                        problems.append(f"{dtype} rows={rows}: differs from the oracle")
            inputs = [_payload(64, 129, "bfloat16", 9, r) for r in range(w)]
            x = to_torch(inputs[rank], "bfloat16").to("cuda:0")
            rev = Leaf("reversed", lambda s, d: portable_fold(s.flip(0), d))
            bad = RsAgFoldRoute(comm._native, rev).all_reduce(x, ReduceOp.SUM)
            if np.array_equal(to_bits(bad), oracle.fold_oracle(inputs, "bfloat16")):
                problems.append("negative control: the reversed-order variant equals the oracle")
        finally:
            detcomm.shutdown()
    finally:
        os.environ.pop("DETCOMM_HOSTS", None)
    return problems


def job_capture(rank: int, w: int) -> list[str]:
    import detcomm

    comm = detcomm.init(numerics="rl-bitwise", workspace=False)
    dev = comm.device
    problems: list[str] = []
    sites = {"cap.bf": ("bfloat16", 6, "sum"), "cap.f32": ("float32", 3, "sum"), "cap.avg": ("float16", 5, "avg")}
    width = 41
    for name, (dt, rows, op) in sites.items():
        detcomm.site(name, collective="all_reduce", dtype=getattr(torch, dt), shape=(width,), max_rows=rows, op=op,
                     route="rs_ag_fold")

    def want(name: str, seed: int) -> np.ndarray:
        dt, rows, op = sites[name]
        fold = oracle.fold_oracle if op == "sum" else oracle.avg_oracle
        return fold([_payload(rows, width, dt, seed, r) for r in range(w)], dt)

    static = {n: to_torch(_payload(rows, width, dt, 0, rank), dt).to(dev) for n, (dt, rows, _) in sites.items()}

    def calls() -> dict[str, torch.Tensor]:
        return {n: detcomm.all_reduce(static[n], n, op=sites[n][2]) for n in sites}

    def refill(seed: int) -> None:
        for n, (dt, rows, _) in sites.items():
            static[n].copy_(to_torch(_payload(rows, width, dt, seed, rank), dt).to(dev))

    problems += capture_and_replay(calls, refill, want, seeds=(1, 2))[0]
    detcomm.shutdown()
    return problems


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_four_ranks_on_one_gpu_two_simulated_hosts() -> None:
    with LocalCluster(4, backend="gloo", pg_timeout_s=120) as c:
        assert c.run(job_two_hosts_one_gpu, timeout_s=600) == [[]] * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_capture_and_replay_one_rank_nccl() -> None:
    from detcomm.envelope import envelope_environment

    with LocalCluster(1, backend="nccl", pg_timeout_s=60, env=envelope_environment("rl-bitwise")) as c:
        assert c.run(job_capture, timeout_s=300) == [[]]
