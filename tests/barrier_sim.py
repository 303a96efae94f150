"""A step-by-step model of the workspace's barrier protocol (csrc/detcomm_common.cuh "Barriers": no end barrier,
two copies of the slots, flags and descriptors selected by the use's parity), driven through every interleaving a
scheduler picks. Test-only: tests/test_workspace_plan.py runs it against the device's epoch rule
(detcomm.workspace.plan's next_epoch / parity / arrived) and, as its negative control, against one copy."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

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
