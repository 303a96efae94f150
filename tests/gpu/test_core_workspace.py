"""The workspace route through the core: arming at init, routing by static max_rows, the self-checks on the
kernels (and their refusal of a rotated-order kernel), against the numpy oracle.

Two configurations: W processes sharing one GPU over a gloo group (device="cuda:0"; native collectives staged
through host memory; the processes time-slice the GPU) and, where several GPUs exist, W processes on W GPUs
over NCCL."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, to_bits, to_torch
from detcomm._spawn import LocalCluster

pytestmark = pytest.mark.gpu


def job_workspace_route(rank: int, w: int, shared_gpu: bool, variant: str) -> dict[str, object]:
    import detcomm
    from detcomm.workspace import Workspace, debug

    # The communicator arms its workspace over this build, recording the code paths (variants_run) from the start.
    Workspace.create = debug.workspace_class(variant, record=True).create  # type: ignore[method-assign]
    device = "cuda:0" if shared_gpu else None
    comm = detcomm.init(numerics="rl-bitwise", device=device)
    out: dict[str, object] = {"caps": comm.caps.workspace_reason}
    dev = comm.device
    comm.site("ws.ar", collective="all_reduce", dtype=torch.bfloat16, shape=(96,), max_rows=2048)
    comm.site("ws.big", collective="all_reduce", dtype=torch.float32, shape=(96,), max_rows=8192)
    comm.site("ws.rs", collective="reduce_scatter", dtype=torch.float16, shape=(40,), max_rows=64 * w)
    table = {e["site"]: (e["route"], e["why"]) for e in comm.routes().as_dicts()}
    out["routes"] = table
    # Every kernel variant the declared ipc_fold sites can reach ran in a self-check before any real call.
    ws = comm._workspace
    if ws is not None:
        need = {("all_reduce", "bfloat16", v) for v in ws.variants("all_reduce", torch.bfloat16, 96, 2048)}
        need |= {("reduce_scatter", "float16", v) for v in ws.variants("reduce_scatter", torch.float16, 40, 64 * w)}
        out["variants_missing"] = sorted(need - ws.variants_run)
        out["variants_listed"] = sorted(need)
    ok = []
    for site, dtype, rows, width in (("ws.ar", "bfloat16", 1, 96), ("ws.ar", "bfloat16", 37, 96),
                                     ("ws.ar", "bfloat16", 2048, 96), ("ws.big", "float32", 5, 96)):
        allb = [ill_bits(rows, width, dtype, seed=rows, rank=r) for r in range(w)]
        got = to_bits(comm.all_reduce(to_torch(allb[rank], dtype).to(dev), site=site))
        ok.append(bool(np.array_equal(got, oracle.fold_oracle(allb, dtype))))
    allb = [ill_bits(6 * w, 40, "float16", seed=3, rank=r) for r in range(w)]
    got = to_bits(comm.reduce_scatter(to_torch(allb[rank], "float16").to(dev), site="ws.rs"))
    ok.append(bool(np.array_equal(got, oracle.fold_oracle(allb, "float16")[rank * 6 : (rank + 1) * 6])))
    out["ok"] = ok
    out["checks"] = [(c.key.label(), c.passed) for c in comm.checks()]
    detcomm.shutdown()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_workspace_route_processes_sharing_one_gpu(world: int) -> None:
    with LocalCluster(world, backend="gloo", pg_timeout_s=120) as c:
        res = c.run(job_workspace_route, True, "canonical", timeout_s=600)
    for r in res:
        assert r["routes"]["ws.ar"][0] == "ipc_fold", r
        assert r["routes"]["ws.rs"][0] == "ipc_fold", r
        # max_rows above the armed rows: still the workspace (chunked when needed), the static rule says why
        assert r["routes"]["ws.big"][0] == "ipc_fold" and "chunked" in r["routes"]["ws.big"][1], r
        assert r["variants_missing"] == [] and len(r["variants_listed"]) >= 2, r
        assert all(r["ok"]), r
        assert any(label.startswith("ipc_fold") and passed for label, passed in r["checks"])


def test_selfcheck_refuses_rotated_workspace_kernels() -> None:
    """Negative control at W = 3: the rotated-order kernels fail check (c); the site falls back to the
    other canonical route (same numerics), and the route table says why."""
    with LocalCluster(3, backend="gloo", pg_timeout_s=120) as c:
        res = c.run(job_workspace_route, True, "rotated", timeout_s=600)
    for r in res:
        route, why = r["routes"]["ws.ar"]
        assert route == "gather_fold" and "refused: ipc_fold" in why and "(c) differs" in why, r
        assert all(r["ok"]), r  # the fallback is the canonical fold


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_workspace_route_nccl_one_gpu_each() -> None:
    w = min(torch.cuda.device_count(), 8)
    from detcomm.envelope import envelope_environment

    with LocalCluster(w, backend="nccl", pg_timeout_s=120, env=envelope_environment("rl-bitwise")) as c:
        res = c.run(job_workspace_route, False, "canonical", timeout_s=600)
    for r in res:
        assert r["routes"]["ws.ar"][0] == "ipc_fold", r
        assert all(r["ok"]), r
