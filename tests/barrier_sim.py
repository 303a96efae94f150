"""A step-by-step model of the workspace's barrier protocol (csrc/detcomm_common.cuh "Barriers": no end barrier,
two copies of the slots, flags and descriptors selected by the use's parity), driven through every interleaving a
scheduler picks. Test-only: tests/test_workspace_plan.py runs it against the device's epoch rule
(detcomm.workspace.plan's next_epoch / parity / arrived) and, as its negative control, against one copy.

Two models: simulate_barrier_uses follows ONE block through consecutive uses; simulate_launches follows every block
of a grid through a sequence of launches whose layouts differ (a slot position owned by one block in one launch and
by another block in the next, blocks that own nothing and skip: "Work assignment", skip_use), so it can tell the
counted skip from the old uncounted one."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from detcomm.workspace.plan import BARRIER_MID, BARRIER_NAMES, BARRIER_START, EPOCH_MOD, arrived, next_epoch, parity


class _Shared:
    """The memory the simulated ranks share for one block: per rank header (flags, descriptors, counters) and data
    slot copies, each slot copy cut into W slices (the two-shot layout)."""

    def __init__(self, world: int, copies: int, start_epoch: int, mid_start: int) -> None:
        def last(copy: int, counter: int) -> int:  # the epoch copy `copy` last held when the counter is `counter`
            return counter if copies == 1 or parity(counter) == copy else (counter - 1) % EPOCH_MOD
        self.counters = [[start_epoch, mid_start] for _ in range(world)]
        # flags[owner][kind][copy][src], desc[owner][copy][src], slot[rank][copy][slice] = (use epoch, stage)
        self.flags = [[[[last(c, start) for _ in range(world)] for c in range(copies)]
                       for start in (start_epoch, mid_start)] for _ in range(world)]
        self.desc = [[[last(c, start_epoch) for _ in range(world)] for c in range(copies)] for _ in range(world)]
        self.slot = [[[(last(c, start_epoch), 1) for _ in range(world)] for c in range(copies)] for _ in range(world)]


def _rank_program(r: int, sh: _Shared, world: int, mids: Sequence[bool], copies: int,
                  problems: list[str]) -> Iterator[Callable[[], bool] | None]:
    """One rank's block through consecutive uses, one shared-memory access per step. Yields None after a step, or
    a predicate while it waits at a barrier (the scheduler runs it only once the predicate holds)."""
    def par(e: int) -> int:
        return parity(e) if copies == 2 else 0

    def barrier(kind: int) -> Iterator[Callable[[], bool] | None]:
        e = next_epoch(sh.counters[r][kind])
        q = par(e)
        for t in range(world):  # arrive: one release store into every peer's header
            sh.flags[t][kind][q][r] = e
            yield None
        # What the flag may hold while this rank waits: this use's epoch or the previous use of the same copy's.
        allowed = (e, (e - copies) % EPOCH_MOD)
        for t in range(world):  # wait for every peer's flag; every poll is a read the claim must hold for
            def poll(t: int = t) -> bool:
                seen = sh.flags[r][kind][q][t]
                if seen not in allowed:
                    problems.append(f"rank {r}: {BARRIER_NAMES[kind]} use {e}: rank {t}'s flag shows use {seen}")
                return arrived(seen, e)
            yield poll
        sh.counters[r][kind] = e

    for two_shot in mids:
        e = next_epoch(sh.counters[r][BARRIER_START])
        p = par(e)  # open_use: the parity of the coming START
        for t in range(world):
            sh.desc[t][p][r] = e  # announce_call
            yield None
        for s in range(world):
            sh.slot[r][p][s] = (e, 0)  # copy-in
            yield None
        yield from barrier(BARRIER_START)
        for t in range(world):  # the descriptor comparison
            if sh.desc[r][p][t] != e:
                problems.append(f"rank {r}: use {e}: rank {t}'s descriptor is use {sh.desc[r][p][t]}'s")
        yield None
        reads = [(t, r) for t in range(world)] if two_shot else [(t, s) for t in range(world) for s in range(world)]
        for t, s in reads:  # one-shot: every slice of every slot; two-shot phase 1: slice r of every slot
            if sh.slot[t][p][s] != (e, 0):
                problems.append(f"rank {r}: use {e}: read rank {t}'s slice {s} of use/stage {sh.slot[t][p][s]}")
            yield None
        if two_shot:
            sh.slot[r][p][r] = (e, 1)  # the folded slice, in place
            yield None
            yield from barrier(BARRIER_MID)
            for t in range(world):  # phase 2: every rank's folded slice
                if sh.slot[t][p][t] != (e, 1):
                    problems.append(f"rank {r}: use {e}: gathered rank {t}'s slice of use/stage {sh.slot[t][p][t]}")
                yield None
        # no end barrier: the next use starts at once


def simulate_barrier_uses(start_epoch: int, mids: Sequence[bool], *, world: int, pick: Callable[[list[int]], int],
                          copies: int = 2, mid_start: int = 0) -> list[str]:
    """Drive W ranks' block b through consecutive uses (mids[u]: use u has a MID barrier, as two-shot does), one
    shared-memory access per step, in the order `pick` chooses among the ranks that can step (e.g. always the
    fastest rank first, or at random). Counters start at start_epoch (START) and mid_start (MID); every copy holds
    the previous use of that copy. copies=2 is the device's parity scheme; copies=1 the same protocol with one copy
    of everything (what dropping the end barrier without parity would give).

    Returns what went wrong, [] when nothing did: a read of a later use's slot data or descriptor ("overtaken"), a
    flag showing a later use than the awaited one, or a deadlock (no rank can step, some not done)."""
    if copies not in (1, 2):
        raise ValueError(f"copies must be 1 or 2, got {copies}")
    sh = _Shared(world, copies, start_epoch % EPOCH_MOD, mid_start % EPOCH_MOD)
    problems: list[str] = []
    progs = [_rank_program(r, sh, world, mids, copies, problems) for r in range(world)]
    waiting: list[Callable[[], bool] | None] = [None] * world
    live = set(range(world))
    while live:
        ready = sorted(r for r in live if (w := waiting[r]) is None or w())
        if not ready:
            return list(dict.fromkeys(problems)) + [f"deadlock: ranks {sorted(live)} all wait"]
        r = pick(ready)
        try:
            waiting[r] = next(progs[r])
        except StopIteration:
            live.discard(r)
    return list(dict.fromkeys(problems))  # a wait polls many times: each finding once


# --- every block of the grid, launches of different layouts ---------------------------------------------------------

class Write(NamedTuple):
    """What a slot position holds: the last write's launch (index in the sequence), stage (0: copy-in, 1: the
    two-shot fold) and writing block (named in the findings, so a test can tell WHO overwrote a copy in use)."""

    launch: int
    stage: int
    block: int


@dataclass(frozen=True)
class BlockUse:
    """Block b's part of one barrier launch, the same on every rank (the sizes are). slice_len == 0 is the one-shot /
    all-gather layout: the block copies `packs` (slot positions) into its rank's slot and after START reads `packs`
    of every rank's slot. slice_len == L > 0 is the two-shot / reduce-scatter layout: the slot is W slices of L
    positions and the block owns in-slice offsets `packs` of every slice: it copies in s*L + j for every slice s
    and j in packs, after START reads slice r (r: its own rank) of every rank's slot, and with `mid` (two-shot)
    folds that slice in place (stage 1, its own slot), passes MID and reads slice t of every rank t's slot."""

    packs: tuple[int, ...]
    slice_len: int = 0
    mid: bool = False

    def __post_init__(self) -> None:
        if not self.packs:
            raise ValueError("a participating block owns at least one pack (None: the block skips the launch)")
        if self.mid and not self.slice_len:
            raise ValueError("a MID needs the sliced (two-shot) layout")
        if self.slice_len and not all(0 <= j < self.slice_len for j in self.packs):
            raise ValueError(f"in-slice offsets {self.packs} outside a slice of {self.slice_len}")

    def writes(self, rank: int, world: int) -> tuple[int, ...]:
        """The positions `rank` copies into its own slot (stage 0)."""
        if not self.slice_len:
            return self.packs
        return tuple(s * self.slice_len + j for s in range(world) for j in self.packs)

    def reads(self, rank: int) -> tuple[int, ...]:
        """The positions `rank` reads in every rank's slot after START (stage 0); for a two-shot use also the
        positions it folds into its own slot (stage 1), and the ones of rank t's slot it reads after MID are
        reads(t)."""
        if not self.slice_len:
            return self.packs
        return tuple(rank * self.slice_len + j for j in self.packs)


# One launch: per block, its use, or None where the block owns no pack and skips (skip_use). Blocks past the tuple's
# end skip too. Block 0 owns a pack of every launch (the device's claim needs it: "Barriers").
Launch = tuple[BlockUse | None, ...]


class _Grid:
    """The memory W ranks share, every block: per rank counters[kind][block] (START, MID), per rank header
    flags[kind][copy][block][src] and desc[copy][block][src] (the launch that stored it), per rank slot
    slot[copy][position] (missing: never written)."""

    def __init__(self, world: int, blocks: int, start_epoch: int, mid_start: int) -> None:
        def last(copy: int, counter: int) -> int:  # the epoch copy `copy` last held when the counter is `counter`
            return counter if parity(counter) == copy else (counter - 1) % EPOCH_MOD
        starts = (start_epoch, mid_start)
        self.counters = [[[start] * blocks for start in starts] for _ in range(world)]
        self.flags = [[[[[last(c, start)] * world for _ in range(blocks)] for c in range(2)] for start in starts]
                      for _ in range(world)]
        self.desc: list[list[list[list[int | None]]]] = [
            [[[None] * world for _ in range(blocks)] for _ in range(2)] for _ in range(world)]
        self.slot: list[list[dict[int, Write]]] = [[{}, {}] for _ in range(world)]


def _block_launch(r: int, b: int, n: int, use: BlockUse | None, g: _Grid, world: int, counted_skip: bool,
                  problems: list[str]) -> Iterator[Callable[[], bool] | None]:
    """Rank r's block b through launch n, one shared-memory access per step (yields as _rank_program does)."""
    where = f"rank {r} block {b} launch {n}"
    if use is None:  # skip_use
        if counted_skip:
            e = next_epoch(g.counters[r][BARRIER_START][b])
            for t in range(world):  # no wait: every rank's block b skips this launch, nobody waits for it
                g.flags[t][BARRIER_START][parity(e)][b][r] = e
                yield None
            g.counters[r][BARRIER_START][b] = e
        return  # uncounted (the old scheme): touches nothing, so this block's parity follows its own uses

    def barrier(kind: int) -> Iterator[Callable[[], bool] | None]:
        e = next_epoch(g.counters[r][kind][b])
        q = parity(e)
        for t in range(world):  # arrive
            g.flags[t][kind][q][b][r] = e
            yield None
        allowed = (e, (e - 2) % EPOCH_MOD)  # this use, or the previous use of the same copy: never a later one
        for t in range(world):
            def poll(t: int = t) -> bool:
                seen = g.flags[r][kind][q][b][t]
                if seen not in allowed:
                    problems.append(f"{where}: {BARRIER_NAMES[kind]} use {e}: rank {t}'s flag shows use {seen}")
                return arrived(seen, e)
            yield poll
        g.counters[r][kind][b] = e

    def read(t: int, q: int, p: int, stage: int) -> None:
        w = g.slot[t][p].get(q)
        if w is None or (w.launch, w.stage) != (n, stage):
            got = "no launch" if w is None else f"launch {w.launch} stage {w.stage}, written by its block {w.block}"
            problems.append(f"{where}: read rank {t}'s position {q} (copy {p}, stage {stage} expected) of {got}")

    p = parity(next_epoch(g.counters[r][BARRIER_START][b]))  # open_use: the coming START's parity
    for t in range(world):  # announce_call
        g.desc[t][p][b][r] = n
        yield None
    for q in use.writes(r, world):  # copy-in
        g.slot[r][p][q] = Write(n, 0, b)
        yield None
    yield from barrier(BARRIER_START)
    for t in range(world):  # the descriptor comparison
        if g.desc[r][p][b][t] != n:
            problems.append(f"{where}: rank {t}'s descriptor is launch {g.desc[r][p][b][t]}'s")
        yield None
    for t in range(world):
        for q in use.reads(r):
            read(t, q, p, 0)
            yield None
    if use.mid:
        for q in use.reads(r):  # the folded slice, in place
            g.slot[r][p][q] = Write(n, 1, b)
            yield None
        yield from barrier(BARRIER_MID)
        for t in range(world):  # every rank's folded slice
            for q in use.reads(t):
                read(t, q, p, 1)
                yield None
    # no end barrier: the block leaves; the rank's next launch waits only for its other blocks


def _check_launches(launches: Sequence[Launch], world: int, blocks: int) -> None:
    for n, launch in enumerate(launches):
        if len(launch) > blocks or not launch or launch[0] is None:
            raise ValueError(f"launch {n}: {len(launch)} blocks named for a grid of {blocks}, block 0 must own packs")
        for r in range(world):  # within a launch a position belongs to one block
            owned = [q for use in launch if use is not None for q in use.writes(r, world)]
            if len(owned) != len(set(owned)):
                raise ValueError(f"launch {n}: two blocks write one position of rank {r}'s slot")


def simulate_launches(launches: Sequence[Launch], *, world: int, blocks: int,
                      pick: Callable[[list[tuple[int, int]]], tuple[int, int]], counted_skip: bool = True,
                      start_epoch: int = 0, mid_start: int = 0) -> list[str]:
    """Drive W ranks, each a grid of `blocks` blocks, through `launches` in stream order: a rank's blocks of launch
    n+1 start only once all its blocks of launch n are done; within a launch its blocks interleave freely, and so do
    the ranks. Each step is one shared-memory access of the (rank, block) that `pick` chooses among those that can
    step (min: the lowest rank runs ahead, max: the highest, rng.choice: at random). Every block's START counter
    starts at start_epoch, its MID counter at mid_start; every flag copy holds the previous use of that copy.
    counted_skip=True is the device's skip_use; False the old scheme (a block that owns nothing touches nothing).

    Returns what went wrong, [] when nothing did: a read of a slot position holding another launch's (or stage's)
    data, naming the launch and block that wrote it; a descriptor of another launch; a flag showing neither the
    awaited use nor the previous use of its copy; a deadlock (no block can step, some not done)."""
    _check_launches(launches, world, blocks)
    g = _Grid(world, blocks, start_epoch % EPOCH_MOD, mid_start % EPOCH_MOD)
    problems: list[str] = []
    at = [0] * world  # each rank's current launch

    def start(r: int) -> dict[int, Iterator[Callable[[], bool] | None]]:
        if at[r] == len(launches):
            return {}
        launch = launches[at[r]]
        return {b: _block_launch(r, b, at[r], launch[b] if b < len(launch) else None, g, world, counted_skip, problems)
                for b in range(blocks)}

    running = [start(r) for r in range(world)]  # rank -> block -> its program in the rank's current launch
    waiting: dict[tuple[int, int], Callable[[], bool] | None] = {}
    while any(running):
        ready = [(r, b) for r in range(world) for b in running[r] if (w := waiting.get((r, b))) is None or w()]
        if not ready:
            stuck = sorted((r, b) for r in range(world) for b in running[r])
            return list(dict.fromkeys(problems)) + [f"deadlock: (rank, block) {stuck} all wait"]
        r, b = pick(ready)
        try:
            waiting[(r, b)] = next(running[r][b])
        except StopIteration:
            del running[r][b]
            waiting.pop((r, b), None)
            if not running[r]:  # the launch completed on this rank: the stream starts the next one
                at[r] += 1
                running[r] = start(r)
    return list(dict.fromkeys(problems))
