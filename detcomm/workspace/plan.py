"""Host-side arithmetic of the workspace: layout constants, capacity planning, chunking, kernel geometry and the
barrier-epoch rule. Pure Python (no torch, no CUDA), so CPU CI tests all of it.

The constants the kernels share with the host are defined here and only here: DEVICE_CONSTANTS (at the end) spells
each as the C macro csrc/ reads, kernels.nvrtc_options passes them to every build as -D options, and
csrc/detcomm_common.cuh refuses to compile without them (it defines none). The header's index formulas over them
(flag_index, ...) are checked against this module's by tests/test_workspace_plan.py.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .. import dtypes

# --- the device constants (DEVICE_CONSTANTS passes them to csrc/) ------------------------------------------
MAX_WORLD = 8
MAX_BLOCKS = 256
BLOCK_THREADS = 512
PACK_BYTES = 16
BARRIER_KINDS = 2
PARITIES = 2
# Bytes of the header at the start of each rank's symmetric buffer (flags, epochs, descriptors, control words).
BUFFER_HEADER_BYTES = 131072
PROBE_BYTES = 4096
DESC_WORDS = 4
ERR_WORDS = 16
CTRL_WORDS = 32
HOST_ABORT_WORD = 16
ERR_TIMEOUT = 0xDE7C0001
ERR_ABORTED = 0xDE7C0002
ERR_PEER_FAILED = 0xDE7C0003
ERR_MISMATCH = 0xDE7C0004
ERR_OVERLAP = 0xDE7C0005
ABORT_BY_KERNEL = 0x100
ABORT_BY_HOST = 0x200
KIND_CODES = {1: "one_shot", 2: "two_shot", 3: "reduce_scatter", 4: "all_gather", 5: "fused_norm_1shot",
              6: "fused_norm_2shot", 7: "virtual_1shot", 8: "virtual_2shot", 9: "one_store",
              10: "fused_norm_one_store", 11: "tree_one_store", 12: "tree_1shot", 13: "tree_2shot",
              14: "fused_norm_tree_1shot", 15: "fused_norm_tree_2shot"}
DTYPE_CODES = {0: "float32", 1: "bfloat16", 2: "float16", 3: "bytes"}
# The `kind` word of a failure record (BARRIER_START, BARRIER_MID); there is no end barrier.
BARRIER_NAMES = ("start", "mid")

# Header words: flags[kind][parity][block][rank], epochs[kind][block], desc[parity][block][rank][4], abort, claim,
# busy[block].
EPOCH_BASE = BARRIER_KINDS * PARITIES * MAX_BLOCKS * MAX_WORLD
DESC_BASE = EPOCH_BASE + BARRIER_KINDS * MAX_BLOCKS
CTRL_BASE = DESC_BASE + PARITIES * MAX_BLOCKS * MAX_WORLD * DESC_WORDS
ABORT_INDEX = CTRL_BASE
CLAIM_INDEX = CTRL_BASE + 1
HEADER_WORDS_USED = CTRL_BASE + 2 + MAX_BLOCKS
assert HEADER_WORDS_USED * 4 <= BUFFER_HEADER_BYTES


def flag_index(kind: int, parity: int, block: int, src: int) -> int:
    return ((kind * PARITIES + parity) * MAX_BLOCKS + block) * MAX_WORLD + src


def epoch_index(kind: int, block: int) -> int:
    return EPOCH_BASE + kind * MAX_BLOCKS + block


def desc_index(parity: int, block: int, src: int) -> int:
    return DESC_BASE + ((parity * MAX_BLOCKS + block) * MAX_WORLD + src) * DESC_WORDS


def busy_index(block: int) -> int:
    return CTRL_BASE + 2 + block

# The float dtypes the kernels fold, by name: element bytes and kernel-name suffix, read from detcomm.dtypes (torch-free,
# so that the router's static view can ask the plan).
ELEM_SIZES = {name: dtypes.size_of(name) for name in dtypes.FLOAT_NAMES}
DTYPE_SUFFIX = {name: dtypes.suffix_of(name) for name in dtypes.FLOAT_NAMES}

# --- the one-store region after the data slot (csrc/one_store_common.cuh; ONE_STORE_COUNTER_BYTES and the kinds are
# device constants) ---------------------------------------------------------------------------------------------
ONE_STORE_COUNTER_BYTES = 4096
ONE_STORE_DESC_OFF = ONE_STORE_COUNTER_BYTES
ONE_STORE_DESC_BYTES = 2 * MAX_BLOCKS * MAX_WORLD * PACK_BYTES
ONE_STORE_DATA_OFF = ONE_STORE_DESC_OFF + ONE_STORE_DESC_BYTES
KIND_ONE_STORE = next(c for c, k in KIND_CODES.items() if k == "one_store")
KIND_FUSED_NORM_ONE_STORE = next(c for c, k in KIND_CODES.items() if k == "fused_norm_one_store")
WAIT_ONE_STORE = 3

DEFAULT_MAX_ROWS_ARMED = 2048
# Above this message size all_reduce takes two-shot (see one_shot_max_bytes). Both give the same bits; this only
# moves latency.
DEFAULT_ONE_SHOT_MAX_BYTES = 512 * 1024
# "Never two-shot": larger than any launch.
ONE_SHOT_ALWAYS = 1 << 62
# Launches up to this many bytes take the one-store kernel (csrc/one_store.cu) where ranks have their own GPUs; it is
# also the capacity of each of its 2 * W areas per rank. See one_store_max_bytes (never on a shared GPU).
DEFAULT_ONE_STORE_MAX_BYTES = 1 << 20
# No cap below the SM count by default: grid_blocks says why every SM helps.
DEFAULT_MAX_GRID = MAX_BLOCKS


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- kernel geometry ----------------------------------------------------------------------------------------
def grid_blocks(world_size: int, sm_count: int, *, max_grid: int = DEFAULT_MAX_GRID, shared_gpu: bool = True) -> int:
    """Blocks per rank for every workspace kernel: a function of static facts only (W, the SM count agreed by all
    ranks at create, whether ranks share a GPU, the configured cap), so every rank launches the same grid.

    One GPU per rank (shared_gpu=False): every SM. The kernels are limited by the loads each SM keeps in flight,
    not by bandwidth (measured on an H200, W = 1, 64 MiB: 529 / 280 / 165 / 101 us with 16 / 33 / 64 / 132
    blocks), so each rank uses its whole GPU.

    Ranks sharing a GPU (in-process streams, or processes on one device): sm_count // W. A block spins on the
    barrier until the same block of every peer arrives, so all W grids must be resident at once, or a resident
    block could spin forever on a peer block that is waiting for its SM. One 512-thread block always fits an SM,
    so W * grid <= sm_count guarantees co-residency. (Processes sharing a GPU time-slice whole contexts, and each
    context's grid fits the GPU alone, so they progress too.)
    """
    if not 1 <= world_size <= MAX_WORLD:
        raise ValueError(f"world_size must be in 1..{MAX_WORLD}, got {world_size}")
    if sm_count < world_size:
        raise ValueError(f"sm_count {sm_count} < world_size {world_size}: ranks cannot be co-resident")
    if max_grid < 1:
        raise ValueError(f"max_grid must be >= 1, got {max_grid}")
    per_rank = sm_count // world_size if shared_gpu else sm_count
    return max(1, min(MAX_BLOCKS, max_grid, per_rank))


def one_shot_max_bytes(world_size: int, *, shared_gpu: bool) -> int:
    """The message size above which all_reduce takes two-shot, from static facts (identical on every rank).

    Two ranks on their own GPUs: never. At W = 2 both kernels move the same bytes over the link (one-shot reads
    the one peer's copy; two-shot reads half of it, then half of the result) and one-shot has one barrier less:
    measured faster at every size on 2x H200 over NVLink (one-shot / two-shot, CUDA graphs: 16 KiB 7.7 / 11.7 us,
    1 MiB 11.9 / 15.8 us, 64 MiB 242.5 / 246.2 us). Otherwise DEFAULT_ONE_SHOT_MAX_BYTES: one-shot reads W - 1
    peer copies where two-shot reads 2 (W - 1) / W, and ranks sharing one GPU share its bandwidth."""
    if world_size == 2 and not shared_gpu:
        return ONE_SHOT_ALWAYS
    return DEFAULT_ONE_SHOT_MAX_BYTES


def one_store_max_bytes(world_size: int, *, shared_gpu: bool) -> int:
    """Launches up to this size take the one-store all-reduce (no barrier: data and arrival in one store), from
    static facts (identical on every rank). 0 = never.

    - W = 1: never: with no peer the one-shot kernel is already a single pass over the data.
    - One GPU per rank: DEFAULT_ONE_STORE_MAX_BYTES. The pushes go to W - 1 other GPUs in parallel and every read is
      local; measured on 2x H200 over NVLink (W = 2, CUDA graphs): 16 KiB 5.8 us vs one-shot 8.1, 256 KiB 6.6 vs
      9.6. Above it the one-store kernel's extra local traffic (each rank receives, re-reads and empties W areas)
      grows with the message while the barrier it saves does not.
    - Ranks sharing one GPU: never. Two ranks as two streams of one H200 (CUDA graphs, 1 and 8 rows of 4096 bf16,
      ten runs): one-shot was faster than the one-store kernel in 19 of the 20 pairs, by 0.3-1.3 us
      (the exception: 0.04 us the other way), and the fused one-store kernel was no faster than the fused one-shot
      one (8.26 vs 8.24 us at 1 row): with no link between the ranks, the barrier it saves costs less than its
      extra pass over the areas. More ranks: every rank's W pushes land in the same HBM (W = 8: 16 KiB 15.2 vs
      one-shot 14.2 us, 256 KiB 37.6 vs 16.4). A caller can still force it (one_store_max_bytes=..., algo="one_store"):
      the stream bench and the tests do."""
    if not 1 <= world_size <= MAX_WORLD:
        raise ValueError(f"world_size must be in 1..{MAX_WORLD}, got {world_size}")
    if world_size == 1:
        return 0
    if shared_gpu:
        return 0
    return DEFAULT_ONE_STORE_MAX_BYTES


# The one-store tiers below the largest (max bytes, blocks), for every workspace with a one-store path
# (one_store_tiers). Why tiers: a one-store launch must run the same blocks every time (each block counts its
# launches, csrc/one_store_common.cuh), and the blocks that own no pack of a small launch still cost it: measured on
# 2x H200 over NVLink (W = 2, CUDA graphs), 16 KiB took 5.7 us on the full grid (132 blocks), 4.9 on
# 16 and 5.0 on 32; 256 KiB 6.3 / 6.6 / 5.7; 1 MiB 8.5 / 11.9 / 12.1 (too few stores in flight). So small
# launches get their own sub-regions with fewer blocks, each with its own counters, descriptors and areas.
DEFAULT_ONE_STORE_TIERS: tuple[tuple[int, int], ...] = ((64 << 10, 16), (256 << 10, 32))


@dataclass(frozen=True)
class OneStoreTier:
    """One sub-region of the one-store region: launches of up to `max_bytes` (plain all-reduce: the message;
    fused: its rows in whole packs, fused_norm_one_store_rows) run `blocks` blocks over its own counters,
    descriptors and 2 x W data areas of `cap` bytes, which start `offset` bytes after slot copy 0 (the kernels'
    `off` argument)."""

    max_bytes: int
    blocks: int
    offset: int
    cap: int

    def region_bytes(self, world_size: int) -> int:
        return ONE_STORE_DATA_OFF + 2 * world_size * self.cap


def one_store_tiers(one_store_max: int, world_size: int, grid: int, *, base: int,
                  table: Sequence[tuple[int, int]] = DEFAULT_ONE_STORE_TIERS,
                  max_blocks: int | None = None) -> tuple[OneStoreTier, ...]:
    """The one-store tiers of a workspace, smallest first, identical on every rank (static facts only): the table's
    tiers below one_store_max, then one up to one_store_max on the whole grid; every tier's blocks capped by the grid
    (ranks sharing a GPU stay co-resident) and by max_blocks (Workspace.create(one_store_grid=)), and neighbours
    left with equal blocks merged into the larger. () when the one-store path is off (one_store_max == 0). `base`:
    where the first tier starts (one_store_offset); the others follow it.

    A tier is a region of its own: its launches are the same sequence on every rank, so the two-buffer argument of
    csrc/one_store_common.cuh holds for each tier by itself, whatever the other tiers' launches in between. Which
    tier a launch takes changes no bit (the fold is element-wise); it only moves latency."""
    if one_store_max < 0:
        raise ValueError(f"one_store_max must be >= 0, got {one_store_max}")
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"one_store_grid must be >= 1, got {max_blocks}")
    prev = (0, 0)
    for max_bytes, blocks in table:
        if max_bytes <= prev[0] or blocks < max(prev[1], 1):
            raise ValueError(f"one_store_tiers must be (max_bytes, blocks) pairs with max_bytes increasing and blocks "
                             f">= 1 and not decreasing, got {list(table)}")
        prev = (max_bytes, blocks)
    if one_store_max == 0:
        return ()
    top = grid if max_blocks is None else min(grid, max_blocks)
    pairs = [(b, min(blk, top)) for b, blk in table if b < one_store_max] + [(one_store_max, top)]
    merged: list[tuple[int, int]] = []
    for b, blk in pairs:
        if merged and merged[-1][1] == blk:
            merged[-1] = (b, blk)
        else:
            merged.append((b, blk))
    tiers, offset = [], base
    for b, blk in merged:
        tier = OneStoreTier(max_bytes=b, blocks=blk, offset=offset, cap=one_store_area_bytes(b))
        tiers.append(tier)
        offset += tier.region_bytes(world_size)
    return tuple(tiers)


def one_store_region_bytes(world_size: int, tiers: Sequence[OneStoreTier]) -> int:
    """Bytes of one rank's one-store region: every tier's counters, two buffers of call descriptors and 2 x W data
    areas. 0 when the one-store path is off (no tiers)."""
    return sum(t.region_bytes(world_size) for t in tiers)


def one_store_area_bytes(one_store_max: int) -> int:
    """Bytes of one (buffer, source) area: the largest one-store launch, in whole packs."""
    return _round_up(one_store_max, PACK_BYTES)


def stride_packs(grid: int) -> int:
    """Packs one sweep of the grid covers: the period of the pack-to-block ownership."""
    return grid * BLOCK_THREADS


def elem_size(dtype: str) -> int:
    try:
        return ELEM_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; the workspace folds {sorted(ELEM_SIZES)}") from None


def pack_elems(dtype: str) -> int:
    return PACK_BYTES // elem_size(dtype)


# --- buffer layout ------------------------------------------------------------------------------------------
# Copies of the data slot in each rank's buffer: a block's use of parity p (its START epoch & 1) works in copy p,
# so the next launch can fill the other copy while a peer still reads this one (csrc/detcomm_common.cuh,
# "Barriers").
SLOT_COPIES = 2


def slot_bytes(capacity_bytes: int, world_size: int, grid: int) -> int:
    """Bytes of one copy of one rank's data slot (what one launch can use): the capacity plus the padding
    two-shot and reduce-scatter slices need (each slice starts at a multiple of the grid stride, so W slices can
    overrun the capacity by up to W * (stride + one pack))."""
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
    return _round_up(capacity_bytes, PACK_BYTES) + world_size * (stride_packs(grid) + 1) * PACK_BYTES


def buffer_bytes(capacity_bytes: int, world_size: int, grid: int, tiers: Sequence[OneStoreTier] = ()) -> int:
    """Total bytes of one rank's symmetric buffer: header (flags, epochs) + probe scratch + SLOT_COPIES data slot
    copies + the one-store region (one_store_region_bytes of its tiers, which start at one_store_offset)."""
    assert not tiers or tiers[0].offset == one_store_offset(capacity_bytes, world_size, grid), tiers
    return (BUFFER_HEADER_BYTES + PROBE_BYTES + one_store_offset(capacity_bytes, world_size, grid)
            + one_store_region_bytes(world_size, tiers))


def one_store_offset(capacity_bytes: int, world_size: int, grid: int) -> int:
    """Where the one-store region (its first tier) starts, in bytes from the start of slot copy 0 (the kernels'
    `off` argument): after both slot copies."""
    return SLOT_COPIES * slot_bytes(capacity_bytes, world_size, grid)


def data_offset() -> int:
    """Offset of data slot copy 0 in a rank's buffer; copy c starts c * slot_bytes(...) after it."""
    return BUFFER_HEADER_BYTES + PROBE_BYTES


def probe_offset() -> int:
    return BUFFER_HEADER_BYTES


# --- chunking -----------------------------------------------------------------------------------------------
def rows_per_chunk(capacity_bytes: int, row_bytes: int, *, parts: int = 1) -> int:
    """Rows one launch carries when `parts` row blocks of that size must fit the capacity together
    (all-reduce and all-gather: 1; reduce-scatter: W, one block per destination rank)."""
    if row_bytes < 1:
        raise ValueError(f"row_bytes must be >= 1, got {row_bytes}")
    rows = capacity_bytes // (row_bytes * parts)
    if rows < 1:
        raise ValueError(
            f"a row of {row_bytes} bytes x {parts} part(s) does not fit the workspace capacity of {capacity_bytes} bytes"
        )
    return rows


def chunks(rows: int, per_chunk: int) -> Iterator[tuple[int, int]]:
    """[start, stop) row ranges of at most per_chunk rows covering 0..rows. Chunk boundaries never change a
    row's bits: the fold is element-wise."""
    if per_chunk < 1:
        raise ValueError(f"per_chunk must be >= 1, got {per_chunk}")
    for start in range(0, rows, per_chunk):
        yield start, min(rows, start + per_chunk)


@dataclass(frozen=True)
class SliceGeometry:
    length: int  # L: elements per slice
    stride_packs: int  # Lp: slice stride in the slot, in packs (a multiple of the grid stride)

    def slot_bytes_used(self, world_size: int) -> int:
        return world_size * self.stride_packs * PACK_BYTES


def two_shot_slices(n_elems: int, world_size: int, dtype: str, grid: int) -> SliceGeometry:
    """Slices of a two-shot all-reduce of n elements: L = ceil(n / W) rounded up to whole packs, so each
    slice of the caller's tensor starts on a pack boundary of the tensor."""
    per = pack_elems(dtype)
    length = _round_up(max(1, _ceil_div(n_elems, world_size)), per)
    return SliceGeometry(length, _round_up(length // per, stride_packs(grid)))


def reduce_scatter_slices(chunk_rows: int, row_elems: int, dtype: str, grid: int) -> SliceGeometry:
    """Slices of one reduce-scatter launch: slice s is chunk_rows rows of rank s's shard."""
    per = pack_elems(dtype)
    length = chunk_rows * row_elems
    return SliceGeometry(length, _round_up(_ceil_div(length, per), stride_packs(grid)))


# --- the kernel rule: which kernel a launch takes, and the variants a site's calls reach ------------------------
# The all-reduce families of the workspace: the plain fold (csrc/one_store.cu, one_shot.cu, two_shot.cu), the fused
# add + RMSNorm (csrc/fused_rmsnorm*.cu), the tree and shard orders of virtual shards (csrc/tree_fold.cu,
# virtual_fold.cu) and the fused tree norm. Their kernels, in the order the rule tries them (and variants lists them).
FAMILY_ALGOS: dict[str, tuple[str, ...]] = {
    "plain": ("one_store", "one_shot", "two_shot"), "fused": ("one_store", "one_shot", "two_shot"),
    "tree": ("one_store", "one_shot", "two_shot"), "fused_tree": ("one_shot", "two_shot"),
    "virtual": ("one_shot", "two_shot")}


def _bytes(rows: int, row_elems: int, dtype: str) -> int:
    """A launch's bytes in `dtype` ("bytes": row_elems counts bytes, as plan.variants is asked)."""
    return rows * row_elems * (1 if dtype == "bytes" else elem_size(dtype))


def _one_store_holds(family: str, rows: int, row_elems: int, dtype: str, max_bytes: int) -> bool:
    """Whether a one-store area (a tier) of max_bytes holds a launch of `rows` rows: the plain fold's bytes, the
    fp32 bytes a tree launch publishes (tree_launch_bytes), the fused rows in whole packs (fused_norm_one_store_rows)."""
    if family == "plain":
        return _bytes(rows, row_elems, dtype) <= max_bytes
    if family == "tree":
        return tree_launch_bytes(rows * row_elems, dtype) <= max_bytes
    if family == "fused":
        return rows <= fused_norm_one_store_rows(row_elems, dtype, max_bytes)
    return False  # the shard order and the fused tree have no one-store kernel


def launch_kernel(family: str, rows: int, *, row_elems: int, dtype: str, shards: int = 1,
                  one_store_tiers: Sequence[int], one_shot_max_bytes: int) -> tuple[str, int]:
    """THE rule: the kernel a launch of `rows` rows of `row_elems` elements takes, from static facts only (every
    rank picks the same), as (algo, tier): the one-store kernel on the first tier that holds the launch
    (one_store_tiers: the tiers' max_bytes, smallest first; _one_store_holds); else one-shot while the launch's
    bytes (rows * row_elems * elem_size(dtype): the output's, also for the tree orders, see below; the shard
    order's fp32 input, shards * rows * row_elems * 4) stay within one_shot_max_bytes; else two-shot. tier is -1
    for the barrier kernels. Every choice gives the same bits (the fold is element-wise); it only moves latency.

    Why a tree launch's output bytes and not the fp32 bytes it publishes: with the fp32 bytes, a bf16 site switched
    to two-shot at half the rows the plain fold does, where one-shot was still the faster. Measured on one H200 (W
    ranks as streams, CUDA graphs, rows of 4096, V = 8; docs/performance.md): 64 rows (1 MiB of fp32) one-shot /
    two-shot 9.30 / 12.86 us at W = 2 and 15.13 / 16.81 at W = 4; 128 rows (1 MiB of bf16 output, two-shot under
    this rule) 24.13 / 22.16 us at W = 4. The fused tree follows (a bf16 launch of 64 rows of 4096 by the fp32 bytes
    took two-shot and cost 1.13-1.16x the composition, 2026-12-02)."""
    for tier, max_bytes in enumerate(one_store_tiers):
        if _one_store_holds(family, rows, row_elems, dtype, max_bytes):
            return "one_store", tier
    nbytes = shards * rows * row_elems * F32_BYTES if family == "virtual" else _bytes(rows, row_elems, dtype)
    return ("one_shot" if nbytes <= one_shot_max_bytes else "two_shot"), -1


def reached(family: str, per: int, max_rows: int, *, row_elems: int, dtype: str, shards: int = 1,
            one_store_max: int, one_shot_max_bytes: int) -> list[str]:
    """The variants calls of 1..max_rows rows reach when a launch carries at most `per` rows: the kernels
    launch_kernel picks for some launch of 1..min(max_rows, per) rows (in FAMILY_ALGOS order), and "chunked" when
    some call takes several launches; [] when per < 1. The kernel a launch takes only moves later in FAMILY_ALGOS as
    its rows grow, so bisecting 1..top between two row counts that pick different kernels finds every kernel
    reached: the rule over its breakpoints."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if per < 1:
        return []
    tiers = (one_store_max,) if one_store_max > 0 else ()

    def pick(k: int) -> str:
        return launch_kernel(family, k, row_elems=row_elems, dtype=dtype, shards=shards, one_store_tiers=tiers,
                             one_shot_max_bytes=one_shot_max_bytes)[0]

    found: set[str] = set()

    def bisect(lo: int, hi: int, a: str, b: str) -> None:
        found.update((a, b))
        if a != b and hi - lo > 1:
            mid = (lo + hi) // 2
            m = pick(mid)
            bisect(lo, mid, a, m)
            bisect(mid, hi, m, b)

    top = min(max_rows, per)
    bisect(1, top, pick(1), pick(top))
    return [a for a in FAMILY_ALGOS[family] if a in found] + (["chunked"] if max_rows > per else [])


def rows_per_launch(family: str, *, row_elems: int, dtype: str, shards: int = 1, capacity_bytes: int,
                    world_size: int, grid: int) -> int:
    """Rows one launch of `family` carries (0: not one row fits): the capacity's rows (plain), the fp32 rows
    (tree: one published row per rank), one row's S fp32 slabs (virtual), the fused kernels' slot rows (fused: the
    site's dtype; fused_tree: fp32)."""
    if family == "plain":
        return capacity_bytes // (row_elems * elem_size(dtype))
    if family == "tree":
        return tree_rows_per_launch(capacity_bytes, row_elems, world_size=world_size, dtype=dtype, grid=grid)
    if family == "virtual":
        return virtual_rows_per_launch(capacity_bytes, row_elems, shards, world_size=world_size, dtype=dtype,
                                       grid=grid)
    slot = slot_bytes(capacity_bytes, world_size, grid)
    if family == "fused":
        return fused_norm_rows_per_launch(row_elems, dtype, grid=grid, slot_bytes=slot)
    return fused_norm_tree_rows_per_launch(row_elems, grid=grid, slot_bytes=slot)


def one_store_rows(family: str, *, row_elems: int, dtype: str, one_store_max: int) -> int:
    """The most rows one one-store launch of `family` carries (0: none): what a forced one-store launch is held to."""
    if family == "plain":
        return one_store_max // (row_elems * elem_size(dtype))
    if family == "tree":
        return tree_one_store_rows(row_elems, dtype, one_store_max)
    if family == "fused":
        return fused_norm_one_store_rows(row_elems, dtype, one_store_max)
    return 0


def variants(collective: str, *, row_bytes: int, max_rows: int, world_size: int, capacity_bytes: int,
             one_shot_max_bytes: int, one_store_max: int = 0) -> list[str]:
    """The code paths calls of 1..max_rows rows of row_bytes each can take, in a fixed order: the kernels
    ("one_store", "one_shot", "two_shot", "reduce_scatter", "all_gather") and "chunked" when some call needs several
    launches; an all-reduce's are the rule's (reached, family "plain"). For reduce_scatter, max_rows counts the
    input rows (W shards). [] when not even one row fits a launch.

    The self-checks run each before a site uses the workspace: all_reduce(algo=...) forces a kernel and
    chunk_rows=... forces chunking on any payload of two rows or more."""
    if row_bytes < 1 or max_rows < 1:
        raise ValueError(f"row_bytes and max_rows must be >= 1, got {row_bytes} and {max_rows}")
    if collective == "all_reduce":  # row_bytes of a one-byte "dtype": the rule reads bytes
        return reached("plain", capacity_bytes // row_bytes, max_rows, row_elems=row_bytes, dtype="bytes",
                       one_store_max=one_store_max, one_shot_max_bytes=one_shot_max_bytes)
    if collective == "reduce_scatter":
        per = capacity_bytes // (row_bytes * world_size)
        if per < 1:
            return []
        return ["reduce_scatter"] + (["chunked"] if max_rows // world_size > per else [])
    if collective == "all_gather":
        per = capacity_bytes // row_bytes
        if per < 1:
            return []
        return ["all_gather"] + (["chunked"] if max_rows > per else [])
    raise ValueError(f"collective must be all_reduce, reduce_scatter or all_gather, got {collective!r}")


# --- virtual-shard all-reduce (csrc/virtual_fold.cu) --------------------------------------------------------
# Each rank passes S = V/W fp32 slabs per call; the kernels fold them in units of one output pack (pack_elems of
# the output dtype: 4 fp32 or 8 bf16/fp16 elements, i.e. 16 or 32 bytes of fp32 in the slot).
F32_BYTES = 4


def virtual_slices(n_elems: int, world_size: int, dtype: str) -> int:
    """L, the slice length in elements of a virtual two-shot launch of n elements per slab: ceil(n / W) rounded up
    to whole output packs (rank q folds elements [q*L, (q+1)*L) of every slab)."""
    return _round_up(max(1, _ceil_div(n_elems, world_size)), pack_elems(dtype))


def virtual_slot_bytes_used(n_elems: int, shards_per_rank: int, world_size: int, dtype: str, algo: str) -> int:
    """Slot bytes one virtual launch writes: S slabs of n fp32 elements rounded up to whole units (one-shot), or
    S slabs of W slices of L elements (two-shot)."""
    per = pack_elems(dtype)
    if algo == "one_shot":
        return shards_per_rank * _round_up(n_elems, per) * F32_BYTES
    if algo == "two_shot":
        return shards_per_rank * world_size * virtual_slices(n_elems, world_size, dtype) * F32_BYTES
    raise ValueError(f"algo must be one_shot or two_shot, got {algo!r}")


def virtual_rows_per_launch(capacity_bytes: int, row_numel: int, shards_per_rank: int, *, world_size: int,
                            dtype: str, grid: int) -> int:
    """Rows of one virtual launch: capacity_bytes // (S * row_numel * 4), the fp32 bytes of one row's S slabs;
    0 when not even one row fits. Either kernel's rounding to whole units stays inside the slot's padding
    (checked here, so a launch never overruns the slot)."""
    if row_numel < 1 or shards_per_rank < 1:
        raise ValueError(f"row_numel and shards_per_rank must be >= 1, got {row_numel} and {shards_per_rank}")
    rows = capacity_bytes // (shards_per_rank * row_numel * F32_BYTES)
    if rows < 1:
        return 0
    n = rows * row_numel
    used = max(virtual_slot_bytes_used(n, shards_per_rank, world_size, dtype, a) for a in ("one_shot", "two_shot"))
    return rows if used <= slot_bytes(capacity_bytes, world_size, grid) else 0


def virtual_variants(*, row_numel: int, shards_per_rank: int, max_rows: int, world_size: int, dtype: str,
                     capacity_bytes: int, grid: int, one_shot_max_bytes: int) -> list[str]:
    """The code paths virtual calls of 1..max_rows rows can take ("one_shot", "two_shot", "chunked"): the rule over
    its breakpoints (reached, by the launch's fp32 input bytes); [] when one row's S slabs do not fit a launch."""
    per = virtual_rows_per_launch(capacity_bytes, row_numel, shards_per_rank, world_size=world_size, dtype=dtype,
                                  grid=grid)
    return reached("virtual", per, max_rows, row_elems=row_numel, dtype=dtype, shards=shards_per_rank,
                   one_store_max=0, one_shot_max_bytes=one_shot_max_bytes)


# --- tree-order virtual-shard all-reduce (csrc/tree_fold.cu) -----------------------------------------------
# Each rank passes S = V/W fp32 slabs per call and folds its own subtree while it reads them, so a launch's slot (or
# one-store area) holds one fp32 row per rank whatever S is. Units are csrc/virtual_fold.cu's (one output pack:
# pack_elems of the output dtype, i.e. 16 or 32 bytes of fp32). TREE_MAX_LOG (a device constant) bounds the local
# subtree: S <= 2^TREE_MAX_LOG (csrc/tree_fold.cu tree_local).
TREE_MAX_LOG = 6
TREE_MAX_SHARDS_PER_RANK = 1 << TREE_MAX_LOG
TREE_ALGOS = ("one_store", "one_shot", "two_shot")


def _power_of_two(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def tree_refusal(virtual_shards: int, world_size: int) -> str | None:
    """Why the tree kernels cannot fold V = virtual_shards shards over W = world_size ranks (None: they can): the
    tree needs V a power of two and W a power of two dividing V, and each rank's subtree of V/W leaves within the
    kernels' local tree (TREE_MAX_SHARDS_PER_RANK)."""
    if not _power_of_two(virtual_shards):
        return f"shard_fold='tree' needs virtual_shards a power of two, got {virtual_shards}"
    if not _power_of_two(world_size) or virtual_shards % world_size:
        return (f"shard_fold='tree' needs W a power of two dividing virtual_shards={virtual_shards}, got W="
                f"{world_size}; shard_fold='order' serves every W dividing V")
    if virtual_shards // world_size > TREE_MAX_SHARDS_PER_RANK:
        return (f"the workspace's tree kernels fold at most {TREE_MAX_SHARDS_PER_RANK} shards per rank locally, "
                f"got V/W={virtual_shards // world_size}")
    return None


def tree_launch_bytes(n_elems: int, dtype: str) -> int:
    """fp32 bytes one rank publishes in a tree launch of n output elements: n rounded up to whole units, 4 bytes
    each. It picks the kernel (one-store up to the tier's max_bytes, one-shot up to one_shot_max_bytes) and is what
    the one-store area and the one-shot slot hold."""
    return _round_up(n_elems, pack_elems(dtype)) * F32_BYTES


def tree_slot_bytes_used(n_elems: int, world_size: int, dtype: str, algo: str) -> int:
    """Slot bytes one tree launch writes: one fp32 row in whole units (one-shot), or W slices of L elements
    (two-shot, virtual_slices)."""
    if algo == "one_shot":
        return tree_launch_bytes(n_elems, dtype)
    if algo == "two_shot":
        return world_size * virtual_slices(n_elems, world_size, dtype) * F32_BYTES
    raise ValueError(f"algo must be one_shot or two_shot, got {algo!r}")


def tree_rows_per_launch(capacity_bytes: int, row_numel: int, *, world_size: int, dtype: str, grid: int) -> int:
    """Rows of one tree launch: capacity_bytes // (row_numel * 4), the fp32 bytes of one published row (S does
    not count: the local subtree is folded before the slot); 0 when not even one row fits. Either kernel's rounding
    to whole units stays inside the slot's padding (checked here)."""
    if row_numel < 1:
        raise ValueError(f"row_numel must be >= 1, got {row_numel}")
    rows = capacity_bytes // (row_numel * F32_BYTES)
    if rows < 1:
        return 0
    n = rows * row_numel
    used = max(tree_slot_bytes_used(n, world_size, dtype, a) for a in ("one_shot", "two_shot"))
    return rows if used <= slot_bytes(capacity_bytes, world_size, grid) else 0


def tree_one_store_rows(row_numel: int, dtype: str, one_store_max: int) -> int:
    """The most rows a one-store tree launch carries: tree_launch_bytes(rows * row_numel) <= one_store_max (0: none)."""
    if row_numel < 1:
        raise ValueError(f"row_numel must be >= 1, got {row_numel}")
    units = (max(one_store_max, 0) // F32_BYTES) // pack_elems(dtype)
    return units * pack_elems(dtype) // row_numel


def tree_algo(n_elems: int, dtype: str, *, one_store_max: int, one_shot_max_bytes: int) -> str:
    """The kernel a tree launch of n output elements takes: launch_kernel's rule for the tree family (one-store up to
    one_store_max published fp32 bytes, then one-shot by the output's bytes)."""
    tiers = (one_store_max,) if one_store_max > 0 else ()
    return launch_kernel("tree", 1, row_elems=n_elems, dtype=dtype, one_store_tiers=tiers,
                         one_shot_max_bytes=one_shot_max_bytes)[0]


def tree_variants(*, row_numel: int, max_rows: int, world_size: int, dtype: str, capacity_bytes: int, grid: int,
                  one_shot_max_bytes: int, one_store_max: int = 0) -> list[str]:
    """The code paths tree calls of 1..max_rows rows can take ("one_store", "one_shot", "two_shot", "chunked"): the
    rule over its breakpoints (reached); [] when one row does not fit a launch."""
    per = tree_rows_per_launch(capacity_bytes, row_numel, world_size=world_size, dtype=dtype, grid=grid)
    return reached("tree", per, max_rows, row_elems=row_numel, dtype=dtype, one_store_max=one_store_max,
                   one_shot_max_bytes=one_shot_max_bytes)


def tree_kernel(algo: str, dtype: str) -> str:
    """The tree kernel's name (csrc/tree_fold.cu) for an output dtype."""
    if algo not in TREE_ALGOS:
        raise ValueError(f"algo must be one of {TREE_ALGOS}, got {algo!r}")
    return f"detcomm_tree_{algo}_{DTYPE_SUFFIX[dtype]}"


# --- fused all-reduce + residual add + RMSNorm (csrc/fused_rmsnorm.cu) ---------------------------------------
FUSED_NORM_ALGOS = ("one_shot", "two_shot", "one_store")  # one_store: csrc/fused_rmsnorm_one_store.cu
_FUSED_NORM_TAG = {"one_shot": "1shot", "two_shot": "2shot", "one_store": "one_store"}


# Device constants of the fused kernels (csrc/fused_norm_row.cuh, csrc/rms_norm_common.cuh): the default load batch
# (DETCOMM_FUSED_BATCH), the lanes of a row (NORM_THREADS) and the elements of a chunk (NORM_CHUNK).
# tests/test_workspace_csrc.py holds fused_norm_register_elems, the host's copy of the header's C, to FnChunk.
FUSED_NORM_BATCH = 2
NORM_LANES = 256
NORM_CHUNK = 8


def fused_norm_register_elems(dtype: str, world_size: int, *, batch: int = FUSED_NORM_BATCH) -> int:
    """C of csrc/fused_norm_row.cuh: the elements of a row one 256-thread half holds in registers, NB * 256 * 8 with
    NB = FnChunk::kBatch, the load batch (chunks per lane): the workspace's unroll budget (8 / W source packs in
    flight per thread, at least 1) in chunks of 1 (16-bit dtypes) or 2 (fp32) packs, at most `batch`."""
    if not 1 <= world_size <= MAX_WORLD:
        raise ValueError(f"world_size must be in 1..{MAX_WORLD}, got {world_size}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    unroll = max(8 // world_size, 1)
    packs_per_chunk = NORM_CHUNK // pack_elems(dtype)
    budget = max(unroll // packs_per_chunk, 1)
    return min(budget, batch) * NORM_LANES * NORM_CHUNK


def fused_norm_register_max(dtype: str, world_size: int, *, batch: int = FUSED_NORM_BATCH, wide: bool = True) -> int:
    """The widest row the fused kernels hold in registers: 2C with the wide kernels, C without (`wide=False`)."""
    return (2 if wide else 1) * fused_norm_register_elems(dtype, world_size, batch=batch)


@functools.cache  # a static fact of a site, asked on every fused call's host path: computed once per key
def fused_norm_layout(hidden: int, dtype: str, world_size: int, *, batch: int = FUSED_NORM_BATCH,
                      wide: bool = True) -> str:
    """How the fused kernels cover rows of `hidden` elements, a function of the site's static facts only
    (csrc/fused_norm_row.cuh): "registers" (H <= C: a row per 256-thread half, r kept in registers), "wide"
    (C < H <= 2C: a row per 512-thread block, each half holding half of every lane's chunks; the wide kernels) or
    "streaming" (wider: a row per half, batch after batch, r stored and read back). `wide=False` never picks the
    wide kernels (the bench's fused_no_wide build). Every layout gives the same bits (docs/spec.md §9.2)."""
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    if hidden <= fused_norm_register_elems(dtype, world_size, batch=batch):
        return "registers"
    return "wide" if hidden <= fused_norm_register_max(dtype, world_size, batch=batch, wide=wide) else "streaming"


def fused_norm_refusal(hidden: int, dtype: str, world_size: int) -> str | None:
    """Why the fused kernels do not serve rows of `hidden` elements at `world_size` (None: they do): rows they would
    stream (fused_norm_layout) take the composition, with the same bits (docs/performance.md has the measurement)."""
    if fused_norm_layout(hidden, dtype, world_size) != "streaming":
        return None
    return (f"rows of {hidden} elements exceed the {fused_norm_register_max(dtype, world_size)} the fused kernels "
            f"hold in registers at W={world_size}; wider rows take the composition")


def fused_norm_kernel(algo: str, dtype: str, weight_dtype: str, *, wide: bool = False, tree: bool = False) -> str:
    """The fused kernel's name for rows of `dtype` and a weight of `weight_dtype` (dtype names); `wide`: the kernel
    of the wide layout (fused_norm_layout), which serves only rows of C < H <= 2C elements; `tree`: the variant
    whose input is a tree-order virtual-shard site's fp32 partials (one_shot and two_shot only)."""
    if tree and algo not in FUSED_NORM_TREE_ALGOS:
        raise ValueError(f"the fused tree kernels are {FUSED_NORM_TREE_ALGOS}, got {algo!r}")
    tag = ("tree_" if tree else "") + _FUSED_NORM_TAG[algo] + ("_wide" if wide else "")
    return f"detcomm_fused_rmsnorm_{tag}_{DTYPE_SUFFIX[dtype]}_w{DTYPE_SUFFIX[weight_dtype]}"


# The fused tree variants (csrc/fused_rmsnorm.cu, TREE): the barrier kernels; their slot rows are fp32 rows.
FUSED_NORM_TREE_ALGOS = ("one_shot", "two_shot")


def fused_norm_tree_rows_per_launch(hidden: int, *, grid: int, slot_bytes: int) -> int:
    """Rows one fused tree launch carries: its slot rows are this rank's fp32 subtree roots, so fp32 rows of
    `hidden` (fused_norm_rows_per_launch of float32)."""
    return fused_norm_rows_per_launch(hidden, "float32", grid=grid, slot_bytes=slot_bytes)


def fused_norm_tree_variants(*, hidden: int, dtype: str, max_rows: int, grid: int, slot_bytes: int,
                             one_shot_max_bytes: int) -> list[str]:
    """The fused tree kernels' code paths calls of 1..max_rows rows can take ("fused_one_shot", "fused_two_shot",
    "fused_chunked"): the rule over its breakpoints (reached, by the rows' bytes in the site's dtype); [] when one
    fp32 row does not fit a launch."""
    per = fused_norm_tree_rows_per_launch(hidden, grid=grid, slot_bytes=slot_bytes)
    return [f"fused_{v}" for v in reached("fused_tree", per, max_rows, row_elems=hidden, dtype=dtype,
                                          one_store_max=0, one_shot_max_bytes=one_shot_max_bytes)]


def fused_norm_rows_per_launch(hidden: int, dtype: str, *, grid: int, slot_bytes: int) -> int:
    """Rows one fused launch carries. Row i belongs to block i mod grid; its P packs take R = ceil(P /
    BLOCK_THREADS) regions of that block, one grid stride apart (positions only that block touches), so a slot
    holds floor(slot packs / (R * stride)) rows per block. 0 when not even one row fits."""
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    regions = _ceil_div(_ceil_div(hidden, pack_elems(dtype)), BLOCK_THREADS)
    return (slot_bytes // PACK_BYTES) // (regions * stride_packs(grid)) * grid


def fused_norm_one_store_rows(hidden: int, dtype: str, one_store_max: int) -> int:
    """Rows one fused one-store launch (csrc/fused_rmsnorm_one_store.cu) carries at most: its bytes stay within
    one_store_max, and its rows in whole packs (each row's last pack zero-filled) fit one area of the one-store
    region (one_store_area_bytes). 0 when the one-store path is off or one row does not fit."""
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    if one_store_max < 0:
        raise ValueError(f"one_store_max must be >= 0, got {one_store_max}")
    packs = _ceil_div(hidden, pack_elems(dtype))
    return min(one_store_max // (hidden * elem_size(dtype)), one_store_area_bytes(one_store_max) // (packs * PACK_BYTES))


def fused_norm_variants(*, hidden: int, dtype: str, max_rows: int, grid: int, slot_bytes: int,
                        one_shot_max_bytes: int, one_store_max: int = 0) -> list[str]:
    """The fused kernel's code paths calls of 1..max_rows rows can take ("fused_one_store", "fused_one_shot",
    "fused_two_shot", "fused_chunked"): the rule over its breakpoints (reached: the one-store kernel for launches of
    up to fused_norm_one_store_rows rows, one-shot up to one_shot_max_bytes, two-shot above); [] when one row does
    not fit a launch."""
    per = fused_norm_rows_per_launch(hidden, dtype, grid=grid, slot_bytes=slot_bytes)
    return [f"fused_{v}" for v in reached("fused", per, max_rows, row_elems=hidden, dtype=dtype,
                                          one_store_max=one_store_max, one_shot_max_bytes=one_shot_max_bytes)]


# --- failure records (written by fail_workspace in csrc/detcomm_common.cuh) ----------------------------------
def describe_call(what: int, call: int, count: int) -> str:
    kind = KIND_CODES.get(what >> 8, f"kind {what >> 8}")
    dtype = DTYPE_CODES.get(what & 0xFF, f"dtype {what & 0xFF}")
    if what >> 8 == KIND_FUSED_NORM_ONE_STORE:  # its count is rows << 32 | hidden (csrc/fused_rmsnorm_one_store.cu)
        return f"call {call}: {kind} {dtype} rows {count >> 32} x hidden {count & 0xFFFFFFFF}"
    return f"call {call}: {kind} {dtype} count {count}"


def decode_record(rec: Sequence[int], labels: dict[int, str] | None = None) -> str | None:
    """A rank's failure record as one line, None when the record is empty. `labels` maps call numbers to what the
    host issued them for (site names)."""
    tag = rec[0]
    if tag == 0:
        return None
    rank, peer, kind, epoch, seen, ms, block = rec[1:8]
    what, call = rec[8], rec[9]
    count = rec[10] | (rec[11] << 32)
    label = (labels or {}).get(call)
    if kind == WAIT_ONE_STORE:  # a one-store wait (csrc/one_store_common.cuh); `epoch` holds the block's launch count
        at = "one-store wait"
    else:
        at = f"{BARRIER_NAMES[kind] if kind < len(BARRIER_NAMES) else kind} barrier"
    where = f"{describe_call(what, call, count)}{f' ({label})' if label else ''}, {at}, block {block}"
    if tag == ERR_TIMEOUT:
        return (f"rank {rank} timed out after {ms} ms waiting for rank {peer} at {where} "
                f"(epoch {epoch}, flag seen {seen})")
    if tag == ERR_ABORTED:
        return f"rank {rank}'s host aborted the workspace while it waited for rank {peer} at {where}"
    if tag == ERR_PEER_FAILED:
        by = "host aborted" if seen & ABORT_BY_HOST else "kernel failed"
        return f"rank {rank} stopped at {where}: rank {seen & 0xFF}'s {by} first"
    if tag == ERR_MISMATCH:
        theirs = describe_call(rec[12], rec[13], rec[14] | (rec[15] << 32))
        return (f"rank {rank} and rank {peer} made different calls: rank {rank} {where}; rank {peer} {theirs} "
                "(every rank must make the same collective calls in the same order)")
    if tag == ERR_OVERLAP:
        return (f"rank {rank} ran two workspace kernels at once ({where}; the other holds call {seen & 0x7FFFFFFF}): "
                "one collective per workspace at a time, graph replays included; order the streams")
    return f"rank {rank}: unknown failure record {tag:#x} at {where}"


# --- barrier epochs and parities (mirror of block_barrier / open_use in csrc/detcomm_common.cuh) ---------------
EPOCH_MOD = 1 << 32
BARRIER_START = 0
BARRIER_MID = 1


def next_epoch(previous: int) -> int:
    """The epoch a barrier use stores and waits for: the owner's counter + 1, modulo 2^32."""
    return (previous + 1) % EPOCH_MOD


def parity(epoch: int) -> int:
    """The copy (of the data slot, the call descriptors and the flags) a use of this epoch works in."""
    return epoch & 1


def arrived(seen: int, expected: int) -> bool:
    """Device rule: a peer has arrived when its flag (in the copy of this use's parity) equals this use's epoch.
    Exact across the wrap because that flag holds either this use's epoch or the previous use of the same copy's,
    expected - 2 (no peer can be a whole use ahead: tests/barrier_sim.py checks it)."""
    return seen == expected


# --- the device constants, as the C macros csrc/ reads ----------------------------------------------------------
def _unsigned(value: int) -> str:
    return f"0x{value:X}u"


_DTYPE_MACROS = {"float32": "DT_F32", "bfloat16": "DT_BF16", "float16": "DT_F16", "bytes": "DT_U8"}
# Every build passes each as -D<name>=<value> (kernels.nvrtc_options); csrc/detcomm_common.cuh requires them all
# and defines none, so a value exists once. Record tags and abort values are unsigned, as the device compares them
# with u32 words.
DEVICE_CONSTANTS: dict[str, str] = {
    "DETCOMM_MAX_W": str(MAX_WORLD),
    "DETCOMM_MAX_BLOCKS": str(MAX_BLOCKS),
    "DETCOMM_BLOCK_THREADS": str(BLOCK_THREADS),
    "DETCOMM_PACK_BYTES": str(PACK_BYTES),
    "DETCOMM_BARRIER_KINDS": str(BARRIER_KINDS),
    "DETCOMM_PARITIES": str(PARITIES),
    "DETCOMM_BUFFER_HEADER_BYTES": str(BUFFER_HEADER_BYTES),
    "DETCOMM_PROBE_BYTES": str(PROBE_BYTES),
    "DETCOMM_DESC_WORDS": str(DESC_WORDS),
    "DETCOMM_ERR_WORDS": str(ERR_WORDS),
    "DETCOMM_CTRL_WORDS": str(CTRL_WORDS),
    "DETCOMM_HOST_ABORT_WORD": str(HOST_ABORT_WORD),
    "DETCOMM_ERR_TIMEOUT": _unsigned(ERR_TIMEOUT),
    "DETCOMM_ERR_ABORTED": _unsigned(ERR_ABORTED),
    "DETCOMM_ERR_PEER_FAILED": _unsigned(ERR_PEER_FAILED),
    "DETCOMM_ERR_MISMATCH": _unsigned(ERR_MISMATCH),
    "DETCOMM_ERR_OVERLAP": _unsigned(ERR_OVERLAP),
    "DETCOMM_ABORT_BY_KERNEL": _unsigned(ABORT_BY_KERNEL),
    "DETCOMM_ABORT_BY_HOST": _unsigned(ABORT_BY_HOST),
    **{f"DETCOMM_KIND_{kind.upper()}": str(code) for code, kind in KIND_CODES.items()},
    "BARRIER_START": str(BARRIER_START),
    "BARRIER_MID": str(BARRIER_MID),
    "DETCOMM_WAIT_ONE_STORE": str(WAIT_ONE_STORE),
    "DETCOMM_ONE_STORE_COUNTER_BYTES": str(ONE_STORE_COUNTER_BYTES),
    **{_DTYPE_MACROS[name]: str(code) for code, name in DTYPE_CODES.items()},
    "NORM_THREADS": str(NORM_LANES),
    "NORM_CHUNK": str(NORM_CHUNK),
    "DETCOMM_FUSED_BATCH": str(FUSED_NORM_BATCH),
    "DETCOMM_TREE_MAX_LOG": str(TREE_MAX_LOG),
}
