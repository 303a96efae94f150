"""The one-store all-reduce (csrc/lamport.cu): data and arrival in one store, no barrier. W ranks as W CUDA streams
of one GPU, bits against the numpy oracle (tests/oracle.py).

What is proven here, and the negative control of each:
- bits: every dtype, W = 2, 3, 4, 8, ordinary, ill-conditioned (signed zeros, subnormals, NaN payloads, Inf) and
  all-zero payloads; the canonical fold's +0.0 start makes the +0.0 -> -0.0 marking invisible (control: the
  rotated-order build differs at W >= 3, so the oracle comparison can fail);
- +0.0 inputs cannot look empty: an all-zero payload completes (control: the build that pushes +0.0 unmarked
  waits on the zero packs until its deadline);
- the two buffers: long runs of back-to-back launches of changing sizes with one rank late to every call, mixed
  with barrier kernels, and graph replays (control: the single-buffer build is caught by the same run, as wrong
  bits or a failed workspace).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import Ranks, cached_ranks
from payloads import BITS, first_mismatch, from_tensor, ill_conditioned, random_bits, to_tensor

from oracle import fold_oracle

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "bfloat16", "float16"]
TRAILING = 40
CAPACITY = 1 << 20


def _ranks(world: int, **kw) -> Ranks:
    return cached_ranks(world, capacity=CAPACITY, timeout_s=20.0, **kw)


def _fresh(world: int, **kw) -> Ranks:
    from detcomm.workspace import Workspace

    return Ranks(Workspace.in_process(world, device="cuda:0", capacity_bytes=CAPACITY, **kw))


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
    max_rows = v.lamport_max_bytes // (TRAILING * esize)
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
            for algo in ("lamport", None):  # forced, and chosen by size (these launches are one-store sized)
                for r, got in enumerate(R.run_bits("all_reduce", bits, dtype, algo=algo)):
                    assert np.array_equal(got, want), (
                        f"W={world} {dtype} rows={rows} {kind} algo={algo} rank {r}: {first_mismatch(got, want)}")
            assert {x for _, _, x in v.variants_run} == {"lamport"}, v.variants_run


@pytest.mark.parametrize("world", [3, 4])
def test_rotated_control_is_caught(world):
    """The same comparison fails for a build that folds in another rank order: the oracle test can fail."""
    Rot = _ranks(world, variant="rotated")
    rng = np.random.default_rng(5)
    bits = ill_conditioned(rng, world, (64, TRAILING), "float32")
    want = fold_oracle(bits, "float32")
    for r, got in enumerate(Rot.run_bits("all_reduce", bits, "float32", algo="lamport")):
        assert not np.array_equal(got, want), f"rotated one-store rank {r} matched the oracle: the control is blind"


def test_unmarked_zeros_would_look_empty():
    """Canonical: a payload of +0.0 rows completes at once. Control: pushing +0.0 unmarked leaves those packs
    indistinguishable from empty ones, and the readers wait until the deadline."""
    from detcomm.errors import WorkspaceFailed

    zeros = [torch.zeros(4, TRAILING, device="cuda:0") for _ in range(2)]
    R = _ranks(2)
    for r, o in enumerate(R.run("all_reduce", zeros, algo="lamport")):
        assert not o.any() and not torch.signbit(o).any(), f"rank {r}: the sum of +0.0 is +0.0"
    for v in R.views:
        v.check()
    Bad = _fresh(2, timeout_s=0.5, _variant="unmarked")
    Bad.run("all_reduce", zeros, algo="lamport")
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
    max_rows = R.views[0].lamport_max_bytes // (TRAILING * 2)
    sizes = [max_rows, 1, max_rows // 3, 2, max_rows - 1, 17, 5, max_rows]
    algos = ["lamport", "lamport", "lamport", "one_shot", "lamport", "two_shot", "lamport", None]
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
    from detcomm.errors import WorkspaceFailed

    rng = np.random.default_rng(world + 40)
    R = _fresh(world, timeout_s=30.0)
    for slow in (None, world - 1, 0):
        bad = _sequence(R, rng, slow=slow)
        for v in R.views:
            v.check()
        assert bad == [], bad
    # The control: one buffer for every launch. A rank a launch ahead stores into the buffer its late peer still
    # reads (wrong bits), or the late peer empties a pack the fast one already stored for the next launch (a
    # timeout).
    One = _fresh(world, timeout_s=3.0, _variant="one_buffer")
    failed: list[str] = []
    try:
        bad = _sequence(One, rng, slow=world - 1)
    except WorkspaceFailed as e:
        bad, failed = [], [str(e)]
    torch.cuda.synchronize()
    for v in One.views:
        try:
            v.check()
        except WorkspaceFailed as e:
            failed.append(str(e))
    assert bad or failed, "the single-buffer control passed: the test cannot see a buffer reused too early"


@pytest.mark.parametrize("world", [2, 4])
def test_graph_replays_alternate_buffers(world):
    """Two one-store calls per graph, replayed with new values: the buffer is chosen on the device (the block's
    launch counter), so replays alternate buffers like eager calls do; an odd number of launches per graph (three)
    shifts the parity between replays."""
    R = _fresh(world, timeout_s=30.0)
    dtype = "float16"
    rng = np.random.default_rng(world + 3)
    shapes = [(33, TRAILING), (2, TRAILING), (300, TRAILING)]
    statics = [[to_tensor(b, dtype, "cuda:0") for b in random_bits(rng, world, s, dtype)] for s in shapes]
    for st in statics:
        R.run("all_reduce", st, algo="lamport")  # warm-up
    graphs, outs = [], []
    for r in range(world):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=R.streams[r]):
            outs.append([R.views[r].all_reduce(st[r], algo="lamport") for st in statics])
        graphs.append(g)
    for it in range(4):
        bits = [ill_conditioned(rng, world, s, dtype) for s in shapes]
        for st, b in zip(statics, bits):
            for r in range(world):
                st[r].copy_(to_tensor(b[r], dtype, "cuda:0"))
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(R.streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        for k, b in enumerate(bits):
            want = fold_oracle(b, dtype)
            for r in range(world):
                got = from_tensor(outs[r][k])
                assert np.array_equal(got, want), f"replay {it} call {k} rank {r}: {first_mismatch(got, want)}"
    for v in R.views:
        v.check()
