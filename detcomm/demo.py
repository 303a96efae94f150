"""``detcomm demo``: W local ranks show what batch invariance means and what the native route gets wrong.

Each rank builds the same ill-conditioned rows (detcomm.payload) and reduces them many times: alone (the
batch-1 reference), then inside batches of other sizes at other offsets, surrounded by other rows; a
reduce-scatter's rows also travel to every receiving rank (detcomm.invariance). For every site it counts the
probe rows whose bits differ from the batch-1 reference, wherever they landed, and the largest distance in
ulps. The fold routes must show zero; the native route (the library's ring) shows some at W >= 3. Runs on CPU
with gloo, or on GPUs with NCCL when there is one GPU per rank.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import cast

import torch

from . import invariance as inv
from .dtypes import name_of
from .tables import format_table

_PROBE_ROWS = 16
_FILLER_ROWS = 32


@dataclass(frozen=True)
class SiteReport:
    site: str
    route: str
    rows_probed: int
    rows_changed: int
    max_ulps: float


def _measure(comm, site: str, collective: str, dtype: torch.dtype, hidden: int, rank: int, w: int) -> SiteReport:  # type: ignore[no-untyped-def]
    from .payload import ill_conditioned

    dev = comm.device
    # Pool rows 0..15 are the probe, the rest filler from "other requests".
    pool = ill_conditioned(_PROBE_ROWS + _FILLER_ROWS, (hidden,), dtype, seed=7, rank=rank, world_size=w)

    def run(comp: inv.Composition) -> torch.Tensor:
        x = pool[comp.tensor()].to(dev)
        out = comm.reduce_scatter(x, site=site) if collective == "reduce_scatter" else comm.all_reduce(x, site=site)
        return inv.gather_whole(out, collective=collective).cpu()

    # Batch-1 reference: each probed row reduced on its own (a reduce-scatter: received by rank 0, and
    # compared on every other receiving rank); then every composition, wherever the rows land.
    _, tally = inv.batch1_reference(run, _PROBE_ROWS, collective=collective, world_size=w)
    comps = inv.compositions(_PROBE_ROWS, collective=collective, world_size=w, filler_rows=_FILLER_ROWS)
    tally = inv.measure(run, comps, tally=tally).agreed(device=dev)
    route = comm.routes()
    route_of = {e.site.name: e.decision.route.value for e in route.entries}
    return SiteReport(site, route_of[site], _PROBE_ROWS, tally.rows_changed, tally.max_ulps)


def _rank_main(rank: int, w: int, hidden: int) -> dict[str, object]:
    import detcomm

    out: dict[str, object] = {}
    # 1. The deployment view: rl-bitwise routes every SUM site to a canonical fold.
    comm = detcomm.init(numerics="rl-bitwise")
    for dt in (torch.bfloat16, torch.float32):
        tag = name_of(dt)
        comm.site(f"o_proj.{tag}", collective="all_reduce", dtype=dt, shape=(hidden,), max_rows=2048)
        comm.site(f"down_proj.rs.{tag}", collective="reduce_scatter", dtype=dt, shape=(hidden,), max_rows=2048 * w)
    comm.site("lm_head.argmax", collective="argmax", dtype=torch.bfloat16, shape=(hidden,), max_rows=2048)
    comm.site("tokens.gather", collective="token_all_gather", dtype=torch.int64, shape=(), max_rows=2048)
    out["bitwise_table"] = str(comm.routes())
    out["checks"] = [(c.key.label(), c.passed, c.reason, c.seconds) for c in comm.checks()]
    reports = []
    for dt in (torch.bfloat16, torch.float32):
        tag = name_of(dt)
        reports.append(_measure(comm, f"o_proj.{tag}", "all_reduce", dt, hidden, rank, w))
        reports.append(_measure(comm, f"down_proj.rs.{tag}", "reduce_scatter", dt, hidden, rank, w))
    detcomm.shutdown()
    # 2. The same sites on the native route (numerics=auto): the library's own reduction.
    comm = detcomm.init(numerics="auto")
    for dt in (torch.bfloat16, torch.float32):
        tag = name_of(dt)
        comm.site(f"o_proj.{tag}", collective="all_reduce", dtype=dt, shape=(hidden,), max_rows=2048)
        comm.site(f"down_proj.rs.{tag}", collective="reduce_scatter", dtype=dt, shape=(hidden,), max_rows=2048 * w)
        reports.append(_measure(comm, f"o_proj.{tag}", "all_reduce", dt, hidden, rank, w))
        reports.append(_measure(comm, f"down_proj.rs.{tag}", "reduce_scatter", dt, hidden, rank, w))
    detcomm.shutdown()
    out["reports"] = reports
    out["backend"] = comm.backend_name
    return out


def _format(result: dict[str, object], w: int, hidden: int) -> str:
    lines = [str(result["bitwise_table"]), "", "startup and site self-checks (rl-bitwise):"]
    for label, passed, reason, secs in result["checks"]:  # type: ignore[attr-defined]
        lines.append(f"  {'PASS' if passed else 'FAIL'}  {label:<48} {secs * 1e3:7.1f} ms  {'' if passed else reason}")
    n_comps = len(inv.placements(_PROBE_ROWS))
    lines += ["", f"batch-composition probe: {_PROBE_ROWS} ill-conditioned rows of width {hidden}, reduced alone and "
              f"inside {n_comps} other batches, reduce-scatter rows on every receiving rank (W={w}, {result['backend']})",
              ("rows changed: probe rows whose bits differ from their batch-1 result in some batch; max ulps: the "
               "largest distance (inf: a NaN whose bits moved)")]
    reports = cast("list[SiteReport]", result["reports"])
    rows = [[r.site, r.route, f"{r.rows_changed}/{r.rows_probed}", r.max_ulps] for r in reports]
    table = format_table(["site", "route", "rows changed", "max ulps"], rows, align="llrr")
    lines += ["  " + line for line in table.split("\n")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="detcomm demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks to start (default 4)")
    p.add_argument("--hidden", type=int, default=1024, help="row width (default 1024)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL when there is a GPU per rank, else gloo on CPU")
    args = p.parse_args(argv)
    if args.nproc < 2:
        p.error("--nproc must be at least 2 (3 or more to see the native route move rows)")
    from ._spawn import spawn
    from .envelope import envelope_environment

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else "gloo"
    print(f"detcomm demo: {args.nproc} ranks on {backend} ({'GPU' if backend == 'nccl' else 'CPU'})", flush=True)
    # The ranks run rl-bitwise (and auto): its environment exists before any NCCL communicator does.
    results = spawn(_rank_main, args.nproc, args.hidden, backend=backend, env=envelope_environment("rl-bitwise"))
    print(_format(results[0], args.nproc, args.hidden))
    reports = results[0]["reports"]
    bad = [r for r in reports if r.route != "native" and r.rows_changed]
    native_moved = sum(r.rows_changed for r in reports if r.route == "native")
    if bad:
        print(f"\nFAIL: a fold route changed rows: {[r.site for r in bad]}")
        return 1
    print(f"\nfold routes: 0 rows changed. native route: {native_moved} rows changed"
          + (" (expected: a ring's association order follows the buffer offset and the receiving rank)" if native_moved else
             " (W=2 adds two values, a+b == b+a: use --nproc 3 or more to see it move)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
