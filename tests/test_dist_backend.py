"""The "detcomm" torch.distributed backend on real spawned gloo ranks (W = 2, 3, 4).

Unmodified torch code (dist.all_reduce inside a tensor-parallel MLP's autograd functions, DistributedDataParallel
with different bucket sizes, reduce_scatter_tensor / all_gather_into_tensor) runs on a group made with
backend="detcomm"; every float SUM is compared with the numpy fold oracle (tests/oracle.py) over per-rank
partials that every rank recomputes locally, so no expected value went through a collective. The same code on
a plain gloo group is the negative control: at W >= 3 its results move with the batch composition / bucket
layout.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, random_bits, to_bits, to_torch

H, F, T_PAD, K = 32, 96, 64, 6  # hidden, FFN (divides by 2, 3, 4), fixed row width, request rows

_GROUPS: dict[str, object] = {}


def _group(kind: str):  # type: ignore[no-untyped-def]
    """One process group of `kind` ("detcomm" or "gloo") per worker, made once (collective)."""
    import torch.distributed as dist

    import detcomm.dist_backend  # noqa: F401 - registers the backend

    if kind not in _GROUPS:
        _GROUPS[kind] = dist.new_group(backend=kind)
    return _GROUPS[kind]


def _mlp_weights(w: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    w1 = (torch.randn(H, F, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(F, H, generator=g) / F**0.5).to(torch.bfloat16)
    s = F // w
    return w1[:, q * s : (q + 1) * s].contiguous(), w2[q * s : (q + 1) * s].contiguous()


def _local_part(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w1) @ w2


def _batch(comp: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Composition `comp`: the request's K rows (and their loss gradients) at an offset among T_PAD rows of
    random co-batch rows; composition 0 is the request alone at offset 0 (zero filler)."""
    req = torch.randn(K, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    req_g = torch.randn(K, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    if comp == 0:
        x, g, off = torch.zeros(T_PAD, H, dtype=torch.bfloat16), torch.zeros(T_PAD, H, dtype=torch.bfloat16), 0
    else:
        gen = torch.Generator().manual_seed(100 + comp)
        x = torch.randn(T_PAD, H, generator=gen).to(torch.bfloat16)
        g = torch.randn(T_PAD, H, generator=gen).to(torch.bfloat16)
        off = int(torch.randint(1, T_PAD - K, (1,), generator=gen))
    x[off : off + K], g[off : off + K] = req, req_g
    return x, g, off


def job_tp_mlp(rank: int, w: int, kind: str, comps: int) -> tuple[list[bytes], list[bytes], bool]:
    """Forward and backward of a tensor-parallel MLP (column-parallel W1, row-parallel W2, Megatron's f/g
    autograd functions calling dist.all_reduce). Returns per composition the request rows' output and input
    gradient bits, and whether every composition matched the fold oracle."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    pg = _group(kind)

    class ToTP(torch.autograd.Function):  # identity forward, all-reduce of the input gradient
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=pg)
            return grad

    class FromTP(torch.autograd.Function):  # all-reduce of the row-parallel partial sums
        @staticmethod
        def forward(ctx, part):  # type: ignore[no-untyped-def]
            out = part.contiguous().clone()
            dist.all_reduce(out, group=pg)
            return out

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            return grad

    w1, w2 = _mlp_weights(w, rank)
    ys, dxs, oracle_ok = [], [], True
    for comp in range(comps):
        xb, gb, off = _batch(comp)
        x = xb.clone().requires_grad_(True)
        y = FromTP.apply(_local_part(ToTP.apply(x), w1.requires_grad_(True), w2.requires_grad_(True)))
        (y * gb).sum().backward()
        ys.append(to_bits(y[off : off + K]).tobytes())
        dxs.append(to_bits(x.grad[off : off + K]).tobytes())
        # Oracle: every rank's partial output and partial input gradient, recomputed here without communication.
        parts, dparts = [], []
        for q in range(w):
            a, b = _mlp_weights(w, q)
            xq = xb.clone().requires_grad_(True)
            pq = _local_part(xq, a, b)
            (dq,) = torch.autograd.grad(pq, xq, grad_outputs=gb)
            parts.append(to_bits(pq.detach()))
            dparts.append(to_bits(dq))
        oracle_ok &= bool(np.array_equal(to_bits(y.detach()), oracle.fold_oracle(parts, "bfloat16")))
        oracle_ok &= bool(np.array_equal(to_bits(x.grad), oracle.fold_oracle(dparts, "bfloat16")))
    return ys, dxs, oracle_ok


@pytest.mark.slow
def test_tp_mlp_step_batch_invariant(cluster) -> None:
    """Outputs and input gradients of the request rows: same bits alone and inside 5 other batches, and the
    fold oracle's bits, on every rank."""
    res = cluster.run(job_tp_mlp, "detcomm", 6)
    for ys, dxs, ok in res:
        assert ok, "a folded all_reduce differs from the oracle"
        assert len(set(ys)) == 1 and len(set(dxs)) == 1, "the request's rows moved with the batch composition"
    assert len({(tuple(ys), tuple(dxs)) for ys, dxs, _ in res}) == 1, "ranks disagree"


@pytest.mark.slow
def test_tp_mlp_native_gloo_moves(cluster3plus) -> None:
    """Negative control: the same step on a plain gloo group changes the request's bits with the batch."""
    ys, dxs, _ = cluster3plus.run(job_tp_mlp, "gloo", 6)[0]
    assert len(set(ys)) > 1 or len(set(dxs)) > 1


def _replicated_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(H, F), torch.nn.GELU(), torch.nn.Linear(F, H)).to(torch.bfloat16)


def _local_grads(model: torch.nn.Module, rank: int) -> None:
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(8, H, generator=gen).to(torch.bfloat16)
    t = torch.randn(8, H, generator=gen).to(torch.bfloat16)
    (model(x) * t).sum().backward()


def job_ddp_buckets(rank: int, w: int, kind: str) -> tuple[list[bytes], bool]:
    """Data-parallel gradient synchronization of a replicated MLP in four bucket layouts: DistributedDataParallel
    (its C++ reducer calling the group), one flat bucket in parameter order, one in reverse order behind 7
    padding elements, and one async all_reduce per parameter (async_op=True, then wait()). Returns each
    layout's gradient bits and whether all equal the fold oracle of every rank's local gradient scaled by 1/W
    (DDP scales before it sums; the manual layouts do the same)."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    pg = _group(kind)
    base = _replicated_mlp()
    scaled = []
    for q in range(w):
        m = copy.deepcopy(base)
        _local_grads(m, q)
        scaled.append([p.grad * (1.0 / w) for p in m.parameters()])
    want = [oracle.fold_oracle([to_bits(sc[i]) for sc in scaled], "bfloat16") for i in range(len(scaled[0]))]
    mine = scaled[rank]
    layouts: list[list[torch.Tensor]] = []

    m = copy.deepcopy(base)
    _local_grads(DDP(m, process_group=pg), rank)
    layouts.append([p.grad for p in m.parameters()])

    flat = torch.cat([g.flatten() for g in mine])
    dist.all_reduce(flat, group=pg)
    layouts.append(list(torch.split(flat, [g.numel() for g in mine])))

    rev = torch.cat([torch.zeros(7, dtype=torch.bfloat16)] + [g.flatten() for g in reversed(mine)])
    dist.all_reduce(rev, group=pg)
    layouts.append(list(reversed(torch.split(rev[7:], [g.numel() for g in reversed(mine)]))))

    each = [g.clone() for g in mine]
    works = [dist.all_reduce(g, group=pg, async_op=True) for g in each]
    assert all(wk.wait() for wk in works)
    layouts.append(each)

    ok = all(np.array_equal(to_bits(g.reshape(e.shape)), e) for lay in layouts for g, e in zip(lay, want))
    return [b"".join(to_bits(g).tobytes() for g in lay) for lay in layouts], ok


@pytest.mark.slow
def test_gradient_bucket_layouts(cluster) -> None:
    """DDP, one bucket, a shifted reversed bucket, a bucket per parameter: the same gradient bits, the oracle's."""
    res = cluster.run(job_ddp_buckets, "detcomm")
    for layouts, ok in res:
        assert ok, "synchronized gradients differ from the fold oracle"
        assert len(set(layouts)) == 1
    assert len({tuple(layouts) for layouts, _ in res}) == 1


@pytest.mark.slow
def test_gradient_bucket_layouts_native_gloo_moves(cluster3plus) -> None:
    layouts, _ = cluster3plus.run(job_ddp_buckets, "gloo")[0]
    assert len(set(layouts)) > 1


def job_zero(rank: int, w: int, n: int) -> dict[str, object]:
    """ZeRO-style: reduce_scatter_tensor of a flat gradient (sync and async_op + wait), all_gather_into_tensor
    of the shards, compared with all_reduce of the same flat tensor and with the oracle."""
    import torch.distributed as dist

    pg = _group("detcomm")
    inputs = [random_bits(w, n, "float32", seed=9, rank=q).reshape(-1) for q in range(w)]
    flat = to_torch(inputs[rank], "float32")
    shard = torch.empty(n)
    dist.reduce_scatter_tensor(shard, flat, group=pg)
    shard_async = torch.empty(n)
    work = dist.reduce_scatter_tensor(shard_async, flat, group=pg, async_op=True)
    waited = work.wait()
    full = torch.empty(w * n)
    work = dist.all_gather_into_tensor(full, shard, group=pg, async_op=True)
    work.wait()
    summed = flat.clone()
    dist.all_reduce(summed, group=pg)
    want = oracle.fold_oracle(inputs, "float32")
    return {"waited": waited, "completed": work.is_completed(),
            "shard": np.array_equal(to_bits(shard), want[rank * n : (rank + 1) * n]),
            "async": np.array_equal(to_bits(shard_async), to_bits(shard)),
            "gathered": np.array_equal(to_bits(full), want), "all_reduce": np.array_equal(to_bits(summed), want)}


def test_reduce_scatter_and_all_gather_tensor(cluster) -> None:
    for r in cluster.run(job_zero, 37):
        assert r == {"waited": True, "completed": True, "shard": True, "async": True, "gathered": True,
                     "all_reduce": True}


def job_delegated(rank: int, w: int) -> dict[str, object]:
    import torch.distributed as dist

    pg = _group("detcomm")
    i = torch.tensor([rank + 1, -rank], dtype=torch.int64)
    dist.all_reduce(i, group=pg)
    m = torch.tensor([float(rank), -float(rank)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=pg)
    avg_in = [random_bits(1, 16, "bfloat16", seed=3, rank=q) for q in range(w)]
    a = to_torch(avg_in[rank], "bfloat16")
    dist.all_reduce(a, op=dist.ReduceOp.AVG, group=pg)
    # AVG: the fp32 fold divided by W in fp32, then one rounding to bf16.
    acc = oracle.fold_oracle([oracle.widen(b, "bfloat16").view(np.uint32) for b in avg_in], "float32")
    want_avg = oracle.round_fp32_bits((acc.view(np.float32) / np.float32(w)).astype(np.float32).view(np.uint32),
                                      "bfloat16")
    refused = ""
    try:
        # PRODUCT is defined since issue 40 (tests/test_dist_backend_calls.py); a bitwise op on floats is not.
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND, group=pg)
    except ValueError as e:
        refused = str(e)
    return {"int": i.tolist(), "max": m.tolist(), "avg": np.array_equal(to_bits(a), want_avg), "refused": refused,
            "backend": dist.get_backend(pg)}


def test_delegated_and_refused(cluster) -> None:
    for r in cluster.run(job_delegated):
        w = cluster.world_size
        assert r["int"] == [w * (w + 1) // 2, -(w * (w - 1) // 2)]
        assert r["max"] == [float(w - 1), 0.0]
        assert r["avg"] and r["backend"] == "detcomm"
        assert "refuses" in r["refused"] and "SUM" in r["refused"]


def job_init_default(rank: int, w: int, store_path: str) -> bool:
    """dist.init_process_group("detcomm") as the default group; then a plain dist.all_reduce folds."""
    import torch.distributed as dist

    import detcomm.dist_backend  # noqa: F401 - registers the backend

    dist.destroy_process_group()
    dist.init_process_group("detcomm", store=dist.FileStore(store_path, w), rank=rank, world_size=w)
    inputs = [random_bits(5, 8, "bfloat16", seed=4, rank=q) for q in range(w)]
    x = to_torch(inputs[rank], "bfloat16")
    dist.all_reduce(x)
    return dist.get_backend() == "detcomm" and bool(np.array_equal(to_bits(x), oracle.fold_oracle(inputs, "bfloat16")))


def test_init_process_group_detcomm(tmp_path) -> None:
    from detcomm._spawn import LocalCluster

    with LocalCluster(3, pg_timeout_s=30.0) as c:
        assert c.run(job_init_default, os.path.join(tmp_path, "store")) == [True, True, True]


def job_async(rank: int, w: int) -> dict[str, object]:
    """dist.all_reduce(x, async_op=True): the work's wait() completes, x then holds the fold, and the work's future
    holds the same bits (DDP's comm hooks read it)."""
    import torch.distributed as dist

    pg = _group("detcomm")
    inputs = [ill_bits(4, 33, "bfloat16", seed=12, rank=q) for q in range(w)]
    x = to_torch(inputs[rank], "bfloat16")
    work = dist.all_reduce(x, group=pg, async_op=True)
    waited = work.wait()
    (fut,) = work.get_future().wait()
    want = oracle.fold_oracle(inputs, "bfloat16")
    return {"waited": waited, "completed": work.is_completed(), "fold": np.array_equal(to_bits(x), want),
            "future": np.array_equal(to_bits(fut), want),
            # The check can fail: folding the ranks in another order gives other bits on these inputs (W >= 3).
            "order_matters": not np.array_equal(oracle.fold_oracle(inputs[::-1], "bfloat16"), want)}


def test_async_all_reduce_work(cluster) -> None:
    for r in cluster.run(job_async):
        assert r == {"waited": True, "completed": True, "fold": True, "future": True,
                     "order_matters": cluster.world_size >= 3}


# -- MAX / MIN, coalesced calls, PREMUL_SUM, tensor subclasses, functional collectives (W = 3) ---------------------

# Special values of every dtype: each element of the test rows is one 3-tuple (x_0, x_1, x_2) of these, rank q
# holding x_q, so every placement of a NaN (two payloads, both signs), of -0.0 / +0.0 and of the infinities
# over the ranks occurs.
_SPECIAL = {
    "float32": [0x7FC00000, 0xFFC00001, 0x80000000, 0x00000000, 0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000],
    "bfloat16": [0x7FC0, 0xFFC1, 0x8000, 0x0000, 0x3F80, 0xBF80, 0x7F80, 0xFF80],
    "float16": [0x7E00, 0xFE01, 0x8000, 0x0000, 0x3C00, 0xBC00, 0x7C00, 0xFC00],
}


def _special_rows(dtype: str, w: int) -> list[np.ndarray]:
    """Rank q's row: the q-th component of every w-tuple of the special values (8^w elements)."""
    vals = np.array(_SPECIAL[dtype], dtype=np.uint64)
    grid = np.stack(np.meshgrid(*([vals] * w), indexing="ij"), axis=-1).reshape(-1, w)
    return [grid[:, q].astype(oracle.BITS_DTYPE[dtype]) for q in range(w)]


def job_extrema(rank: int, w: int, kind: str) -> dict[str, bool]:
    """all_reduce and reduce_scatter_tensor with MAX / MIN on every placement of NaN and signed zeros over the
    ranks; each result compared with the numpy key oracle (any NaN -> canonical NaN, a zero result is +0.0)."""
    import torch.distributed as dist

    pg = _group(kind)
    ok: dict[str, bool] = {}
    for dtype in ("float32", "bfloat16", "float16"):
        rows = _special_rows(dtype, w)
        for name, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            want = oracle.ordered_key_extreme_oracle(rows, dtype, name)
            x = to_torch(rows[rank], dtype)
            dist.all_reduce(x, op=op, group=pg)
            ok[f"all_reduce {dtype} {name}"] = bool(np.array_equal(to_bits(x), want))
            n = want.size // w * w  # reduce-scatter: the first W whole blocks of the row
            shard = torch.empty(n // w, dtype=x.dtype)
            dist.reduce_scatter_tensor(shard, to_torch(rows[rank][:n], dtype), op=op, group=pg)
            blk = want[:n].reshape(w, -1)[rank]
            ok[f"reduce_scatter {dtype} {name}"] = bool(np.array_equal(to_bits(shard), blk))
    return ok


def test_max_min_nan_and_signed_zeros_order_free() -> None:
    from clusters import get_cluster

    for r in get_cluster(3).run(job_extrema, "detcomm"):
        assert all(r.values()), [k for k, v in r.items() if not v]


def test_max_min_gloo_moves_nan_and_zeros() -> None:
    """Negative control: gloo's float MAX / MIN keeps a NaN or the sign of a zero by rank position."""
    from clusters import get_cluster

    r = get_cluster(3).run(job_extrema, "gloo")[0]
    assert not all(r[k] for k in r if k.startswith("all_reduce"))


def job_coalesced(rank: int, w: int) -> dict[str, object]:
    """all_reduce_coalesced reduces every tensor of the list on its own: MAX and int64 SUM of same-shaped
    tensors, unequal sizes, and float SUM of unequal rows against the fold oracle; the functional
    (torch.ops._c10d_functional) coalesced forms too."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    pg = _group("detcomm")
    a, b = torch.tensor([float(rank)]), torch.tensor([10.0 * rank])
    dist.all_reduce_coalesced([a, b], op=dist.ReduceOp.MAX, group=pg)
    i, j = torch.tensor([rank], dtype=torch.int64), torch.tensor([10 * rank, 1, 2], dtype=torch.int64)
    dist.all_reduce_coalesced([i, j], group=pg)
    ins = [[random_bits(1, n, "bfloat16", seed=20 + n, rank=q) for q in range(w)] for n in (5, 17)]
    fs = [to_torch(x[rank], "bfloat16") for x in ins]
    dist.all_reduce_coalesced(fs, group=pg)
    fold_ok = all(np.array_equal(to_bits(f), oracle.fold_oracle(x, "bfloat16")) for f, x in zip(fs, ins))
    fun = funcol.all_reduce_coalesced([to_torch(x[rank], "bfloat16") for x in ins], "sum", pg)
    fun_ok = all(np.array_equal(to_bits(funcol.wait_tensor(f)), oracle.fold_oracle(x, "bfloat16"))
                 for f, x in zip(fun, ins))
    from datetime import timedelta

    pg.monitored_barrier(timedelta(seconds=60), wait_all_ranks=True)  # dist.monitored_barrier accepts gloo only
    return {"max": [a.item(), b.item()], "int": [i.tolist(), j.tolist()], "fold": fold_ok, "functional": fun_ok}


def test_coalesced_calls_reduce_each_tensor() -> None:
    from clusters import get_cluster

    w = 3
    for r in get_cluster(w).run(job_coalesced):
        # gloo's allreduce of the list gave [20], [20] for the MAX (the list's tensors reduced together).
        assert r["max"] == [float(w - 1), 10.0 * (w - 1)]
        assert r["int"] == [[w * (w - 1) // 2], [10 * w * (w - 1) // 2, w, 2 * w]]
        assert r["fold"] and r["functional"]


def _premul_oracle(rows: list[np.ndarray], dtype: str, factor: float) -> np.ndarray:
    """PREMUL_SUM (docs/spec.md §1.1): fp32(x_q) * fp32(factor) rounded once to fp32, the fold of those fp32
    values, one rounding to `dtype`."""
    with np.errstate(all="ignore"):
        pre = [(oracle.widen(x, dtype) * np.float32(factor)).astype(np.float32).view(np.uint32) for x in rows]
    return oracle.round_fp32_bits(oracle.fold_oracle(pre, "float32"), dtype)


def job_premul(rank: int, w: int, factor: float) -> dict[str, bool]:
    import torch.distributed as dist

    pg = _group("detcomm")
    ok: dict[str, bool] = {}
    for dtype in ("float32", "bfloat16", "float16"):
        rows = [ill_bits(3, 32, dtype, seed=31, rank=q).reshape(-1) for q in range(w)]
        want = _premul_oracle(rows, dtype, factor)
        x = to_torch(rows[rank], dtype)
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor), group=pg)
        ok[f"all_reduce {dtype}"] = bool(np.array_equal(to_bits(x), want))
        t = to_torch(rows[rank], dtype)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor(factor)), group=pg)
        ok[f"tensor factor {dtype}"] = bool(np.array_equal(to_bits(t), want))
        n = want.size // w
        shard = torch.empty(n, dtype=x.dtype)
        dist.reduce_scatter_tensor(shard, to_torch(rows[rank], dtype), op=dist._make_nccl_premul_sum(factor),
                                   group=pg)
        ok[f"reduce_scatter {dtype}"] = bool(np.array_equal(to_bits(shard), want.reshape(w, -1)[rank]))
        # The check can fail: rounding each product to the dtype first, or another rank order, moves bits.
        with np.errstate(all="ignore"):
            pre_rounded = [oracle.round_fp32_bits((oracle.widen(r, dtype) * np.float32(factor)).astype(np.float32)
                                                  .view(np.uint32), dtype) for r in rows]
        ok[f"discriminates {dtype}"] = (not np.array_equal(_premul_oracle(rows[::-1], dtype, factor), want)
                                        and (dtype == "float32"
                                             or not np.array_equal(oracle.fold_oracle(pre_rounded, dtype), want)))
    return ok


def test_premul_sum_folds() -> None:
    from clusters import get_cluster

    for r in get_cluster(3).run(job_premul, 1.0 / 3.0):
        assert all(r.values()), [k for k, v in r.items() if not v]


def job_subclass_and_functional(rank: int, w: int) -> dict[str, object]:
    """An AsyncCollectiveTensor (what DTensor's to_local() returns) handed to dist.all_reduce / all_gather /
    broadcast, and the functional all-gather / reduce-scatter that find the group by its name."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    pg = _group("detcomm")
    rows = [ill_bits(2, 24, "float32", seed=41, rank=q).reshape(-1) for q in range(w)]
    want = oracle.fold_oracle(rows, "float32")
    mine = to_torch(rows[rank], "float32")
    act = funcol.all_gather_tensor(mine, 0, pg)  # an AsyncCollectiveTensor
    gathered_ok = isinstance(act, funcol.AsyncCollectiveTensor) and bool(
        np.array_equal(to_bits(funcol.wait_tensor(act)).reshape(w, -1), np.stack(rows)))
    sub = funcol.all_reduce(mine.clone(), "sum", pg)
    folded_ok = bool(np.array_equal(to_bits(funcol.wait_tensor(sub)), want))
    act = funcol.all_reduce(mine.clone(), "sum", pg)
    assert isinstance(act, funcol.AsyncCollectiveTensor)
    dist.all_reduce(act, group=pg)  # crashed the process (SIGSEGV) before the group unwrapped subclasses
    twice = oracle.fold_oracle([want] * w, "float32")
    outs = [torch.empty_like(mine) for _ in range(w)]
    dist.all_gather(outs, funcol.all_reduce(mine.clone(), "max", pg), group=pg)
    b = funcol.all_reduce(torch.full((3,), float(rank)), "max", pg)
    dist.broadcast(b, src=0, group=pg)
    shard = funcol.reduce_scatter_tensor(mine, "sum", 0, pg)
    return {"name": pg.group_name != "", "gathered": gathered_ok, "folded": folded_ok,
            "subclass_all_reduce": bool(np.array_equal(to_bits(act.elem), twice)),
            "subclass_all_gather": all(torch.equal(o, outs[0]) for o in outs),
            "subclass_broadcast": b.elem.tolist() == [float(w - 1)] * 3,
            "reduce_scatter": bool(np.array_equal(to_bits(funcol.wait_tensor(shard)), want.reshape(w, -1)[rank]))}


def test_subclass_inputs_and_functional_collectives() -> None:
    from clusters import get_cluster

    for r in get_cluster(3).run(job_subclass_and_functional):
        assert all(r.values()), r


# -- the group's reductions go through detcomm's communicator: routes, self-checks, call guard (W = 3, 4) -------

def job_mutant_fold(rank: int, w: int) -> dict[str, object]:
    """A mutant of the gather_fold route (the W inputs folded in reverse rank order) on the group's communicator:
    patched after a size's site was self-checked, it changes the backend's result (to the reversed fold's bits);
    patched before a fresh group's first reduction, the startup self-check refuses the route on every rank."""
    import torch.distributed as dist

    import detcomm.dist_backend  # noqa: F401 - registers the backend
    from detcomm.errors import RouteRefused
    from detcomm.route_impls.gather_fold import GatherFoldRoute

    inputs = [ill_bits(1, 300, "float32", seed=61, rank=q).reshape(-1) for q in range(w)]
    want, reversed_fold = oracle.fold_oracle(inputs, "float32"), oracle.fold_oracle(inputs[::-1], "float32")
    original = GatherFoldRoute._fold

    def mutant(self, stacked, *rest):  # type: ignore[no-untyped-def]
        return original(self, stacked.flip(0), *rest)

    pg = dist.new_group(backend="detcomm")
    x = to_torch(inputs[rank], "float32")
    dist.all_reduce(x, group=pg)  # declares and self-checks the site of 300 fp32 elements
    out: dict[str, object] = {"before": bool(np.array_equal(to_bits(x), want)),
                              "discriminates": not np.array_equal(reversed_fold, want)}
    GatherFoldRoute._fold = mutant  # type: ignore[method-assign]
    try:
        x = to_torch(inputs[rank], "float32")
        dist.all_reduce(x, group=pg)
        out["mutant reaches the backend"] = bool(np.array_equal(to_bits(x), reversed_fold))
        fresh = dist.new_group(backend="detcomm")
        try:
            dist.all_reduce(to_torch(inputs[rank], "float32"), group=fresh)
            out["refused"] = "not refused"
        except RouteRefused as e:
            out["refused"] = str(e)
        dist.destroy_process_group(fresh)
    finally:
        GatherFoldRoute._fold = original  # type: ignore[method-assign]
    dist.destroy_process_group(pg)
    return out


def test_mutant_route_reaches_backend_and_self_check_refuses_it(cluster3plus) -> None:
    for r in cluster3plus.run(job_mutant_fold):
        assert r["before"] and r["discriminates"] and r["mutant reaches the backend"], r
        assert "gather_fold" in str(r["refused"]) and "(c) differs from the reference" in str(r["refused"]), r


def job_guard_and_routes(rank: int, w: int) -> dict[str, object]:
    """Rank 0 calls all_reduce with 101 elements where the others pass 100: every rank raises the call guard's
    DetcommError naming the sites, the call and the ranks, before any data is reduced. Then the route table of
    the group's communicator lists the sites the calls declared."""
    import torch.distributed as dist

    from detcomm.errors import DetcommError

    pg = _group("detcomm")
    fresh = dist.new_group(backend="detcomm")
    dist.all_reduce(torch.ones(100), group=fresh)
    dist.all_reduce(torch.ones(3, 5, dtype=torch.bfloat16), op=dist.ReduceOp.MAX, group=fresh)
    shard = torch.empty(7)
    dist.reduce_scatter_tensor(shard, torch.ones(7 * w), op=dist.ReduceOp.AVG, group=fresh)
    table = fresh.routes()
    sites = {e.site.name: e.decision.route.value for e in table.entries if not e.site.name.startswith("<")}
    checked = {c.label for c in fresh.checks() if c.passed}
    error = ""
    try:
        dist.all_reduce(torch.ones(101 if rank == 0 else 100), group=fresh)
    except DetcommError as e:
        error = f"{type(e).__name__}: {e}"
    dist.destroy_process_group(fresh)
    del pg
    return {"sites": sites, "error": error, "printed": str(table), "checked": sorted(checked)}


def test_call_guard_catches_a_mismatched_size_and_routes_list_the_sites(cluster3plus) -> None:
    for r in cluster3plus.run(job_guard_and_routes):
        assert r["sites"] == {"torch.all_reduce.sum.float32.100": "gather_fold",
                              "torch.all_reduce.max.bfloat16.15": "native",
                              "torch.reduce_scatter.avg.float32.7": "a2a_fold"}, r
        err = str(r["error"])
        assert err.startswith("CollectiveMismatch"), err
        # Rank 0's call of a new size meets the peers' call in the backend's guard, before any declaration (40.1-40.9).
        assert "rank 0: site 'torch.all_reduce.sum.float32.101' call #1 (dist.all_reduce(float32[101]" in err, err
        assert "rank 1: site 'torch.all_reduce.sum.float32.100' call #2" in err, err
        assert "torch.all_reduce.sum.float32.100" in str(r["printed"])
        # Each site's (route, collective, op, dtype, row width) was self-checked (100 elements: one row of 128).
        assert {"gather_fold: all_reduce sum float32[128]", "native: all_reduce max bfloat16[16]",
                "a2a_fold: reduce_scatter avg float32[8]"} <= set(r["checked"]), r["checked"]


def job_large_bucket(rank: int, w: int) -> dict[str, object]:
    """DDP on one 1024 x 1024 fp32 layer (a bucket of 4 MiB, above rs_ag_fold's break-even at W = 4) and the
    same scaled gradients all-reduced in 64 chunks of 16 Ki elements (below it, gather_fold): the bucket's site
    takes rs_ag_fold, the chunks' gather_fold, and both give the numpy fold oracle's bits of every rank's local
    gradient divided by W."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import detcomm.dist_backend  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    pg = dist.new_group(backend="detcomm")
    torch.manual_seed(0)
    base = torch.nn.Linear(1024, 1024)

    def local(m: torch.nn.Module, q: int) -> None:
        gen = torch.Generator().manual_seed(70 + q)
        (m(torch.randn(4, 1024, generator=gen)) * torch.randn(4, 1024, generator=gen)).sum().backward()

    scaled = []
    for q in range(w):
        m = copy.deepcopy(base)
        local(m, q)
        scaled.append([p.grad / w for p in m.parameters()])
    want = [oracle.fold_oracle([to_bits(sc[i]) for sc in scaled], "float32") for i in range(2)]
    m = copy.deepcopy(base)
    local(DDP(m, process_group=pg), rank)
    ddp_routes = {e.site.name: e.decision.route.value for e in pg.routes().entries if not e.site.name.startswith("<")}
    ddp = [to_bits(p.grad) for p in m.parameters()]
    flat = torch.cat([g.reshape(-1) for g in scaled[rank]])
    chunks = list(flat.split(16384))
    for c in chunks:
        dist.all_reduce(c, group=pg)
    small = [to_bits(g) for g in torch.split(flat, [1024 * 1024, 1024])]
    all_routes = {e.site.name: e.decision.route.value for e in pg.routes().entries}
    dist.destroy_process_group(pg)
    return {"ddp_routes": ddp_routes, "chunk_route": all_routes["torch.all_reduce.sum.float32.16384"],
            "ddp": all(np.array_equal(g.reshape(-1), e.reshape(-1)) for g, e in zip(ddp, want)),
            "small": all(np.array_equal(g.reshape(-1), e.reshape(-1)) for g, e in zip(small, want)),
            "same": all(np.array_equal(a.reshape(-1), b) for a, b in zip(ddp, small))}


@pytest.mark.slow
def test_large_ddp_bucket_takes_rs_ag_fold(cluster4) -> None:
    for r in cluster4.run(job_large_bucket):
        big = {n: route for n, route in r["ddp_routes"].items() if int(n.rsplit(".", 1)[1]) >= 1024 * 1024}
        assert big and set(big.values()) == {"rs_ag_fold"}, r["ddp_routes"]
        assert r["chunk_route"] == "gather_fold"
        assert r["ddp"] and r["small"] and r["same"], r
