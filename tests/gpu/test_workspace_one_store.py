"""The one-store all-reduce (csrc/one_store.cu): data and arrival in one store, no barrier. W ranks as W CUDA streams
of one GPU, bits against the numpy oracle (tests/oracle.py).

What is proven here, and the negative control of each:
- bits: every dtype, W = 2, 3, 4, 8, ordinary, ill-conditioned (signed zeros, subnormals, NaN payloads, Inf) and
  all-zero payloads; the canonical fold's +0.0 start makes the +0.0 -> -0.0 marking invisible (control: the
  rotated-order build differs at W >= 3, so the oracle comparison can fail);
- +0.0 inputs cannot look empty: an all-zero payload completes (control: the build that pushes +0.0 unmarked
  waits on the zero packs until its deadline);
- the two buffers: a peer a whole launch ahead, made deterministic by emulating one rank's push (control: the
  single-buffer build is caught there, as wrong bits or a failed workspace); long runs of back-to-back launches
  of changing sizes with one rank late to every call, mixed with barrier kernels; graph replays.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import Ranks, cached_ranks, on_ranks, recorded_in_process, run_collecting_failures
from payloads import BITS, first_mismatch, from_tensor, ill_conditioned, random_bits, to_tensor

from oracle import fold_oracle

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "bfloat16", "float16"]
TRAILING = 40
CAPACITY = 1 << 20
# Forced on for every W here: by default ranks sharing one GPU never take it (plan.one_store_max_bytes).
ONE_STORE = 256 << 10


def _ranks(world: int, **kw) -> Ranks:
    return cached_ranks(world, capacity=CAPACITY, timeout_s=20.0, one_store_max_bytes=ONE_STORE, **kw)


def _fresh(world: int, **kw) -> Ranks:
    return Ranks(recorded_in_process(world, device="cuda:0", capacity_bytes=CAPACITY, one_store_max_bytes=ONE_STORE, **kw))


def _zeros(world: int, shape: tuple[int, ...], dtype: str, rng) -> list[np.ndarray]:
    """+0.0 and -0.0 only, plus exact cancellations x + (-x): every result is +0.0."""
    t = BITS[dtype]
    neg = t(0x80000000) if dtype == "float32" else t(0x8000)
    out = [np.where(rng.random(shape) < 0.5, neg, t(0)).astype(t) for _ in range(world)]
    out[-1][0] = 0  # a whole row of +0.0 on one rank: its packs are all +0.0
    if world >= 2:
        vals = random_bits(rng, 1, shape, dtype)[0]
        sel = rng.random(shape) < 0.3
        out[0] = np.where(sel, vals, out[0]).astype(t)
        out[1] = np.where(sel, vals ^ (neg), out[1]).astype(t)  # -x: the sum is exactly zero
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_store_matches_the_oracle(world, dtype):
    R = _ranks(world)
    v = R.views[0]
    rng = np.random.default_rng(world * 10 + DTYPES.index(dtype))
    esize = np.dtype(BITS[dtype]).itemsize
    max_rows = v.one_store_max_bytes // (TRAILING * esize)
    for rows in (1, 2, 3, 7, 61, 257, max_rows - 1, max_rows):
        for kind in ("random", "ill", "zeros"):
            if kind == "zeros":
                bits = _zeros(world, (rows, TRAILING), dtype, rng)
            elif kind == "ill":
                bits = ill_conditioned(rng, world, (rows, TRAILING), dtype)
            else:
                bits = random_bits(rng, world, (rows, TRAILING), dtype)
            want = fold_oracle(bits, dtype)
            if kind == "zeros":
                assert not np.any(want), "the all-zero payload must fold to +0.0 everywhere"
            v.variants_run.clear()
            for algo in ("one_store", None):  # forced, and chosen by size (these launches are one-store sized)
                for r, got in enumerate(R.run_bits("all_reduce", bits, dtype, algo=algo)):
                    assert np.array_equal(got, want), (
                        f"W={world} {dtype} rows={rows} {kind} algo={algo} rank {r}: {first_mismatch(got, want)}")
            assert {x for _, _, x in v.variants_run} == {"one_store"}, v.variants_run


@pytest.mark.parametrize("world", [3, 4])
def test_rotated_control_is_caught(world):
    """The same comparison fails for a build that folds in another rank order: the oracle test can fail."""
    Rot = _ranks(world, build="rotated")
    rng = np.random.default_rng(5)
    bits = ill_conditioned(rng, world, (64, TRAILING), "float32")
    want = fold_oracle(bits, "float32")
    for r, got in enumerate(Rot.run_bits("all_reduce", bits, "float32", algo="one_store")):
        assert not np.array_equal(got, want), f"rotated one-store rank {r} matched the oracle: the control is blind"


def test_unmarked_zeros_would_look_empty():
    """Canonical: a payload of +0.0 rows completes at once. Control: pushing +0.0 unmarked leaves those packs
    indistinguishable from empty ones, and the readers wait until the deadline."""
    from detcomm.errors import WorkspaceFailed

    zeros = [torch.zeros(4, TRAILING, device="cuda:0") for _ in range(2)]
    R = _ranks(2)
    for r, o in enumerate(R.run("all_reduce", zeros, algo="one_store")):
        assert not o.any() and not torch.signbit(o).any(), f"rank {r}: the sum of +0.0 is +0.0"
    for v in R.views:
        v.check()
    Bad = _fresh(2, timeout_s=0.5, build="unmarked")
    Bad.run("all_reduce", zeros, algo="one_store")
    raised = []
    for v in Bad.views:
        try:
            v.check()
        except WorkspaceFailed as e:
            raised.append(str(e))
    assert raised and any("timed out" in e and "one-store wait" in e for e in raised), raised


def _sequence(R: Ranks, rng, *, slow: int | None, sleep_cycles: int = 2_000_000, n: int = 24) -> list[str]:
    """n back-to-back calls of changing sizes (large after small and back, so a stale or early-emptied pack of any
    earlier launch would show), one-store launches mostly, with one-shot and two-shot between them; rank `slow`
    sleeps on its stream before each call, so the others run up to a launch ahead. Everything is staged first (in
    one process a device allocation could wait for the spinning kernels of the other ranks)."""
    world, dtype = R.world, "bfloat16"
    max_rows = R.views[0].one_store_max_bytes // (TRAILING * 2)
    sizes = [max_rows, 1, max_rows // 3, 2, max_rows - 1, 17, 5, max_rows]
    algos = ["one_store", "one_store", "one_store", "one_shot", "one_store", "two_shot", "one_store", None]
    torch.cuda._sleep(1)
    staged = []
    for i in range(n):
        rows, algo = sizes[i % len(sizes)], algos[(i * 3) % len(algos)]
        bits = ill_conditioned(rng, world, (rows, TRAILING), dtype)
        xs = [to_tensor(b, dtype, "cuda:0") for b in bits]
        outs = [torch.empty_like(xs[0]) for _ in range(world)]
        staged.append((algo, bits, xs, outs))
    torch.cuda.synchronize()
    for algo, _bits, xs, outs in staged:
        for r in range(world):
            with torch.cuda.stream(R.streams[r]):
                if r == slow:
                    torch.cuda._sleep(sleep_cycles)
                R.views[r].all_reduce(xs[r], out=outs[r], algo=algo)
    torch.cuda.synchronize()
    bad = []
    for i, (algo, bits, _xs, outs) in enumerate(staged):
        want = fold_oracle(bits, dtype)
        for r, o in enumerate(outs):
            got = from_tensor(o)
            if not np.array_equal(got, want):
                bad.append(f"call {i} {algo} rows={len(bits[0])} rank {r}: {first_mismatch(got, want)}")
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_back_to_back_launches_with_a_late_rank(world):
    """Real launches, no emulation: every result equals the oracle whichever rank is late (the deterministic
    control of the buffer rotation is test_a_peer_one_launch_ahead, below: a late rank's timing alone does not
    reliably open the window)."""
    rng = np.random.default_rng(world + 40)
    R = _fresh(world, timeout_s=30.0)
    for slow in (None, world - 1, 0):
        bad = _sequence(R, rng, slow=slow)
        for v in R.views:
            v.check()
        assert bad == [], bad
    R.close()


@pytest.mark.parametrize("world", [2, 3])
def test_a_smaller_one_store_grid_keeps_the_bits(world):
    """one_store_grid=2: every one-store launch (plain and fused, one tier) runs 2 blocks while the barrier launches run the
    whole grid. The plain all-reduce gives the oracle's bits for launches that take the 2 blocks several sweeps,
    back to back with barrier launches and a late rank (the blocks' launch counters and busy words keep agreeing);
    the fused one-store kernel, whose blocks then norm several rows each, gives the fused one-shot kernel's bits
    (both proven against the composition in tests/gpu/test_norm_gpu.py) at the register, the wide and the
    streaming widths (plan.fused_norm_layout). The oracle comparison's control is test_rotated_control_is_caught."""
    from detcomm.numerics import norm

    R = _fresh(world, timeout_s=30.0, one_store_grid=2)
    v = R.views[0]
    assert [t.blocks for t in v.one_store_tiers] == [2] and v.grid > 2, (v.one_store_tiers, v.grid)
    rng = np.random.default_rng(world + 70)
    for slow in (None, world - 1):
        bad = _sequence(R, rng, slow=slow)
        for w_ in R.views:
            w_.check()
        assert bad == [], bad
    for hidden in (4096, 8192, 12288):
        rows = min(7, v.one_store_max_bytes // (hidden * 2))
        xs = [torch.randn(rows, hidden, device="cuda:0").to(torch.bfloat16) for _ in range(world)]
        res = [torch.randn(rows, hidden, device="cuda:0").to(torch.bfloat16) for _ in range(world)]
        weight = (1.0 + 0.1 * torch.randn(hidden, device="cuda:0")).to(torch.bfloat16)
        eps32 = norm.eps_fp32(1e-6)
        got = {algo: on_ranks(R.streams, lambda r, a=algo: R.views[r].all_reduce_rmsnorm(xs[r], res[r], weight, eps32,
                                                                                          algo=a))
               for algo in ("one_store", "one_shot")}
        for r in range(world):
            for k, name in enumerate(("y", "r")):
                assert torch.equal(got["one_store"][r][k].view(torch.int16), got["one_shot"][r][k].view(torch.int16)), (
                    f"W={world} hidden={hidden} rank {r}: {name} of the one-store kernel on 2 blocks differs")
    for w_ in R.views:
        w_.check()
    R.close()


def _mark(bits: np.ndarray, dtype: str) -> np.ndarray:
    """What a rank pushes (one_store_common.cuh): its elements padded with +0.0 to whole 16-byte packs, every +0.0
    rewritten as -0.0 (independent of the kernel's code: plain numpy)."""
    t = BITS[dtype]
    per = 16 // np.dtype(t).itemsize
    flat = bits.reshape(-1)
    padded = np.zeros(-(-flat.size // per) * per, dtype=t)
    padded[:flat.size] = flat
    neg = t(0x80000000) if dtype == "float32" else t(0x8000)
    return np.where(padded == 0, neg, padded).astype(t)


def _emulate_push(owner, src: int, buf: int, bits: np.ndarray, dtype: str, call: int) -> None:
    """Store rank `src`'s one-store push of `bits` (its data and every owning block's call descriptor) into
    `owner`'s region, buffer `buf`, exactly where rank src's kernel would (plan.ONE_STORE_* layout), without running it."""
    from cupy.cuda import runtime

    from detcomm.workspace import plan

    tier = next(t for t in owner.one_store_tiers if bits.nbytes <= t.max_bytes)  # the one the launch will take
    base = owner._transport.ptrs[owner.rank] + plan.data_offset() + tier.offset
    data = np.ascontiguousarray(_mark(bits, dtype))
    area = base + plan.ONE_STORE_DATA_OFF + (buf * owner.world_size + src) * tier.cap
    runtime.memcpy(area, data.ctypes.data, data.nbytes, runtime.memcpyHostToDevice)
    n = bits.size
    what = (plan.KIND_ONE_STORE << 8) | {"float32": 0, "bfloat16": 1, "float16": 2}[dtype]
    desc = np.array([what, call, n & 0xFFFFFFFF, (n >> 32) | 0x80000000], dtype=np.uint32)
    for b in range(-(-(data.nbytes // 16) // plan.BLOCK_THREADS)):  # the blocks that own a pack
        at = base + plan.ONE_STORE_DESC_OFF + ((buf * plan.MAX_BLOCKS + b) * plan.MAX_WORLD + src) * 16
        runtime.memcpy(at, desc.ctypes.data, 16, runtime.memcpyHostToDevice)
    runtime.deviceSynchronize()


@pytest.mark.parametrize("variant", ["canonical", "one_buffer"])
def test_a_peer_one_launch_ahead(variant):
    """Rank 1 runs a whole launch ahead of rank 0, deterministically: rank 0's push of launch 0 is emulated into
    rank 1's region, so rank 1 finishes launch 0 and pushes launch 1 into rank 0's region before rank 0's kernel
    of launch 0 has even started. Two buffers: rank 0 still reads launch 0's data, and both launches give the
    oracle's bits. The single-buffer control: rank 1's launch-1 push overwrote the launch-0 data (and descriptor)
    rank 0 had not read yet, which must show as wrong bits or a failed workspace."""
    import time

    dtype, rows = "float32", 700  # 7000 packs: 14 blocks own packs
    R = _fresh(2, timeout_s=5.0, build=variant)
    p, q = R.views
    rng = np.random.default_rng(11)
    bits = [ill_conditioned(rng, 2, (rows, TRAILING), dtype) for _ in range(2)]  # [launch][rank]
    xs = [[to_tensor(b, dtype, "cuda:0") for b in launch] for launch in bits]
    outs = [[torch.empty_like(xs[0][0]) for _ in range(2)] for _ in range(2)]
    torch.cuda.synchronize()
    _emulate_push(q, 0, 0, bits[0][0], dtype, call=q._calls + 1)

    def calls() -> None:
        with torch.cuda.stream(R.streams[1]):
            q.all_reduce(xs[0][1], out=outs[0][1], algo="one_store")  # completes on the emulated push
            q.all_reduce(xs[1][1], out=outs[1][1], algo="one_store")  # pushes launch 1, then waits for rank 0
        time.sleep(0.2)  # launch 1's pushes have landed long before rank 0's first kernel starts
        with torch.cuda.stream(R.streams[0]):
            p.all_reduce(xs[0][0], out=outs[0][0], algo="one_store")
            p.all_reduce(xs[1][0], out=outs[1][0], algo="one_store")

    # The control may already refuse a later call (its kernel failed meanwhile).
    _, failed = run_collecting_failures(R.views, calls, default=None)
    bad = []
    for e in range(2):
        want = fold_oracle(bits[e], dtype)
        for r in range(2):
            got = from_tensor(outs[e][r])
            if not np.array_equal(got, want):
                bad.append(f"launch {e} rank {r}: {first_mismatch(got, want)}")
    if variant == "canonical":
        assert failed == [] and bad == [], (failed, bad)
    else:
        assert failed or bad, "the single-buffer control passed: the test cannot see a buffer reused too early"
        assert any(b.startswith("launch 0 rank 0") for b in bad) or any("different calls" in f for f in failed), (
            bad, failed)


@pytest.mark.parametrize("world", [2, 4])
def test_graph_replays_alternate_buffers(world):
    """One-store calls captured in one graph, replayed with new values: the buffer is chosen on the device (the
    block's launch counter of the launch's tier), so replays alternate buffers like eager calls do; an odd number of
    launches per graph and tier (three in the 64 KiB tier, one in the next) shifts the parity between replays."""
    R = _fresh(world, timeout_s=30.0)
    dtype = "float16"
    rng = np.random.default_rng(world + 3)
    shapes = [(33, TRAILING), (2, TRAILING), (1000, TRAILING), (300, TRAILING)]
    statics = [[to_tensor(b, dtype, "cuda:0") for b in random_bits(rng, world, s, dtype)] for s in shapes]
    for st in statics:
        R.run("all_reduce", st, algo="one_store")  # warm-up
    graphs, outs = [], []
    for r in range(world):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=R.streams[r]):
            outs.append([R.views[r].all_reduce(st[r], algo="one_store") for st in statics])
        graphs.append(g)
    for it in range(4):
        bits = [ill_conditioned(rng, world, s, dtype) for s in shapes]
        for st, b in zip(statics, bits):
            for r in range(world):
                st[r].copy_(to_tensor(b[r], dtype, "cuda:0"))
        torch.cuda.synchronize()
        on_ranks(R.streams, lambda r: graphs[r].replay())
        for k, b in enumerate(bits):
            want = fold_oracle(b, dtype)
            for r in range(world):
                got = from_tensor(outs[r][k])
                assert np.array_equal(got, want), f"replay {it} call {k} rank {r}: {first_mismatch(got, want)}"
    for v in R.views:
        v.check()
