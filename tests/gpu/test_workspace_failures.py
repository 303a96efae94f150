"""Workspace failure semantics (docs/spec.md §9) on one GPU, W ranks as W streams: a deadline, an abort, ranks
making different calls or one rank running two kernels at once end the kernels of every rank with one record per
rank and a WorkspaceFailed on the host; the CUDA context survives. Also the slow-rank barrier test of the real
kernels (with its stale-flag negative control), the fast-rank test of the parity slots (with its single-copy
negative control), overlapping out/x, the variants a site can reach and the capturable CUDA fold leaf.

The tests whose kernels must hit a deadline run in a child process: if a regression brought the trap back, it
would take only that child's context."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from harness import Ranks, recorded_in_process, run_collecting_failures
from payloads import first_mismatch, from_tensor, ill_conditioned, to_tensor

from oracle import fold_oracle

pytestmark = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(script: str, *, env: dict[str, str] | None = None) -> str:
    full = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=180,
                       check=False, env=full, cwd=REPO)
    return p.stdout + p.stderr


@pytest.mark.parametrize("algo", ["one_store", "one_shot"])
def test_deadline_ends_the_kernel_without_a_trap_one_record_per_rank(algo):
    """W = 3, rank 2 never launches (the one-store kernel and a barrier kernel). Ranks 0 and 1 pass their 0.3 s deadline in every block: each writes ONE
    record and prints ONE line, the kernels return, the context survives, and both ranks raise WorkspaceFailed
    naming rank 2 and the call's label. Rank 2 learns of it at its next call (its kernel stops at once), and
    every later call of every rank raises."""
    out = _child(f"""
        import torch
        from detcomm.workspace import Workspace
        from detcomm.errors import WorkspaceFailed
        views = Workspace.in_process(3, device="cuda:0", capacity_bytes=1 << 16, timeout_s=0.3, one_store_max_bytes=1 << 16)
        streams = [torch.cuda.Stream() for _ in views]
        x = torch.ones(64, 256, device="cuda:0")  # 4096 packs: the 8 blocks that own them wait
        for r in (0, 1):
            with torch.cuda.stream(streams[r]):
                views[r].all_reduce(x, label="site.missing_rank", algo="{algo}")
        torch.cuda.synchronize()  # returns: no trap, no CUDA error
        print("SYNC-OK")
        for r in (0, 1):
            try:
                views[r].check()
                print("NO-RAISE", r)
            except WorkspaceFailed as e:
                print("RAISED", r, e)
        print("CONTEXT-OK", float(torch.ones(4, device="cuda:0").sum()))
        with torch.cuda.stream(streams[2]):
            views[2].all_reduce(x, algo="{algo}")  # its kernel sees the abort word and stops at once
        try:
            views[2].synchronize()
            print("NO-RAISE 2")
        except WorkspaceFailed as e:
            print("RAISED", 2, e)
        # A kernel that finds the workspace failed arrives nowhere: no START flag of rank 2 in the peers' headers
        # (a barrier kernel looks before arriving; a one-store kernel pushes first and looks before it waits).
        import cupy
        from detcomm.symm_mem.ipc import _u32_view
        from detcomm.workspace import plan
        words = plan.flag_index(1, 1, plan.MAX_BLOCKS - 1, plan.MAX_WORLD - 1) + 1
        for r in (0, 1):
            flags = _u32_view(cupy, views[r]._transport.ptrs[r], words, 0).get()
            from2 = [int(flags[plan.flag_index(0, p, b, 2)]) for p in range(2) for b in range(plan.MAX_BLOCKS)]
            print("FLAGS-FROM-2", r, max(from2))
        for r in range(3):
            try:
                views[r].all_reduce(x)
                print("ACCEPTED", r)
            except WorkspaceFailed:
                print("REFUSED", r)
    """)
    assert "SYNC-OK" in out and "CONTEXT-OK 4.0" in out, out
    lines = {r: next(l for l in out.splitlines() if l.startswith(f"RAISED {r} ")) for r in (0, 1)}
    # The first rank past its deadline names rank 2; the other either does too or was stopped by that abort first.
    assert any(f"rank {r} timed out" in lines[r] and "waiting for rank 2" in lines[r] for r in (0, 1)), lines
    for r in (0, 1):
        line = lines[r]
        assert ("waiting for rank 2" in line or f"rank {1 - r}'s kernel failed first" in line), line
        assert "site.missing_rank" in line and f"call 1: {algo} float32" in line, line
        assert ("one-store wait" in line) == (algo == "one_store"), line
        # one printed line per rank, although all 44 blocks (and 2 threads each) hit the deadline
        assert sum(l.startswith(f"detcomm: rank {r}: workspace failed") for l in out.splitlines()) == 1, out
    assert "rank 2 stopped" in out and "kernel failed first" in out, out
    if algo == "one_shot":
        assert "FLAGS-FROM-2 0 0" in out and "FLAGS-FROM-2 1 0" in out, out
    assert all(f"REFUSED {r}" in out for r in range(3)), out


def test_debug_switch_traps():
    """DETCOMM_WORKSPACE_TRAP=1 builds the debug kernels: the record is written, then the kernel traps (the
    context is lost, as the switch documents)."""
    out = _child("""
        import torch
        from detcomm.workspace import Workspace
        views = Workspace.in_process(2, device="cuda:0", capacity_bytes=4096, timeout_s=0.2)
        views[0].all_reduce(torch.ones(4, 8, device="cuda:0"))
        try:
            torch.cuda.synchronize()
            print("NO-TRAP")
        except Exception as e:
            print("CUDA-ERROR", type(e).__name__)
        print("RECORD", views[0].error_record())
        views[0].abort()
        print("ABORTED")
    """, env={"DETCOMM_WORKSPACE_TRAP": "1", "DETCOMM_CACHE_DIR": os.environ.get("DETCOMM_CACHE_DIR", "")})
    assert "CUDA-ERROR" in out and "RECORD rank 0 timed out" in out and "waiting for rank 1" in out, out
    assert "ABORTED" in out, out


@pytest.mark.parametrize("algo", ["one_store", "one_shot"])
def test_abort_releases_a_spinning_kernel_and_tells_the_peer(algo):
    """The one-store kernel and a barrier kernel. Rank 0 spins on rank 1 with an 8 s deadline and its abort() cannot copy into any header (as in a context a
    debug trap destroyed): the host's abort word alone must end the spin (the record says aborted, not timed out),
    and the failing kernel tells rank 1, whose next kernel stops at once. Then, on a fresh workspace, abort() while
    no kernel of rank 0 runs: only the host's copy into the peers' headers can tell rank 1, whose next kernel must
    stop at once, naming the abort, instead of timing out."""
    out = _child(f"""
        import time, torch
        from detcomm.workspace import Workspace
        from detcomm.errors import WorkspaceFailed
        views = Workspace.in_process(2, device="cuda:0", capacity_bytes=4096, timeout_s=8.0, one_store_max_bytes=4096)
        s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
        x = torch.ones(4, 8, device="cuda:0")
        with torch.cuda.stream(s0):
            views[0].all_reduce(x, algo="{algo}")
        time.sleep(0.3)
        views[0]._sig_ptrs = []  # no header copies: only the host abort word can reach the spin
        views[0].abort()
        s0.synchronize()
        print("RECORD0", views[0].error_record())
        with torch.cuda.stream(s1):
            views[1].all_reduce(x, algo="{algo}")
        try:
            views[1].synchronize()
            print("NO-RAISE")
        except WorkspaceFailed as e:
            print("RAISED1", e)
        idle = Workspace.in_process(2, device="cuda:0", capacity_bytes=4096, timeout_s=8.0, one_store_max_bytes=4096)
        idle[0].abort()  # no kernel of rank 0 in flight
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            idle[1].all_reduce(x, algo="{algo}")
        try:
            idle[1].synchronize()
            print("IDLE-NO-RAISE")
        except WorkspaceFailed as e:
            print("IDLE-RAISED1", e)
    """)
    rec = next(l for l in out.splitlines() if l.startswith("RECORD0"))
    assert "host aborted the workspace while it waited for rank 1" in rec and "timed out" not in rec, out
    raised = next((l for l in out.splitlines() if l.startswith(("RAISED1", "NO-RAISE"))), out)
    assert raised.startswith("RAISED1") and "rank 1 stopped" in raised and "rank 0's" in raised, out
    idle = next((l for l in out.splitlines() if l.startswith("IDLE-")), out)
    assert idle.startswith("IDLE-RAISED1") and "rank 0's host aborted first" in idle, out


def test_init_sets_the_deadline_and_checks_every_variant_before_first_use():
    """detcomm.init(timeout_s=) is the workspace's deadline, and declaring a site runs a self-check of every kernel
    variant the site can reach (here one-shot, two-shot and chunked: 16 KiB rows, up to 128 of them, 1 MiB per
    launch) before any call of it. One rank (W = 1) keeps it cheap: the paths are the same at any W."""
    from detcomm.launch.mpi_bootstrap import free_port

    out = _child(f"""
        import os, torch
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        import detcomm
        from detcomm.workspace import Workspace, debug
        Workspace.create = debug.workspace_class(record=True).create  # the self-checks' code paths, recorded
        comm = detcomm.init(numerics="rl-bitwise", workspace_bytes=1 << 20, timeout_s=9.0)
        ws = comm._workspace
        print("TIMEOUT_NS", ws.timeout_ns)
        comm.site("big.ar", collective="all_reduce", dtype=torch.bfloat16, shape=(8192,), max_rows=128)
        print("ROUTE", next(e["route"] for e in comm.routes().as_dicts() if e["site"] == "big.ar"))
        print("LISTED", " ".join(ws.variants("all_reduce", torch.bfloat16, 8192, 128)))
        print("RAN", " ".join(sorted(v for c, d, v in ws.variants_run if (c, d) == ("all_reduce", "bfloat16"))))
        detcomm.shutdown()
    """)
    lines = dict(l.split(" ", 1) for l in out.splitlines() if l.split(" ", 1)[0] in ("TIMEOUT_NS", "ROUTE", "LISTED", "RAN"))
    assert lines.get("TIMEOUT_NS") == str(9 * 10**9), out
    assert lines.get("ROUTE") == "ipc_fold", out
    assert lines.get("LISTED") == "one_shot two_shot chunked", out
    assert lines.get("RAN") == "chunked one_shot two_shot", out


def _ranks(world: int, **kw) -> Ranks:
    kw.setdefault("one_store_max_bytes", 1 << 18)  # the one-store kernel at every W (by default never on one GPU)

    return Ranks(recorded_in_process(world, device="cuda:0", **kw))


@pytest.mark.parametrize("algo", ["one_store", "one_shot"])
def test_different_calls_raise_on_every_rank(algo):
    """Rank 1 sends one more row than rank 0 (then another dtype; then another call number): the call descriptors
    (compared at the start barrier, or beside the one-store data) differ, every rank's kernel stops and every rank
    raises, with no host-side checking involved."""
    from detcomm.errors import WorkspaceFailed

    cases = [
        (torch.ones(8, 16, device="cuda:0"), torch.ones(9, 16, device="cuda:0")),
        (torch.ones(8, 16, device="cuda:0"), torch.ones(8, 16, device="cuda:0", dtype=torch.bfloat16)),
    ]
    for xs in cases:
        R = _ranks(2, capacity_bytes=1 << 16, timeout_s=30.0)
        R.run("all_reduce", list(xs), algo=algo)
        for r, v in enumerate(R.views):
            with pytest.raises(WorkspaceFailed, match="made different calls"):
                v.check()
    # call numbers: same kernel, dtype and count, but rank 0's host has counted five launches more
    R = _ranks(2, capacity_bytes=1 << 16, timeout_s=30.0)
    x = [torch.ones(8, 16, device="cuda:0") for _ in range(2)]
    R.run("all_reduce", x, algo=algo)
    for v in R.views:
        v.check()
    R.views[0]._calls += 5
    R.run("all_reduce", x, algo=algo)
    for v in R.views:
        with pytest.raises(WorkspaceFailed, match="made different calls"):
            v.check()


@pytest.mark.parametrize("algo", ["one_store", "one_shot"])
def test_graph_replay_beside_an_eager_call_fails_the_workspace(algo):
    """The host's in-flight guard cannot see replays: a replay of rank 0's graph on one stream and an eager call of
    rank 0 on another run two kernels at once. The busy words catch it on the device and the rank raises."""
    from detcomm.errors import WorkspaceFailed

    # A short deadline: without the busy words the two kernels would spin on rank 1 until it passes.
    R = _ranks(2, capacity_bytes=1 << 16, timeout_s=5.0)
    x = [torch.ones(8, 16, device="cuda:0") for _ in range(2)]
    R.run("all_reduce", x, algo=algo)  # warm-up
    graphs = []
    for r in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=R.streams[r]):
            R.views[r].all_reduce(x[r], algo=algo)
        graphs.append(g)
    other = torch.cuda.Stream()
    with torch.cuda.stream(R.streams[0]):
        graphs[0].replay()  # spins: rank 1 has not replayed
    with torch.cuda.stream(other):
        R.views[0].all_reduce(x[0], algo=algo)  # not seen by the host guard (the replay is not a host call)
    torch.cuda.synchronize()
    with pytest.raises(WorkspaceFailed, match="two workspace kernels at once"):
        R.views[0].check()


def test_overlapping_out_and_x_are_refused_before_any_launch():
    R = _ranks(2, capacity_bytes=1 << 16, timeout_s=30.0)
    v = R.views[0]
    buf = torch.zeros(17, 16, device="cuda:0")
    calls = v._calls
    for x, out in ((buf[:8], buf[1:9]), (buf[1:9], buf[:8]), (buf[:8], buf[:8]), (buf[4:12], buf[8:16])):
        with pytest.raises(ValueError, match="overlaps"):
            v.all_reduce(x, out=out)
    with pytest.raises(ValueError, match="overlaps"):
        v.all_gather(buf[:4], out=buf[3:11])
    assert v._calls == calls  # nothing launched
    # adjacent ranges do not overlap: accepted
    outs = [torch.zeros(8, 16, device="cuda:0") for _ in range(2)]
    xs = [buf[:8], torch.ones(8, 16, device="cuda:0")]
    for r in range(2):
        with torch.cuda.stream(R.streams[r]):
            R.views[r].all_reduce(xs[r], out=buf[8:16] if r == 0 else outs[1])
    torch.cuda.synchronize()
    assert torch.equal(buf[8:16], torch.ones(8, 16, device="cuda:0")) and torch.equal(outs[1], buf[8:16])


@pytest.mark.parametrize("world", [2, 3])
def test_variants_forced_kernels_and_chunking_match_the_oracle(world):
    """Every variant `variants()` lists for a site can be forced on a small payload, as the self-checks do, and
    gives the oracle's bits; variants_run records what ran."""
    dtype, trailing = "bfloat16", 24
    R = _ranks(world, capacity_bytes=37 * trailing * 2, one_shot_max_bytes=10 * trailing * 2,
               one_store_max_bytes=3 * trailing * 2, timeout_s=30.0)
    v = R.views[0]
    assert v.variants("all_reduce", torch.bfloat16, trailing, 100) == ["one_store", "one_shot", "two_shot", "chunked"]
    assert v.variants("all_reduce", torch.bfloat16, trailing, 5) == ["one_store", "one_shot"]
    assert v.variants("all_reduce", torch.bfloat16, trailing, 3) == ["one_store"]
    assert v.variants("reduce_scatter", torch.bfloat16, trailing, world * 30) == ["reduce_scatter", "chunked"]
    assert v.variants("all_gather", torch.bfloat16, trailing, 38) == ["all_gather", "chunked"]
    rng = np.random.default_rng(world)
    bits = ill_conditioned(rng, world, (5, trailing), dtype)
    want = fold_oracle(bits, dtype)
    for kw in ({"algo": "one_store"}, {"algo": "one_shot"}, {"algo": "two_shot"}, {"chunk_rows": 1},
               {"chunk_rows": 2, "algo": "two_shot"}):
        for r, got in enumerate(R.run_bits("all_reduce", bits, dtype, **kw)):
            assert np.array_equal(got, want), f"{kw} rank {r}: {first_mismatch(got, want)}"
    rs = ill_conditioned(rng, world, (world * 3, trailing), dtype)
    full = fold_oracle(rs, dtype)
    for r, got in enumerate(R.run_bits("reduce_scatter", rs, dtype, chunk_rows=1)):
        assert np.array_equal(got, full[r * 3:(r + 1) * 3])
    for r, got in enumerate(R.run_bits("all_gather", bits, dtype, chunk_rows=2)):
        assert np.array_equal(got, np.concatenate(bits))
    assert {("all_reduce", dtype, k) for k in ("one_store", "one_shot", "two_shot", "chunked")} <= v.variants_run
    assert ("reduce_scatter", dtype, "chunked") in v.variants_run and ("all_gather", dtype, "chunked") in v.variants_run
    with pytest.raises(ValueError):
        v.all_reduce(torch.ones(4, trailing, dtype=torch.bfloat16, device="cuda:0"), chunk_rows=38)
    with pytest.raises(ValueError, match="one_store_max_bytes"):  # one forced one-store launch larger than its areas
        v.all_reduce(torch.ones(4, trailing, dtype=torch.bfloat16, device="cuda:0"), algo="one_store", chunk_rows=4)


# Consecutive calls through every kernel and barrier kind. Then the same calls reversed: 16 calls, so call i and call
# 15 - i have opposite parities and every kernel runs in both slot copies (block 0 takes part in every launch, so on
# a fresh workspace launch i is its use i + 1).
_BASE = [("all_reduce", {"algo": "one_shot"}), ("all_reduce", {"algo": "two_shot"}), ("reduce_scatter", {}),
         ("all_gather", {}), ("all_reduce", {"algo": "two_shot"}), ("all_reduce", {"algo": "one_shot"}),
         ("reduce_scatter", {}), ("all_reduce", {"algo": "two_shot"})]
_SEQUENCE = _BASE + _BASE[::-1]


def _both_parities(sequence: list[tuple[str, dict]]) -> bool:
    uses: dict[str, set[int]] = {}
    for i, (op, kw) in enumerate(sequence):
        uses.setdefault(f"{op} {kw}", set()).add((i + 1) & 1)
    return all(v == {0, 1} for v in uses.values())


def _run_sequence(R: Ranks, rng, *, slow: int, dtype: str, trailing: int, rows0: int, sleeps: dict[int, int],
                  misaligned: bool) -> list[str]:
    """_SEQUENCE on every rank, launched back to back: call i carries world * (rows0 + 17 * i) rows (a window, at row
    i, of one ill-conditioned payload per rank: every call's data differs; calls over the capacity are chunked into
    several launches), and rank `slow` sleeps sleeps[i] cycles on its stream before call i. misaligned: rank `slow` writes every output one element past a 16-byte boundary
    (store_user's element-by-element path), so it reads the slots more slowly than its peers after each start
    barrier. Returns mismatches with the oracle.

    Every input and output is allocated and uploaded first, and the sleep kernel is loaded first: between the
    launches the host issues nothing else, since in one process a device allocation or the lazy loading of a
    kernel may wait for the spinning kernels of the other ranks (this harness's limit, not the protocol's)."""
    world, tdtype = R.world, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    torch.cuda._sleep(1)
    pool = ill_conditioned(rng, world, (world * (rows0 + 17 * len(_SEQUENCE)) + len(_SEQUENCE), trailing), dtype)
    staged = []
    for i, (op, kw) in enumerate(_SEQUENCE):
        rows = world * (rows0 + 17 * i)
        bits = [b[i:i + rows] for b in pool]
        xs = [to_tensor(b, dtype, "cuda:0") for b in bits]
        out_rows = {"all_reduce": rows, "reduce_scatter": rows // world, "all_gather": world * rows}[op]
        outs = [torch.empty(out_rows * trailing + 1, dtype=tdtype, device="cuda:0")[1:].view(out_rows, trailing)
                if misaligned and r == slow else torch.empty(out_rows, trailing, dtype=tdtype, device="cuda:0")
                for r in range(world)]
        staged.append((op, kw, bits, xs, outs))
    torch.cuda.synchronize()
    for i, (op, kw, _bits, xs, outs) in enumerate(staged):
        for r in range(world):
            with torch.cuda.stream(R.streams[r]):
                if r == slow and sleeps.get(i):
                    torch.cuda._sleep(sleeps[i])
                getattr(R.views[r], op)(xs[r], out=outs[r], **kw)
    torch.cuda.synchronize()
    bad = []
    for i, (op, kw, bits, _xs, outs) in enumerate(staged):
        full = fold_oracle(bits, dtype) if op != "all_gather" else np.concatenate(bits)
        shard = full.shape[0] // world
        for r, o in enumerate(outs):
            want = full[r * shard:(r + 1) * shard] if op == "reduce_scatter" else full
            got = from_tensor(o)
            if not np.array_equal(got, want):
                bad.append(f"call {i} {op} {kw} rank {r}: {first_mismatch(got, want)}")
    return bad


def _canonical_then_control(world: int, run, *, capacity: int, variant: str,
                            max_grid: int = 256) -> tuple[list[str], list[str]]:
    """`run` on canonical kernels must give the oracle's bits with no failure; then the same run on the negative
    control build `variant` (5 s deadline). Returns the control's (mismatches, failure messages): a failed workspace
    usually raises while the calls are still being issued; every rank is checked after."""
    R = _ranks(world, capacity_bytes=capacity, timeout_s=30.0, max_grid=max_grid)
    bad = run(R)
    for v in R.views:
        v.check()
    assert bad == []
    R = _ranks(world, capacity_bytes=capacity, timeout_s=5.0, build=variant, max_grid=max_grid)
    return run_collecting_failures(R.views, lambda: run(R), default=[])


@pytest.mark.parametrize("world", [2, 3])
def test_slow_rank_never_lets_a_flag_be_consumed_early(world):
    """The real kernels through consecutive uses of every barrier kind, each kernel in both parities, one rank ~1 ms
    late to every call (one use behind the others at every start barrier): every result equals the oracle and
    nothing fails. The negative control (a build whose barriers accept an earlier use's flag) is caught by the same
    sequence: wrong bits or a failed workspace."""
    assert _both_parities(_SEQUENCE)
    rng = np.random.default_rng(world)
    late = dict.fromkeys(range(len(_SEQUENCE)), 2_000_000)

    def run(R: Ranks) -> list[str]:
        return _run_sequence(R, rng, slow=world - 1, dtype="float32", trailing=40, rows0=64, sleeps=late,
                             misaligned=False)

    # The control: caught as wrong bits, or (usually) as a failed workspace (a rank passed a start barrier on the
    # previous use of its flag copy and found that use's descriptor).
    bad, failed = _canonical_then_control(world, run, capacity=1 << 20, variant="stale_flags")
    assert bad or failed, "the stale-flag control passed: the slow-rank test cannot see a flag consumed early"
    assert not failed or any("made different calls" in f or "stopped" in f for f in failed), failed


@pytest.mark.parametrize("world", [2, 3])
def test_fast_rank_ahead_never_overwrites_a_slot_in_use(world):
    """Without an end barrier, ranks whose streams already hold the whole sequence (16 calls, most of them chunked
    into several launches) while a slow peer's stream sleeps reach each next kernel while the peer still reads the
    current one: the slow rank's stream first sleeps ~25 ms and again before every third call, and it writes its
    outputs misaligned, so after each start barrier it is still reading the fast ranks' slot copies while their next
    kernel fills the other copy, arrives at the next START and stores its next descriptor (one use ahead on the
    device, as far as the parity proof allows). bf16, ~2 MiB per launch on an 8-block grid: each thread sweeps the
    slot 8 (W = 2) to 16 (W = 3) times per launch, so the slow rank's stores delay its later loads (with the whole
    launch in one sweep, every load would precede the slow stores). Every result equals the oracle, nothing
    fails. The negative control (a build with one copy of the slots, flags and descriptors) is caught by the same
    run: wrong bits, a descriptor of the next call ("made different calls") or a flag overtaken (a deadline)."""
    rng = np.random.default_rng(100 + world)
    sleeps = {0: 50_000_000, **dict.fromkeys(range(2, len(_SEQUENCE), 3), 2_000_000)}

    def run(R: Ranks) -> list[str]:
        return _run_sequence(R, rng, slow=world - 1, dtype="bfloat16", trailing=1024, rows0=512, sleeps=sleeps,
                             misaligned=True)

    bad, failed = _canonical_then_control(world, run, capacity=2 << 20, variant="single_copy", max_grid=8)
    assert bad or failed, "the single-copy control passed: the fast-rank test cannot see a slot overwritten in use"


def test_cuda_fold_leaf_is_capturable_and_falls_back():
    """gather_fold's CUDA leaf inside a CUDA graph: captured once, replayed with new values, oracle bits. A dtype
    whose module is refused folds with the portable leaf (same bits) instead of raising."""
    from detcomm.numerics import cuda_leaf as leaf
    from detcomm.workspace import kernels

    world, dtype = 3, "bfloat16"
    rng = np.random.default_rng(9)
    static = torch.stack([to_tensor(b, dtype, "cuda:0") for b in ill_conditioned(rng, world, (33, 40), dtype)])
    leaf.cuda_fold(static, static.dtype)  # loads the kernels before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=s):
        out = leaf.cuda_fold(static, static.dtype)
    for it in range(3):
        bits = ill_conditioned(rng, world, (33, 40), dtype)
        static.copy_(torch.stack([to_tensor(b, dtype, "cuda:0") for b in bits]))
        g.replay()
        torch.cuda.synchronize()
        got, want = from_tensor(out), fold_oracle(bits, dtype)
        assert np.array_equal(got, want), f"replay {it}: {first_mismatch(got, want)}"
    # A refused module has no kernels loaded: the fold must take the portable leaf, never launch.
    ks = kernels.kernel_set(0, world)
    ks.refused["bfloat16"] = "simulated: no bf16 conversions on this architecture"
    loaded = ks._functions.pop("detcomm_fold_local_bf16")
    try:
        got = from_tensor(leaf.cuda_fold(static, static.dtype))
        assert np.array_equal(got, want)
    finally:
        del ks.refused["bfloat16"]
        ks._functions["detcomm_fold_local_bf16"] = loaded
