"""Data parallelism on the "detcomm" backend, unmodified: FSDP2 ``fully_shard`` (default AVG, force-sum,
divide factor = PREMUL_SUM, bf16 and fp16 reduce dtypes; three sharding groupings and placements) and
DistributedDataParallel (two bucket caps, torch's built-in allreduce and fp16 compression hooks), at W = 3.

Oracle: every rank recomputes every rank's local gradient on a plain copy of the model (the same torch ops on
the same full shapes, one thread: the same local kernels as FSDP's unsharded compute and DDP's), then the numpy
fold (tests/oracle.py) reduces those bits as the stack's reduction is defined: AVG, SUM then FSDP's division,
PREMUL_SUM (docs/spec.md §1.1), the reduce-dtype casts and the comm hooks' divisions, all written in numpy. The
only cross-rank arithmetic is the reduction. Negative control: the same code on a gloo group gives other bits.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import oracle
from datagen import to_bits

H, F, T = 8, 12, 5  # hidden (8 rows: FSDP pads the shards at W = 3), FFN, tokens per rank
MODES = ("avg", "sum", "premul", "bf16", "fp16")
GROUPINGS = ("per_layer", "root", "shard1")
DIVIDE_FACTOR = 5.0


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(H, F), torch.nn.ReLU(), torch.nn.Linear(F, H))


def _batch(q: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + q)
    return torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)


def _local_grads(w: int) -> list[list[np.ndarray]]:
    """[rank][param] fp32 gradient bits of each rank's batch, without communication."""
    out = []
    for q in range(w):
        m = _model()
        x, t = _batch(q)
        (m(x) * t).sum().backward()
        out.append([to_bits(p.grad) for p in m.parameters()])
    return out


def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float32)


def _div(bits: np.ndarray, dtype: str, d: float) -> np.ndarray:
    """torch's division of a `dtype` tensor by a Python number: in fp32, one rounding to `dtype`."""
    with np.errstate(all="ignore"):
        q = (oracle.widen(bits, dtype) / np.float32(d)).astype(np.float32)
    return oracle.round_fp32_bits(q.view(np.uint32), dtype)


def _cast(bits32: np.ndarray, dtype: str) -> np.ndarray:
    return oracle.round_fp32_bits(bits32, dtype)


def _widen_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    return oracle.widen(bits, dtype).view(np.uint32)


def _fsdp_oracle(grads: list[np.ndarray], mode: str, w: int) -> np.ndarray:
    """The fp32 bits of FSDP2's reduced gradient of one parameter (torch's _get_gradient_divide_factors)."""
    if mode == "avg":
        return oracle.avg_oracle(grads, "float32")
    if mode == "sum":  # SUM, then reduce_output.div_(W)
        return _div(oracle.fold_oracle(grads, "float32"), "float32", float(w))
    if mode == "premul":  # ReduceOp.PREMUL_SUM(1 / factor)
        with np.errstate(all="ignore"):
            pre = [(_f32(g) * np.float32(1.0 / DIVIDE_FACTOR)).astype(np.float32).view(np.uint32) for g in grads]
        return oracle.fold_oracle(pre, "float32")
    if mode == "bf16":  # cast to the reduce dtype, AVG, cast back
        return _widen_bits(oracle.avg_oracle([_cast(g, "bfloat16") for g in grads], "bfloat16"), "bfloat16")
    assert mode == "fp16"  # overflow risk: divide by 2 before the SUM and by W / 2 after it
    pre = [_div(_cast(g, "float16"), "float16", 2.0) for g in grads]
    return _widen_bits(_div(oracle.fold_oracle(pre, "float16"), "float16", w / 2.0), "float16")


def _init_default(rank: int, w: int, store: str) -> None:
    import torch.distributed as dist

    import detcomm.dist_backend  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    if dist.get_backend() != "detcomm":
        dist.destroy_process_group()
        dist.init_process_group("detcomm", store=dist.FileStore(store, w), rank=rank, world_size=w)


def _fsdp_step(mesh, mode: str, grouping: str, rank: int) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    mp = MixedPrecisionPolicy(reduce_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode))
    def shard1(p: torch.Tensor) -> Shard:  # FSDP2 shards dim 1 only evenly
        return Shard(1) if p.ndim == 2 and p.shape[1] % mesh.size() == 0 else Shard(0)

    placement = shard1 if grouping == "shard1" else None
    m = _model()
    layers = [m[0], m[2]] if grouping != "root" else []
    for mod in [*layers, m]:
        fully_shard(mod, mesh=mesh, mp_policy=mp, shard_placement_fn=placement)
    for mod in [*layers, m]:  # each fully_shard module's own parameter group
        if mode == "sum":
            mod.set_force_sum_reduction_for_comms(True)
        if mode == "premul":
            mod.set_gradient_divide_factor(DIVIDE_FACTOR)
    x, t = _batch(rank)
    (m(x) * t).sum().backward()
    return [to_bits(p.grad.full_tensor()) for p in m.parameters()]


def job_fsdp(rank: int, w: int, store: str) -> dict[str, bool]:
    from torch.distributed.device_mesh import init_device_mesh

    _init_default(rank, w, store)
    mesh = init_device_mesh("cpu", (w,), mesh_dim_names=("dp",))
    local = _local_grads(w)
    ok: dict[str, bool] = {}
    for mode in MODES:
        want = [_fsdp_oracle([local[q][i] for q in range(w)], mode, w) for i in range(len(local[0]))]
        got = {g: _fsdp_step(mesh, mode, g, rank) for g in GROUPINGS}
        for g, grads in got.items():
            ok[f"{mode} {g}"] = all(np.array_equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(grads, want))
    return ok


def job_fsdp_gloo(rank: int, w: int, store: str) -> bool:
    """Negative control: FSDP2's force-sum reduce-scatter on a gloo mesh (gloo has no AVG); True if it matched."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    _init_default(rank, w, store)
    mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu", mesh_dim_names=("gloo_dp",))
    local = _local_grads(w)
    want = [_fsdp_oracle([local[q][i] for q in range(w)], "sum", w) for i in range(len(local[0]))]
    got = _fsdp_step(mesh, "sum", "per_layer", rank)
    return all(np.array_equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(got, want))


# bf16_compress_hook: DDP itself refuses it without CUDA and NCCL 2.10 (register_comm_hook's check), on any group.
HOOKS = ("default", "allreduce", "fp16_compress")
BUCKET_CAPS_MB = (25.0, 0.0002)  # one bucket; a bucket per parameter (or less)


def _ddp_oracle(grads: list[np.ndarray], hook: str, w: int) -> np.ndarray:
    if hook == "default":  # the reducer multiplies by fp32(1 / W) as it copies into the bucket, then SUM
        with np.errstate(all="ignore"):
            pre = [(_f32(g) * np.float32(1.0 / w)).astype(np.float32).view(np.uint32) for g in grads]
        return oracle.fold_oracle(pre, "float32")
    if hook == "allreduce":  # allreduce_hook: divide by W, then SUM
        return oracle.fold_oracle([_div(g, "float32", float(w)) for g in grads], "float32")
    dt = "float16"  # cast, divide by W, SUM, cast back
    return _widen_bits(oracle.fold_oracle([_div(_cast(g, dt), dt, float(w)) for g in grads], dt), dt)


def job_ddp(rank: int, w: int, store: str, kind: str) -> dict[str, bool]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init_default(rank, w, store)
    pg = dist.group.WORLD if kind == "detcomm" else dist.new_group(backend="gloo")
    local = _local_grads(w)
    hooks = {"allreduce": default_hooks.allreduce_hook, "fp16_compress": default_hooks.fp16_compress_hook}
    ok: dict[str, bool] = {}
    for hook in HOOKS:
        want = [_ddp_oracle([local[q][i] for q in range(w)], hook, w) for i in range(len(local[0]))]
        for cap in BUCKET_CAPS_MB:
            m = _model()
            ddp = DDP(copy.deepcopy(m), process_group=pg, bucket_cap_mb=cap)
            if hook != "default":
                ddp.register_comm_hook(pg, hooks[hook])
            x, t = _batch(rank)
            (ddp(x) * t).sum().backward()
            ok[f"{hook} {cap}"] = all(np.array_equal(to_bits(p.grad).reshape(-1), e.reshape(-1))
                                      for p, e in zip(ddp.module.parameters(), want))
    return ok


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory):  # type: ignore[no-untyped-def]
    from detcomm._spawn import LocalCluster

    with LocalCluster(3, pg_timeout_s=60.0) as c:
        yield c, str(tmp_path_factory.mktemp("dp3") / "store")


def test_fsdp2_modes_and_groupings_oracle(cluster3) -> None:  # type: ignore[no-untyped-def]
    """Every mode x grouping: the oracle's bits on every rank (so also identical across groupings)."""
    c, store = cluster3
    for r in c.run(job_fsdp, store):
        assert all(r.values()), [k for k, v in r.items() if not v]


def test_fsdp2_gloo_moves(cluster3) -> None:  # type: ignore[no-untyped-def]
    c, store = cluster3
    assert not all(c.run(job_fsdp_gloo, store))


def test_ddp_hooks_and_bucket_caps_oracle(cluster3) -> None:  # type: ignore[no-untyped-def]
    c, store = cluster3
    for r in c.run(job_ddp, store, "detcomm"):
        assert all(r.values()), [k for k, v in r.items() if not v]


def test_ddp_gloo_moves(cluster3) -> None:  # type: ignore[no-untyped-def]
    c, store = cluster3
    res = c.run(job_ddp, store, "gloo")
    assert not all(all(r.values()) for r in res)
