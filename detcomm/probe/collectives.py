"""Collective probe: every declared site, an ill-conditioned payload, many batch compositions.

For each site the same payload rows (detcomm.payload: magnitudes 1e-38..1e38, cancellations across ranks,
±0, subnormals) are reduced alone (batch 1, the reference, twice) and then inside batches of many sizes at
random offsets among other rows (detcomm.invariance). A row's output must keep its bits wherever it travels,
including to another receiving rank of a reduce-scatter: its shards are gathered and every row is compared
wherever it landed. The per-site table counts the payload rows (and elements) whose output changed against
the batch-1 reference, the largest change in ulps, and whether every rank held the same bits. A route that claims batch invariance (a canonical-fold route for a
float SUM; the exact key-based routes for MAX and argmax) and changed anything fails the probe (exit 1); the
native route's float sums make no such claim and their changes are reported, not failed (at W >= 3 they are
the expected negative control).

    detcomm-launch --nproc 4 --numerics rl-bitwise -m detcomm.probe collectives
    detcomm-launch --nproc 4 --numerics auto -m detcomm.probe collectives --route native --expect-divergence
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import detcomm
from detcomm import invariance as inv
from detcomm.dtypes import name_of
from detcomm.payload import ill_conditioned
from detcomm.sites import ROUTE_INFO, Route

from ..tables import format_table
from .envelope import ROUTE_CHOICES, probe_numerics
from .table import emit

__all__ = ["SiteSpec", "SiteResult", "SITES", "probe_site", "main"]


@dataclass(frozen=True)
class SiteSpec:
    """A representative call site of a tensor-parallel decoder (what a model would declare)."""

    name: str
    collective: str
    dtype: torch.dtype
    op: str = "sum"

    @property
    def float_sum(self) -> bool:
        return self.collective in ("all_reduce", "reduce_scatter") and self.op == "sum"


SITES: tuple[SiteSpec, ...] = (
    SiteSpec("o_proj", "all_reduce", torch.bfloat16),
    SiteSpec("o_proj.fp32", "all_reduce", torch.float32),
    SiteSpec("down_proj", "all_reduce", torch.bfloat16),
    SiteSpec("down_proj.fp32", "all_reduce", torch.float32),
    SiteSpec("seq_parallel.reduce_scatter", "reduce_scatter", torch.bfloat16),
    SiteSpec("seq_parallel.reduce_scatter.fp32", "reduce_scatter", torch.float32),
    SiteSpec("lm_head.argmax", "argmax", torch.float32, op="max"),
    SiteSpec("router.max", "all_reduce", torch.float32, op="max"),
)


@dataclass
class SiteResult:
    """What the probe saw on one site (identical on every rank after the final agreement step)."""

    site: str
    collective: str
    op: str
    dtype: str
    route: str
    claim: bool
    rows: int
    compositions: int
    rows_changed: int
    elements_changed: int
    max_ulps: float
    rank_disagreements: int
    reference_repeatable: bool

    @property
    def failed(self) -> bool:
        return self.claim and (self.rows_changed > 0 or self.rank_disagreements > 0 or not self.reference_repeatable)

    @property
    def verdict(self) -> str:
        if self.failed:
            return "FAIL"
        if self.rows_changed or self.rank_disagreements:
            return "changed (no bitwise claim)"
        return "ok"


def _payload(spec: SiteSpec, rows: int, width: int, *, seed: int, rank: int, world: int) -> torch.Tensor:
    x = ill_conditioned(rows, (width,), spec.dtype, seed=seed, rank=rank, world_size=world)
    if spec.collective == "argmax":
        # Exact ties across shards (the same maximum on every rank: the lowest global index must win) and
        # rows whose maximum is a signed zero (-0.0 on some ranks, +0.0 on others: equal, lowest index wins).
        x = x.clone()
        tie = torch.arange(rows) % 4 == 1
        x[tie] = torch.where(x[tie] > 1e30, torch.full_like(x[tie], -1.0), x[tie])
        x[tie, (rank * 7) % width] = 1e30
        zero = torch.arange(rows) % 4 == 2
        x[zero] = -x[zero].abs() - 1.0
        x[zero, (rank * 5) % width] = -0.0 if rank % 2 else 0.0
    return x


def _agree(t: torch.Tensor, device: torch.device) -> int:
    """Elements whose bits differ between ranks (0 when all ranks hold the same bits). Bookkeeping goes
    through torch.distributed directly: the probe must not check detcomm with detcomm."""
    b = inv.bits(t).to(torch.int64).reshape(-1).to(device)
    hi, lo = b.clone(), b.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return int((hi != lo).sum())


def probe_site(
    spec: SiteSpec, *, width: int, rows: int, max_rows: int, route: str | None, seed: int, per_size: int,
    device: torch.device,
) -> SiteResult:
    """Declare ``spec`` as a site, run the compositions, and return the agreed result. Collective.

    Payloads live on ``device`` (the communicator's: CUDA under NCCL); comparisons happen on the CPU."""
    rank, world = dist.get_rank(), dist.get_world_size()
    forced = route if spec.float_sum else None
    detcomm.site(spec.name, collective=spec.collective, dtype=spec.dtype, shape=(width,), max_rows=max_rows,
                 op=spec.op, route=forced)
    decision = {e["site"]: e for e in detcomm.routes().as_dicts()}[spec.name]
    chosen = Route(decision["route"])
    claim = ROUTE_INFO[chosen].canonical_sum if spec.float_sum else True

    x = _payload(spec, rows, width, seed=seed, rank=rank, world=world).to(device)
    call: Callable[[torch.Tensor], torch.Tensor]
    if spec.collective == "argmax":
        call = lambda b: detcomm.argmax(b, site=spec.name, vocab_start=rank * width)  # noqa: E731
    elif spec.collective == "reduce_scatter":
        call = lambda b: detcomm.reduce_scatter(b, site=spec.name)  # noqa: E731
    else:
        call = lambda b: detcomm.all_reduce(b, site=spec.name, op=spec.op)  # noqa: E731

    # Whole outputs on every rank: a reduce-scatter's shards are gathered in rank order, so a row is compared
    # with its batch-1 result on whichever rank received it.
    def run(comp: inv.Composition) -> torch.Tensor:
        return inv.gather_whole(call(x[comp.tensor(device)]), collective=spec.collective).cpu()

    # Batch-1 references (twice: the reference itself must repeat); a reduce-scatter's smallest batch is the
    # row in every block, received by every rank.
    ref, tally = inv.batch1_reference(run, rows, collective=spec.collective, world_size=world)
    again, _ = inv.batch1_reference(run, rows, collective=spec.collective, world_size=world)
    repeatable = inv.bits_equal(ref, again)
    disagreements = _agree(ref, device)

    multiple = world if spec.collective == "reduce_scatter" else 1
    comps = inv.shuffled(rows, max_rows=max_rows, multiple=multiple, seed=seed, per_size=per_size)
    for comp in comps:
        out = run(comp)
        if spec.collective != "reduce_scatter":  # gathered reduce-scatter outputs are the same on every rank
            disagreements += _agree(out, device)
        tally.add(out, comp)
    tally = tally.agreed(device=device)
    counts = torch.tensor([disagreements, int(not repeatable)], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return SiteResult(
        site=spec.name, collective=spec.collective, op=spec.op, dtype=name_of(spec.dtype),
        route=chosen.value, claim=claim, rows=rows, compositions=len(comps), rows_changed=tally.rows_changed,
        elements_changed=tally.elements_changed, max_ulps=tally.max_ulps, rank_disagreements=int(counts[0]),
        reference_repeatable=int(counts[1]) == 0,
    )


def format_results(results: Sequence[SiteResult], *, header: str) -> str:
    rows = [
        [r.site, r.collective, r.op, r.dtype, r.route, ("bitwise" if r.op == "sum" else "exact") if r.claim else "none",
         f"{r.rows_changed}/{r.rows}", r.elements_changed, r.max_ulps, r.compositions,
         "yes" if r.rank_disagreements == 0 else f"NO ({r.rank_disagreements})", r.verdict]
        for r in results
    ]
    return format_table(
        ["site", "collective", "op", "dtype", "route", "claim", "rows changed", "elements changed", "max ulps",
         "batches", "ranks agree", "verdict"], rows, title=header)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m detcomm.probe collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--numerics", default=None, help="numerics envelope (default: $DETCOMM_NUMERICS, else rl-bitwise)")
    p.add_argument("--route", default=None, choices=ROUTE_CHOICES,
                   help="force this route on the float SUM sites (native, under numerics auto: the negative control)")
    p.add_argument("--width", type=int, default=96, help="elements per row (default 96)")
    p.add_argument("--rows", type=int, default=32, help="payload rows per site (default 32)")
    p.add_argument("--max-rows", type=int, default=64, help="the sites' max_rows, the largest batch (default 64)")
    p.add_argument("--per-size", type=int, default=2, help="random batches per batch size (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results as JSON")
    p.add_argument("--expect-divergence", action="store_true",
                   help="negative control: exit 0 only if some route without a bitwise claim changed bits "
                        "(and none with a claim did)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run on every rank; rank 0 prints. Exit 1 when a route claiming batch invariance changed anything."""
    ns = build_parser().parse_args(argv)
    if ns.width < 1 or ns.rows < 1 or ns.max_rows < 1 or ns.per_size < 1:
        raise ValueError("--width, --rows, --max-rows and --per-size must be positive")
    comm = detcomm.init(numerics=probe_numerics(ns.numerics, route=ns.route, command="collectives"))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if ns.max_rows < world:
            raise ValueError(f"--max-rows must be at least the world size {world} (reduce-scatter batches)")
        results = [
            probe_site(spec, width=ns.width, rows=ns.rows, max_rows=ns.max_rows, route=ns.route, seed=ns.seed,
                       per_size=ns.per_size, device=comm.device)
            for spec in SITES
        ]
        table = detcomm.routes()
    finally:
        detcomm.shutdown()
    failed = [r.site for r in results if r.failed]
    caught = [r.site for r in results if not r.claim and (r.rows_changed or r.rank_disagreements)]
    if rank == 0:
        header = (
            f"collective probe: W={world} backend={table.backend} numerics={table.numerics} "
            f"route={ns.route or 'auto'} payload=ill-conditioned (1e-38..1e38, cancellations, +-0, subnormals) "
            f"rows={ns.rows} width={ns.width} max_rows={ns.max_rows}"
        )
        lines = ["PASS: no route that claims batch invariance changed a bit" if not failed
                 else f"FAIL: {', '.join(failed)} changed bits on a route that claims batch invariance"]
        if ns.expect_divergence:
            lines.append(f"negative control: {'caught: ' + ', '.join(caught) if caught else 'NOT caught: no route changed a bit'}")
        emit(str(table), format_results(results, header=header), "\n".join(lines))
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"world_size": world, "backend": table.backend, "numerics": table.numerics,
                           "route": ns.route, "passed": not failed,
                           "sites": [asdict(r) | {"verdict": r.verdict} for r in results]}, f, indent=2)
    if ns.expect_divergence:
        return 0 if caught and not failed else 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
