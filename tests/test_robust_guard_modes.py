"""The call guard in both of its modes (detcomm/route_impls/guard.py), on gloo at W = 3 and 4.

A host-memory group exchanges a separate header before each call ("header"); a device group carries the header
inside each route's own message ("in_message": appended to each rank's contribution for data movement, in a
region of W slots for a native reduction). The device groups' mode is a static fact of the group, forced here on
a gloo group (``Communicator(call_guard=...)``) so the same torch ops run on CPU. For every route that used to
be unguarded on device groups (native all_reduce sum/max/min, reduce_scatter, all_gather, all_to_all,
token_all_gather, argmax) and the fold routes:

- a mismatched call of the same message size (another site, another call count, another trailing shape, a stale
  ``rows_per_rank``) raises ``CollectiveMismatch`` on every rank naming each rank's site and call, with checking
  off; negative control: with the guard disabled (``_disabled``, the mutants of tests/mutations.py) the same
  calls return mixed data without a word;
- matched calls return the bits of an independent numpy oracle (exact integer arithmetic, concatenation, the
  canonical fold of tests/oracle.py), each with a negative control that shows the comparison can fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, random_bits, to_bits, to_torch

MODES = ("header", "in_message")


@pytest.fixture(params=[3, 4], ids=lambda w: f"W{w}")
def cluster34(request):  # noqa: ANN001, ANN201
    from clusters import get_cluster

    return get_cluster(request.param)


def _comm(numerics: str, mode: str, *, selfcheck: bool):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    import detcomm
    from detcomm.comm import Communicator
    from detcomm.envelope import resolve_numerics

    detcomm.shutdown()
    assert dist.group.WORLD is not None
    comm = Communicator(group=dist.group.WORLD, resolved=resolve_numerics(numerics), selfcheck=selfcheck,
                        call_guard=mode)
    assert comm.call_guard == mode
    return comm


@contextlib.contextmanager
def _disabled(comm, mode: str) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """The guard of ``mode`` removed from this rank's calls (the negative control)."""
    from detcomm.route_impls.guard import MessageGuard

    if mode == "header":
        for sc in comm._site_calls.values():
            sc.header = None
        yield
        return
    begin = MessageGuard.begin
    MessageGuard.begin = lambda self, x: None  # type: ignore[method-assign, assignment, return-value]
    try:
        yield
    finally:
        MessageGuard.begin = begin  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------------------
# Mismatched calls

# (case, numerics, collective, op, forced route): every route a site can take on a gloo group.
CASES = (
    ("native all_reduce sum", "auto", "all_reduce", "sum", None),
    ("native all_reduce max", "auto", "all_reduce", "max", None),
    ("native all_reduce min int", "auto", "all_reduce", "min", None),
    ("native reduce_scatter", "auto", "reduce_scatter", "sum", None),
    ("native all_gather", "auto", "all_gather", "sum", None),
    ("native all_to_all", "auto", "all_to_all", "sum", None),
    ("native argmax", "auto", "argmax", "max", None),
    ("gather_fold all_reduce", "rl-bitwise", "all_reduce", "sum", None),
    ("a2a_fold reduce_scatter", "rl-bitwise", "reduce_scatter", "sum", None),
    ("rs_ag_fold all_reduce", "rl-bitwise", "all_reduce", "sum", "rs_ag_fold"),
)
KINDS = ("site", "count", "shape")


def _one_case(comm, rank: int, w: int, case: tuple, kind: str) -> Callable[[], object]:  # type: ignore[no-untyped-def, type-arg]
    """Declare the case's sites and return rank ``rank``'s call: rank 1 differs by ``kind``, in a message of the
    same size as the others'."""
    label, _, coll, op, route = case
    dtype = torch.int32 if label.endswith(" int") else torch.float32
    rows, width = 2 * w, 8
    if kind == "shape" and rank == 1:  # the same bytes in another trailing shape
        rows, width = w, 16
    for name in ("m.a", "m.b"):
        comm.site(name, collective=coll, dtype=dtype, shape=(width,), max_rows=4 * w, op=op, route=route)
    name = "m.b" if kind == "site" and rank == 1 else "m.a"
    if kind == "count" and rank == 1:
        comm._site_calls[name].calls += 1  # as if an earlier call of this rank's had paired elsewhere
    x = (torch.arange(rows * width, dtype=torch.float32).view(rows, width) + 100 * rank).to(dtype)
    fn = getattr(comm, coll)
    if coll == "all_reduce" or coll == "reduce_scatter":
        return lambda: fn(x, name, op=op)
    if coll == "argmax":
        return lambda: fn(x, name, vocab_start=width * rank)
    return lambda: fn(x, name)


def _outcome(call: Callable[[], object], want: list[str]) -> str:
    import detcomm

    try:
        call()
        return "silent"
    except detcomm.CollectiveMismatch as e:
        missing = [w for w in want if w not in str(e)]
        return "raised" if not missing else f"raised without {missing}: {e}"


def job_mismatch(rank: int, w: int, mode: str, guarded: bool) -> list[str]:
    outcomes = []
    for case in CASES:
        for kind in KINDS:
            if kind == "shape" and case[2] == "argmax":
                continue  # argmax moves one key per row: another trailing shape is another message size
            comm = _comm(case[1], mode, selfcheck=False)  # no declaration check: the call guard alone
            # Nor the declaration exchange (issue 40.8: it would refuse kind "shape" at site(), before any call).
            comm._agree_declaration = lambda s: None
            call = _one_case(comm, rank, w, case, kind)
            want = {"site": ["rank 1: site 'm.b' call #1", "rank 0: site 'm.a' call #1"],
                    "count": ["rank 1: site 'm.a' call #2", "rank 0: site 'm.a' call #1"],
                    "shape": ["rank 1: site 'm.a' call #1", "16]", "8]"]}[kind]
            if guarded:
                got = _outcome(call, want)
            else:
                with _disabled(comm, mode):
                    got = _outcome(call, want)
            route = comm.routes().as_dicts()[0]["route"]
            outcomes.append(f"{case[0]} [{route}] {kind}: {got}")
            comm.close()
    # token_all_gather (native on every envelope): rank 1 passes 1 row, rank 0 holds a stale rows_per_rank that
    # says 2 (the same padded message size); unguarded, rank 0 returns an invented row for rank 1.
    comm = _comm("auto", mode, selfcheck=False)
    truth = [2] * w
    truth[1] = 1
    rpr = [2] * w if rank == 0 else truth
    x = torch.full((truth[rank], 8), float(rank + 1))
    comm.site("m.tok", collective="token_all_gather", dtype=torch.float32, shape=(8,), max_rows=4)
    call = lambda: comm.token_all_gather(x, "m.tok", rows_per_rank=rpr)  # noqa: E731
    want = [f"rows_per_rank={[2] * w}", f"rows_per_rank={truth}"]
    if guarded:
        got = _outcome(call, want)
    else:
        with _disabled(comm, mode):
            got = _outcome(call, want)
    outcomes.append(f"token_all_gather stale rows_per_rank: {got}")
    comm.close()
    return outcomes


@pytest.mark.parametrize("mode", MODES)
def test_every_route_raises_on_a_mismatched_call(cluster34, mode: str) -> None:  # noqa: ANN001
    for outcome in cluster34.run(job_mismatch, mode, True, timeout_s=600):
        bad = [o for o in outcome if not o.endswith(": raised")]
        assert not bad, bad
        # Each case ran on the route it names.
        assert all(o.split()[0] == o.split("[")[1].split("]")[0] for o in outcome if "[" in o), outcome


@pytest.mark.parametrize("mode", MODES)
def test_negative_control_without_the_guard_the_mismatch_is_silent(cluster34, mode: str) -> None:  # noqa: ANN001
    for outcome in cluster34.run(job_mismatch, mode, False, timeout_s=600):
        bad = [o for o in outcome if not o.endswith(": silent")]
        assert not bad, bad


# ---------------------------------------------------------------------------------------------------------
# Matched calls: the oracle's bits in both modes

def _ints(rows: int, width: int, dtype: np.dtype, *, seed: int, rank: int, lo: int, hi: int) -> np.ndarray:
    return np.random.default_rng([seed, 271, rank]).integers(lo, hi, (rows, width)).astype(dtype)


def _flip(a: np.ndarray) -> np.ndarray:
    b = np.array(a, copy=True)
    b.reshape(-1).view(np.uint8)[0] ^= 1
    return b


def job_matched(rank: int, w: int, mode: str) -> list[str]:
    """Every route on matched calls, self-checks on (their calls run the guarded path too). Returns the problems."""
    problems: list[str] = []

    def same(label: str, got: np.ndarray, want: np.ndarray, route: str, comm) -> None:  # type: ignore[no-untyped-def]
        routes = {e["site"]: e["route"] for e in comm.routes().as_dicts()}
        if routes.get(label) != route:
            problems.append(f"{label}: route {routes.get(label)}, expected {route}")
        if not np.array_equal(got, want):
            problems.append(f"{label}: not the oracle's bits")
        if np.array_equal(_flip(got), want):  # negative control: the comparison sees one flipped bit
            problems.append(f"{label}: the comparison cannot fail")

    def site(comm, name: str, coll: str, dtype: torch.dtype, width: int, op: str = "sum",  # type: ignore[no-untyped-def]
             route: str | None = None) -> str:
        comm.site(name, collective=coll, dtype=dtype, shape=(width,), max_rows=8 * w, op=op, route=route)
        return name

    # numerics=auto: the native route for every collective.
    comm = _comm("auto", mode, selfcheck=True)
    f = [random_bits(3, 8, "float32", seed=1, rank=r) for r in range(w)]
    got = to_bits(comm.all_gather(to_torch(f[rank], "float32"), site(comm, "ag", "all_gather", torch.float32, 8)))
    same("ag", got, np.concatenate(f), "native", comm)
    counts = [(r % 3) + 1 for r in range(w)]
    t = [random_bits(counts[r], 8, "bfloat16", seed=2, rank=r) for r in range(w)]
    got = to_bits(comm.token_all_gather(to_torch(t[rank], "bfloat16"), site(comm, "tok", "token_all_gather",
                                        torch.bfloat16, 8), rows_per_rank=counts))
    same("tok", got, np.concatenate(t), "native", comm)
    e = [random_bits(2 * w, 8, "float32", seed=3, rank=r) for r in range(w)]
    got = to_bits(comm.all_to_all(to_torch(e[rank], "float32"), site(comm, "a2a", "all_to_all", torch.float32, 8)))
    same("a2a", got, np.concatenate([e[q][2 * rank : 2 * rank + 2] for q in range(w)]), "native", comm)
    splits = [[(q + d) % 3 + 1 for d in range(w)] for q in range(w)]
    u = [_ints(sum(splits[q]), 4, np.dtype(np.int64), seed=4, rank=q, lo=-(2**62), hi=2**62) for q in range(w)]
    got = comm.all_to_all(torch.from_numpy(u[rank].copy()), site(comm, "a2a.u", "all_to_all", torch.int64, 4),
                          splits=splits[rank]).numpy()
    want = np.concatenate([u[q][sum(splits[q][:rank]) : sum(splits[q][: rank + 1])] for q in range(w)])
    same("a2a.u", got, want, "native", comm)
    i32 = [_ints(3, 8, np.dtype(np.int32), seed=5, rank=r, lo=-(2**30), hi=2**30) for r in range(w)]
    got = comm.all_reduce(torch.from_numpy(i32[rank].copy()), site(comm, "i32", "all_reduce", torch.int32, 8)).numpy()
    same("i32", got, np.sum(np.stack(i32), axis=0, dtype=np.int32), "native", comm)
    i8 = [_ints(3, 8, np.dtype(np.int8), seed=6, rank=r, lo=-128, hi=128) for r in range(w)]
    x8 = torch.from_numpy(i8[rank].copy())
    got = comm.all_reduce(x8, site(comm, "i8", "all_reduce", torch.int8, 8), out=x8).numpy()  # in place
    same("i8", x8.numpy(), np.sum(np.stack(i8), axis=0, dtype=np.int8), "native", comm)
    for dt, op, lo, hi in ((np.uint8, "max", 0, 256), (np.int64, "min", -(2**63), 2**63 - 1)):
        v = [_ints(3, 8, np.dtype(dt), seed=7, rank=r, lo=lo, hi=hi) for r in range(w)]
        name = site(comm, f"{op}.{np.dtype(dt).name}", "all_reduce", getattr(torch, np.dtype(dt).name), 8, op)
        got = comm.all_reduce(torch.from_numpy(v[rank].copy()), name, op=op).numpy()
        same(name, got, (np.max if op == "max" else np.min)(np.stack(v), axis=0), "native", comm)
    for dtype, op in (("float32", "max"), ("bfloat16", "min")):
        v = [ill_bits(3, 8, dtype, seed=8, rank=r) for r in range(w)]
        name = site(comm, f"k.{op}", "all_reduce", getattr(torch, dtype), 8, op)
        got = to_bits(comm.all_reduce(to_torch(v[rank], dtype), name, op=op))
        same(name, got, oracle.ordered_key_extreme_oracle(v, dtype, op), "native", comm)
    # A float SUM on the library's own arithmetic: small integers, exact in any order.
    s = [_ints(3, 8, np.dtype(np.int64), seed=9, rank=r, lo=-64, hi=64) for r in range(w)]
    got = comm.all_reduce(torch.from_numpy(s[rank].copy()).to(torch.bfloat16),
                          site(comm, "bf.sum", "all_reduce", torch.bfloat16, 8)).to(torch.int64).numpy()
    same("bf.sum", got, np.sum(np.stack(s), axis=0), "native", comm)
    rs = [_ints(2 * w, 8, np.dtype(np.int32), seed=10, rank=r, lo=-(2**20), hi=2**20) for r in range(w)]
    got = comm.reduce_scatter(torch.from_numpy(rs[rank].copy()), site(comm, "rs", "reduce_scatter", torch.int32, 8)).numpy()
    same("rs", got, np.sum(np.stack(rs), axis=0, dtype=np.int32)[2 * rank : 2 * rank + 2], "native", comm)
    km = [ill_bits(2 * w, 8, "float16", seed=11, rank=r) for r in range(w)]
    got = to_bits(comm.reduce_scatter(to_torch(km[rank], "float16"),
                                      site(comm, "rs.max", "reduce_scatter", torch.float16, 8, "max"), op="max"))
    same("rs.max", got, oracle.ordered_key_extreme_oracle(km, "float16", "max")[2 * rank : 2 * rank + 2], "native", comm)
    lg = [np.random.default_rng([12, r]).standard_normal((3, 5)).astype(np.float32) for r in range(w)]
    got = comm.argmax(torch.from_numpy(lg[rank].copy()), site(comm, "am", "argmax", torch.float32, 5, "max"),
                      vocab_start=5 * rank).numpy()
    same("am", got, np.argmax(np.concatenate(lg, axis=1), axis=1), "native", comm)
    comm.close()
    # numerics=rl-bitwise: the fold routes.
    comm = _comm("rl-bitwise", mode, selfcheck=True)
    g = [ill_bits(3, 24, "bfloat16", seed=13, rank=r) for r in range(w)]
    got = to_bits(comm.all_reduce(to_torch(g[rank], "bfloat16"), site(comm, "gf", "all_reduce", torch.bfloat16, 24)))
    same("gf", got, oracle.fold_oracle(g, "bfloat16"), "gather_fold", comm)
    got = to_bits(comm.all_reduce(to_torch(g[rank], "bfloat16"),
                                  site(comm, "rsag", "all_reduce", torch.bfloat16, 24, route="rs_ag_fold")))
    same("rsag", got, oracle.fold_oracle(g, "bfloat16"), "rs_ag_fold", comm)
    a = [ill_bits(2 * w, 8, "float32", seed=14, rank=r) for r in range(w)]
    got = to_bits(comm.reduce_scatter(to_torch(a[rank], "float32"), site(comm, "a2af", "reduce_scatter", torch.float32, 8)))
    same("a2af", got, oracle.fold_oracle(a, "float32")[2 * rank : 2 * rank + 2], "a2a_fold", comm)
    comm.close()
    return problems


@pytest.mark.parametrize("mode", MODES)
def test_matched_calls_keep_the_oracles_bits(cluster34, mode: str) -> None:  # noqa: ANN001
    assert cluster34.run(job_matched, mode, timeout_s=600) == [[]] * cluster34.world_size


# ---------------------------------------------------------------------------------------------------------
# The in-message guard's CUDA path: one process, an NCCL group of one rank (no peer to disagree with, so the
# comparison and the bits are checked; the mismatch path by a header tampered with after the collective).

@pytest.mark.gpu
def test_in_message_guard_on_cuda_with_nccl(tmp_path) -> None:  # noqa: ANN001
    import torch.distributed as dist

    from detcomm.errors import CollectiveMismatch
    from detcomm.route_impls.guard import HEADER_BYTES, MessageGuard
    from detcomm.route_impls.native import NativeRoute
    from detcomm.sites import Collective, ReduceOp, Site

    if dist.is_initialized():
        pytest.skip("needs a process group of its own")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dev = torch.device("cuda", 0)
        plain, guarded = NativeRoute(dist.group.WORLD), NativeRoute(dist.group.WORLD, in_message=True)

        def run(coll: Collective, op: ReduceOp, dtype: torch.dtype, x: torch.Tensor, **kw: object):  # type: ignore[no-untyped-def]
            site = Site(f"g.{coll.value}.{op.value}.{dtype}", coll, dtype, tuple(x.shape[1:]), 64, op)
            g = MessageGuard(site, native=guarded)
            g.arm(1, x.shape[0], kw.get("rows_per_rank"))  # type: ignore[arg-type]
            fn = {Collective.ALL_REDUCE: "all_reduce", Collective.REDUCE_SCATTER: "reduce_scatter"}.get(coll)
            if fn is not None:
                return getattr(plain, fn)(x, op), getattr(guarded, fn)(x, op, guard=g)
            if coll is Collective.ARGMAX:
                return plain.argmax(x, 0), guarded.argmax(x, 0, guard=g)
            if coll is Collective.ALL_GATHER:
                return plain.all_gather(x), guarded.all_gather(x, guard=g)
            return plain.all_to_all(x, [x.shape[0]], [x.shape[0]]), guarded.all_to_all(x, [x.shape[0]], [x.shape[0]], guard=g)

        gen = torch.Generator(device="cpu").manual_seed(3)
        cases = [
            (Collective.ALL_REDUCE, ReduceOp.SUM, torch.bfloat16), (Collective.ALL_REDUCE, ReduceOp.SUM, torch.int32),
            (Collective.ALL_REDUCE, ReduceOp.MAX, torch.float16), (Collective.ALL_REDUCE, ReduceOp.MIN, torch.int64),
            (Collective.REDUCE_SCATTER, ReduceOp.SUM, torch.float32), (Collective.REDUCE_SCATTER, ReduceOp.MAX, torch.bfloat16),
            (Collective.ARGMAX, ReduceOp.MAX, torch.float32), (Collective.ALL_GATHER, ReduceOp.SUM, torch.bfloat16),
            (Collective.ALL_TO_ALL, ReduceOp.SUM, torch.float32),
        ]
        for coll, op, dtype in cases:
            base = torch.randn(5, 24, generator=gen) * 100
            x = (base if dtype.is_floating_point else base.round()).to(dtype).to(dev)
            want, got = run(coll, op, dtype, x)
            assert got.device == dev and got.dtype == want.dtype and got.shape == want.shape, (coll, op, dtype)
            # W = 1: every collective returns its input (argmax: the row's index of the max), bit for bit.
            assert torch.equal(got.cpu().view(torch.uint8), want.cpu().view(torch.uint8)), (coll, op, dtype)
            if coll is not Collective.ARGMAX:
                assert torch.equal(got.cpu().view(torch.uint8), x.cpu().view(torch.uint8)), (coll, op, dtype)
        # A header that differs from this rank's own: CollectiveMismatch, naming the site and the call.
        site = Site("g.tamper", Collective.ALL_GATHER, torch.float32, (8,), 8, ReduceOp.SUM)
        g = MessageGuard(site, native=guarded)
        g.arm(7, 2, None)
        header = g.begin(torch.zeros(1, device=dev))
        assert header is not None and header.is_cuda and header.numel() == HEADER_BYTES
        bad = header.clone().view(1, -1)
        bad[0, 24] ^= 1  # the call number's low byte
        with pytest.raises(CollectiveMismatch, match=r"site 'g.tamper' call #7"):
            g.end(bad)
        # Inside CUDA-graph capture the guard stands aside (no host read), and the replay is exact.
        site = Site("g.graph", Collective.ALL_REDUCE, torch.float32, (24,), 8, ReduceOp.SUM)
        g = MessageGuard(site, native=guarded)
        x = torch.randn(4, 24, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            guarded.all_reduce(x, ReduceOp.SUM, guard=g)  # warm-up outside capture: the guarded path
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = guarded.all_reduce(x, ReduceOp.SUM, guard=g)
        x.copy_(torch.arange(96, dtype=torch.float32, device=dev).view(4, 24))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), x.cpu())
    finally:
        dist.destroy_process_group()
