"""Robustness on GPUs: a peer that dies mid-collective on the workspace route, CUDA
graph capture churn, and a soak over every GPU route. Compared bit for bit with the numpy oracle."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, random_bits, to_bits, to_torch

pytestmark = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_graph_churn_returns_memory_and_stays_exact() -> None:
    """Capture graphs of many sizes, destroy and recapture 100 times, replay with new values: exact every time,
    and device memory back at its baseline afterwards. (The workspace copies user rows into its own armed
    buffers, so there are no user buffers to register, and nothing to mismatch across ranks.)"""
    from detcomm.workspace import Workspace

    w = 2
    views = Workspace.in_process(w, device="cuda:0", capacity_bytes=1 << 20, timeout_s=30.0)
    streams = [torch.cuda.Stream() for _ in range(w)]
    sizes = (1, 7, 64, 129, 1000)
    dtype = "bfloat16"
    base = None
    for it in range(-len(sizes), 100):  # the negative iterations warm up every size, then the baseline is taken
        if it == 0:
            torch.cuda.synchronize()
            gc.collect()
            base = torch.cuda.memory_allocated()
        rows = sizes[it % len(sizes)]
        static = [torch.empty(rows, 96, dtype=torch.bfloat16, device="cuda:0") for _ in range(w)]
        graphs, outs = [], []
        for r in range(w):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=streams[r]):
                outs.append(views[r].all_reduce(static[r], algo="one_shot" if it % 2 else "two_shot"))
            graphs.append(g)
        bits = [ill_bits(rows, 96, dtype, seed=it + 1000, rank=r) for r in range(w)]
        for r in range(w):
            static[r].copy_(to_torch(bits[r], dtype).cuda())
        torch.cuda.synchronize()
        for r in range(w):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        want = oracle.fold_oracle(bits, dtype)
        for r in range(w):
            assert np.array_equal(to_bits(outs[r]), want), f"iteration {it}, rank {r}"
        del graphs, outs, static
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_allocated() <= base, (base, torch.cuda.memory_allocated())
    for v in views:
        v.close()


_DEATH_SCRIPT = textwrap.dedent("""
    import os, sys, time, datetime
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, out_dir):
        from detcomm.envelope import MULTICAST_OFF_ENV
        os.environ.update(MULTICAST_OFF_ENV)
        store = dist.FileStore(os.path.join(out_dir, "store"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        from detcomm.workspace import Workspace
        ws = Workspace.create(None, device="cuda:0", capacity_bytes=1 << 16, max_rows_armed=64, timeout_s=2.0)
        x = torch.ones(8, 64, device="cuda:0")
        ws.all_reduce(x); torch.cuda.synchronize()  # one good collective first
        dist.barrier()
        if rank == 1:
            os._exit(0)  # dies without a word, its peer is about to spin on it
        time.sleep(0.5)
        from detcomm.errors import WorkspaceFailed
        try:
            ws.all_reduce(x, label="death.site")
            ws.synchronize()
            msg = "NO-RAISE"
        except WorkspaceFailed as e:
            msg = f"RAISED: {e}"
        try:  # the context survived: the device still computes, and the workspace refuses further calls
            alive = float(torch.ones(8, device="cuda:0").sum())
            ws.all_reduce(x)
            msg += f"\\nALIVE {alive} ACCEPTED"
        except WorkspaceFailed:
            msg += f"\\nALIVE {alive} REFUSED"
        with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
            f.write(msg + "\\n")
        os._exit(0)

    if __name__ == "__main__":
        mp.start_processes(rank_main, args=(sys.argv[1],), nprocs=2, join=True, start_method="spawn")
""")


def test_peer_death_on_the_workspace_route_hits_the_deadline(tmp_path) -> None:  # noqa: ANN001
    """Rank 1 dies between two collectives; rank 0's kernel spins on it, passes its 2 s deadline, writes the
    record naming rank 1 and returns: the host raises WorkspaceFailed instead of hanging, its CUDA context
    survives, and the workspace refuses further calls."""
    script = tmp_path / "death.py"
    script.write_text(_DEATH_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240,
                   env=env, cwd=REPO)
    text = (tmp_path / "rank0.txt").read_text()
    assert text.startswith("RAISED:"), text
    assert "waiting for rank 1" in text and "death.site" in text, text
    assert "ALIVE 8.0 REFUSED" in text, text


# The soak's sites: every route a user meets (the workspace's one-store, one-shot, two-shot and chunked kernels
# through ipc_fold; gather_fold and a2a_fold forced where the rule would pick the workspace; native for MAX and the
# all-gather), declared in the same order on every rank.
_SOAK_ROUTES = {"soak.ws": "ipc_fold", "soak.big": "ipc_fold", "soak.rs": "ipc_fold", "soak.gf": "gather_fold",
                "soak.a2a": "a2a_fold", "soak.max": "native", "soak.gather": "native"}


def _soak_job(rank: int, w: int, seconds: float, device: str | None) -> dict[str, object]:
    import random

    import torch.distributed as dist

    import detcomm
    from detcomm.workspace import debug

    # 1 MiB per launch: the larger calls of soak.ws and soak.big are chunked.
    comm = detcomm.init(numerics="rl-bitwise", device=device, workspace_bytes=1 << 20)
    comm.site("soak.ws", collective="all_reduce", dtype=torch.bfloat16, shape=(512,), max_rows=2048)
    comm.site("soak.big", collective="all_reduce", dtype=torch.float32, shape=(256,), max_rows=8192)
    comm.site("soak.rs", collective="reduce_scatter", dtype=torch.float16, shape=(128,), max_rows=64 * w)
    comm.site("soak.gf", collective="all_reduce", dtype=torch.bfloat16, shape=(256,), max_rows=512,
              route="gather_fold")
    comm.site("soak.a2a", collective="reduce_scatter", dtype=torch.float32, shape=(128,), max_rows=64 * w,
              route="a2a_fold")
    comm.site("soak.max", collective="all_reduce", dtype=torch.float32, shape=(64,), max_rows=512, op="max")
    comm.site("soak.gather", collective="all_gather", dtype=torch.bfloat16, shape=(64,), max_rows=512)
    dev = comm.device
    routes = {e["site"]: e["route"] for e in comm.routes().as_dicts()}
    ws = comm._workspace
    assert ws is not None, comm.caps.workspace_reason
    # Every kernel variant the ipc_fold sites can reach (the self-checks ran each once at declaration).
    reach = {v for args in (("all_reduce", torch.bfloat16, 512, 2048), ("all_reduce", torch.float32, 256, 8192),
                            ("reduce_scatter", torch.float16, 128, 64 * w)) for v in ws.variants(*args)}
    debug.record(ws)
    rng = random.Random(1234)  # the same sequence on every rank
    torch.cuda.synchronize()
    gc.collect()
    mem0 = torch.cuda.memory_allocated()
    fds0, threads0 = len(os.listdir("/proc/self/fd")), threading.active_count()
    calls = mismatches = 0
    per_site = dict.fromkeys(_SOAK_ROUTES, 0)
    end = time.monotonic() + seconds
    # The ranks stop together: every 16 calls they agree (MAX over ranks) on whether any rank's time is up. Each
    # rank's own clock alone would let one rank make a call its peers never join.
    flag = torch.zeros(1, device="cpu" if dist.get_backend() == "gloo" else dev)
    while True:
        if calls % 16 == 0:
            flag.fill_(float(time.monotonic() >= end and min(per_site.values()) >= 3))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
        site = rng.choice(sorted(_SOAK_ROUTES))
        seed = rng.randrange(1 << 30)
        time.sleep(rng.random() * 0.002 * (rank + 1))  # injected host delay, different per rank
        if site in ("soak.ws", "soak.gf"):
            rows = rng.choice([1, 3, 64, 400, 777, 2048] if site == "soak.ws" else [1, 5, 512])
            allb = [ill_bits(rows, 512 if site == "soak.ws" else 256, "bfloat16", seed=seed, rank=r)
                    for r in range(w)]
            got = comm.all_reduce(to_torch(allb[rank], "bfloat16").to(dev), site=site)
            want = oracle.fold_oracle(allb, "bfloat16")
        elif site == "soak.big":
            rows = rng.choice([1, 100, 1500, 4000, 8192])
            allb = [random_bits(rows, 256, "float32", seed=seed, rank=r) for r in range(w)]
            got = comm.all_reduce(to_torch(allb[rank], "float32").to(dev), site=site)
            want = oracle.fold_oracle(allb, "float32")
        elif site in ("soak.rs", "soak.a2a"):
            per = rng.choice([1, 5, 64] if site == "soak.rs" else [1, 7, 64])
            dt = "float16" if site == "soak.rs" else "float32"
            allb = [ill_bits(per * w, 128, dt, seed=seed, rank=r) for r in range(w)]
            got = comm.reduce_scatter(to_torch(allb[rank], dt).to(dev), site=site)
            want = oracle.fold_oracle(allb, dt)[rank * per : (rank + 1) * per]
        elif site == "soak.max":
            rows = rng.choice([1, 9, 512])
            allb = [ill_bits(rows, 64, "float32", seed=seed, rank=r) for r in range(w)]
            got = comm.all_reduce(to_torch(allb[rank], "float32").to(dev), site=site, op="max")
            want = oracle.ordered_key_extreme_oracle(allb, "float32", "max")
        else:
            rows = rng.choice([1, 17, 512])
            allb = [random_bits(rows, 64, "bfloat16", seed=seed, rank=r) for r in range(w)]
            got = comm.all_gather(to_torch(allb[rank], "bfloat16").to(dev), site=site)
            want = np.concatenate(allb)
        calls += 1
        per_site[site] += 1
        mismatches += int(not np.array_equal(to_bits(got), want))
        del got
    torch.cuda.synchronize()
    gc.collect()
    out = {"calls": calls, "mismatches": mismatches, "routes": routes, "per_site": per_site,
           "variants": sorted({v for _, _, v in ws.variants_run}), "reach": sorted(reach),
           "mem_growth": torch.cuda.memory_allocated() - mem0,
           "fd_growth": len(os.listdir("/proc/self/fd")) - fds0, "thread_growth": threading.active_count() - threads0}
    detcomm.shutdown()
    return out


def _check_soak(res: list[dict], w: int, seconds: float, where: str) -> None:
    for r in res:
        assert {k: r["routes"].get(k) for k in _SOAK_ROUTES} == _SOAK_ROUTES, r["routes"]
        assert r["mismatches"] == 0 and min(r["per_site"].values()) >= 3, r
        # Every workspace kernel these sites can reach ran during the soak, not only in the self-checks.
        assert "chunked" in r["reach"] and set(r["reach"]) <= set(r["variants"]), r
        assert r["mem_growth"] <= 256 * 1024 and r["fd_growth"] <= 2 and r["thread_growth"] <= 1, r
    print(f"GPU soak ({where}): W={w}, {res[0]['calls']} calls per rank in {seconds:.0f} s, 0 mismatches, "
          f"calls per site {res[0]['per_site']}, workspace kernels {res[0]['variants']}")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_soak_every_route() -> None:
    """W processes on W GPUs over NCCL: random sites, sizes and host delays for DETCOMM_GPU_SOAK_S seconds,
    every result against the oracle, no growth in device memory, files or threads."""
    from detcomm._spawn import LocalCluster
    from detcomm.envelope import envelope_environment

    seconds = float(os.environ.get("DETCOMM_GPU_SOAK_S", "45"))
    w = min(torch.cuda.device_count(), 8)
    with LocalCluster(w, backend="nccl", pg_timeout_s=120, env=envelope_environment("rl-bitwise")) as c:
        res = c.run(_soak_job, seconds, None, timeout_s=seconds + 300)
    _check_soak(res, w, seconds, "one GPU per rank, NCCL")
    assert "one_store" in res[0]["variants"], res[0]["variants"]


@pytest.mark.parametrize("world", [2, 3])
def test_gpu_soak_processes_sharing_one_gpu(world: int) -> None:
    """The same soak with W processes sharing cuda:0 over a gloo group (the workspace by CUDA IPC on one device,
    native collectives staged through host memory). Each workspace call costs milliseconds here (the processes
    time-slice the GPU), so the soak runs fewer, but the same, calls. The one-store kernel is off for ranks sharing a
    GPU (plan.one_store_max_bytes; tests/gpu/test_workspace_one_store.py forces it on); W = 3 catches ordering faults."""
    from detcomm._spawn import LocalCluster
    from detcomm.envelope import envelope_environment

    seconds = float(os.environ.get("DETCOMM_GPU_SOAK_S", "45")) / (1 if world == 2 else 2)
    with LocalCluster(world, backend="gloo", pg_timeout_s=120, env=envelope_environment("rl-bitwise")) as c:
        res = c.run(_soak_job, seconds, "cuda:0", timeout_s=seconds + 300)
    _check_soak(res, world, seconds, "processes sharing one GPU, gloo")
    assert "one_store" not in res[0]["variants"], res[0]["variants"]


@pytest.mark.parametrize("world", [2, 3])
def test_barrier_epochs_across_the_wrap(world: int) -> None:
    """Item 6: start every barrier flag and epoch counter of every rank a few uses before 2**32 (a consistent
    state, as a fresh workspace's zeros are: both parity copies of a flag then hold an epoch no coming use waits for)
    and run collectives across the wrap: no hang (a hang would trap at the deadline), no stale flag consumed (every
    result equals the oracle)."""
    import cupy
    from harness import Ranks

    from detcomm.symm_mem.ipc import _u32_view
    from detcomm.workspace import Workspace, plan

    start = (1 << 32) - 5
    views = Workspace.in_process(world, device="cuda:0", capacity_bytes=1 << 16, timeout_s=10.0)
    words = plan.DESC_BASE  # each rank's header: flags[kind][parity][block][src], then epochs[kind][block]
    assert plan.epoch_index(plan.BARRIER_KINDS - 1, plan.MAX_BLOCKS - 1) == words - 1
    torch.cuda.synchronize()
    for base in views[0]._transport.ptrs:
        _u32_view(cupy, base, words, 0).fill(start)
    cupy.cuda.runtime.deviceSynchronize()
    R = Ranks(views)
    for it in range(12):
        rows = (1, 9, 64)[it % 3]
        bits = [ill_bits(world * rows, 40, "float32", seed=it, rank=r) for r in range(world)]
        op = ("all_reduce", "all_reduce", "reduce_scatter")[it % 3]
        kw = {"algo": "one_shot" if it % 2 else "two_shot"} if op == "all_reduce" else {}
        got = R.run_bits(op, bits, "float32", **kw)
        want = oracle.fold_oracle(bits, "float32")
        for r in range(world):
            expect = want if op == "all_reduce" else want[r * rows : (r + 1) * rows]
            assert np.array_equal(got[r], expect), f"use {it}, rank {r}"
    R.close()
