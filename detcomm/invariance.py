"""Batch invariance, measured one way: by the self-checks, the demo, both probes and the bench.

A route is batch-invariant when a row's output bits depend on that row's inputs on the W ranks and nothing
else: not on the batch size, not on the row's offset in the batch, not on which rank receives it.

Compositions. The rows under watch (the probe: rows 0..n-1 of a pool) are put into batches of other sizes at
other offsets among filler rows (pool rows n and up). A ``Composition`` is one batch written as pool-row
indices: batch position j holds pool row ``index[j]``, and output position j holds that row's result. For a
reduce-scatter the batch is the whole input (W equal blocks; rank r receives block r) and the output is read
in the whole reduced buffer (every rank's shard gathered in rank order, ``gather_whole``): a composition
therefore also chooses WHICH RANK RECEIVES each probe row, and ``compositions`` moves the probe over every
receiving rank, and across a block boundary. A reduce-scatter's batch-1 reference (``batch1``) is the row
itself in every block: what rank 0 receives is the reference, and what ranks 1..W-1 receive is compared with it.

Changed. An element is changed when any bit differs from its reference: -0.0 against +0.0 is a change, and
so are two NaNs with different bits. A row is changed when any of its elements is. A ``Tally`` counts distinct
probe rows ("rows changed") and distinct probe elements ("elements changed") changed in at least one
composition, and the largest distance in ulps seen.

Ulps. ``ulp_distance(a, b)`` counts the steps from a to b in the value order of all non-NaN bit patterns of
the dtype, in which -0.0 is one step below +0.0: adjacent floats are 1 apart, -0.0 and +0.0 are 1 apart.
NaN rule: a pair with a NaN on either side is 0 when its bits are identical and +inf otherwise (a NaN
against a number, or two NaNs of different bits: detcomm writes one canonical NaN, so a NaN whose bits moved
has changed, and no finite distance means anything there). Hence distance 0 exactly when the bits are
identical: "max ulps 0" and "0 elements changed" always say the same thing. Integers: |a - b|.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .dtypes import bits_view

__all__ = ["bits", "bits_equal", "changed_mask", "rows_changed", "ulp_distance", "Composition", "placements",
           "place", "compositions", "shuffled", "batch1", "gather_whole", "Tally", "measure", "batch1_reference"]


# ---------------------------------------------------------------------------------------------------- bits


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``x`` as the same-width integer dtype (integers are returned as they are)."""
    view = bits_view(x.dtype)
    return x if view == x.dtype else x.contiguous().view(view)


def changed_mask(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do ``a`` and ``b`` differ in any bit? ValueError unless shapes and dtypes match."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    return bits(a) != bits(b)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of bit patterns (so -0.0 != +0.0 and NaN payloads count); False for another shape or dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(bits(a), bits(b))


def rows_changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """Rows (first dimension) of ``a`` and ``b`` that differ in any bit; elements for 1-D tensors."""
    ne = changed_mask(a, b)
    if ne.dim() <= 1:
        return int(ne.sum())
    return int(ne.reshape(ne.shape[0], -1).any(dim=1).sum())


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Float bits as int64 in value order, one step per bit pattern: -0.0 -> -1, +0.0 -> 0."""
    i = bits(x).to(torch.int64)
    width = torch.iinfo(bits_view(x.dtype)).bits
    magnitude = i & ((1 << (width - 1)) - 1)
    return torch.where(i < 0, -magnitude - 1, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, the distance in ulps (float64) under the module's rule: 0 exactly for identical bits,
    -0.0 to +0.0 is 1, +inf for any pair with a NaN whose bits differ. Integers: |a - b|."""
    changed = changed_mask(a, b)
    if not a.dtype.is_floating_point:
        return (a.to(torch.float64) - b.to(torch.float64)).abs()
    d = (_ordered(a) - _ordered(b)).abs().to(torch.float64)
    nan = torch.isnan(a) | torch.isnan(b)
    return torch.where(nan, torch.where(changed, float("inf"), 0.0), d)


# -------------------------------------------------------------------------------------------- compositions


@dataclass(frozen=True)
class Composition:
    """One batch as pool-row indices; pool rows below ``probe_rows`` are the probe, the rest filler."""

    index: tuple[int, ...]
    probe_rows: int

    @property
    def rows(self) -> int:
        return len(self.index)

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.index, dtype=torch.long, device=device)

    def receivers(self, world_size: int) -> list[int]:
        """Reduce-scatter: the rank that receives each batch position (rank r receives block r)."""
        if self.rows % world_size:
            raise ValueError(f"a reduce-scatter batch of {self.rows} rows does not split over {world_size} ranks")
        k = self.rows // world_size
        return [j // k for j in range(self.rows)]


def placements(probe_rows: int) -> tuple[tuple[int, int], ...]:
    """(batch rows, offset of the probe) pairs, smallest batch first: one more row, a few more, twice, four
    times, up to 64 times the probe, with the probe at the start, at unaligned offsets and at the end, so that
    a ring or a tree chunking the buffer by its size gives some probe element another association order."""
    n = probe_rows
    if n < 1:
        raise ValueError(f"probe_rows must be at least 1, got {n}")
    return ((n, 0), (n + 1, 1), (n + 7, 4), (2 * n + 13, n + 9), (4 * n, 3 * n), (4 * n + 5, n + 2),
            (8 * n + 1, 5 * n - 1), (16 * n + 3, 13 * n), (64 * n - 1, 63 * n - 1))


def place(rows: int, offset: int, *, probe_rows: int, filler_rows: int) -> Composition:
    """The probe's rows in order at ``offset`` of a ``rows``-row batch; filler rows cycle around it."""
    if offset < 0 or offset + probe_rows > rows:
        raise ValueError(f"a {probe_rows}-row probe at offset {offset} does not fit a {rows}-row batch")
    if rows > probe_rows and filler_rows < 1:
        raise ValueError(f"a {rows}-row batch around a {probe_rows}-row probe needs filler rows")
    filler = (probe_rows + (k % filler_rows) for k in range(rows - probe_rows))
    index = [next(filler) for _ in range(offset)] + list(range(probe_rows))
    index += list(filler)
    return Composition(tuple(index), probe_rows)


def compositions(probe_rows: int, *, collective: str, world_size: int, filler_rows: int,
                 count: int | None = None) -> tuple[Composition, ...]:
    """The standard batches for a probe of ``probe_rows`` rows (the first ``count`` of ``placements``).

    All-reduce (and every collective whose output rows are its input rows): each placement as it is.
    Reduce-scatter: placement c = (k, off) becomes a W*k-row input with the probe in block c % W at offset
    off (so it is received by rank c % W), and, every other round of W, straddling the boundary into the next
    block (so its rows are split over two receiving ranks)."""
    chosen = placements(probe_rows)[:count]
    if collective != "reduce_scatter":
        return tuple(place(r, off, probe_rows=probe_rows, filler_rows=filler_rows) for r, off in chosen)
    w, n, out = world_size, probe_rows, []
    for c, (k, off) in enumerate(chosen):
        block = c % w
        if (c // w) % 2 == 1 and block < w - 1 and n >= 2:
            start = block * k + k - n // 2
        else:
            start = block * k + off
        out.append(place(w * k, start, probe_rows=n, filler_rows=filler_rows))
    return tuple(out)


def shuffled(probe_rows: int, *, max_rows: int, multiple: int, seed: int, per_size: int) -> list[Composition]:
    """Batches of many sizes (each a multiple of ``multiple``, up to ``max_rows``) drawn from the probe alone:
    a random subset in random order, or random rows with repeats when the batch outgrows the probe. Every
    row lands at many offsets (and, for a reduce-scatter, on many receiving ranks). Same on every rank."""
    g = torch.Generator().manual_seed(seed ^ 0xC0B)
    sizes = sorted({s for s in (1, 2, 3, 4, 5, 7, 8, 11, 13, 16, 17, 23, 24, 31, 32, 33, 47, 48, 63, 64, 96, 127, 128)
                    if s <= max_rows} | {max_rows})
    sizes = sorted({max(multiple, (s // multiple) * multiple) for s in sizes})
    out = []
    for size in sizes:
        for _ in range(per_size):
            if size <= probe_rows:
                idx = torch.randperm(probe_rows, generator=g)[:size]
            else:
                idx = torch.randint(0, probe_rows, (size,), generator=g)
            out.append(Composition(tuple(idx.tolist()), probe_rows))
    return out


def batch1(probe_rows: int, *, collective: str, world_size: int) -> list[Composition]:
    """Each probe row alone: one row, or for a reduce-scatter the row in each of the W blocks."""
    copies = world_size if collective == "reduce_scatter" else 1
    return [Composition((i,) * copies, probe_rows) for i in range(probe_rows)]


def gather_whole(out: torch.Tensor, *, collective: str, group: dist.ProcessGroup | None = None,
                 all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """A reduce-scatter's whole reduced buffer: every rank's shard in rank order (``all_gather`` if given,
    else torch.distributed on ``group``: the measurement never trusts the route under test). Other
    collectives' outputs are returned as they are. Collective for a reduce-scatter."""
    if collective != "reduce_scatter":
        return out
    if all_gather is not None:
        return all_gather(out.contiguous())
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts)


# -------------------------------------------------------------------------------------------------- tally


@dataclass
class Tally:
    """What the probe rows did against ``reference`` ([probe_rows, *row shape]) over the compositions added."""

    reference: torch.Tensor
    changed: torch.Tensor = field(init=False)
    placements: int = 0
    max_ulps: float = 0.0

    def __post_init__(self) -> None:
        self.changed = torch.zeros(self.reference.shape, dtype=torch.bool, device=self.reference.device)

    @property
    def probe_rows(self) -> int:
        return int(self.reference.shape[0])

    @property
    def rows_changed(self) -> int:
        return int(self.changed.reshape(self.probe_rows, -1).any(dim=1).sum())

    @property
    def elements_changed(self) -> int:
        return int(self.changed.sum())

    @property
    def changed_fraction(self) -> float:
        return self.elements_changed / self.changed.numel() if self.changed.numel() else 0.0

    def add(self, out: torch.Tensor, comp: Composition) -> None:
        """Compare the whole output ``out`` of batch ``comp`` (position j: pool row comp.index[j])."""
        pos = [j for j, i in enumerate(comp.index) if i < self.probe_rows]
        if not pos:
            return
        src = torch.tensor([comp.index[j] for j in pos], dtype=torch.long, device=self.reference.device)
        got = out[torch.tensor(pos, dtype=torch.long, device=out.device)].to(self.reference.device)
        want = self.reference[src]
        mask = changed_mask(got, want)
        if len(set(src.tolist())) == len(pos):
            self.changed[src] |= mask
        else:  # a row placed twice in one batch: an indexed |= would keep only one of the two results
            for k in range(len(pos)):
                self.changed[src[k]] |= mask[k]
        self.placements += len(pos)
        if bool(mask.any()):
            self.max_ulps = max(self.max_ulps, float(ulp_distance(got, want).max()))

    def agreed(self, *, device: torch.device, group: dist.ProcessGroup | None = None) -> Tally:
        """The union over ranks (changed anywhere, the largest distance, placements summed), via
        torch.distributed directly. Collective."""
        flags = self.changed.reshape(-1).to(torch.int32).to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        nums = torch.tensor([self.max_ulps], dtype=torch.float64, device=device)
        dist.all_reduce(nums, op=dist.ReduceOp.MAX, group=group)
        count = torch.tensor([self.placements], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
        out = Tally(self.reference)
        out.changed = flags.to(self.changed.device).bool().view(self.changed.shape)
        out.max_ulps, out.placements = float(nums[0]), int(count[0])
        return out


def measure(run: Callable[[Composition], torch.Tensor], comps: Iterable[Composition], *,
            tally: Tally) -> Tally:
    """Run every composition through ``run`` (the collective on that batch, returning the whole output:
    ``gather_whole`` for a reduce-scatter) and add the probe rows to ``tally``; returns it."""
    for comp in comps:
        tally.add(run(comp), comp)
    return tally


def batch1_reference(run: Callable[[Composition], torch.Tensor], probe_rows: int, *, collective: str,
                     world_size: int) -> tuple[torch.Tensor, Tally]:
    """Each probe row reduced alone (``batch1``): the reference rows, and the tally of the copies that other
    ranks received against them (a reduce-scatter whose result depends on the receiving rank shows here)."""
    comps = batch1(probe_rows, collective=collective, world_size=world_size)
    outs = [run(c) for c in comps]
    reference = torch.stack([o[0] for o in outs])
    tally = Tally(reference)
    for c, o in zip(comps, outs):
        tally.add(o, c)
    return reference, tally
