"""CPU tests of the workspace's host arithmetic (detcomm/workspace/plan.py): no GPU, no cupy."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from barrier_sim import BlockUse, Launch, simulate_barrier_uses, simulate_launches
from detcomm.workspace import plan

CUH = Path(__file__).resolve().parents[1] / "csrc" / "detcomm_common.cuh"


CSRC = CUH.parent
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)", re.M)


def _defined_constants(text: str) -> set[str]:
    """The device constants (plan.DEVICE_CONSTANTS) a C text #defines itself."""
    return set(_DEFINE.findall(text)) & set(plan.DEVICE_CONSTANTS)


def test_device_constants_have_one_source():
    """No csrc/ file defines a device constant (each comes from plan.DEVICE_CONSTANTS as a -D option), and
    detcomm_common.cuh requires exactly the table's names. The control: a header that defines one is caught."""
    for path in sorted(CSRC.glob("*.cu*")):
        assert _defined_constants(path.read_text()) == set(), path.name
    assert _defined_constants("#define DETCOMM_PACK_BYTES 16\n  #  define NORM_CHUNK 8\n") == {"DETCOMM_PACK_BYTES",
                                                                                             "NORM_CHUNK"}
    text = CUH.read_text()
    guard = text[text.index("#if !defined(DETCOMM_MAX_W)"):]
    guard = guard[:guard.index("#error")]
    assert set(re.findall(r"defined\((\w+)\)", guard)) == set(plan.DEVICE_CONSTANTS)


def test_device_constants_are_plan_values():
    """The table spells plan's values: every kernel kind, dtype code and layout constant the host uses."""
    c = plan.DEVICE_CONSTANTS
    assert int(c["DETCOMM_MAX_W"]) == plan.MAX_WORLD and int(c["DETCOMM_BUFFER_HEADER_BYTES"]) == plan.BUFFER_HEADER_BYTES
    for code, kind in plan.KIND_CODES.items():
        assert int(c[f"DETCOMM_KIND_{kind.upper()}"]) == code
    assert plan.KIND_ONE_STORE == int(c["DETCOMM_KIND_ONE_STORE"]) == 9
    assert plan.KIND_FUSED_NORM_ONE_STORE == int(c["DETCOMM_KIND_FUSED_NORM_ONE_STORE"]) == 10
    for name in ("TIMEOUT", "ABORTED", "PEER_FAILED", "MISMATCH", "OVERLAP"):
        assert int(c[f"DETCOMM_ERR_{name}"].rstrip("u"), 16) == getattr(plan, f"ERR_{name}")
    assert [int(c[m]) for m in ("DT_F32", "DT_BF16", "DT_F16", "DT_U8")] == [
        code for code, _ in sorted(plan.DTYPE_CODES.items())]
    assert (int(c["NORM_THREADS"]), int(c["NORM_CHUNK"]), int(c["DETCOMM_FUSED_BATCH"])) == (
        plan.NORM_LANES, plan.NORM_CHUNK, plan.FUSED_NORM_BATCH)


def test_one_store_offsets_match_their_header():
    text = (CSRC / "one_store_common.cuh").read_text()
    defines = dict(re.findall(r"^#define (DETCOMM_\w+) (\S+)", text, re.M))
    # The offsets are expressions over device constants: check the values they stand for.
    assert plan.ONE_STORE_DESC_OFF == plan.ONE_STORE_COUNTER_BYTES
    assert plan.ONE_STORE_DESC_BYTES == 2 * plan.MAX_BLOCKS * plan.MAX_WORLD * plan.PACK_BYTES
    assert plan.ONE_STORE_DATA_OFF == plan.ONE_STORE_DESC_OFF + plan.ONE_STORE_DESC_BYTES
    for name, expr in (("DETCOMM_ONE_STORE_DESC_OFF", "DETCOMM_ONE_STORE_COUNTER_BYTES"),
                       ("DETCOMM_ONE_STORE_DATA_OFF", "(DETCOMM_ONE_STORE_DESC_OFF")):
        assert defines[name].startswith(expr), (name, defines[name])


def test_one_store_tiers_are_static_and_never_exceed_the_grid():
    """The one-store tiers: the table's tiers below one_store_max, then one up to one_store_max on the grid; blocks
    capped by the grid (ranks sharing a GPU stay co-resident) and by one_store_grid; equal neighbours merged; each
    tier's sub-region right after the previous one, areas in whole packs."""
    t = plan.one_store_tiers(1 << 20, 2, 132, base=1000)
    assert [(x.max_bytes, x.blocks) for x in t] == [(64 << 10, 16), (256 << 10, 32), (1 << 20, 132)]
    assert t[0].offset == 1000 and all(b.offset == a.offset + a.region_bytes(2) for a, b in zip(t, t[1:]))
    assert [x.cap for x in t] == [64 << 10, 256 << 10, 1 << 20]
    assert plan.one_store_region_bytes(2, t) == sum(plan.ONE_STORE_DATA_OFF + 4 * x.cap for x in t)
    # Tiers at or above one_store_max are dropped; the largest always runs the grid.
    assert [(x.max_bytes, x.blocks) for x in plan.one_store_tiers(64 << 10, 2, 132, base=0)] == [(64 << 10, 132)]
    assert [(x.max_bytes, x.blocks) for x in plan.one_store_tiers(100 << 10, 2, 132, base=0)] == [
        (64 << 10, 16), (100 << 10, 132)]
    assert plan.one_store_tiers(1000, 4, 132, base=0)[0].cap == 1008  # whole packs
    # A small grid (ranks sharing a GPU) or one_store_grid caps every tier; equal neighbours merge into the larger.
    assert [(x.max_bytes, x.blocks) for x in plan.one_store_tiers(1 << 20, 8, 16, base=0)] == [(1 << 20, 16)]
    assert [(x.max_bytes, x.blocks) for x in plan.one_store_tiers(1 << 20, 2, 66, base=0)] == [
        (64 << 10, 16), (256 << 10, 32), (1 << 20, 66)]
    assert [(x.max_bytes, x.blocks) for x in plan.one_store_tiers(1 << 20, 2, 132, base=0, max_blocks=32)] == [
        (64 << 10, 16), (1 << 20, 32)]
    assert [(x.max_bytes, x.blocks) for x in plan.one_store_tiers(1 << 20, 2, 132, base=0, max_blocks=2)] == [
        (1 << 20, 2)]
    # No table: one tier on the grid (every one-store launch on the same blocks).
    assert [(x.max_bytes, x.blocks) for x in plan.one_store_tiers(1 << 20, 2, 132, base=0, table=())] == [
        (1 << 20, 132)]
    assert plan.one_store_tiers(0, 2, 132, base=0) == ()
    for bad in (0, -3):
        with pytest.raises(ValueError, match="one_store_grid"):
            plan.one_store_tiers(1 << 20, 2, 132, base=0, max_blocks=bad)
    for table in (((64 << 10, 16), (64 << 10, 32)), ((64 << 10, 32), (256 << 10, 16)), ((64 << 10, 0),)):
        with pytest.raises(ValueError, match="one_store_tiers"):
            plan.one_store_tiers(1 << 20, 2, 132, base=0, table=table)
    with pytest.raises(ValueError, match="grid"):
        plan.one_store_tiers(1 << 20, 2, 0, base=0)
    with pytest.raises(ValueError, match="one_store_max"):
        plan.one_store_tiers(-1, 2, 132, base=0)


def test_one_store_region_layout():
    for shared in (False, True):
        assert plan.one_store_max_bytes(1, shared_gpu=shared) == 0  # no peer: no one-store path
    assert all(plan.one_store_max_bytes(w, shared_gpu=False) == plan.DEFAULT_ONE_STORE_MAX_BYTES for w in range(2, 9))
    assert all(plan.one_store_max_bytes(w, shared_gpu=True) == 0 for w in range(2, 9))  # never on a shared GPU
    assert plan.one_store_region_bytes(4, ()) == 0
    cap, w, grid = 1 << 20, 3, 40
    # The region follows the data slot and the buffer holds it whole.
    off = plan.one_store_offset(cap, w, grid)
    assert off >= plan.slot_bytes(cap, w, grid)
    tiers = plan.one_store_tiers(plan.DEFAULT_ONE_STORE_MAX_BYTES, w, grid, base=off)
    total = plan.buffer_bytes(cap, w, grid, tiers)
    assert total == plan.data_offset() + off + plan.one_store_region_bytes(w, tiers)
    assert total == plan.data_offset() + tiers[-1].offset + tiers[-1].region_bytes(w)
    assert plan.buffer_bytes(cap, w, grid) == plan.data_offset() + off


def test_grid_is_static_and_co_resident():
    for sm in (16, 78, 114, 132):
        for w in range(1, 9):
            g = plan.grid_blocks(w, sm)
            assert 1 <= g <= plan.MAX_BLOCKS and w * g <= sm
            assert g == plan.grid_blocks(w, sm)
    assert plan.grid_blocks(8, 132) == 16
    assert plan.grid_blocks(2, 132, max_grid=32) == 32
    # one GPU per rank: every SM, whatever W
    assert plan.grid_blocks(8, 132, shared_gpu=False) == 132 == plan.grid_blocks(2, 132, shared_gpu=False)
    assert plan.grid_blocks(8, 300, shared_gpu=False) == plan.MAX_BLOCKS
    with pytest.raises(ValueError):
        plan.grid_blocks(9, 132)
    with pytest.raises(ValueError):
        plan.grid_blocks(4, 3)


def test_chunks_cover_rows_exactly_and_respect_capacity():
    rng = random.Random(0)
    for _ in range(500):
        row_bytes = rng.randint(1, 5000)
        cap = rng.randint(row_bytes, 50 * row_bytes)
        rows = rng.randint(0, 3000)
        per = plan.rows_per_chunk(cap, row_bytes)
        assert per * row_bytes <= cap < (per + 1) * row_bytes
        got = list(plan.chunks(rows, per))
        assert [a for a, _ in got] == list(range(0, rows, per))
        assert sum(b - a for a, b in got) == rows and all(0 < b - a <= per for a, b in got)
    cap = 37 * 48
    assert [b - a for a, b in plan.chunks(36, plan.rows_per_chunk(cap, 48))] == [36]
    assert [b - a for a, b in plan.chunks(37, plan.rows_per_chunk(cap, 48))] == [37]
    assert [b - a for a, b in plan.chunks(38, plan.rows_per_chunk(cap, 48))] == [37, 1]
    assert plan.rows_per_chunk(cap, 48, parts=4) == 9
    with pytest.raises(ValueError):
        plan.rows_per_chunk(100, 101)
    with pytest.raises(ValueError):
        plan.rows_per_chunk(100, 30, parts=4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_slices_fit_the_slot_and_keep_block_ownership(dtype):
    """Two-shot and reduce-scatter slices: start on pack boundaries, strides a multiple of the grid stride (the
    per-block barrier contract), and W slices never overrun the slot whatever the shape."""
    rng = random.Random(1)
    es = plan.elem_size(dtype)
    per = plan.pack_elems(dtype)
    for _ in range(400):
        w = rng.randint(1, 8)
        grid = plan.grid_blocks(w, rng.choice([16, 78, 132]), max_grid=rng.choice([1, 8, 64]))
        cap = rng.randint(16, 1 << 20)
        slot = plan.slot_bytes(cap, w, grid)
        n = rng.randint(1, cap // es)
        geo = plan.two_shot_slices(n, w, dtype, grid)
        assert geo.length % per == 0 and geo.length * w >= n
        assert geo.stride_packs % plan.stride_packs(grid) == 0 and geo.stride_packs * per >= geo.length
        assert geo.slot_bytes_used(w) <= slot
        row_elems = rng.randint(1, 300)
        if w * row_elems * es <= cap:
            rows = plan.rows_per_chunk(cap, row_elems * es, parts=w)
            rs = plan.reduce_scatter_slices(rows, row_elems, dtype, grid)
            assert rs.length == rows * row_elems
            assert rs.stride_packs % plan.stride_packs(grid) == 0 and rs.stride_packs * per >= rs.length
            assert rs.slot_bytes_used(w) <= slot


def _c_value(expr: str, defines: dict[str, str], env: dict[str, int]) -> int:
    """Evaluate one of the header's integer expressions (casts dropped, DETCOMM_ names and parameters bound)."""
    py = re.sub(r"\((?:u32|int)\)", "", expr).replace("/", "//")
    names = {n: _c_value(defines[n], defines, env) for n in set(re.findall(r"DETCOMM_\w+", py))}
    return int(eval(py, {"__builtins__": {}}, {**names, **env}))  # noqa: S307 - the repository's own header


def test_header_layout_matches_the_device_formulas():
    """plan's header indices (used by the host and the tests) equal the device's flag_index, epoch_index,
    desc_index and busy_index, evaluated from the header's own text, and the doubled layout fits the header."""
    text = CUH.read_text()
    defines = {**plan.DEVICE_CONSTANTS, **dict(re.findall(r"^#define (DETCOMM_\w+) (.+?)(?:\s*//.*)?$", text, re.M))}
    assert int(defines["DETCOMM_PARITIES"]) == plan.PARITIES == plan.SLOT_COPIES == 2
    bodies = {name: body for name, body in re.findall(
        r"__device__ __forceinline__ u32 (\w+_index)\([^)]*\) \{\s*return (.+?);\s*\}", text, re.S)}
    assert set(bodies) >= {"flag_index", "epoch_index", "desc_index", "busy_index"}
    rng = random.Random(5)
    for _ in range(200):
        kind, par = rng.randrange(plan.BARRIER_KINDS), rng.randrange(plan.PARITIES)
        block, src = rng.randrange(plan.MAX_BLOCKS), rng.randrange(plan.MAX_WORLD)
        env = {"kind": kind, "par": par, "block": block, "src": src}
        assert _c_value(bodies["flag_index"], defines, env) == plan.flag_index(kind, par, block, src)
        assert _c_value(bodies["epoch_index"], defines, env) == plan.epoch_index(kind, block)
        assert _c_value(bodies["desc_index"], defines, env) == plan.desc_index(par, block, src)
        assert _c_value(bodies["busy_index"], defines, env) == plan.busy_index(block)
    for name in ("EPOCH_BASE", "DESC_BASE", "CTRL_BASE", "HEADER_WORDS_USED"):
        assert _c_value(defines[f"DETCOMM_{name}"], defines, {}) == getattr(plan, name)
    assert _c_value(defines["DETCOMM_ABORT_INDEX"], defines, {}) == plan.ABORT_INDEX
    assert _c_value(defines["DETCOMM_CLAIM_INDEX"], defines, {}) == plan.CLAIM_INDEX
    # regions in order, disjoint, inside the header
    last = (plan.flag_index(plan.BARRIER_KINDS - 1, plan.PARITIES - 1, plan.MAX_BLOCKS - 1, plan.MAX_WORLD - 1),
            plan.epoch_index(plan.BARRIER_KINDS - 1, plan.MAX_BLOCKS - 1),
            plan.desc_index(plan.PARITIES - 1, plan.MAX_BLOCKS - 1, plan.MAX_WORLD - 1) + plan.DESC_WORDS - 1)
    assert last[0] < plan.EPOCH_BASE and last[1] < plan.DESC_BASE and last[2] < plan.CTRL_BASE
    assert plan.busy_index(plan.MAX_BLOCKS - 1) < plan.HEADER_WORDS_USED <= plan.BUFFER_HEADER_BYTES // 4
    # the barrier kinds the device names, decoded by name; there is no end barrier
    kinds = {k: v for k, v in plan.DEVICE_CONSTANTS.items() if k.startswith("BARRIER_")}
    assert kinds == {"BARRIER_START": "0", "BARRIER_MID": "1"} and len(plan.BARRIER_NAMES) == plan.BARRIER_KINDS
    assert (plan.BARRIER_START, plan.BARRIER_MID) == (0, 1)


def test_buffer_holds_two_slot_copies():
    for cap, w, grid in ((1 << 20, 2, 132), (16, 8, 16), (37 * 48, 3, 44)):
        slot = plan.slot_bytes(cap, w, grid)
        assert plan.buffer_bytes(cap, w, grid) == plan.data_offset() + plan.SLOT_COPIES * slot
        assert plan.data_offset() == plan.BUFFER_HEADER_BYTES + plan.PROBE_BYTES and plan.data_offset() % plan.PACK_BYTES == 0
        assert slot % plan.PACK_BYTES == 0  # copy 1 starts pack-aligned


# Uses of one block: one-shot-like (START only) and two-shot-like (START and MID) interleaved.
MIDS = [False, True, False, False, True, True, False, True, True, False, False, False, True]


def test_parity_scheme_never_lets_a_peer_overtake_a_use():
    """The protocol as the device runs it (no end barrier, two copies selected by the use's parity), one shared
    access per step: with the fast rank always stepping first, and under 400 random interleavings at W = 2..4
    (counters started just below the wrap), no rank ever reads a later use's slot data or descriptor, a waiting
    rank's flag only ever shows this use or the previous use of its copy, and nothing deadlocks."""
    assert simulate_barrier_uses(0, MIDS, world=2, pick=min) == []
    assert simulate_barrier_uses(0, MIDS, world=4, pick=max) == []
    rng = random.Random(12)
    for _ in range(400):
        world = rng.randint(2, 4)
        start, mid = rng.choice([0, 7, 2**31, 2**32 - 4]), rng.choice([0, 2**32 - 3])
        assert simulate_barrier_uses(start, MIDS, world=world, pick=rng.choice, mid_start=mid) == []


def test_single_copy_scheme_is_overtaken():
    """The negative control of the test above: the same protocol with one copy of everything (the end barrier
    removed without parity). A peer one use ahead (the fast rank first) overwrites the flag this rank waits for
    (then nothing can ever pass); random interleavings also show it reading a later use's slot data and
    descriptor."""
    got = simulate_barrier_uses(0, MIDS, world=2, pick=min, copies=1)
    assert "rank 1: start use 1: rank 0's flag shows use 2" in got and got[-1].startswith("deadlock")
    seen = set()
    rng = random.Random(13)
    for _ in range(200):
        for line in simulate_barrier_uses(0, MIDS, world=rng.randint(2, 4), pick=rng.choice, copies=1):
            seen.add(next(k for k in ("flag shows", "descriptor", "read rank", "gathered", "deadlock") if k in line))
    assert {"flag shows", "descriptor", "read rank", "deadlock"} <= seen, seen


# --- every block of a grid, launches whose layouts differ (barrier_sim.simulate_launches) ---------------------------
# Launch kinds over slot positions 0..7, written for up to 3 blocks and cut to the grid (blocks past a launch's tuple
# own nothing and skip). They stand for kernels that place one position in different blocks: one-shot packs spread
# over the blocks (A), a unit layout that gives the first four to block 0 (B, as the tree kernels' two-pack units do
# to what one-shot spreads), the same positions with the blocks swapped (C), two-shot and reduce-scatter slices with
# their offsets in other blocks (D, E, R), and a launch where block 1 owns nothing between blocks that do (F).
def _one_shot(*packs: int) -> BlockUse:
    return BlockUse(packs)


def _sliced(*offsets: int, slice_len: int, mid: bool = True) -> BlockUse:
    return BlockUse(offsets, slice_len, mid)


_KINDS: dict[str, Launch] = {
    "A": (_one_shot(0, 1), _one_shot(2, 3), _one_shot(4, 5)),
    "B": (_one_shot(0, 1, 2, 3),),
    "C": (_one_shot(2, 3), _one_shot(0, 1)),
    "D": (_sliced(0, slice_len=2), _sliced(1, slice_len=2)),
    "E": (_sliced(0, 1, slice_len=2),),
    "F": (_one_shot(0), None, _one_shot(1, 2, 3)),
    "R": (_sliced(1, slice_len=2, mid=False), _sliced(0, slice_len=2, mid=False)),
}
# Launch 1 (B) skips block 1 right before launch 2 (A) gives block 1 positions 2 and 3, which B gave block 0: the
# shortest case of the bug (see the control); the rest mixes every kind, MIDs included.
MIXED = "ABACDBEAFDCRBEAC"


def _mixed(blocks: int) -> list[Launch]:
    return [_KINDS[k][:blocks] for k in MIXED]


def _same_layout(blocks: int) -> list[Launch]:
    """Launches that all place position q in block q % G, as the one-input kernels do (one-shot pack q and two-shot
    pack s*L + j, L a multiple of the grid stride, both go to thread q mod stride), of sizes that let the higher
    blocks skip some launches."""
    def spread(n: int) -> Launch:
        return tuple(BlockUse(own) if (own := tuple(range(b, n, blocks))) else None for b in range(blocks))

    def sliced(m: int, slice_len: int, mid: bool = True) -> Launch:
        return tuple(BlockUse(own, slice_len, mid) if (own := tuple(range(b, m, blocks))) else None
                     for b in range(blocks))
    g = blocks
    return [spread(2 * g), spread(1), sliced(g, g), spread(g + 1), sliced(1, g), spread(1), sliced(2 * g, 2 * g),
            sliced(1, g, mid=False), spread(2 * g), spread(1), sliced(g, g), spread(1), sliced(1, 2 * g), spread(2 * g)]


def _owners(launches: list[Launch], world: int) -> dict[int, set[int]]:
    """position -> the blocks that write it (on some rank) in some launch."""
    got: dict[int, set[int]] = {}
    for launch in launches:
        for b, use in enumerate(launch):
            for r in range(world):
                for q in use.writes(r, world) if use else ():
                    got.setdefault(q, set()).add(b)
    return got


def _skippers(launches: list[Launch], blocks: int) -> set[int]:
    """The blocks that own nothing in some launch."""
    return {b for launch in launches for b in range(blocks) if b >= len(launch) or launch[b] is None}


# A control finding: rank r's block b, in launch n, read rank t's position q in copy c and found what launch m's
# block k wrote there.
_OVERTAKEN = re.compile(r"rank (\d+) block (\d+) launch (\d+): read rank (\d+)'s position (\d+) \(copy (\d), stage \d "
                        r"expected\) of launch (\d+) stage \d, written by its block (\d+)$")


def test_counted_skip_keeps_every_block_in_the_launch_parity():
    """The device's scheme (skip_use counts the launch and stores its START flag), every block of the grid through
    launches whose layouts move positions between blocks and skip blocks, two-shot MIDs among them: with the lowest
    or the highest rank always stepping first, and under 300 random interleavings at W = 2..4, G = 2..3 (counters
    started near the 2^32 wrap too), no block reads another launch's data or descriptor, no waiting block sees a
    flag other than its use or the previous use of its copy, and nothing deadlocks."""
    for blocks in (2, 3):
        seq = _mixed(blocks)
        # What makes the sequence a test of skip_use: positions change block, every block but 0 skips some launch.
        assert any(len(owners) > 1 for owners in _owners(seq, 2).values())
        assert _skippers(seq, blocks) == set(range(1, blocks))
        for world in (2, 3, 4):
            for pick in (min, max):
                assert simulate_launches(seq, world=world, blocks=blocks, pick=pick) == [], (blocks, world, pick)
    rng = random.Random(21)
    for _ in range(300):
        world, blocks = rng.randint(2, 4), rng.randint(2, 3)
        start, mid = rng.choice([0, 7, 2**31, 2**32 - 4, 2**32 - 3]), rng.choice([0, 2**32 - 1, 2**32 - 2])
        assert simulate_launches(_mixed(blocks), world=world, blocks=blocks, pick=rng.choice, start_epoch=start,
                                 mid_start=mid) == [], (world, blocks, start, mid)


def _assert_overtaken(got: list[str]) -> None:
    """Every finding is the bug skip_use fixed: a reader's copy overwritten by a PEER's OTHER block in a LATER launch
    (the reader's block and the writer's had counted different numbers of launches, so one parity for both)."""
    assert got
    for line in got:
        m = _OVERTAKEN.match(line)
        assert m, line
        r, b, n, t, _q, _c, later, writer = map(int, m.groups())
        assert t != r and writer != b and later > n, line


def test_uncounted_skip_is_overtaken_when_layouts_differ():
    """The negative control (the old scheme, as the device's DETCOMM_TEST_UNCOUNTED_SKIP build): a block that owns
    nothing touches nothing, so its parity follows its own uses. On the same launches as above, in launch 1 (B)
    block 1 skips: block 0 works at epoch 2 (copy 0) while block 1 still counts 1, so in launch 2 (A) block 1 works
    at epoch 2 in copy 0 too. The rank that runs ahead enters launch 2 as soon as its peer's block 0 arrived at START
    of launch 1, and its block 1 copies positions 2 and 3 into copy 0 while the peer's block 0 still reads them there
    for launch 1. Fast rank first (either end) shows it deterministically; most random schedules do too."""
    got = simulate_launches(_mixed(2), world=2, blocks=2, pick=min, counted_skip=False)
    assert got[0] == ("rank 1 block 0 launch 1: read rank 0's position 2 (copy 0, stage 0 expected) of launch 2 "
                      "stage 0, written by its block 1"), got
    _assert_overtaken(got)
    got = simulate_launches(_mixed(2), world=2, blocks=2, pick=max, counted_skip=False)
    assert got[0] == ("rank 0 block 0 launch 1: read rank 1's position 2 (copy 0, stage 0 expected) of launch 2 "
                      "stage 0, written by its block 1"), got
    _assert_overtaken(got)
    for blocks in (2, 3):
        for world in (3, 4):
            for pick in (min, max):
                _assert_overtaken(simulate_launches(_mixed(blocks), world=world, blocks=blocks, pick=pick,
                                                    counted_skip=False))
    rng = random.Random(22)
    caught = 0
    for _ in range(100):
        world, blocks = rng.randint(2, 4), rng.randint(2, 3)
        got = simulate_launches(_mixed(blocks), world=world, blocks=blocks, pick=rng.choice, counted_skip=False)
        if got:
            _assert_overtaken(got)
            caught += 1
    assert caught >= 50, caught  # 78 of 100 with this seed: the race is wide, not a one-schedule corner


def test_uncounted_skip_holds_when_positions_keep_their_block():
    """Why the old scheme held for the one-input kernels: when every launch places position q in the same block
    (q % G), each position's copies are only ever touched by one block, whose own uses alternate the parity, so the
    single-block argument applies per block even though blocks skip launches and their counters diverge. Both
    schemes pass here, fast rank first and under 200 random interleavings (wrap included)."""
    for blocks in (2, 3):
        seq = _same_layout(blocks)
        assert all(owners == {q % blocks} for q, owners in _owners(seq, 4).items())
        assert _skippers(seq, blocks) == set(range(1, blocks))
        for world in (2, 3, 4):
            for pick in (min, max):
                for counted in (True, False):
                    assert simulate_launches(seq, world=world, blocks=blocks, pick=pick, counted_skip=counted) == []
    rng = random.Random(23)
    for _ in range(200):
        world, blocks = rng.randint(2, 4), rng.randint(2, 3)
        start, mid = rng.choice([0, 2**32 - 3]), rng.choice([0, 2**32 - 1])
        assert simulate_launches(_same_layout(blocks), world=world, blocks=blocks, pick=rng.choice,
                                 counted_skip=False, start_epoch=start, mid_start=mid) == [], (world, blocks, start)


def test_epoch_rule_is_exact_across_the_wrap():
    assert plan.next_epoch(2**32 - 1) == 0
    assert [plan.parity(plan.next_epoch(e)) for e in (2**32 - 2, 2**32 - 1, 0)] == [1, 0, 1]
    assert plan.arrived(0, 0) and not plan.arrived(2**32 - 2, 0)  # the previous use of the copy, across the wrap
    # An ordering comparison would be fooled by a flag 2^31 uses old; equality is not.
    assert not plan.arrived((5 - 2**31) % 2**32, 5)


def test_variants_a_site_can_reach():
    kw = {"world_size": 2, "capacity_bytes": 16 << 20, "one_shot_max_bytes": 512 << 10}
    # 8192-wide bf16 rows: 16 KiB each; 64 rows = 1 MiB > one-shot limit -> two-shot reachable
    assert plan.variants("all_reduce", row_bytes=16384, max_rows=64, **kw) == ["one_shot", "two_shot"]
    assert plan.variants("all_reduce", row_bytes=16384, max_rows=32, **kw) == ["one_shot"]
    assert plan.variants("all_reduce", row_bytes=16384, max_rows=33, **kw) == ["one_shot", "two_shot"]
    assert plan.variants("all_reduce", row_bytes=16384, max_rows=1025, **kw) == ["one_shot", "two_shot", "chunked"]
    assert plan.variants("all_reduce", row_bytes=1 << 20, max_rows=1, **kw) == ["two_shot"]  # one row > one-shot
    assert plan.variants("all_reduce", row_bytes=(16 << 20) + 1, max_rows=1, **kw) == []
    assert plan.variants("reduce_scatter", row_bytes=16384, max_rows=2 * 512, **kw) == ["reduce_scatter"]
    assert plan.variants("reduce_scatter", row_bytes=16384, max_rows=2 * 513, **kw) == ["reduce_scatter", "chunked"]
    assert plan.variants("all_gather", row_bytes=16384, max_rows=1024, **kw) == ["all_gather"]
    assert plan.variants("all_gather", row_bytes=16384, max_rows=1025, **kw) == ["all_gather", "chunked"]
    with pytest.raises(ValueError):
        plan.variants("broadcast", row_bytes=4, max_rows=1, **kw)


def test_variants_with_the_one_store_kernel():
    kw = {"world_size": 4, "capacity_bytes": 16 << 20, "one_shot_max_bytes": 512 << 10, "one_store_max": 64 << 10}
    # 16 KiB rows: 1..4 rows per launch take the one-store kernel, 5..32 one-shot, 33+ two-shot.
    assert plan.variants("all_reduce", row_bytes=16384, max_rows=4, **kw) == ["one_store"]
    assert plan.variants("all_reduce", row_bytes=16384, max_rows=5, **kw) == ["one_store", "one_shot"]
    assert plan.variants("all_reduce", row_bytes=16384, max_rows=33, **kw) == ["one_store", "one_shot", "two_shot"]
    # A row larger than the one-store areas never takes it; rows whose next multiple skips past one-shot's range
    # reach no one-shot launch (300 KiB rows: one row takes the one-store kernel, two rows are 600 KiB > one-shot).
    assert plan.variants("all_reduce", row_bytes=100 << 10, max_rows=8, **kw) == ["one_shot", "two_shot"]
    kw["one_store_max"] = 300 << 10
    assert plan.variants("all_reduce", row_bytes=300 << 10, max_rows=2, **kw) == ["one_store", "two_shot"]
    assert plan.variants("all_reduce", row_bytes=300 << 10, max_rows=1, **kw) == ["one_store"]
    # Capped by the capacity: a launch never carries more than it.
    kw.update(capacity_bytes=32 << 10, one_store_max=64 << 10)
    assert plan.variants("all_reduce", row_bytes=16384, max_rows=3, **kw) == ["one_store", "chunked"]
    # A one-store size above one-shot's (one GPU per rank at W >= 3: 1 MiB vs 512 KiB): launches up to it never take
    # one-shot or two-shot, so a 1 MiB capacity reaches neither (two-shot was listed once, and self-checked for nothing).
    kw.update(capacity_bytes=1 << 20, one_store_max=1 << 20)
    assert plan.variants("all_reduce", row_bytes=1024, max_rows=8192, **kw) == ["one_store", "chunked"]
    kw.update(capacity_bytes=2 << 20)
    assert plan.variants("all_reduce", row_bytes=1024, max_rows=8192, **kw) == ["one_store", "two_shot", "chunked"]
    # Off (0) is the old behaviour.
    kw.update(capacity_bytes=16 << 20, one_store_max=0)
    assert plan.variants("all_reduce", row_bytes=16384, max_rows=64, **kw) == ["one_shot", "two_shot"]


def test_fused_norm_variants_with_the_one_store_kernel():
    """The fused all-reduce + RMSNorm picks its kernel per launch exactly as all_reduce does (plan.launch_kernel): the
    one-store kernel up to fused_norm_one_store_rows rows, one-shot up to one_shot_max_bytes, two-shot above."""
    grid = 132
    slot = plan.slot_bytes(32 << 20, 4, grid)
    kw = {"grid": grid, "slot_bytes": slot, "one_shot_max_bytes": 512 << 10, "one_store_max": 64 << 10}
    # bf16 x 4096 = 8 KiB rows: 1..8 rows per launch take the one-store kernel, 9..64 one-shot, 65+ two-shot.
    assert plan.fused_norm_one_store_rows(4096, "bfloat16", 64 << 10) == 8
    assert plan.fused_norm_variants(hidden=4096, dtype="bfloat16", max_rows=8, **kw) == ["fused_one_store"]
    assert plan.fused_norm_variants(hidden=4096, dtype="bfloat16", max_rows=9, **kw) == ["fused_one_store",
                                                                                          "fused_one_shot"]
    assert plan.fused_norm_variants(hidden=4096, dtype="bfloat16", max_rows=65, **kw) == [
        "fused_one_store", "fused_one_shot", "fused_two_shot"]
    # The same answers as the all-reduce's rule for the same launches (whole-pack rows: no padding).
    for max_rows in (1, 8, 9, 64, 65, 300):
        ar = plan.reached("plain", plan.fused_norm_rows_per_launch(4096, "bfloat16", grid=grid, slot_bytes=slot),
                          max_rows, row_elems=4096, dtype="bfloat16", one_store_max=64 << 10,
                          one_shot_max_bytes=512 << 10)
        assert plan.fused_norm_variants(hidden=4096, dtype="bfloat16", max_rows=max_rows, **kw) == [
            f"fused_{v}" for v in ar]
    # Rows that end mid-pack take whole packs in the area: 9 bf16 elements are 18 bytes but 32 in the area, so a
    # 64 KiB area holds 2048 rows (not 3640), and the launch's bytes stay within one_store_max either way.
    assert plan.fused_norm_one_store_rows(9, "bfloat16", 64 << 10) == 2048
    assert plan.fused_norm_one_store_rows(9, "bfloat16", 100) == 3  # 100 bytes: 5 rows of 18 bytes, 3 areas' packs
    assert plan.fused_norm_one_store_rows(3, "float32", 100) == 7  # 12-byte rows, 16-byte packs in 112 bytes
    assert plan.fused_norm_variants(hidden=9, dtype="bfloat16", max_rows=2049, **kw) == ["fused_one_store",
                                                                                        "fused_one_shot"]
    # A row larger than the one-store limit never takes it; off (0, and W = 1) is the old behaviour.
    assert plan.fused_norm_one_store_rows(65536, "bfloat16", 64 << 10) == 0
    assert plan.fused_norm_variants(hidden=65536, dtype="bfloat16", max_rows=2, **kw) == ["fused_one_shot"]
    kw["one_store_max"] = plan.one_store_max_bytes(1, shared_gpu=False)
    assert plan.fused_norm_variants(hidden=4096, dtype="bfloat16", max_rows=64, **kw) == ["fused_one_shot"]
    assert plan.fused_norm_variants(hidden=1 << 20, dtype="float32", max_rows=4, grid=grid, slot_bytes=1 << 20,
                                    one_shot_max_bytes=512 << 10, one_store_max=64 << 10) == []
    with pytest.raises(ValueError):
        plan.fused_norm_one_store_rows(0, "bfloat16", 64 << 10)


def test_fused_one_store_descriptor_names_rows_and_hidden():
    """The fused one-store kernel's descriptor count is rows << 32 | hidden: a mismatch names both."""
    rec = [0] * plan.ERR_WORDS
    what = (plan.KIND_FUSED_NORM_ONE_STORE << 8) | 1
    rec[:16] = [plan.ERR_MISMATCH, 0, 1, plan.WAIT_ONE_STORE, 7, 0, 0, 0, what, 12, 4096, 2, what, 12, 8192, 1]
    line = plan.decode_record(rec)
    assert "fused_norm_one_store bfloat16 rows 2 x hidden 4096" in line, line
    assert "rows 1 x hidden 8192" in line and "one-store wait" in line, line


def test_failure_records_decode_to_one_line():
    rec = [0] * plan.ERR_WORDS
    assert plan.decode_record(rec) is None
    rec[:12] = [plan.ERR_TIMEOUT, 1, 0, 0, 7, 6, 60000, 3, (2 << 8) | 1, 41, 4096, 0]
    line = plan.decode_record(rec, {41: "layer.3.attn_out"})
    assert "rank 1 timed out after 60000 ms waiting for rank 0" in line
    assert "call 41: two_shot bfloat16 count 4096 (layer.3.attn_out)" in line and "start barrier" in line
    rec[0], rec[12:16] = plan.ERR_MISMATCH, [(1 << 8) | 1, 41, 2048, 0]
    line = plan.decode_record(rec)
    assert "different calls" in line and "rank 0 call 41: one_shot bfloat16 count 2048" in line
    rec[0], rec[5] = plan.ERR_PEER_FAILED, plan.ABORT_BY_HOST | 2
    assert "rank 2's host aborted first" in plan.decode_record(rec)
    rec[5] = plan.ABORT_BY_KERNEL | 0
    assert "rank 0's kernel failed first" in plan.decode_record(rec)
    rec[0], rec[3], rec[8] = plan.ERR_TIMEOUT, plan.WAIT_ONE_STORE, (plan.KIND_ONE_STORE << 8) | 1
    line = plan.decode_record(rec)
    assert "one_store bfloat16" in line and "one-store wait" in line and "barrier" not in line


def test_one_shot_threshold_from_topology() -> None:
    """Two ranks on their own GPUs never take two-shot (same link bytes, one barrier less: measured faster at every
    size); ranks sharing a GPU and W > 2 keep the 512 KiB threshold, and then two-shot is reachable again."""
    from detcomm.workspace import plan as p

    assert p.one_shot_max_bytes(2, shared_gpu=False) == p.ONE_SHOT_ALWAYS
    for w, shared in ((2, True), (3, False), (8, False), (4, True)):
        assert p.one_shot_max_bytes(w, shared_gpu=shared) == p.DEFAULT_ONE_SHOT_MAX_BYTES
    row = 16384  # 8192 bf16
    big = dict(row_bytes=row, max_rows=4096, world_size=2, capacity_bytes=32 << 20)
    assert p.variants("all_reduce", **big, one_shot_max_bytes=p.one_shot_max_bytes(2, shared_gpu=False)) == \
        ["one_shot", "chunked"]
    # Negative control: the old threshold at W = 2 reaches two-shot on the same site.
    assert "two_shot" in p.variants("all_reduce", **big, one_shot_max_bytes=p.DEFAULT_ONE_SHOT_MAX_BYTES)


# --- virtual-shard all-reduce (csrc/virtual_fold.cu) -----------------------------------------------------------
def test_virtual_rows_per_launch_is_the_fp32_capacity_and_stays_in_the_slot():
    """rows = capacity // (S * row_numel * 4); for every such launch both kernels' slot use (whole units, W slices
    of L) stays inside slot_bytes, for S up to 64 and every W, dtype and a small and a large grid."""
    got = plan.virtual_rows_per_launch(1 << 17, 33, 12, world_size=1, dtype="bfloat16", grid=132)
    assert got == (1 << 17) // (12 * 33 * 4)
    assert plan.virtual_rows_per_launch(1000, 33, 12, world_size=1, dtype="float32", grid=132) == 0  # 1584 B > 1000
    for world in range(1, plan.MAX_WORLD + 1):
        for s in (1, 2, 3, 5, 12, 64):
            for dtype in ("float32", "bfloat16", "float16"):
                for grid in (1, 132):
                    for cap, numel in ((16, 1), (1000, 3), (1 << 16, 33), (12345, 7)):
                        rows = plan.virtual_rows_per_launch(cap, numel, s, world_size=world, dtype=dtype, grid=grid)
                        assert rows == cap // (s * numel * 4)
                        if rows:
                            n = rows * numel
                            slot = plan.slot_bytes(cap, world, grid)
                            for algo in ("one_shot", "two_shot"):
                                assert plan.virtual_slot_bytes_used(n, s, world, dtype, algo) <= slot


def test_virtual_slices_cover_the_slab_in_whole_output_packs():
    for world in range(1, plan.MAX_WORLD + 1):
        for dtype, per in (("float32", 4), ("bfloat16", 8), ("float16", 8)):
            for n in (1, 7, 8, 33, 1000, 4097):
                L = plan.virtual_slices(n, world, dtype)
                assert L % per == 0 and world * L >= n and L - -(-n // world) < per
                assert plan.virtual_slot_bytes_used(n, 3, world, dtype, "two_shot") == 3 * world * L * 4
                assert plan.virtual_slot_bytes_used(n, 3, world, dtype, "one_shot") == 3 * (-(-n // per) * per) * 4
    with pytest.raises(ValueError):
        plan.virtual_slot_bytes_used(8, 1, 1, "float32", "three_shot")


def test_virtual_variants():
    kw = dict(world_size=4, dtype="bfloat16", grid=33)
    # S = 3, 33 elements: 396 fp32 bytes a row; 100 rows per launch at 39600 bytes of capacity
    assert plan.virtual_variants(row_numel=33, shards_per_rank=3, max_rows=64, capacity_bytes=39600,
                                 one_shot_max_bytes=1 << 19, **kw) == ["one_shot"]
    assert plan.virtual_variants(row_numel=33, shards_per_rank=3, max_rows=101, capacity_bytes=39600,
                                 one_shot_max_bytes=1 << 19, **kw) == ["one_shot", "chunked"]
    assert plan.virtual_variants(row_numel=33, shards_per_rank=3, max_rows=64, capacity_bytes=39600,
                                 one_shot_max_bytes=4000, **kw) == ["one_shot", "two_shot"]
    assert plan.virtual_variants(row_numel=33, shards_per_rank=3, max_rows=64, capacity_bytes=39600,
                                 one_shot_max_bytes=100, **kw) == ["two_shot"]
    assert plan.virtual_variants(row_numel=33, shards_per_rank=3, max_rows=64, capacity_bytes=395,
                                 one_shot_max_bytes=1 << 19, **kw) == []
    with pytest.raises(ValueError):
        plan.virtual_rows_per_launch(100, 0, 3, world_size=1, dtype="float32", grid=1)


# --- the one-store protocol's mirror (csrc/one_store_common.cuh) ---------------------------------------------------
def _one_store_schedule(world: int, launches: int, buffers: int, rng: random.Random) -> str | None:
    """One random interleaving of the one-store protocol at the level of launches: in launch e every rank issues a
    store of its tag e into area [e mod buffers][its rank] of every rank's region (stores land later, in any
    order), waits until its own region's W areas of that buffer are all full, reads them, empties them, and only
    then starts launch e+1 (a kernel boundary). Returns what went wrong (a read of another launch's data, or no
    rank able to move), None when every launch read exactly its own data."""
    empty = None
    region = [[[empty] * world for _ in range(buffers)] for _ in range(world)]  # [owner][buffer][source]
    launch = [0] * world          # each rank's current launch
    pushed = [False] * world      # has the rank issued its stores of the current launch
    flight: list[tuple[int, int, int, int]] = []  # stores issued, not landed: (owner, buffer, source, tag)
    while min(launch) < launches:
        moves: list[tuple[str, int]] = []
        for r in range(world):
            if launch[r] < launches:
                b = launch[r] % buffers
                if not pushed[r] or all(region[r][b][k] is not empty for k in range(world)):
                    moves.append(("rank", r))
        moves += [("land", i) for i in range(len(flight))]
        if not moves:
            return f"no rank can move (launches {launch}): a store was lost"
        kind, i = rng.choice(moves)
        if kind == "land":
            owner, b, src, tag = flight.pop(i)
            region[owner][b][src] = tag
            continue
        r = i
        b = launch[r] % buffers
        if not pushed[r]:
            flight += [(t, b, r, launch[r]) for t in range(world)]
            pushed[r] = True
            continue
        got = [region[r][b][k] for k in range(world)]
        if got != [launch[r]] * world:
            return f"rank {r} read {got} in launch {launch[r]}"
        region[r][b] = [empty] * world  # empties what it read, before its next kernel starts
        launch[r] += 1
        pushed[r] = False
    return None


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_store_protocol_two_buffers_are_enough(world):
    """The two-buffer argument of docs/spec.md §9.3 (docs/design/workspace-protocol.md), checked on the protocol's
    mirror: with two buffers no schedule lets a rank read another launch's data or lose a store; with one buffer (the
    `one_buffer` control build's protocol) some schedules do, so the mirror can tell the two apart."""
    rng = random.Random(world)
    assert all(_one_store_schedule(world, 8, 2, rng) is None for _ in range(400))
    bad = [p for p in (_one_store_schedule(world, 8, 1, rng) for _ in range(400)) if p is not None]
    assert bad, "the single-buffer mirror never went wrong: the check is blind"


def test_tree_refusal_names_the_rule():
    """The tree kernels fold V a power of two over W a power of two dividing V, with V/W within the local tree."""
    for v, w in ((8, 1), (8, 2), (8, 4), (8, 8), (64, 1), (128, 2), (2, 2)):
        assert plan.tree_refusal(v, w) is None, (v, w)
    assert "power of two" in plan.tree_refusal(12, 4)
    assert "shard_fold='order'" in plan.tree_refusal(8, 3)
    assert "shard_fold='order'" in plan.tree_refusal(4, 8)
    assert str(plan.TREE_MAX_SHARDS_PER_RANK) in plan.tree_refusal(256, 2)
    assert plan.TREE_MAX_SHARDS_PER_RANK == 1 << int(plan.DEVICE_CONSTANTS["DETCOMM_TREE_MAX_LOG"])


def test_tree_launch_bytes_and_rows_stay_in_the_slot_and_the_areas():
    """A tree launch publishes one fp32 row per rank in whole units: rows per launch = capacity // (row * 4),
    whatever S is, and every kernel's slot use stays inside slot_bytes; the one-store rows are the most whose
    published bytes fit one_store_max (so one more row does not), and a tier's area (one_store_area_bytes) holds them."""
    assert plan.tree_launch_bytes(1, "bfloat16") == 32 and plan.tree_launch_bytes(1, "float32") == 16
    assert plan.tree_launch_bytes(9, "float16") == 64
    for world in (1, 2, 4, 8):
        for dtype in ("float32", "bfloat16", "float16"):
            for grid in (1, 33, 132):
                for cap, numel in ((16, 1), (1000, 3), (1 << 16, 33), (12345, 7), (1 << 20, 4096)):
                    rows = plan.tree_rows_per_launch(cap, numel, world_size=world, dtype=dtype, grid=grid)
                    assert rows == cap // (numel * 4)
                    if rows:
                        slot = plan.slot_bytes(cap, world, grid)
                        for algo in ("one_shot", "two_shot"):
                            assert plan.tree_slot_bytes_used(rows * numel, world, dtype, algo) <= slot
            for one_store in (0, 15, 16, 100, 64 << 10, 1 << 20):
                for numel in (1, 7, 33, 4096):
                    k = plan.tree_one_store_rows(numel, dtype, one_store)
                    assert k == 0 or plan.tree_launch_bytes(k * numel, dtype) <= one_store <= plan.one_store_area_bytes(one_store)
                    assert plan.tree_launch_bytes((k + 1) * numel, dtype) > one_store
    with pytest.raises(ValueError):
        plan.tree_slot_bytes_used(8, 1, "float32", "one_store")


def test_tree_variants_are_the_kernels_some_row_count_takes():
    """tree_variants equals a brute force over every row count 1..max_rows (each launch's kernel by tree_algo, a
    call above the launch's rows chunked), for one-store limits on and off; the kernel names exist per dtype."""
    for dtype in ("float32", "bfloat16"):
        for numel in (1, 33, 4096):
            for cap in (1 << 12, 1 << 20, 8 << 20):
                for one_store in (0, 64 << 10, 1 << 20):
                    for one in (256, 512 << 10, plan.ONE_SHOT_ALWAYS):
                        for max_rows in (1, 7, 64, 2048):
                            got = plan.tree_variants(row_numel=numel, max_rows=max_rows, world_size=4, dtype=dtype,
                                                     capacity_bytes=cap, grid=33, one_shot_max_bytes=one,
                                                     one_store_max=one_store)
                            per = plan.tree_rows_per_launch(cap, numel, world_size=4, dtype=dtype, grid=33)
                            if per < 1:
                                assert got == []
                                continue
                            seen = {plan.tree_algo(min(k, per) * numel, dtype, one_store_max=min(one_store, cap),
                                                   one_shot_max_bytes=one) for k in range(1, max_rows + 1)}
                            want = [a for a in plan.TREE_ALGOS if a in seen] + (["chunked"] if max_rows > per else [])
                            assert got == want, (dtype, numel, cap, one_store, one, max_rows, got, want)
    assert plan.tree_kernel("one_store", "bfloat16") == "detcomm_tree_one_store_bf16"
    with pytest.raises(ValueError):
        plan.tree_kernel("chunked", "float32")


class _TreeSite:
    """A site declared shard_fold="tree" (Site.shard_fold, and the layout every layer asks: Site.layout), bypassing
    Site's own validation (so that admission's refusal of a V that is not a power of two is reachable): every other
    attribute is the wrapped Site's."""

    shard_fold = "tree"

    @property
    def layout(self) -> object:
        from detcomm.layout import Layout

        return Layout.of(self._site.virtual_shards, "tree")

    def __init__(self, site: object) -> None:
        self._site = site

    def __getattr__(self, name: str) -> object:
        return getattr(self._site, name)


def test_tree_sites_are_admitted_where_the_tree_kernels_fold_them():
    """admission.admit for a tree site: served where W is a power of two dividing V and one fp32 row fits a launch
    (the slabs per rank do not count: the local subtree is folded before the slot), else refused with the rule.
    The control: the same site in shard order is refused where its V/W slabs do not fit, the tree is not."""
    import torch

    from detcomm.envelope import resolve_numerics
    from detcomm.sites import Capabilities, Collective, Site
    from detcomm.workspace import admission

    bitwise = resolve_numerics("rl-bitwise")

    def caps(world: int, nbytes: int) -> Capabilities:
        return Capabilities(backend="nccl", device_type="cuda", world_size=world, workspace=True,
                            workspace_max_rows=64, workspace_bytes=nbytes)

    site = Site("s", Collective.ALL_REDUCE, torch.bfloat16, (4096,), 64, virtual_shards=64)
    tree = _TreeSite(site)
    got = admission.admit(tree, caps(2, 1 << 20), bitwise)
    assert got.serves and "tree kernels" in got.why and "V/W=32" in got.why, got
    # 16 KiB: one fp32 row of 4096 fits, the order site's 32 slabs do not.
    assert admission.admit(tree, caps(2, 16 << 10), bitwise).serves
    assert not admission.admit(site, caps(2, 16 << 10), bitwise).serves
    assert "launches per call" in admission.admit(tree, caps(2, 16 << 10), bitwise).why
    small = admission.admit(tree, caps(2, 8 << 10), bitwise)
    assert not small.serves and "one fp32 row" in small.why, small
    odd = _TreeSite(Site("s", Collective.ALL_REDUCE, torch.bfloat16, (4096,), 64, virtual_shards=12))
    assert "power of two" in admission.admit(odd, caps(4, 1 << 20), bitwise).why
    wide = _TreeSite(Site("s", Collective.ALL_REDUCE, torch.bfloat16, (4096,), 64, virtual_shards=256))
    assert "at most 64 shards per rank" in admission.admit(wide, caps(2, 1 << 20), bitwise).why
    assert admission.admit(wide, caps(4, 1 << 20), bitwise).serves
