"""``detcomm demo``: W local ranks show what batch invariance means and what the native route gets wrong.

Each rank builds the same ill-conditioned rows (detcomm.payload) and reduces them many times: alone (the
batch-1 reference), then inside batches of other sizes at other offsets, surrounded by other rows. For every
site it counts the rows whose bits differ from the batch-1 reference and the largest distance in ulps. The
fold routes must show zero; the native route (the library's ring) shows some at W >= 3. Runs on CPU with gloo,
or on GPUs with NCCL when there is one GPU per rank.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import torch

# (batch rows, offset of the 16 probed rows): sizes and offsets that put the rows in different ring chunks.
_COMPOSITIONS = ((16, 0), (17, 1), (24, 3), (40, 11), (64, 0), (64, 37), (100, 50), (128, 101), (257, 200),
                 (512, 333), (1000, 901))
_PROBE_ROWS = 16


@dataclass(frozen=True)
class SiteReport:
    site: str
    route: str
    rows_compared: int
    rows_changed: int
    max_ulps: int


def _measure(comm, site: str, collective: str, dtype: torch.dtype, hidden: int, rank: int, w: int) -> SiteReport:  # type: ignore[no-untyped-def]
    from .payload import ill_conditioned
    from .probe.bits import changed_mask, ulp_distance

    blocks = w if collective == "reduce_scatter" else 1
    dev = comm.device

    def run(x: torch.Tensor) -> torch.Tensor:
        if collective == "reduce_scatter":
            return comm.reduce_scatter(x, site=site)
        return comm.all_reduce(x, site=site)

    base = ill_conditioned(blocks * _PROBE_ROWS, (hidden,), dtype, seed=7, rank=rank, world_size=w)
    # Batch-1 reference: each probed row reduced on its own.
    ref_rows = []
    for i in range(_PROBE_ROWS):
        one = base.view(blocks, _PROBE_ROWS, hidden)[:, i : i + 1].reshape(blocks, hidden).contiguous().to(dev)
        ref_rows.append(run(one).cpu())
    ref = torch.cat(ref_rows, dim=0)
    changed = 0
    max_ulps = 0
    compared = 0
    for k, (total, off) in enumerate(_COMPOSITIONS):
        batch = ill_conditioned(blocks * total, (hidden,), dtype, seed=100 + k, rank=rank, world_size=w).view(blocks, total, hidden)
        batch[:, off : off + _PROBE_ROWS] = base.view(blocks, _PROBE_ROWS, hidden)
        got = run(batch.reshape(blocks * total, hidden).to(dev)).cpu()[off : off + _PROBE_ROWS]
        changed += int(changed_mask(got, ref).any(dim=1).sum())
        dist = ulp_distance(got, ref)
        finite = dist[torch.isfinite(dist)]
        max_ulps = max(max_ulps, int(finite.max()) if finite.numel() else 0)
        compared += _PROBE_ROWS
    route = comm.routes()
    route_of = {e.site.name: e.decision.route.value for e in route.entries}
    return SiteReport(site, route_of[site], compared, changed, max_ulps)


def _rank_main(rank: int, w: int, hidden: int) -> dict[str, object]:
    import detcomm

    out: dict[str, object] = {}
    # 1. The deployment view: rl-bitwise routes every SUM site to a canonical fold.
    comm = detcomm.init(numerics="rl-bitwise")
    for dt in (torch.bfloat16, torch.float32):
        tag = str(dt).replace("torch.", "")
        comm.site(f"o_proj.{tag}", collective="all_reduce", dtype=dt, shape=(hidden,), max_rows=2048)
        comm.site(f"down_proj.rs.{tag}", collective="reduce_scatter", dtype=dt, shape=(hidden,), max_rows=2048 * w)
    comm.site("lm_head.argmax", collective="argmax", dtype=torch.bfloat16, shape=(hidden,), max_rows=2048)
    comm.site("tokens.gather", collective="token_all_gather", dtype=torch.int64, shape=(), max_rows=2048)
    out["bitwise_table"] = str(comm.routes())
    out["checks"] = [(c.key.label(), c.passed, c.reason, c.seconds) for c in comm.checks()]
    reports = []
    for dt in (torch.bfloat16, torch.float32):
        tag = str(dt).replace("torch.", "")
        reports.append(_measure(comm, f"o_proj.{tag}", "all_reduce", dt, hidden, rank, w))
        reports.append(_measure(comm, f"down_proj.rs.{tag}", "reduce_scatter", dt, hidden, rank, w))
    detcomm.shutdown()
    # 2. The same sites on the native route (numerics=auto): the library's own reduction.
    comm = detcomm.init(numerics="auto")
    for dt in (torch.bfloat16, torch.float32):
        tag = str(dt).replace("torch.", "")
        comm.site(f"o_proj.{tag}", collective="all_reduce", dtype=dt, shape=(hidden,), max_rows=2048)
        comm.site(f"down_proj.rs.{tag}", collective="reduce_scatter", dtype=dt, shape=(hidden,), max_rows=2048 * w)
        reports.append(_measure(comm, f"o_proj.{tag}", "all_reduce", dt, hidden, rank, w))
        reports.append(_measure(comm, f"down_proj.rs.{tag}", "reduce_scatter", dt, hidden, rank, w))
    detcomm.shutdown()
    out["reports"] = reports
    out["backend"] = comm.backend_name
    return out


def _format(result: dict[str, Any], w: int, hidden: int) -> str:
    lines = [str(result["bitwise_table"]), "", "startup and site self-checks (rl-bitwise):"]
    for label, passed, reason, secs in result["checks"]:
        lines.append(f"  {'PASS' if passed else 'FAIL'}  {label:<48} {secs * 1e3:7.1f} ms  {'' if passed else reason}")
    lines += ["", f"batch-composition probe: {_PROBE_ROWS} ill-conditioned rows of width {hidden}, reduced alone and "
              f"inside {len(_COMPOSITIONS)} other batches (W={w}, {result['backend']})",
              f"  {'site':<24} {'route':<12} {'rows changed':>14} {'max ulps':>9}"]
    for r in result["reports"]:
        lines.append(f"  {r.site:<24} {r.route:<12} {f'{r.rows_changed}/{r.rows_compared}':>14} {r.max_ulps:>9}")
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
          + (" (expected: a ring's association order follows the buffer offset)" if native_moved else
             " (W=2 adds two values, a+b == b+a: use --nproc 3 or more to see it move)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
