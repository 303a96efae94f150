"""``detcomm demo``: W local ranks show what batch invariance means and what the native route gets wrong.

Each rank builds the same ill-conditioned rows (detcomm.payload) and reduces them many times: alone (the
batch-1 reference), then inside batches of other sizes at other offsets, surrounded by other rows; a
reduce-scatter's rows also travel to every receiving rank (detcomm.invariance). For every site it counts the
probe rows whose bits differ from the batch-1 reference, wherever they landed, and the largest distance in
ulps. The fold routes must show zero; the native route (the library's ring) shows some at W >= 3. Runs on CPU
with gloo, or on GPUs with NCCL when there is one GPU per rank.

The work runs as one job per step (start, init, each site under each envelope) on LocalCluster ranks that keep
their communicator between steps: a progress line per step goes to stderr, and every step must finish within
--timeout (also the ranks' process-group timeout), else the demo stops with an error naming --timeout.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, cast

import torch

from . import invariance as inv
from .deadline import DEFAULT_TIMEOUT_S
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


# ---- the steps, each one job on every rank (the communicator lives in the rank between jobs) ----------
def _site_names() -> list[tuple[str, str, torch.dtype]]:
    out = []
    for dt in (torch.bfloat16, torch.float32):
        tag = str(dt).replace("torch.", "")
        out += [(f"o_proj.{tag}", "all_reduce", dt), (f"down_proj.rs.{tag}", "reduce_scatter", dt)]
    return out


def _init_job(rank: int, w: int, numerics: str, hidden: int) -> dict[str, object]:
    import detcomm

    detcomm.shutdown()  # the previous step's communicator, if any
    comm = detcomm.init(numerics=numerics)
    for name, coll, dt in _site_names():
        rows = 2048 * (w if coll == "reduce_scatter" else 1)
        comm.site(name, collective=coll, dtype=dt, shape=(hidden,), max_rows=rows)
    if numerics == "rl-bitwise":
        # The deployment view: rl-bitwise routes every SUM site to a canonical fold; argmax and gathers too.
        comm.site("lm_head.argmax", collective="argmax", dtype=torch.bfloat16, shape=(hidden,), max_rows=2048)
        comm.site("tokens.gather", collective="token_all_gather", dtype=torch.int64, shape=(), max_rows=2048)
    return {"table": str(comm.routes()), "backend": comm.backend_name,
            "checks": [(c.key.label(), c.passed, c.reason, c.seconds) for c in comm.checks()]}


def _measure_job(rank: int, w: int, site: str, collective: str, dtype: torch.dtype, hidden: int) -> SiteReport:
    import detcomm

    return _measure(detcomm.get_communicator(), site, collective, dtype, hidden, rank, w)


def _shutdown_job(rank: int, w: int) -> None:
    import detcomm

    detcomm.shutdown()


def _format(result: dict[str, Any], w: int, hidden: int) -> str:
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


def _run_steps(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    from ._spawn import LocalCluster
    from .envelope import envelope_environment

    sites = _site_names()
    total = 2 + 2 * (1 + len(sites))
    done = [0]
    t_start = time.monotonic()

    def step(label: str, fn, *fargs, **fkw):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        print(f"detcomm demo: [{done[0] + 1}/{total}] {label} ...", file=sys.stderr, flush=True)
        out = fn(*fargs, **fkw)
        done[0] += 1
        print(f"detcomm demo: [{done[0]}/{total}] {label}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        return out

    # The ranks run rl-bitwise (and auto): its environment exists before any NCCL communicator does. The process
    # group's own timeout is the same deadline, so a slow peer on a loaded machine is not an error before it.
    cluster = step(f"start {args.nproc} ranks ({backend})", LocalCluster, args.nproc, backend=backend,
                   env=envelope_environment("rl-bitwise"), pg_timeout_s=args.timeout, start_timeout_s=args.timeout)
    result: dict[str, Any] = {"reports": []}
    with cluster:
        def job(fn, *jargs):  # type: ignore[no-untyped-def]
            return cluster.run(fn, *jargs, timeout_s=args.timeout)[0]

        for numerics in ("rl-bitwise", "auto"):
            what = "startup self-checks, sites" if numerics == "rl-bitwise" else "sites on the native route"
            info = step(f"init numerics={numerics} ({what})", job, _init_job, numerics, args.hidden)
            if numerics == "rl-bitwise":
                result.update(bitwise_table=info["table"], checks=info["checks"], backend=info["backend"])
            for name, coll, dt in sites:
                r = step(f"{name} under {numerics}: {_PROBE_ROWS} rows alone and in {len(inv.placements(_PROBE_ROWS))} batches",
                         job, _measure_job, name, coll, dt, args.hidden)
                result["reports"].append(r)
        step("shut down", job, _shutdown_job)
    result["seconds"] = time.monotonic() - t_start
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="detcomm demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks to start (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="row width (default 256)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="the torch.distributed backend: auto (default) is NCCL when there is a GPU per rank, else "
                   "gloo on CPU")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds each step may take on every rank (default {DEFAULT_TIMEOUT_S:g}); also the ranks' "
                   "process-group timeout. Raise it on a slow or heavily loaded machine")
    args = p.parse_args(argv)
    if args.nproc < 2:
        p.error("--nproc must be at least 2 (3 or more to see the native route move rows)")
    if not args.timeout > 0:
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    from ._spawn import RankFailed

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else "gloo"
    print(f"detcomm demo: {args.nproc} ranks on {backend} ({'GPU' if backend == 'nccl' else 'CPU'}); progress on "
          "stderr", flush=True)
    try:
        result = _run_steps(args, backend)
    except RankFailed as e:
        if e.late:
            print(f"detcomm demo: error: rank(s) {', '.join(map(str, e.late))} gave no result within --timeout "
                  f"{args.timeout:g} s; on a slow or loaded machine raise it, e.g. detcomm demo --timeout "
                  f"{max(4 * args.timeout, 600):g}", file=sys.stderr)
        else:
            print(f"detcomm demo: error: {e}", file=sys.stderr)
        return 1
    print(_format(result, args.nproc, args.hidden))
    reports = result["reports"]
    bad = [r for r in reports if r.route != "native" and r.rows_changed]
    native_moved = sum(r.rows_changed for r in reports if r.route == "native")
    if bad:
        print(f"\nFAIL: a fold route changed rows: {[r.site for r in bad]}")
        return 1
    print(f"\nfold routes: 0 rows changed. native route: {native_moved} rows changed"
          + (" (expected: a ring's association order follows the buffer offset and the receiving rank)" if native_moved else
             " (W=2 adds two values, a+b == b+a: use --nproc 3 or more to see it move)"))
    print(f"({result['seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
