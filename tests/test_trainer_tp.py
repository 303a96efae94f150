"""DTensor tensor parallelism on the "detcomm" backend, unmodified: ``parallelize_module`` with
``SequenceParallel`` (a LayerNorm on sequence shards), ``ColwiseParallel`` and ``RowwiseParallel`` on a small
transformer MLP block, on a 1-D DeviceMesh at W = 3 and on the TP dimension of a (2, 2) mesh at W = 4 (with
FSDP2 ``fully_shard`` on the other dimension).

Isolating the collective from the local matmuls: every weight entry is 0 or a signed power of two, placed so
that every output element of every local matmul (forward and backward, on any shard of either mesh) has at most
two nonzero products. A product by a power of two is exact, and a sum of two exact terms rounds once whatever
order or FMA the kernel uses, so each rank's partial sums are exact functions of the inputs; the only
order-dependent arithmetic left is the cross-rank reduction (the row-parallel reduce-scatter in the forward pass,
the column-parallel input-gradient reduce-scatter in the backward pass). The numpy fold oracle (tests/oracle.py)
reduces the partials that each rank recomputes locally, with no collective. Negative control: the same code on a
gloo mesh gives other bits at W = 3.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import oracle
from datagen import to_bits

H, F, S, B = 8, 12, 6, 2  # hidden, FFN (divides by 2, 3), sequence (divides by 2, 3), batch


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    up = torch.zeros(F, H)  # row j: one entry, at column 3j mod H (distinct within any 4 or 6 consecutive rows)
    for j in range(F):
        up[j, (3 * j) % H] = (-1.0) ** (j // 2) * 2.0 ** (j % 5 - 2)
    # Column c: rows i = c - c // 4 (mod 4), two per column. Shard q of 4 columns gives row i the local column
    # (i + q) mod 4, so the three ranks' terms of an output come from three different hidden columns.
    down = torch.zeros(H, F)
    for i in range(H):
        for c in range(F):
            if c % 4 == (i + c // 4) % 4:
                down[i, c] = (-1.0) ** (c // 4 + i) * 2.0 ** ((i + c) % 5 - 2)
    return up, down


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.up = torch.nn.Linear(H, F, bias=False)
        self.down = torch.nn.Linear(F, H, bias=False)
        up, down = _weights()
        with torch.no_grad():
            self.up.weight.copy_(up)
            self.down.weight.copy_(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    return torch.randn(B, S, H, generator=g) * 3, torch.randn(B, S, H, generator=g)


def _oracle(x: torch.Tensor, gy: torch.Tensor, tp: int, *, reverse: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The block's output and input gradient bits, from each TP rank's partials recomputed locally (no
    communication) on x's device and reduced by the numpy fold; ``reverse`` folds the ranks in reverse order (the
    negative control). On CUDA the norm is the same per-row kernel as each rank's SequenceParallel norm."""
    up, down = (w.to(x.device) for w in _weights())
    norm = torch.nn.LayerNorm(H).to(x.device)
    xn_in = x.clone().requires_grad_(True)
    xn = norm(xn_in)
    parts, gparts = [], []
    s = F // tp
    with torch.no_grad():
        for q in range(tp):
            wu, wd = up[q * s : (q + 1) * s], down[:, q * s : (q + 1) * s]
            pre = xn @ wu.T
            parts.append(to_bits(torch.relu(pre) @ wd.T))
            gparts.append(to_bits(((gy @ wd) * (pre > 0)) @ wu))
    if reverse:
        parts, gparts = parts[::-1], gparts[::-1]
    y = oracle.fold_oracle(parts, "float32")
    gn = torch.from_numpy(oracle.fold_oracle(gparts, "float32").view(np.float32).copy()).to(x.device)
    (gx,) = torch.autograd.grad(xn, xn_in, grad_outputs=gn)
    return y, to_bits(gx)


def _tp_plan():  # type: ignore[no-untyped-def]
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}


def _run_block(model: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor, tp_rank: int, tp: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """One forward and backward on this rank's sequence shard; returns the local output and input-gradient bits."""
    xs = x.chunk(tp, dim=1)[tp_rank].clone().requires_grad_(True)
    y = model(xs)
    (y * gy.chunk(tp, dim=1)[tp_rank]).sum().backward()
    assert xs.grad is not None
    return to_bits(y.detach()), to_bits(xs.grad)


def _init_default(rank: int, w: int, store: str) -> None:
    import torch.distributed as dist

    import detcomm.dist_backend  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    if dist.get_backend() != "detcomm":
        dist.destroy_process_group()
        dist.init_process_group("detcomm", store=dist.FileStore(store, w), rank=rank, world_size=w)


def job_tp_1d(rank: int, w: int, store: str, kind: str) -> dict[str, bool]:
    """init_device_mesh("cpu", (W,)) on a default "detcomm" group (kind "detcomm"), or a mesh over a gloo group
    (the negative control); SequenceParallel + Colwise + Rowwise; two steps against the oracle."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    _init_default(rank, w, store)
    # Distinct dimension names: DTensor caches sharding plans by mesh equality, which ignores the groups.
    if kind == "detcomm":
        mesh = init_device_mesh("cpu", (w,), mesh_dim_names=("tp",))
    else:
        mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu", mesh_dim_names=("gloo_tp",))
    model = parallelize_module(Block(), mesh, _tp_plan())
    ok: dict[str, bool] = {}
    for step in range(2):
        x, gy = _data(step)
        y, gx = _run_block(model, x, gy, rank, w)
        want_y, want_gx = _oracle(x, gy, w)
        ok[f"y{step}"] = bool(np.array_equal(y, np.split(want_y, w, axis=1)[rank]))
        ok[f"gx{step}"] = bool(np.array_equal(gx, np.split(want_gx, w, axis=1)[rank]))
        model.zero_grad()
    return ok


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory):  # type: ignore[no-untyped-def]
    from detcomm._spawn import LocalCluster

    with LocalCluster(3, pg_timeout_s=60.0) as c:
        yield c, str(tmp_path_factory.mktemp("tp3") / "store")


def test_tp_sequence_parallel_block_oracle(cluster3) -> None:  # type: ignore[no-untyped-def]
    c, store = cluster3
    for r in c.run(job_tp_1d, store, "detcomm"):
        assert all(r.values()), r


def test_tp_sequence_parallel_block_gloo_moves(cluster3) -> None:  # type: ignore[no-untyped-def]
    """Negative control: the same block on a gloo mesh misses the oracle on some rank."""
    c, store = cluster3
    res = c.run(job_tp_1d, store, "gloo")
    assert not all(all(r.values()) for r in res)


def job_fsdp_tp_2d(rank: int, w: int, store: str) -> dict[str, bool]:
    """A (2, 2) mesh ("dp", "tp"): the block tensor-parallel on "tp", then FSDP2 fully_shard on "dp"; each dp
    rank its own data. Output and input gradients against the TP oracle; the block's weight gradients after
    FSDP's reduce-scatter (AVG over "dp", on weights TP-sharded) equal to the average oracle of the two dp
    ranks' TP-local gradients, recomputed locally."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    _init_default(rank, w, store)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    model = parallelize_module(Block(), mesh["tp"], _tp_plan())
    fully_shard(model, mesh=mesh["dp"])
    x, gy = _data(10 + dp)
    y, gx = _run_block(model, x, gy, tp, 2)
    want_y, want_gx = _oracle(x, gy, 2)
    ok = {"y": bool(np.array_equal(y, np.split(want_y, 2, axis=1)[tp])),
          "gx": bool(np.array_equal(gx, np.split(want_gx, 2, axis=1)[tp]))}
    # The weight gradient each dp rank's TP shard computes locally: the same shard's forward and backward run
    # on a plain (unsharded) copy of this TP rank's slice, one per dp rank's data.
    grads = []
    for d in range(2):
        xd, gyd = _data(10 + d)
        up, down = _weights()
        s = F // 2
        wu = up[tp * s : (tp + 1) * s].clone().requires_grad_(True)
        wd = down[:, tp * s : (tp + 1) * s].clone().requires_grad_(True)
        xn = torch.nn.LayerNorm(H)(xd)
        part = torch.relu(xn @ wu.T) @ wd.T
        part.backward(gyd)  # the row-parallel output's gradient is the (all-gathered) full gy
        grads.append(to_bits(wd.grad))
    want = oracle.avg_oracle(grads, "float32")
    got = model.down.weight.grad.full_tensor()  # the full [H, F] gradient: TP shards gathered over both dims
    got_tp = to_bits(got[:, tp * (F // 2) : (tp + 1) * (F // 2)].contiguous())
    ok["down.grad"] = bool(np.array_equal(got_tp, want))
    return ok


def test_fsdp_tp_2d_mesh_oracle(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from detcomm._spawn import LocalCluster

    with LocalCluster(4, pg_timeout_s=60.0) as c:
        for r in c.run(job_fsdp_tp_2d, os.path.join(tmp_path, "store")):
            assert all(r.values()), r
