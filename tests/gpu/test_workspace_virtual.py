"""The virtual-shard workspace kernels (csrc/virtual_fold.cu, docs/spec.md §9.1), W ranks as W CUDA streams of one
GPU, against the numpy oracle.

The same V = 12 global fp32 partials are split over W = 1, 2, 3, 4 ranks (rank r passes shards r*V/W ..
(r+1)*V/W - 1 as [V/W, rows, N]); every variant (one-shot, two-shot, chunked, the automatic choice) must give the
oracle's bits (the fold of the V shards in global order from +0.0 in fp32, one rounding to the dtype, canonical
NaN) on every rank, hence the same bits at every W. Negative controls: the rotated build (peers folded in the
order 1, 2, ..., W-1, 0) and the plain fold of per-rank pre-summed partials both differ at W >= 3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import Ranks, cached_ranks
from payloads import first_mismatch, from_tensor, to_tensor

from oracle import fold_oracle, round_fp32_bits

pytestmark = pytest.mark.gpu

V = 12
WORLDS = (1, 2, 3, 4)
DTYPES = ("bfloat16", "float16", "float32")
N = 33  # odd: the last unit of every row range is partial (the scalar tail)
ROWS = (1, 2, 5, 64)
CAPACITY = 1 << 17  # 82 rows of N at S = 12: none of ROWS is chunked unless forced


def ranks(world: int, *, capacity: int = CAPACITY, build: str = "canonical", **kw) -> Ranks:
    return cached_ranks(world, capacity=capacity, build=build, **kw)


def partials(seed: int, rows: int, n: int, dtype: str) -> np.ndarray:
    """[V, rows, n] fp32 bits: random values at the dtype's scale with bits below its precision, and adversarial
    columns: cancelling ±big pairs on two shards (the result names the order), all -0.0, tiny negatives (a
    negative sum that rounds to -0.0 in bf16/fp16), +huge +huge -huge (Inf or finite by order), NaN with a
    payload and a sign, Inf - Inf, a lone -Inf, values that overflow the output dtype."""
    rng = np.random.default_rng([seed, rows, n, len(dtype)])
    scale = np.float32(2.0) ** rng.integers(-12, 12, (V, rows * n)).astype(np.float32)
    p = (rng.standard_normal((V, rows * n)).astype(np.float32) * scale).astype(np.float32)
    m = p.shape[1]
    kind = rng.integers(0, 10, m)
    big = np.float32(3e4 if dtype == "float16" else 1e30)
    huge = np.float32(3.0e38)
    a = rng.integers(0, V, m)
    b = (a + 1 + rng.integers(0, V - 1, m)) % V
    for c in np.flatnonzero(kind == 0):
        p[a[c], c], p[b[c], c] = big, -big
    p[:, kind == 1] = np.float32(-0.0)
    p[:, kind == 2] = -np.float32(1e-45) * rng.integers(1, 4, (V, int((kind == 2).sum()))).astype(np.float32)
    for c in np.flatnonzero(kind == 3):
        p[:, c] = np.float32(0)
        p[a[c], c], p[b[c], c], p[(b[c] + 1) % V, c] = huge, huge, -huge
    pv = p.view(np.uint32)
    for c in np.flatnonzero(kind == 4):
        pv[a[c], c] = np.uint32((0xFFC00000 if c % 2 else 0x7F800000) | int(rng.integers(1, 1 << 22)))
    for c in np.flatnonzero(kind == 5):
        p[a[c], c], p[b[c], c] = np.inf, -np.inf
    for c in np.flatnonzero(kind == 6):
        p[a[c], c] = -np.inf
    p[:, kind == 7] = np.float32(7e4 if dtype == "float16" else 3.4e38)  # overflows fp16 (and fp32) when summed
    return pv.reshape(V, rows, n).copy()


def oracle(bits: np.ndarray, dtype: str) -> np.ndarray:
    acc = fold_oracle(list(bits), "float32")  # fp32 in, fp32 out: the adds only
    return round_fp32_bits(acc, dtype)


def split(bits: np.ndarray, world: int) -> list[torch.Tensor]:
    s = V // world
    return [to_tensor(np.ascontiguousarray(bits[r * s:(r + 1) * s]), "float32", "cuda:0") for r in range(world)]


def run(R: Ranks, bits: np.ndarray, dtype: str, **kw) -> list[np.ndarray]:
    outs = R.run("all_reduce_virtual", split(bits, R.world), dtype=getattr(torch, dtype), **kw)
    return [from_tensor(o) for o in outs]


def check_all(outs, want, what):
    for r, got in enumerate(outs):
        assert np.array_equal(got, want), f"{what}, rank {r}: {first_mismatch(got, want)}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_variant_every_world_matches_the_oracle(dtype):
    """W = 1, 2, 3, 4 (S = 12, 6, 4, 3): one-shot, two-shot, forced chunking, the automatic choice and a small
    one_shot_max_bytes (auto takes two-shot) all give the oracle's bits, so the same bits at every W."""
    seen: dict[int, np.ndarray] = {}
    for world in WORLDS:
        R = ranks(world)
        R2 = ranks(world, one_shot_max_bytes=256)
        for rows in ROWS:
            bits = partials(world, rows, N, dtype)
            want = oracle(bits, dtype)
            for kw in ({"algo": "one_shot"}, {"algo": "two_shot"}, {}, {"chunk_rows": 2},
                       {"chunk_rows": 3, "algo": "two_shot"}):
                check_all(run(R, bits, dtype, **kw), want, f"W={world} {dtype} rows={rows} {kw}")
            check_all(run(R2, bits, dtype), want, f"W={world} {dtype} rows={rows} auto two-shot")
        for v in R.views:
            assert {("all_reduce_virtual", dtype, k) for k in ("one_shot", "two_shot", "chunked")} <= v.variants_run
        # the same global partials at every W: identical bits (also implied by the oracle; checked directly)
        bits = partials(0, 64, N, dtype)
        got = run(R, bits, dtype)[0]
        if seen:
            assert np.array_equal(got, seen[1]), f"W={world} vs W=1: {first_mismatch(got, seen[1])}"
        seen[world] = got


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_grid_sweeps_and_natural_chunking(world, dtype):
    """Messages longer than one grid sweep (on an H200 at W = 3 / 4: 44 / 33 blocks; the one-shot units of every
    dtype and the fp32 two-shot slices wrap the grid), and a capacity that chunks the call without being asked."""
    rows, n = 4096, 72
    bits = partials(11, rows, n, dtype)
    want = oracle(bits, dtype)
    R = ranks(world, capacity=8 << 20)
    for kw in ({"algo": "one_shot"}, {"algo": "two_shot"}):
        check_all(run(R, bits, dtype, **kw), want, f"W={world} {dtype} {kw}")
    small = ranks(world, capacity=V // world * 100 * n * 4)  # 100 rows per launch: 41 launches
    check_all(run(small, bits, dtype), want, f"W={world} {dtype} natural chunking")
    assert ("all_reduce_virtual", dtype, "chunked") in small.views[0].variants_run


@pytest.mark.parametrize("world", [2, 3])
def test_unaligned_partials_and_output(world):
    """Partials and output starting off a 16-byte boundary, rows of 13 elements: the scalar path, same bits."""
    s, rows, n = V // world, 9, 13
    for dtype in DTYPES:
        bits = partials(5, rows, n, dtype)
        want = oracle(bits, dtype)
        R = ranks(world)
        xs, outs = [], []
        for r in range(world):
            flat = torch.empty(s * rows * n + 1, dtype=torch.float32, device="cuda:0")
            x = flat[1:].view(s, rows, n)
            x.copy_(to_tensor(np.ascontiguousarray(bits[r * s:(r + 1) * s]), "float32", "cuda:0"))
            xs.append(x)
            outs.append(torch.empty(rows * n + 1, dtype=getattr(torch, dtype), device="cuda:0")[1:].view(rows, n))
        assert all(x.data_ptr() % 16 for x in xs) and all(o.data_ptr() % 16 for o in outs)
        for algo in ("one_shot", "two_shot"):
            for o in outs:
                o.fill_(7)
            main = torch.cuda.current_stream()
            for v, st, x, o in zip(R.views, R.streams, xs, outs):
                st.wait_stream(main)
                with torch.cuda.stream(st):
                    v.all_reduce_virtual(x, dtype=getattr(torch, dtype), out=o, algo=algo)
            torch.cuda.synchronize()
            check_all([from_tensor(o) for o in outs], want, f"W={world} {dtype} {algo} unaligned")


@pytest.mark.parametrize("world", [3])  # W = 3 is the smallest W where the controls must differ
def test_negative_controls_differ(world):
    """The checks above can fail: folding the peers in a rotated order (the rotated build), or folding per-rank
    pre-sums (each rank's S slabs summed in fp32 and rounded, then the plain fold over ranks), gives other bits."""
    rows = 64
    rot = ranks(world, build="rotated")
    plain = ranks(world)
    s = V // world
    for dtype in DTYPES:
        bits = partials(3, rows, N, dtype)
        want = oracle(bits, dtype)
        for algo in ("one_shot", "two_shot"):
            got = run(rot, bits, dtype, algo=algo)
            assert not np.array_equal(got[0], want), f"rotated {algo} W={world} {dtype} matched the oracle"
        presums = [round_fp32_bits(fold_oracle(list(bits[r * s:(r + 1) * s]), "float32"), dtype) for r in range(world)]
        got = plain.run_bits("all_reduce", presums, dtype)
        assert not np.array_equal(got[0], want), f"pre-summed W={world} {dtype} matched the oracle"


def test_different_calls_fail_every_rank():
    """The descriptor's count is the fp32 input (S * rows * N): ranks passing different slab counts, or row counts,
    fail at the start barrier on every rank."""
    from detcomm.errors import WorkspaceFailed
    from detcomm.workspace import Workspace

    cases = [((6, 8, 16), (7, 8, 16)), ((6, 8, 16), (6, 9, 16))]
    for a, b in cases:
        R = Ranks(Workspace.in_process(2, device="cuda:0", capacity_bytes=1 << 16, timeout_s=30.0))
        xs = [torch.ones(a, device="cuda:0"), torch.ones(b, device="cuda:0")]
        R.run("all_reduce_virtual", xs, dtype=torch.bfloat16)
        for v in R.views:
            with pytest.raises(WorkspaceFailed, match="made different calls"):
                v.check()


def test_arguments_are_refused_before_any_launch():
    R = ranks(2)
    v = R.views[0]
    x = torch.zeros(6, 4, 8, device="cuda:0")
    with pytest.raises(ValueError, match="float32"):
        v.all_reduce_virtual(x.to(torch.bfloat16), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        v.all_reduce_virtual(x, dtype="bfloat16")
    with pytest.raises(ValueError, match="algo"):
        v.all_reduce_virtual(x, dtype=torch.bfloat16, algo="three_shot")
    with pytest.raises(ValueError, match="chunk_rows"):
        v.all_reduce_virtual(x, dtype=torch.bfloat16, chunk_rows=10**6)
    with pytest.raises(ValueError, match="out must be"):
        v.all_reduce_virtual(x, dtype=torch.bfloat16, out=torch.empty(4, 8, device="cuda:0"))
    calls = v._calls
    assert calls == R.views[1]._calls  # nothing launched: the ranks still agree


# ---- through the public API: W processes sharing one GPU (gloo side channel), self-checks on -------------------
def job_public_api(rank: int, w: int, variant: str) -> dict[str, object]:
    import detcomm
    from detcomm.workspace import Workspace, debug

    # The communicator arms its workspace over this build, recording the code paths (variants_run) from the start.
    Workspace.create = debug.workspace_class(variant, record=True).create  # type: ignore[method-assign]
    comm = detcomm.init(numerics="rl-bitwise", device="cuda:0")
    s = V // w
    out: dict[str, object] = {}
    for dtype in ("bfloat16", "float32"):
        comm.site(f"vs.{dtype}", collective="all_reduce", dtype=getattr(torch, dtype), shape=(N,), max_rows=64,
                  virtual_shards=V)
    out["routes"] = {e["site"]: (e["route"], e["why"]) for e in comm.routes().as_dicts()}
    ws = comm._workspace
    if ws is not None:
        need = {("all_reduce_virtual", "bfloat16", v) for v in ws.virtual_variants(torch.bfloat16, N, 64, s)}
        out["variants_missing"] = sorted(need - ws.variants_run)
    ok = []
    for dtype in ("bfloat16", "float32"):
        for rows in (1, 5, 64):
            bits = partials(100 + rows, rows, N, dtype)
            mine = to_tensor(np.ascontiguousarray(bits[rank * s:(rank + 1) * s]), "float32", "cuda:0")
            got = from_tensor(comm.all_reduce(mine, site=f"vs.{dtype}"))
            ok.append(bool(np.array_equal(got, oracle(bits, dtype))))
    out["ok"] = ok
    out["checks"] = [(c.key.label(), c.passed) for c in comm.checks()]
    detcomm.shutdown()
    return out


def test_public_api_routes_virtual_sites_to_the_workspace_and_the_checks_refuse_a_rotated_build():
    """W = 3 processes on one GPU: a virtual-shard all-reduce site takes ipc_fold, every reachable variant ran in
    its self-check, and the results are the oracle's. Negative control: with the rotated build the self-check
    refuses ipc_fold and the site falls back to gather_fold (the same canonical bits)."""
    from detcomm._spawn import LocalCluster

    for variant in ("canonical", "rotated"):
        with LocalCluster(3, backend="gloo", pg_timeout_s=120) as c:
            res = c.run(job_public_api, variant, timeout_s=600)
        for r in res:
            assert all(r["ok"]), r
            route, why = r["routes"]["vs.bfloat16"]
            if variant == "canonical":
                assert route == "ipc_fold" and "V/W=4 fp32 slabs" in why, r
                assert r["variants_missing"] == [], r
                assert any(label.startswith("ipc_fold") and f"virtual_shards={V}" in label and passed
                           for label, passed in r["checks"]), r["checks"]
            else:
                assert route == "gather_fold" and "refused: ipc_fold" in why and "(c) differs" in why, r
