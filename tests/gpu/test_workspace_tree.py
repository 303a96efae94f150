"""The tree-order virtual-shard workspace kernels (csrc/tree_fold.cu, docs/spec.md §9.1 shard_fold="tree"), W ranks
as W CUDA streams of one GPU, against a numpy oracle written from the definition:

    T(i, 1) = p_i;  T(i, n) = fp32(T(i, n/2) + T(i + n/2, n/2));  out = round_to_nearest_even(T(0, V) + 0.0)

with the canonical NaN. The same V global fp32 partials are split over W = 2, 4, 8 ranks (rank r passes shards
r*V/W .. (r+1)*V/W - 1 as [V/W, rows, N]); every algorithm (one-store, one-shot, two-shot, chunked, the automatic
choice), eagerly and replayed from CUDA graphs, must give the oracle's bits on every rank. Negative control: on a
payload built for it, the shard-order kernel (csrc/virtual_fold.cu) gives other bits, the order oracle's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import Ranks, cached_ranks, on_ranks
from payloads import first_mismatch, from_tensor, to_tensor

from oracle import round_fp32_bits

pytestmark = pytest.mark.gpu

DTYPES = ("bfloat16", "float16", "float32")
N = 33  # odd: the last unit of every row range is partial (the scalar tail)
# V per W: S = V/W covers the register trees (1, 2, 4, 8 leaves) and the 8-leaf block counter (16, 32, 64).
SHARDS = {2: (2, 8, 16, 64, 128), 4: (4, 8, 16, 64), 8: (8, 16, 64)}
ONE_STORE = 1 << 20  # the one-store path is off between streams of one GPU by default (plan.one_store_max_bytes): forced on
CAPACITY = 1 << 20


def ranks(world: int, *, capacity: int = CAPACITY, **kw) -> Ranks:
    return cached_ranks(world, capacity=capacity, one_store_max_bytes=ONE_STORE, **kw)


# ---- the oracles (numpy, from the definitions; nothing from detcomm) ----------------------------------------
def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float32)


def tree_oracle(bits: np.ndarray, dtype: str) -> np.ndarray:
    """bits: [V, ...] fp32 bit patterns of the V shards in order -> the tree's output bits in `dtype`."""

    def t(i: int, n: int) -> np.ndarray:
        if n == 1:
            return _f32(bits[i]).copy()
        with np.errstate(all="ignore"):
            return (t(i, n // 2) + t(i + n // 2, n // 2)).astype(np.float32)

    with np.errstate(all="ignore"):
        root = (t(0, bits.shape[0]) + np.float32(0.0)).astype(np.float32)
    return round_fp32_bits(root.view(np.uint32), dtype)


def order_oracle(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The shard-order fold: +0.0, then p_0, p_1, ... in turn, one rounding."""
    acc = np.zeros(bits.shape[1:], dtype=np.float32)
    with np.errstate(all="ignore"):
        for v in range(bits.shape[0]):
            acc = (acc + _f32(bits[v])).astype(np.float32)
    return round_fp32_bits(acc.view(np.uint32), dtype)


def partials(seed: int, v: int, rows: int, n: int, dtype: str, *, specials: bool = True) -> np.ndarray:
    """[V, rows, n] fp32 bits: values at the dtype's scale with bits below its precision, and adversarial columns:
    a ±big pair split across the tree's halves with small terms beside them (the tree and the shard order give
    different sums), all -0.0 (+0.0 out), tiny negatives (a negative sum that rounds to -0.0 in bf16/fp16),
    subnormal fp32 sums, +huge +huge -huge (Inf or finite by the grouping), NaN with payloads and either sign,
    Inf - Inf, a lone -Inf, values whose sum overflows the output dtype. specials=False leaves out the NaN, Inf and
    overflow columns (a fused norm's row holding one is NaN or zero throughout, which would hide the rest)."""
    rng = np.random.default_rng([seed, v, rows, n, len(dtype)])
    m = rows * n
    scale = np.float32(2.0) ** rng.integers(-12, 12, (v, m)).astype(np.float32)
    p = (rng.standard_normal((v, m)).astype(np.float32) * scale).astype(np.float32)
    kind = rng.integers(0, 11, m)
    if not specials:
        kind[(kind >= 3) & (kind <= 7)] = 10
    big, small = np.float32(2.0**40), np.float32(1.0)  # small is absorbed by big in fp32
    huge = np.float32(3.0e38)
    a = rng.integers(0, v, m)
    b = (a + 1 + rng.integers(0, max(v - 1, 1), m)) % v
    h = v // 2
    if v >= 4:  # at V = 2 the tree and the shard order are the same sum
        for c in np.flatnonzero(kind == 0):
            p[:, c] = 0  # tree: (big + 1) + (-big + 1) = 0; shard order: ((big + 1) - big) + 1 = 1
            p[0, c], p[1, c], p[h, c], p[h + 1, c] = big, small, -big, small
    p[:, kind == 1] = np.float32(-0.0)
    p[:, kind == 2] = -np.float32(1e-45) * rng.integers(1, 4, (v, int((kind == 2).sum()))).astype(np.float32)
    for c in np.flatnonzero(kind == 3):
        p[:, c] = 0
        p[a[c], c], p[b[c], c], p[(b[c] + 1) % v, c] = huge, huge, -huge
    pv = p.view(np.uint32)
    for c in np.flatnonzero(kind == 4):
        pv[a[c], c] = np.uint32((0xFFC00000 if c % 2 else 0x7F800000) | int(rng.integers(1, 1 << 22)))
    for c in np.flatnonzero(kind == 5):
        p[a[c], c], p[b[c], c] = np.inf, -np.inf
    for c in np.flatnonzero(kind == 6):
        p[a[c], c] = -np.inf
    p[:, kind == 7] = np.float32(7e4 if dtype == "float16" else 3.4e38)
    # subnormal fp32 partials whose sums stay subnormal (kept: no flush-to-zero anywhere)
    sub = kind == 8
    pv[:, sub] = rng.integers(1, 1 << 20, (v, int(sub.sum()))).astype(np.uint32) | (
        rng.integers(0, 2, (v, int(sub.sum()))).astype(np.uint32) << 31)
    return pv.reshape(v, rows, n).copy()


def split(bits: np.ndarray, world: int) -> list[torch.Tensor]:
    s = bits.shape[0] // world
    return [to_tensor(np.ascontiguousarray(bits[r * s:(r + 1) * s]), "float32", "cuda:0") for r in range(world)]


def run(R: Ranks, bits: np.ndarray, dtype: str, op: str = "all_reduce_tree", **kw) -> list[np.ndarray]:
    outs = R.run(op, split(bits, R.world), dtype=getattr(torch, dtype), **kw)
    return [from_tensor(o) for o in outs]


def check_all(outs, want, what):
    for r, got in enumerate(outs):
        assert np.array_equal(got, want), f"{what}, rank {r}: {first_mismatch(got, want)}"


def test_the_oracles_are_what_they_say():
    """The oracle itself, on hand-made sums: V = 4 leaves big, 1, -big, 1: the tree gives (big + 1) + (-big + 1) =
    0 -> +0.0, the shard order ((big + 1) - big) + 1 = 1; all -0.0 gives +0.0; a NaN is the canonical one."""
    big = np.float32(2.0**30)
    p = np.array([[big], [1.0], [-big], [1.0]], dtype=np.float32).view(np.uint32)
    assert tree_oracle(p, "float32")[0] == 0 and order_oracle(p, "float32")[0] == np.float32(1.0).view(np.uint32)
    z = np.full((4, 1), 0x80000000, dtype=np.uint32)
    assert tree_oracle(z, "bfloat16")[0] == 0 and tree_oracle(z, "float32")[0] == 0
    nan = np.array([[0xFFC12345], [0], [0], [0]], dtype=np.uint32)
    assert tree_oracle(nan, "float32")[0] == 0x7FC00000 and tree_oracle(nan, "bfloat16")[0] == 0x7FC0


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_algorithm_matches_the_tree_oracle(world, dtype):
    """Every V of SHARDS[W], rows 1 / 7 / 64 (rows of 33) and 2048 (rows of 72): the one-store, one-shot and
    two-shot kernels forced, forced chunking (alone and with two-shot), the automatic choice and a workspace whose
    small one_shot_max_bytes sends auto to two-shot all give the oracle's bits on every rank; every code path of
    Workspace.tree_variants ran."""
    R = ranks(world)
    R2 = cached_ranks(world, capacity=CAPACITY, one_shot_max_bytes=256)  # no one-store path: auto is two-shot
    for v in SHARDS[world]:
        for rows, n in ((1, N), (7, N), (64, N), (2048, 72)):
            if rows == 2048 and v > 16 and dtype != "bfloat16":
                continue  # the large payload once per V and W is enough; the kernels' tails are the small rows'
            bits = partials(world, v, rows, n, dtype)
            want = tree_oracle(bits, dtype)
            # Chunks of 2-3 rows, at most ~20 launches per call: W streams of one process issue every rank's
            # launches from one thread, and a call of ~1000 launches fills the driver's launch queue while rank 0's
            # first kernel waits for rank 1's, which the blocked thread has not issued yet (seen on the H200: a
            # 60 s timeout at 1024 launches of 2 rows; 683 launches of 3 rows passed).
            c = 3 if rows < 2048 else 113
            for kw in ({"algo": "one_store"}, {"algo": "one_shot"}, {"algo": "two_shot"}, {}, {"chunk_rows": c},
                       {"chunk_rows": c - 1, "algo": "two_shot"}):
                check_all(run(R, bits, dtype, **kw), want, f"W={world} V={v} {dtype} rows={rows} {kw}")
            check_all(run(R2, bits, dtype), want, f"W={world} V={v} {dtype} rows={rows} auto two-shot")
    view = R.views[0]
    for v in SHARDS[world]:
        need = {("all_reduce_tree", dtype, k)
                for k in view.tree_variants(getattr(torch, dtype), N, 4096, v // world)} - {
                    ("all_reduce_tree", dtype, "chunked")}
        assert need and need <= view.variants_run, (need, view.variants_run)
    assert ("all_reduce_tree", dtype, "chunked") in view.variants_run


def test_the_same_bits_at_every_world():
    """The same V = 16 global partials at W = 2, 4, 8: identical bits (also implied by the oracle; checked
    directly, on the automatic path)."""
    for dtype in DTYPES:
        bits = partials(7, 16, 64, N, dtype)
        got = {w: run(ranks(w), bits, dtype)[0] for w in (2, 4, 8)}
        for w in (4, 8):
            assert np.array_equal(got[w], got[2]), f"{dtype} W={w} vs W=2: {first_mismatch(got[w], got[2])}"


@pytest.mark.parametrize("world", [2, 4])
def test_signed_zeros_subnormals_and_nan(world):
    """A sum of signed zeros is +0.0 (the root's +0.0); subnormal fp32 sums are kept exactly; a NaN anywhere gives
    the canonical NaN; Inf - Inf is NaN: on every algorithm."""
    v, rows = 8, 4
    R = ranks(world)
    zeros = np.full((v, rows, N), 0x80000000, dtype=np.uint32)
    zeros[::2] = 0  # +0.0 and -0.0 mixed
    zeros[:, 1] = 0x80000000  # a row of -0.0 only
    sub = (np.arange(v * rows * N, dtype=np.uint32) % 1000 + 1).reshape(v, rows, N)  # subnormals, sums subnormal
    sub[1::3] |= np.uint32(0x80000000)
    nan = np.zeros((v, rows, N), dtype=np.uint32)
    nan[3, :, ::2] = 0xFFC0BEEF
    nan[5, :, 1::2] = np.float32(np.inf).view(np.uint32)
    nan[6, :, 1::2] = np.float32(-np.inf).view(np.uint32)
    for algo in ("one_store", "one_shot", "two_shot"):
        for dtype in DTYPES:
            got = run(R, zeros, dtype, algo=algo)
            check_all(got, np.zeros_like(got[0]), f"zeros W={world} {dtype} {algo}")
            got = run(R, nan, dtype, algo=algo)
            canon = {"float32": 0x7FC00000, "bfloat16": 0x7FC0, "float16": 0x7E00}[dtype]
            check_all(got, np.full_like(got[0], canon), f"NaN W={world} {dtype} {algo}")
        want = tree_oracle(sub, "float32")
        assert np.count_nonzero(want) > 0 and np.all((want & 0x7F800000) == 0)  # nonzero subnormal results
        check_all(run(R, sub, "float32", algo=algo), want, f"subnormals W={world} {algo}")


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_graph_capture_and_replay(world):
    """Each rank captures its site-bound call (Workspace.bind_all_reduce_tree, the route's hot path) and each
    forced algorithm in its own graph on its own stream; the W graphs replayed together, after the inputs were
    overwritten in place, give the oracle's bits of the new inputs, replay after replay."""
    v, rows, dtype = 8, 64, "bfloat16"
    R = ranks(world)
    s = v // world
    bits = [partials(40 + k, v, rows, N, dtype) for k in range(3)]
    xs = split(bits[0], world)
    outs = [torch.empty(rows, N, dtype=torch.bfloat16, device="cuda:0") for _ in range(world)]
    bound = [view.bind_all_reduce_tree(torch.bfloat16, N, s, label="tree") for view in R.views]
    calls = {"bound": lambda r: bound[r](xs[r], outs[r])}
    for algo in ("one_store", "one_shot", "two_shot"):
        calls[algo] = lambda r, algo=algo: R.views[r].all_reduce_tree(xs[r], dtype=torch.bfloat16, out=outs[r],
                                                                      algo=algo)
    calls["chunked"] = lambda r: R.views[r].all_reduce_tree(xs[r], dtype=torch.bfloat16, out=outs[r], chunk_rows=5)
    for name, fn in calls.items():
        on_ranks(R.streams, fn)  # eager first: the launches are prepared outside the capture
        graphs = []
        for r in range(world):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=R.streams[r]):
                fn(r)
            graphs.append(g)
        for k in (1, 2, 0):
            for r, x in enumerate(split(bits[k], world)):
                xs[r].copy_(x)
            for o in outs:
                o.fill_(7)
            on_ranks(R.streams, lambda r, gs=graphs: gs[r].replay())
            check_all([from_tensor(o) for o in outs], tree_oracle(bits[k], dtype), f"graph {name} W={world} input {k}")


@pytest.mark.parametrize("world", [2, 4])
def test_unaligned_partials_and_output(world):
    """Partials and output starting off a 16-byte boundary, rows of 13 elements: the scalar path, same bits."""
    v, rows, n = 8, 9, 13
    s = v // world
    R = ranks(world)
    for dtype in DTYPES:
        bits = partials(5, v, rows, n, dtype)
        want = tree_oracle(bits, dtype)
        xs, outs = [], []
        for r in range(world):
            flat = torch.empty(s * rows * n + 1, dtype=torch.float32, device="cuda:0")
            x = flat[1:].view(s, rows, n)
            x.copy_(to_tensor(np.ascontiguousarray(bits[r * s:(r + 1) * s]), "float32", "cuda:0"))
            xs.append(x)
            outs.append(torch.empty(rows * n + 1, dtype=getattr(torch, dtype), device="cuda:0")[1:].view(rows, n))
        for algo in ("one_store", "one_shot", "two_shot"):
            for o in outs:
                o.fill_(7)
            on_ranks(R.streams, lambda r: R.views[r].all_reduce_tree(xs[r], dtype=getattr(torch, dtype), out=outs[r],
                                                                     algo=algo))
            check_all([from_tensor(o) for o in outs], want, f"W={world} {dtype} {algo} unaligned")


@pytest.mark.parametrize("world", [2, 4])
def test_negative_control_the_shard_order_kernel_gives_other_bits(world):
    """The checks above can fail: on the same partials the shard-order kernel (all_reduce_virtual) gives the order
    oracle's bits, which differ from the tree's (the ±big pairs across the tree's halves), while the tree kernel
    gives the tree oracle's."""
    R = ranks(world)
    for dtype in DTYPES:
        bits = partials(3, 8, 64, N, dtype)
        tree, order = tree_oracle(bits, dtype), order_oracle(bits, dtype)
        assert not np.array_equal(tree, order)
        check_all(run(R, bits, dtype), tree, f"tree W={world} {dtype}")
        for algo in ("one_shot", "two_shot"):
            got = run(R, bits, dtype, op="all_reduce_virtual", algo=algo)
            check_all(got, order, f"shard order W={world} {dtype} {algo}")
            assert not np.array_equal(got[0], tree), f"shard-order {algo} matched the tree at W={world} {dtype}"


def test_ranks_that_disagree_fail_every_rank():
    """The descriptor names the tree kernel and counts S * rows * N: a rank calling the shard-order kernel while
    its peer calls the tree kernel, or ranks passing different rows, fail on every rank."""
    from detcomm.errors import WorkspaceFailed
    from detcomm.workspace import Workspace

    for ops, shapes in ((("all_reduce_tree", "all_reduce_virtual"), ((4, 8, 16), (4, 8, 16))),
                        (("all_reduce_tree", "all_reduce_tree"), ((4, 8, 16), (4, 9, 16)))):
        R = Ranks(Workspace.in_process(2, device="cuda:0", capacity_bytes=1 << 16, timeout_s=30.0))
        xs = [torch.ones(sh, device="cuda:0") for sh in shapes]
        on_ranks(R.streams, lambda r: getattr(R.views[r], ops[r])(xs[r], dtype=torch.bfloat16, algo="one_shot"))
        for view in R.views:
            with pytest.raises(WorkspaceFailed, match="made different calls"):
                view.check()


def test_arguments_are_refused_before_any_launch():
    R = ranks(2)
    view = R.views[0]
    x = torch.zeros(4, 4, 8, device="cuda:0")
    with pytest.raises(ValueError, match="power of two"):
        view.all_reduce_tree(torch.zeros(3, 4, 8, device="cuda:0"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        view.all_reduce_tree(x.to(torch.bfloat16), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="algo"):
        view.all_reduce_tree(x, dtype=torch.bfloat16, algo="three_shot")
    with pytest.raises(ValueError, match="chunk_rows"):
        view.all_reduce_tree(x, dtype=torch.bfloat16, chunk_rows=10**6)
    with pytest.raises(ValueError, match="out must be"):
        view.all_reduce_tree(x, dtype=torch.bfloat16, out=torch.empty(4, 8, device="cuda:0"))
    assert view._calls == R.views[1]._calls  # nothing launched: the ranks still agree


def on_threads(streams, fn):
    """fn(r) for every rank, each in its own thread on rank r's stream (calls that synchronize inside), joined."""
    import threading

    out: list = [None] * len(streams)
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            with torch.cuda.stream(streams[r]):
                out[r] = fn(r)
                torch.cuda.current_stream().synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


# ---- the fused all-reduce + residual add + RMSNorm on the tree (csrc/fused_rmsnorm.cu, the tree variants) -----
EPS = 1e-6


def norm_oracle(s_bits: np.ndarray, res_bits: np.ndarray, w_bits: np.ndarray, dtype: str) -> tuple:
    from norm_oracle import residual_add_oracle, rms_norm_oracle

    r = residual_add_oracle(s_bits, res_bits, dtype)
    return rms_norm_oracle(r, w_bits, dtype, dtype, EPS), r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_norm_on_the_tree_matches_the_oracle_and_the_composition(world, dtype):
    """(y, r) of the fused tree kernels, one-shot, two-shot, the automatic choice and forced chunking, in every
    row layout (registers, wide, streaming: hidden 1000 / 4096, 6000, 9000 in bf16), equal the oracle's (the tree
    oracle's s, then the numpy residual add and RMSNorm of docs/spec.md §9.2) and the workspace composition's
    (all_reduce_tree, then detcomm.numerics.norm.add_rms_norm) on every rank. The control: the same oracle fed the
    shard-order s gives other bits."""
    from detcomm.numerics import norm

    v = 8
    s = v // world
    R = ranks(world, capacity=8 << 20)
    eps32 = norm.eps_fp32(EPS)
    for hidden in (1000, 4096, 6000, 9000):
        for rows in (1, 7, 64):
            bits = partials(60 + rows, v, rows, hidden, dtype, specials=False)
            rng = np.random.default_rng([rows, hidden])
            res_bits = partials(61 + rows, 1, rows, hidden, "float32", specials=False)[0]
            res_bits = round_fp32_bits(res_bits, dtype)  # a residual of the site's dtype, specials included
            w_bits = round_fp32_bits((rng.standard_normal(hidden).astype(np.float32) * 0.5 + 1).view(np.uint32), dtype)
            y_want, r_want = norm_oracle(tree_oracle(bits, dtype), res_bits, w_bits, dtype)
            y_order, _ = norm_oracle(order_oracle(bits, dtype), res_bits, w_bits, dtype)
            assert not np.array_equal(y_want, y_order)
            xs = split(bits, world)
            res = to_tensor(res_bits, dtype, "cuda:0")
            w = to_tensor(w_bits, dtype, "cuda:0")
            comp = on_ranks(R.streams, lambda r: R.views[r].all_reduce_tree(xs[r], dtype=getattr(torch, dtype)))
            ref = [norm.add_rms_norm(c, res, w, eps=EPS) for c in comp]
            for kw in ({"algo": "one_shot"}, {"algo": "two_shot"}, {}, {"chunk_rows": 3},
                       {"chunk_rows": 2, "algo": "two_shot"}):
                got = on_ranks(R.streams, lambda r: R.views[r].all_reduce_rmsnorm_tree(xs[r], res, w, eps32, **kw))
                what = f"fused tree W={world} {dtype} H={hidden} rows={rows} {kw}"
                for k, ((y, r_), (yc, rc)) in enumerate(zip(got, ref)):
                    yb, rb = from_tensor(y), from_tensor(r_)
                    assert np.array_equal(rb, r_want), f"{what} r, rank {k}: {first_mismatch(rb, r_want)}"
                    assert np.array_equal(yb, y_want), f"{what} y, rank {k}: {first_mismatch(yb, y_want)}"
                    assert np.array_equal(yb, from_tensor(yc)) and np.array_equal(rb, from_tensor(rc)), what
    ran = R.views[0].variants_run
    for k in ("fused_one_shot", "fused_two_shot", "fused_chunked", "layout_registers", "layout_wide",
              "layout_streaming"):
        assert ("all_reduce_rmsnorm_tree", dtype, k) in ran, (k, ran)
    assert s >= 1


@pytest.mark.parametrize("world", [2, 4])
def test_the_route_binds_a_tree_norm_site_to_the_fused_tree_kernels(world):
    """ipc_fold binds an all_reduce_rmsnorm site whose all-reduce is the tree (a Site declared with
    shard_fold="tree", bound by the route directly: the router's own declaration is the host side's) to the fused
    tree kernels: every
    variant the binding exposes runs its self-check call (fused vs composition, raising on any differing bit) and
    returns the tree's s; the fused call gives the oracle's (y, r)."""
    from detcomm.envelope import resolve_numerics
    from detcomm.route_impls.ipc_fold import IpcFoldRoute
    from detcomm.sites import Collective, ReduceOp, Site

    v, rows, hidden, dtype = 8, 7, 4096, "bfloat16"
    site = Site(name="tree.add_norm", collective=Collective.ALL_REDUCE_RMSNORM, dtype=torch.bfloat16,
                shape=(hidden,), max_rows=128, op=ReduceOp.SUM, virtual_shards=v, shard_fold="tree")
    R = ranks(world, capacity=8 << 20)
    bound = [IpcFoldRoute(view, resolved=resolve_numerics("rl-bitwise")).bind(site) for view in R.views]
    assert all(b.fused is not None for b in bound), [b.note for b in bound]
    names = sorted(bound[0].variants)
    # Up to 128 rows of 4096: the fused tree kernel takes one-shot while the rows' bf16 bytes fit the one-shot limit
    # (512 KiB: 64 rows) and two-shot above; the tree all-reduce takes the one-store kernel while its published fp32
    # fits ONE_STORE (1 MiB: 64 rows) and then two-shot (the output's 512 KiB one-shot limit is passed at the same row)
    assert names == ["fused_one_shot", "fused_two_shot", "one_store", "two_shot"], names
    bits = partials(80, v, rows, hidden, dtype, specials=False)
    xs = split(bits, world)
    want = tree_oracle(bits, dtype)
    from detcomm.numerics import norm

    # The self-check calls compare bits on the host (a synchronization inside each rank's call), so each rank runs in
    # its own thread on its own stream; the norm kernel is loaded first (a module load waits for running kernels).
    norm.add_rms_norm(torch.zeros(1, hidden, device="cuda:0", dtype=torch.bfloat16),
                      torch.zeros(1, hidden, device="cuda:0", dtype=torch.bfloat16),
                      torch.ones(hidden, device="cuda:0", dtype=torch.bfloat16), eps=EPS)
    torch.cuda.synchronize()
    for name in names:
        got = on_threads(R.streams, lambda r: bound[r].variants[name](xs[r], None))
        check_all([from_tensor(g) for g in got], want, f"bound variant {name} W={world}")
    res = to_tensor(round_fp32_bits(partials(81, 1, rows, hidden, "float32", specials=False)[0], dtype), dtype, "cuda:0")
    w = torch.ones(hidden, dtype=torch.bfloat16, device="cuda:0")
    y_want, r_want = norm_oracle(want, from_tensor(res), from_tensor(w), dtype)
    got = on_ranks(R.streams, lambda r: bound[r].fused(xs[r], res, w, EPS))
    for k, (y, r_) in enumerate(got):
        assert np.array_equal(from_tensor(r_), r_want) and np.array_equal(from_tensor(y), y_want), f"fused rank {k}"


# ---- the fused tree norm through the public API (detcomm.init / site / all_reduce_residual_rmsnorm), W processes
# sharing one GPU over gloo ----------------------------------------------------------------------------------------
API_V = 8
API_SITES = {"bfloat16": 4096, "float32": 1000}  # hidden per dtype: a register row of 16-bit and of fp32 elements


def job_api_tree_norm(rank: int, w: int) -> dict[str, object]:
    """Through the public API (detcomm.init, detcomm.site, detcomm.all_reduce_residual_rmsnorm): a tree-order
    all_reduce_rmsnorm site per dtype, on a communicator whose workspace records its code paths: its route and
    self-check (the fused tree variants' self-check calls ran); then every call's (y, r) bits with the kernels'
    record (the fused tree kernel alone), the composition through the API (the tree all_reduce site, then
    add_rms_norm), the shard-order site's (the composition: no fused kernel), and a CUDA graph of the fused call
    replayed with new inputs
    (tests/gpu/harness.capture_and_replay: the oracle's bits after every replay). Returns what differs."""
    from harness import capture_and_replay

    import detcomm
    from detcomm.numerics import norm
    from detcomm.workspace import Workspace, debug

    Workspace.create = debug.workspace_class("canonical", record=True).create  # type: ignore[method-assign]
    # A gloo group staging CUDA tensors: eager calls exchange the call guard's separate header; a captured call
    # carries none (SiteCall._prove), and ipc_fold's kernels compare their own per-call descriptor.
    comm = detcomm.init(numerics="rl-bitwise", device="cuda:0")
    ws = comm._workspace
    problems: list[str] = []
    out: dict[str, object] = {"problems": problems, "armed": comm.caps.workspace_reason}
    if ws is None:
        problems.append(f"the workspace did not arm: {comm.caps.workspace_reason}")
        detcomm.shutdown()
        return out
    k = API_V // w
    routes: dict[str, tuple[str, str, str]] = {}
    for dt, hidden in API_SITES.items():
        dtype = getattr(torch, dt)
        for fold in ("tree", "order"):
            detcomm.site(f"{fold}.{dt}", collective="all_reduce_rmsnorm", dtype=dtype, shape=(hidden,),
                         max_rows=64, virtual_shards=API_V, shard_fold=fold)
        detcomm.site(f"ar.{dt}", collective="all_reduce", dtype=dtype, shape=(hidden,), max_rows=64,
                     virtual_shards=API_V, shard_fold="tree")
        # The tree site's self-check ran the fused tree variants against the composition.
        if not any(c == "all_reduce_rmsnorm_tree" and d == dt for c, d, _ in ws.variants_run):
            problems.append(f"{dt}: no self-check ran a fused tree kernel: {sorted(ws.variants_run)}")
        ws.variants_run.clear()
    for e in detcomm.routes().as_dicts():
        routes[str(e["site"])] = (str(e["route"]), str(e["selfcheck"]), str(e["why"]))
    out["routes"] = routes

    def inputs(dt: str, seed: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        hidden = API_SITES[dt]
        bits = partials(seed, API_V, rows, hidden, dt, specials=False)
        res = round_fp32_bits(partials(seed + 1, 1, rows, hidden, "float32", specials=False)[0], dt)
        rng = np.random.default_rng([seed, hidden])
        wt = round_fp32_bits((rng.standard_normal(hidden).astype(np.float32) * 0.5 + 1).view(np.uint32), dt)
        return bits, res, wt

    def mine(bits: np.ndarray) -> torch.Tensor:
        return to_tensor(np.ascontiguousarray(bits[rank * k : (rank + 1) * k]), "float32", "cuda:0")

    for dt in API_SITES:
        for rows in (1, 7, 64):
            bits, res_b, w_b = inputs(dt, 90 + rows, rows)
            x, res, wt = mine(bits), to_tensor(res_b, dt, "cuda:0"), to_tensor(w_b, dt, "cuda:0")
            y_want, r_want = norm_oracle(tree_oracle(bits, dt), res_b, w_b, dt)
            y_order, r_order = norm_oracle(order_oracle(bits, dt), res_b, w_b, dt)
            if np.array_equal(y_order, y_want):
                problems.append(f"{dt} rows={rows}: the payload does not tell the shard order from the tree")
            ws.variants_run.clear()
            y, r = detcomm.all_reduce_residual_rmsnorm(x, res, wt, eps=EPS, site=f"tree.{dt}")
            torch.cuda.synchronize()
            ran = set(ws.variants_run)
            # Fused on the workspace: the fused tree kernels alone, no separate all-reduce.
            if not ran or any(c != "all_reduce_rmsnorm_tree" for c, _, _ in ran):
                problems.append(f"{dt} rows={rows}: the call did not run the fused tree kernels alone: {sorted(ran)}")
            yb, rb = from_tensor(y), from_tensor(r)
            if not (np.array_equal(yb, y_want) and np.array_equal(rb, r_want)):
                problems.append(f"{dt} rows={rows}: (y, r) differ from the oracle: y {first_mismatch(yb, y_want)}"
                                f", r {first_mismatch(rb, r_want)}")
            yc, rc = norm.add_rms_norm(detcomm.all_reduce(x, f"ar.{dt}"), res, wt, eps=EPS)
            if not (np.array_equal(from_tensor(yc), yb) and np.array_equal(from_tensor(rc), rb)):
                problems.append(f"{dt} rows={rows}: (y, r) differ from the composition through the API")
            ws.variants_run.clear()
            yo, ro = detcomm.all_reduce_residual_rmsnorm(x, res, wt, eps=EPS, site=f"order.{dt}")
            torch.cuda.synchronize()
            if not (np.array_equal(from_tensor(yo), y_order) and np.array_equal(from_tensor(ro), r_order)):
                problems.append(f"{dt} rows={rows}: the shard-order site differs from the shard-order composition")
            if any(c == "all_reduce_rmsnorm_tree" for c, _, _ in ws.variants_run):
                problems.append(f"{dt} rows={rows}: the shard-order site ran a fused tree kernel")

    # CUDA graph: the fused call captured once, replayed after new partials and residual are copied in.
    dt, rows = "bfloat16", 7
    static = {}

    def refill(seed: int) -> None:
        bits, res_b, w_b = inputs(dt, 200 + seed, rows)
        for name, t in (("x", mine(bits)), ("res", to_tensor(res_b, dt, "cuda:0")), ("w", to_tensor(w_b, dt, "cuda:0"))):
            if name in static:
                static[name].copy_(t)
            else:
                static[name] = t

    def want(name: str, seed: int) -> np.ndarray:
        bits, res_b, w_b = inputs(dt, 200 + seed, rows)
        y_w, r_w = norm_oracle(tree_oracle(bits, dt), res_b, w_b, dt)
        return y_w if name == "y" else r_w

    refill(0)

    def calls() -> dict[str, torch.Tensor]:
        y, r = detcomm.all_reduce_residual_rmsnorm(static["x"], static["res"], static["w"], eps=EPS,
                                                   site=f"tree.{dt}")
        return {"y": y, "r": r}

    found, _ = capture_and_replay(calls, refill, want, seeds=(1, 2))
    problems += [f"graph: {p}" for p in found]
    detcomm.shutdown()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_public_api_tree_norm_processes_sharing_one_gpu(world):
    """detcomm's call path end to end on the workspace: a tree-order all_reduce_rmsnorm site routes to ipc_fold fused
    (the route table says so; its self-check ran the fused tree variants); each call runs the fused tree kernels
    alone and gives the oracle's and the composition's (y, r), rows 1 / 7 / 64, bf16 H=4096 and fp32 H=1000; the
    shard-order site gives the shard-order composition's bits (the negative control: they differ from the tree's);
    the call captured in a CUDA graph replays the oracle's bits of new inputs. (Before the barriers counted skipped
    launches, this run's self-check refused the fused tree kernels here: test_mixed_layouts_... below.)"""
    from detcomm._spawn import LocalCluster

    with LocalCluster(world, backend="gloo", pg_timeout_s=120) as c:
        res = c.run(job_api_tree_norm, timeout_s=600)
    for rank, r in enumerate(res):
        assert r["problems"] == [], (rank, r["armed"], r["problems"])
        routes = r["routes"]
        for dt in API_SITES:
            route, check, why = routes[f"tree.{dt}"]
            assert route == "ipc_fold" and check == "passed" and "fused with the residual add" in why, why
            route, check, why = routes[f"order.{dt}"]
            assert route == "ipc_fold" and check == "passed" and "no fused kernel folds the shard order" in why, why


# ---- launches that place a slot position in different blocks, across processes sharing one GPU ------------------
MIXED_ITERATIONS = 40


def job_mixed_layouts(rank: int, w: int, build: str) -> dict[str, object]:
    """On a workspace of kernel build `build` (W processes sharing the GPU, which time-slice it: a rank can be
    descheduled in the middle of a launch's reads while its peers run their next launches), MIXED_ITERATIONS rounds of
    three launches whose slot layouts give one position to different blocks and whose blocks skip different launches:
    the fused tree norm one-shot on 3 rows of 4096 (blocks 0-2, a row's fp32 regions per block), the tree all-reduce
    one-shot on the same partials (units of two fp32 packs: block 0 writes the positions the fused launch gave block
    1) and a plain one-shot all-reduce of one bf16 row (block 0 alone: its START counter runs ahead of blocks 1-2's
    unless the skipping blocks count the launch). Every output is compared with the numpy oracles afterwards; returns
    the mismatches and the workspace's failure, if any."""
    from detcomm.numerics import norm
    from detcomm.workspace import WorkspaceFailed, debug
    from oracle import fold_oracle

    ws = debug.workspace_class(build).create(None, device="cuda:0", capacity_bytes=8 << 20, max_rows_armed=64,
                                             timeout_s=20.0)
    v, rows, hidden, dt = 8, 3, 4096, "bfloat16"
    k = v // w
    eps32 = norm.eps_fp32(EPS)
    staged = []
    for i in range(MIXED_ITERATIONS):  # every input first: nothing but launches between the launches
        bits = partials(300 + i, v, rows, hidden, dt, specials=False)
        res_b = round_fp32_bits(partials(301 + i, 1, rows, hidden, "float32", specials=False)[0], dt)
        w_b = round_fp32_bits((np.random.default_rng(i).standard_normal(hidden).astype(np.float32) * 0.5 + 1)
                              .view(np.uint32), dt)
        # every rank's bf16 row, from one seed on every rank: each builds every rank's row (the oracle needs all)
        plain = list(round_fp32_bits(partials(302 + i, w, 1, hidden, "float32", specials=False), dt))
        staged.append((bits, res_b, w_b, plain,
                       to_tensor(np.ascontiguousarray(bits[rank * k:(rank + 1) * k]), "float32", "cuda:0"),
                       to_tensor(res_b, dt, "cuda:0"), to_tensor(w_b, dt, "cuda:0"), to_tensor(plain[rank], dt, "cuda:0")))
    torch.cuda.synchronize()
    outs, failure = [], None
    try:
        for _bits, _res_b, _w_b, _plain, x, res, wt, xp in staged:
            y, r = ws.all_reduce_rmsnorm_tree(x, res, wt, eps32, algo="one_shot")
            s = ws.all_reduce_tree(x, dtype=torch.bfloat16, algo="one_shot")
            p = ws.all_reduce(xp, algo="one_shot")
            outs.append((y, r, s, p))
        torch.cuda.synchronize()
        ws.check()
    except WorkspaceFailed as e:
        failure = str(e)
    problems: list[str] = []
    if failure is None:
        for i, ((bits, res_b, w_b, plain, *_), (y, r, s, p)) in enumerate(zip(staged, outs)):
            s_want = tree_oracle(bits, dt)
            y_want, r_want = norm_oracle(s_want, res_b, w_b, dt)
            for name, got, want in (("y", y, y_want), ("r", r, r_want), ("tree s", s, s_want),
                                    ("plain", p, fold_oracle(plain, dt))):
                g = from_tensor(got)
                if not np.array_equal(g, want):
                    problems.append(f"round {i} {name}: {int((g != want).sum())} elements differ, "
                                    f"{first_mismatch(g, want)}")
    ws.close()
    return {"problems": problems, "failure": failure}


@pytest.mark.parametrize("world", [2, 4])
def test_mixed_layouts_across_processes_never_read_a_copy_in_use(world):
    """Launches that give one slot position to different blocks, with blocks that skip different launches, on W
    processes sharing one GPU: every output equals the oracle on every rank and nothing fails. The negative control
    is the build whose skipping blocks do not count the launch (kernels "uncounted_skip", the scheme before
    2026-12-02): a block's parity then follows its own uses, and a peer's block 0 one launch ahead fills the copy this
    rank's block 1 still reads; the same run must catch it (wrong bits, or a failed workspace). That scheme is how the
    fused tree norm's self-check through the communicator was refused on the H200."""
    from detcomm._spawn import LocalCluster

    with LocalCluster(world, backend="gloo", pg_timeout_s=120) as c:
        res = c.run(job_mixed_layouts, "canonical", timeout_s=300)
        for rank, r in enumerate(res):
            assert r["failure"] is None and r["problems"] == [], (rank, r)
        control = c.run(job_mixed_layouts, "uncounted_skip", timeout_s=300)
    assert any(r["failure"] or r["problems"] for r in control), "the uncounted-skip control passed: the test cannot see it"
