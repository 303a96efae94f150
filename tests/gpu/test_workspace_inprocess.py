"""The workspace kernels, W ranks as W CUDA streams of one process on one GPU, against the numpy oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import Ranks, cached_ranks, on_ranks
from payloads import first_mismatch, from_tensor, ill_conditioned, random_bits, to_tensor

from oracle import fold_oracle

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "bfloat16", "float16"]
ROWS = [1, 2, 3, 5, 7, 31, 61, 127, 257, 1021, 4093, 4096]
TRAILING = 40  # 160 B fp32 rows, 80 B bf16 rows: rows start on 16 B boundaries only every few rows
CAPACITY = 4096 * TRAILING * 4 + 4096  # all of ROWS fit without chunking (chunking has its own test)


def ranks(world: int, *, capacity: int = CAPACITY, build: str = "canonical", **kw) -> Ranks:
    return cached_ranks(world, capacity=capacity, build=build, **kw)


def payload(rng, world, shape, dtype, kind):
    return ill_conditioned(rng, world, shape, dtype) if kind == "ill" else random_bits(rng, world, shape, dtype)


def check_all(outs, want, what):
    for r, got in enumerate(outs):
        assert np.array_equal(got, want), f"{what}, rank {r}: {first_mismatch(got, want)}"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_one_shot_two_shot_oracle(world, dtype):
    R = ranks(world)
    rng = np.random.default_rng(world * 100 + DTYPES.index(dtype))
    for rows in ROWS:
        for kind in ("random", "ill"):
            bits = payload(rng, world, (rows, TRAILING), dtype, kind)
            want = fold_oracle(bits, dtype)
            one = R.run_bits("all_reduce", bits, dtype, algo="one_shot")
            two = R.run_bits("all_reduce", bits, dtype, algo="two_shot")
            auto = R.run_bits("all_reduce", bits, dtype)
            check_all(one, want, f"one-shot W={world} {dtype} rows={rows} {kind}")
            check_all(two, want, f"two-shot W={world} {dtype} rows={rows} {kind}")
            check_all(auto, want, f"auto W={world} {dtype} rows={rows} {kind}")


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_row_sizes_and_unaligned_pointers(world, dtype):
    """Rows of 13 elements (tails inside a pack) and views that start off a 16-byte boundary: the scalar path."""
    R = ranks(world)
    rng = np.random.default_rng(7)
    for rows in (1, 2, 17, 509):
        bits = ill_conditioned(rng, world, (rows + 1, 13), dtype)
        xs = [to_tensor(b, dtype, "cuda:0")[1:] for b in bits]  # offset by one 26/52-byte row
        assert all(x.data_ptr() % 16 for x in xs)
        want = fold_oracle([b[1:] for b in bits], dtype)
        for algo in ("one_shot", "two_shot"):
            check_all([from_tensor(o) for o in R.run("all_reduce", xs, algo=algo)], want, f"{algo} unaligned rows={rows}")
        # the reduce-scatter shard and the all-gather of unaligned rows
        rs_rows = world * rows
        bits = ill_conditioned(rng, world, (rs_rows, 13), dtype)
        outs = R.run_bits("reduce_scatter", bits, dtype)
        full = fold_oracle(bits, dtype)
        for r, got in enumerate(outs):
            assert np.array_equal(got, full[r * rows:(r + 1) * rows]), f"reduce_scatter rank {r}: {first_mismatch(got, full[r * rows:(r + 1) * rows])}"
        gathered = R.run_bits("all_gather", [b[:rows] for b in bits], dtype)
        want_g = np.concatenate([b[:rows] for b in bits])
        check_all(gathered, want_g, "all_gather")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_and_all_gather(world, dtype):
    R = ranks(world)
    rng = np.random.default_rng(world + 11)
    for shard in (1, 3, 64, 97):
        bits = payload(rng, world, (world * shard, TRAILING), dtype, "ill")
        full = fold_oracle(bits, dtype)
        outs = R.run_bits("reduce_scatter", bits, dtype)
        for r, got in enumerate(outs):
            want = full[r * shard:(r + 1) * shard]
            assert np.array_equal(got, want), f"reduce_scatter W={world} shard={shard} rank {r}: {first_mismatch(got, want)}"
        gathered = R.run_bits("all_gather", [b[:shard] for b in bits], dtype)
        check_all(gathered, np.concatenate([b[:shard] for b in bits]), f"all_gather W={world} shard={shard}")


@pytest.mark.parametrize("world", [3, 4])
def test_capacity_edges_chunked(world):
    """cap-1, cap, cap+1 and 2cap+1 rows, where cap = rows one launch carries: chunking leaves the bits alone."""
    dtype, trailing = "bfloat16", 24
    row_bytes = trailing * 2
    cap = 37
    R = ranks(world, capacity=cap * row_bytes)
    rng = np.random.default_rng(world)
    for rows in (cap - 1, cap, cap + 1, 2 * cap + 1):
        bits = ill_conditioned(rng, world, (rows, trailing), dtype)
        want = fold_oracle(bits, dtype)
        for algo in ("one_shot", "two_shot", None):
            check_all(R.run_bits("all_reduce", bits, dtype, algo=algo), want, f"{algo} rows={rows} cap={cap}")
        gathered = R.run_bits("all_gather", bits, dtype)
        check_all(gathered, np.concatenate(bits), f"all_gather rows={rows}")
    rs_cap = cap // world  # reduce-scatter carries W row blocks per launch
    for shard in (rs_cap - 1, rs_cap, rs_cap + 1, 2 * rs_cap + 1):
        bits = ill_conditioned(rng, world, (world * shard, trailing), dtype)
        full = fold_oracle(bits, dtype)
        for r, got in enumerate(R.run_bits("reduce_scatter", bits, dtype)):
            assert np.array_equal(got, full[r * shard:(r + 1) * shard]), f"reduce_scatter shard={shard} rank {r}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_vs_parent(dtype):
    """A row's bits do not depend on the batch it travels in: rows inside a 4096-row batch equal the same rows
    reduced alone, as a prefix, and at another offset."""
    world = 4
    R = ranks(world)
    rng = np.random.default_rng(3)
    bits = ill_conditioned(rng, world, (4096, TRAILING), dtype)
    parent = R.run_bits("all_reduce", bits, dtype)[0]
    assert np.array_equal(parent, fold_oracle(bits, dtype))
    for start, k in ((0, 1), (0, 7), (0, 100), (1, 4095), (2047, 3), (4000, 96)):
        sub = [b[start:start + k] for b in bits]
        for algo in ("one_shot", "two_shot"):
            got = R.run_bits("all_reduce", sub, dtype, algo=algo)
            check_all(got, parent[start:start + k], f"{algo} rows [{start}, {start + k}) vs parent")


def test_fold_local_kernel_matches_oracle():
    """The bench's local fold kernel is the same fold: check it too."""
    import ctypes

    from detcomm.workspace.kernels import kernel_set

    rng = np.random.default_rng(5)
    for world in (2, 3, 8):
        ks = kernel_set(0, world)
        for dtype in DTYPES:
            bits = ill_conditioned(rng, world, (1000, 13), dtype)
            xs = torch.stack([to_tensor(b, dtype, "cuda:0") for b in bits])
            out = torch.empty_like(xs[0])
            sfx = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
            ks.launch(f"detcomm_fold_local_{sfx}", 7, [ctypes.c_uint64(xs.data_ptr()), ctypes.c_int64(out.numel()),
                                                       ctypes.c_uint64(out.data_ptr()), ctypes.c_int64(out.numel())],
                      stream_ptr=torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            got = from_tensor(out)
            want = fold_oracle(bits, dtype)
            assert np.array_equal(got, want), f"fold_local W={world} {dtype}: {first_mismatch(got, want)}"


@pytest.mark.parametrize("world", [3, 4])
def test_negative_control_rotated_order_differs(world):
    """The rotated-rank-order build (-DDETCOMM_ROTATE_RANK_ORDER) must be caught by the same comparison that the
    canonical kernels pass: the tests can fail."""
    R = ranks(world)
    Rot = ranks(world, build="rotated")
    rng = np.random.default_rng(17)
    dtype = "float32"
    rows = 16 * world  # divisible by W, for the reduce-scatter below
    bits = ill_conditioned(rng, world, (rows, TRAILING), dtype, specials=False)
    want = fold_oracle(bits, dtype)
    check_all(R.run_bits("all_reduce", bits, dtype, algo="one_shot"), want, "canonical")
    for algo in ("one_shot", "two_shot"):
        rot = Rot.run_bits("all_reduce", bits, dtype, algo=algo)
        for r, got in enumerate(rot):
            assert not np.array_equal(got, want), f"rotated {algo} rank {r} matched the oracle: the control is blind"
    rs = Rot.run_bits("reduce_scatter", bits, dtype)
    for r, got in enumerate(rs):
        assert not np.array_equal(got, want[r * 16:(r + 1) * 16]), f"rotated reduce_scatter rank {r} matched the oracle"


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_graph_capture_and_replay_new_values(world):
    R = ranks(world)
    dtype = "bfloat16"
    rng = np.random.default_rng(23)
    static = [to_tensor(b, dtype, "cuda:0") for b in random_bits(rng, world, (129, TRAILING), dtype)]
    static_rs = [to_tensor(b, dtype, "cuda:0") for b in random_bits(rng, world, (world * 5, TRAILING), dtype)]
    R.run("all_reduce", static)  # warm-up outside capture
    graphs, outs = [], []
    for r in range(world):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=R.streams[r]):
            o1 = R.views[r].all_reduce(static[r], algo="one_shot")
            o2 = R.views[r].all_reduce(static[r], algo="two_shot")
            o3 = R.views[r].reduce_scatter(static_rs[r])
        graphs.append(g)
        outs.append((o1, o2, o3))
    for it in range(3):
        bits = ill_conditioned(rng, world, (129, TRAILING), dtype)
        bits_rs = ill_conditioned(rng, world, (world * 5, TRAILING), dtype)
        for r in range(world):
            static[r].copy_(to_tensor(bits[r], dtype, "cuda:0"))
            static_rs[r].copy_(to_tensor(bits_rs[r], dtype, "cuda:0"))
        torch.cuda.synchronize()
        on_ranks(R.streams, lambda r: graphs[r].replay())
        want, full_rs = fold_oracle(bits, dtype), fold_oracle(bits_rs, dtype)
        for r in range(world):
            o1, o2, o3 = (from_tensor(o) for o in outs[r])
            assert np.array_equal(o1, want), f"replay {it} one-shot rank {r}: {first_mismatch(o1, want)}"
            assert np.array_equal(o2, want), f"replay {it} two-shot rank {r}: {first_mismatch(o2, want)}"
            assert np.array_equal(o3, full_rs[r * 5:(r + 1) * 5]), f"replay {it} reduce_scatter rank {r}"


def test_create_refused_under_capture():
    from detcomm.workspace import Workspace

    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda:0")
    with pytest.raises(RuntimeError, match="graph capture"):
        with torch.cuda.graph(g, stream=s):
            x.add_(1)
            Workspace.in_process(2, device="cuda:0", capacity_bytes=4096)


def test_second_stream_while_in_flight_raises():
    """Rank 0's one-shot spins until rank 1 arrives, so it is deterministically in flight; a call on the same
    workspace from another stream must raise; launching rank 1 then completes both."""
    R = ranks(2, timeout_s=30.0)
    x = [torch.ones(8, 16, device="cuda:0") for _ in range(2)]
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(a):
        out0 = R.views[0].all_reduce(x[0])
    with torch.cuda.stream(b):
        with pytest.raises(RuntimeError, match="in flight"):
            R.views[0].all_reduce(x[0])
    with torch.cuda.stream(R.streams[1]):
        out1 = R.views[1].all_reduce(x[1])
    torch.cuda.synchronize()
    assert torch.equal(out0, torch.full_like(out0, 2.0)) and torch.equal(out1, out0)


def test_caller_errors_are_value_errors():
    R = ranks(2)
    v = R.views[0]
    with pytest.raises(ValueError):
        v.all_reduce(torch.ones(4, 4, dtype=torch.int32, device="cuda:0"))
    with pytest.raises(ValueError):
        v.all_reduce(torch.ones(4, 4, device="cuda:0").t())
    with pytest.raises(ValueError):
        v.reduce_scatter(torch.ones(3, 4, device="cuda:0"))
    with pytest.raises(ValueError):
        v.all_reduce(torch.ones(4, 4, device="cuda:0"), algo="three_shot")
    with pytest.raises(ValueError):
        v.all_reduce(torch.ones(4, 4))  # CPU tensor


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_site_bound_all_reduce_equals_oracle(world, dtype):
    """The per-site fast path the workspace route calls (Workspace.bind_all_reduce: launches prepared once, their
    parameter blocks reused by every call and chunk), with an output buffer and without, across one-shot,
    two-shot and chunked row counts, against the oracle."""
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    R = ranks(world, capacity=64 * TRAILING * elem, one_shot_max_bytes=16 * TRAILING * elem,
              one_store_max_bytes=4 * TRAILING * elem)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    calls = [v.bind_all_reduce(tdt, TRAILING, label="test.site") for v in R.views]
    rng = np.random.default_rng(7 + world)
    main = torch.cuda.current_stream()
    for rows in (1, 5, 16, 17, 63, 64, 65, 200):  # one-store, one-shot, two-shot, chunked (64 rows per launch)
        for with_out in (False, True):
            bits = ill_conditioned(rng, world, (rows, TRAILING), dtype)
            want = fold_oracle(bits, dtype)
            xs = [to_tensor(b, dtype, "cuda:0") for b in bits]
            outs = [torch.full_like(x, float("nan")) if with_out else None for x in xs]
            got = []
            for r in range(world):
                R.streams[r].wait_stream(main)
                with torch.cuda.stream(R.streams[r]):
                    got.append(calls[r](xs[r], outs[r]))
            torch.cuda.synchronize()
            for r in range(world):
                assert got[r] is outs[r] or not with_out
                g = from_tensor(got[r])
                assert np.array_equal(g, want), f"bound W={world} {dtype} rows={rows} out={with_out}, rank {r}: " \
                                                f"{first_mismatch(g, want)}"
    assert ("all_reduce", dtype, "chunked") in R.views[0].variants_run
    assert ("all_reduce", dtype, "two_shot") in R.views[0].variants_run
    assert ("all_reduce", dtype, "one_shot") in R.views[0].variants_run
    assert ("all_reduce", dtype, "one_store") in R.views[0].variants_run


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_rank_folds_straight_into_out(dtype):
    """W = 1: one-shot, two-shot and reduce-scatter fold x straight into out (no slot, no barrier): the oracle's bits
    (+0.0 + x, one rounding, the canonical NaN) for every row count, from and into tensors that start one element
    past a 16-byte boundary, and chunked. The payloads hold -0.0 and NaNs with payloads, so a kernel that copied x
    instead of folding it would differ (checked: the control)."""
    R = ranks(1)
    rng = np.random.default_rng(7 + DTYPES.index(dtype))
    tdtype = getattr(torch, dtype)
    for rows in ROWS:
        bits = ill_conditioned(rng, 1, (rows, TRAILING), dtype)
        want = fold_oracle(bits, dtype)
        if rows >= 61:
            assert not np.array_equal(bits[0], want), "the payload cannot tell a copy from the fold"
        for kw in ({"algo": "one_shot"}, {"algo": "two_shot"}, {"algo": "one_shot", "chunk_rows": 7}):
            check_all(R.run_bits("all_reduce", bits, dtype, **kw), want, f"W=1 {kw} {dtype} rows={rows}")
        check_all(R.run_bits("reduce_scatter", bits, dtype), want, f"W=1 reduce_scatter {dtype} rows={rows}")
        x = torch.empty(rows * TRAILING + 1, dtype=tdtype, device="cuda:0")[1:].view(rows, TRAILING)
        x.copy_(to_tensor(bits[0], dtype, "cuda:0"))
        out = torch.empty(rows * TRAILING + 1, dtype=tdtype, device="cuda:0")[1:].view(rows, TRAILING)
        R.views[0].all_reduce(x, out=out)
        torch.cuda.synchronize()
        check_all([from_tensor(out)], want, f"W=1 unaligned {dtype} rows={rows}")
