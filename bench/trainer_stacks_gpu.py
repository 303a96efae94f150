"""Trainer stacks on the "detcomm" backend against the library's own backend, one rank per GPU: a short table.

    python bench/trainer_stacks_gpu.py                 # W = every visible GPU (NCCL needs one GPU per rank)
    python bench/trainer_stacks_gpu.py --shared-gpu -w 3   # W processes sharing cuda:0, against gloo
    python bench/trainer_stacks_gpu.py --device cpu -w 3   # the same on CPU against gloo (a smoke run)

For each stack (DDP in bf16 across two bucket caps and with bf16_compress_hook; FSDP2 with bf16 reduce across two
groupings; a DTensor Colwise/Rowwise block; a plain bf16 all_reduce eager and replayed in a CUDA graph) it reports
whether the results are bitwise identical across the layouts that should not matter (bucket cap, grouping,
eager vs graph replay) and the median step time, for "detcomm" and for the library backend ("nccl" / "gloo").
``--shared-gpu``: W processes on one GPU (NCCL refuses that): "detcomm" then carries its CUDA traffic through host
memory on gloo and folds its SUM sites in the CUDA-IPC workspace; the library row is gloo with CUDA tensors (its
rows may read "error" where gloo takes no CUDA tensors, or cannot be captured). The processes time-slice the GPU,
so the times are the shared GPU's, not one rank's. Multicast stays off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

H, F, T = 1024, 6144, 512  # F divides by every W up to 4 and 6, 8 (Colwise shards evenly)
STEPS = 5


def _model(dev: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(H, F), torch.nn.GELU(), torch.nn.Linear(F, H)).to(dev)


def _batch(rank: int, dev: torch.device, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(T, H, generator=g).to(dev, dtype), torch.randn(T, H, generator=g).to(dev, dtype)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device) -> tuple[object, float]:  # type: ignore[no-untyped-def]
    times, out = [], None
    for _ in range(STEPS):
        _sync(dev)
        t0 = time.perf_counter()
        out = fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times[1:]) * 1e3


def _grads(m: torch.nn.Module) -> bytes:
    return b"".join(_grad(p).detach().float().cpu().numpy().tobytes() for p in m.parameters())


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None, "every parameter takes part in the step"
    return p.grad


def _ddp(rank: int, dev: torch.device, pg: dist.ProcessGroup) -> tuple[bool, float]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    outs, ms = [], []
    for cap, hook in ((25.0, None), (0.5, None), (25.0, default_hooks.bf16_compress_hook)):
        ddp = DDP(_model(dev).to(torch.bfloat16), process_group=pg, bucket_cap_mb=cap,
                  device_ids=[dev.index] if dev.type == "cuda" else None)
        if hook is not None:
            if dev.type != "cuda":
                continue  # DDP refuses the bf16 hook without CUDA
            ddp.register_comm_hook(pg, hook)
        x, t = _batch(rank, dev, torch.bfloat16)

        def step(ddp: DDP = ddp, x: torch.Tensor = x, t: torch.Tensor = t) -> bytes:
            ddp.zero_grad(set_to_none=True)
            (ddp(x).float() * t.float()).sum().backward()
            return _grads(ddp.module)

        out, t_ms = _timed(step, dev)
        outs.append(out)
        ms.append(t_ms)
    return len(set(outs[:2])) == 1, statistics.median(ms)


def _fsdp(rank: int, dev: torch.device, pg: dist.ProcessGroup, kind: str) -> tuple[bool, float]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(pg, dev.type, mesh_dim_names=(f"{kind}_dp",))
    outs, ms = [], []
    for per_layer in (True, False):
        m = _model(dev)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for mod in ([m[0], m[2]] if per_layer else []) + [m]:
            fully_shard(mod, mesh=mesh, mp_policy=mp_policy)
        x, t = _batch(rank, dev)

        def step(m: torch.nn.Sequential = m, x: torch.Tensor = x, t: torch.Tensor = t) -> bytes:
            m.zero_grad(set_to_none=True)
            (m(x).float() * t).sum().backward()
            full = [_grad(p).full_tensor() for p in m.parameters()]  # type: ignore[attr-defined]  # DTensor grads
            return b"".join(g.float().cpu().numpy().tobytes() for g in full)

        out, t_ms = _timed(step, dev)
        outs.append(out)
        ms.append(t_ms)
    return len(set(outs)) == 1, statistics.median(ms)


def _tp(rank: int, dev: torch.device, pg: dist.ProcessGroup, kind: str) -> tuple[bool, float]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh.from_group(pg, dev.type, mesh_dim_names=(f"{kind}_tp",))
    m = parallelize_module(_model(dev).to(torch.bfloat16), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x, _ = _batch(0, dev, torch.bfloat16)
    with torch.no_grad():
        out, t_ms = _timed(lambda: m(x).float().cpu().numpy().tobytes(), dev)
        again = m(x).float().cpu().numpy().tobytes()
    return out == again, t_ms


def _graph(rank: int, dev: torch.device, pg: dist.ProcessGroup) -> tuple[bool, float]:
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(dev, torch.bfloat16)
    eager = x.clone()
    dist.all_reduce(eager, group=pg)  # also the warm-up a capture needs
    if dev.type != "cuda" or dist.get_backend(pg) == "gloo":
        # gloo's CUDA work runs on its own threads with host copies, which a CUDA graph cannot hold (a capture
        # attempt crashed the process on the H200): eager only, and "identical" compares two eager runs.
        again = x.clone()
        _, t_ms = _timed(lambda: dist.all_reduce(again.copy_(x), group=pg), dev)
        return torch.equal(again, eager), t_ms
    static = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(static, group=pg)

    def replay() -> bytes:
        static.copy_(x)
        g.replay()
        return static.float().cpu().numpy().tobytes()

    out, t_ms = _timed(replay, dev)
    return out == eager.float().cpu().numpy().tobytes(), t_ms


def rank_main(rank: int, world: int, device: str, store: str, results: dict, shared: bool) -> None:  # type: ignore[type-arg]
    from detcomm.envelope import MULTICAST_OFF_ENV

    os.environ.update(MULTICAST_OFF_ENV)
    import detcomm.dist_backend  # noqa: F401 - registers "detcomm"

    global H, F, T
    dev = torch.device("cuda", 0 if shared else rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cpu":  # the smoke run: small enough for 2 cores
        H, F, T = 64, 192, 32
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    lib = "nccl" if dev.type == "cuda" and not shared else "gloo"
    dist.init_process_group("detcomm", init_method=f"file://{store}", rank=rank, world_size=world)
    groups = {"detcomm": dist.group.WORLD, lib: dist.new_group(backend=lib)}
    rows = []
    for kind, pg in groups.items():
        for name, fn, args in (("DDP bf16 (bucket caps)", _ddp, (rank, dev, pg)),
                               ("FSDP2 bf16 reduce (groupings)", _fsdp, (rank, dev, pg, kind)),
                               ("TP Colwise/Rowwise (rerun)", _tp, (rank, dev, pg, kind)),
                               ("all_reduce bf16 (graph; gloo: eager x2)", _graph, (rank, dev, pg))):
            if kind == "gloo" and dev.type == "cuda" and fn is _fsdp:
                # FSDP2 reduce-scatters its gradients, and gloo reduce-scatters CPU tensors only. (On the H200 a rank
                # of this bench died of SIGSEGV in an FSDP2 step's all-gather wait, with gloo's row attempted; which
                # group's step it was is not isolated yet.)
                rows.append((name, kind, "n/a: gloo has no CUDA reduce_scatter", "-"))
                continue
            try:
                same, ms = fn(*args)
                rows.append((name, kind, "yes" if same else "NO", f"{ms:.2f}"))
            except Exception as e:  # noqa: BLE001 - the table reports it
                rows.append((name, kind, f"error: {type(e).__name__}: {str(e)[:80]}", "-"))
    if rank == 0:
        results["rows"] = rows
        if dev.type == "cuda":
            results["transport"] = groups["detcomm"].cuda_transport(dev)  # type: ignore[union-attr]
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("-w", "--world-size", type=int, default=None)
    ap.add_argument("--shared-gpu", action="store_true", help="W processes on cuda:0 (default W = 3), against gloo")
    a = ap.parse_args()
    w = a.world_size or (torch.cuda.device_count() if a.device == "cuda" and not a.shared_gpu else 3)
    if a.device == "cuda" and not a.shared_gpu and not 1 <= w <= torch.cuda.device_count():
        sys.exit(f"--world-size {w}: NCCL needs one GPU per rank and {torch.cuda.device_count()} are visible")
    store = os.path.join(tempfile.mkdtemp(prefix="detcomm-trainer-bench-"), "store")
    with mp.Manager() as mgr:
        results = mgr.dict()
        mp.spawn(rank_main, args=(w, a.device, store, results, a.shared_gpu), nprocs=w)
        rows = list(results["rows"])
        transport = results.get("transport", "-")
    where = "one GPU, shared" if a.shared_gpu else a.device
    print(f"W = {w} on {where} (torch {torch.__version__}); identical = bitwise equal across the layouts named")
    print(f"detcomm's CUDA transport: {transport}")
    print(f"{'stack':40} {'backend':8} {'identical':10} {'median ms':>10}")
    for name, kind, same, ms in rows:
        print(f"{name:40} {kind:8} {same:10} {ms:>10}")


if __name__ == "__main__":
    main()
