"""The bench's numerical columns: how far a route's bits move when the same rows travel in another batch.

Every rank's rows come from a small pool of ill-conditioned rows (detcomm.payload.ill_conditioned: magnitudes
1e-38..1e38, cancellations, signed zeros, subnormals), the first POOL_ROWS of which are the probe and the rest
filler from "other requests". A batch is a list of pool-row indices, so the same probe rows can sit at any
offset inside a batch of any size, and the canonical fold of any batch is known from the fold of the pool
alone (reference_fold of the W ranks' pools, indexed). Same pools, same seeds, same sizes for every route.

Per measured point (the definitions of detcomm.invariance: changed = any bit, one NaN rule, one ulp distance):
  changed_frac  fraction of the probe's elements whose bits differ, in at least one placement (another
                offset, another batch size; for a reduce-scatter the whole reduced buffer is compared, so a
                row that moves to another receiving rank is compared there), from their bits when the probe
                is reduced alone;
  max_ulps      the largest distance in ulps, over the probe's elements in every placement and alone, from
                the canonical fold (0 exactly when the bits are the canonical fold's; inf where a NaN's bits
                differ).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from detcomm import invariance as inv
from detcomm.numerics.fold import reference_fold
from detcomm.payload import ill_conditioned

__all__ = ["POOL_ROWS", "Placement", "placements", "batch_index", "make_pools", "measure", "measure_gather"]

# Probe rows in the pool (filler rows: as many again). Rows repeat every POOL_ROWS inside a large batch, which
# keeps the payload cheap to build at 8192 x 8192; each element still sees its own ill-conditioned values.
POOL_ROWS = 32


@dataclass(frozen=True)
class Placement:
    """The probe's rows with ``front`` filler rows before them and ``back`` after them in one batch."""

    front: int
    back: int

    def composition(self, rows: int) -> inv.Composition:
        return inv.place(self.front + rows + self.back, self.front, probe_rows=rows, filler_rows=POOL_ROWS)


def placements(collective: str, rows: int, world_size: int) -> list[Placement]:
    """The other batches the probe travels in: shifted by a little, doubled in size, and both (the bench's
    probe is the measured point's whole batch, so its placements stay within about twice its size).

    A ring chunks the buffer by message size, so both an offset and a batch size move an element's
    association order there. Reduce-scatter batches keep their row count a multiple of W; shifting by W rows
    or doubling the batch also changes which rank receives each probe row.
    """
    if collective == "all_reduce":
        return [Placement(1, 0), Placement(0, rows), Placement(rows // 2 + 1, rows // 2 + 2)]
    if collective == "reduce_scatter":
        w = world_size
        return [Placement(w, 0), Placement(0, rows), Placement(rows, w)]
    return []  # all_gather moves data: there is no arithmetic to move


def batch_index(rows: int, placement: Placement = Placement(0, 0)) -> torch.Tensor:
    """Pool-row indices of a batch: filler rows (POOL_ROWS..2*POOL_ROWS-1) around the probe (0..POOL_ROWS-1);
    probe row i is pool row i % POOL_ROWS."""
    index = torch.tensor(placement.composition(rows).index, dtype=torch.long)
    return torch.where(index < rows, index % POOL_ROWS, POOL_ROWS + (index - rows) % POOL_ROWS)


def make_pools(hidden: int, dtype: torch.dtype, *, world_size: int, seed: int, ranks: list[int],
               device: torch.device) -> dict[int, torch.Tensor]:
    """Each listed rank's pool, [2 * POOL_ROWS, hidden] of ``dtype`` on ``device`` (deterministic in seed and rank)."""
    return {r: ill_conditioned(2 * POOL_ROWS, (hidden,), dtype, seed=seed, rank=r, world_size=world_size,
                               device=device) for r in ranks}


def reference_pool(pools: dict[int, torch.Tensor], world_size: int) -> torch.Tensor:
    """The canonical fold of the W ranks' pools, row by row (rows of a batch index into it)."""
    stacked = torch.stack([pools[r] for r in range(world_size)])
    return reference_fold(stacked, stacked.dtype)


def _max_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(inv.ulp_distance(a, b).max()) if a.numel() else 0.0


def measure(full_reduce: Callable[[torch.Tensor], torch.Tensor | None], *, collective: str, rows: int,
            world_size: int, ref_pool: torch.Tensor | None) -> dict[str, float] | None:
    """Run the probe alone and in every placement through ``full_reduce`` (collective: every rank calls it with
    the same indices); return the numerical columns on the rank whose ``full_reduce`` returns the whole reduced
    buffer (rows in input order) and None elsewhere. ``ref_pool`` is needed on that rank only."""
    alone = full_reduce(batch_index(rows))
    moved = [(p, full_reduce(batch_index(rows, p))) for p in placements(collective, rows, world_size)]
    if alone is None:
        return None
    assert ref_pool is not None
    ref = ref_pool.to(alone.device)[batch_index(rows).to(alone.device)]
    changed = inv.Tally(alone)
    worst = _max_ulps(alone, ref)
    for p, out in moved:
        assert out is not None
        changed.add(out, p.composition(rows))
        worst = max(worst, _max_ulps(out[p.front:p.front + rows], ref))
    return {"changed_frac": changed.changed_fraction, "max_ulps": worst}


def measure_gather(gather: Callable[[torch.Tensor], torch.Tensor | None], *, rows_per_rank: int, world_size: int,
                   pools: dict[int, torch.Tensor] | None) -> dict[str, float | None] | None:
    """All-gather moves bits: the largest ulp distance of the gathered rows from the inputs (0 when exact); no
    changed fraction (nothing to reassociate)."""
    idx = batch_index(rows_per_rank)
    out = gather(idx)
    if out is None:
        return None
    assert pools is not None
    want = torch.cat([pools[r].to(out.device)[idx.to(out.device)] for r in range(world_size)])
    return {"changed_frac": None, "max_ulps": _max_ulps(out, want)}
