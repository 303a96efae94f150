"""``detcomm-bench``: every route's latency and bandwidth beside its numerical divergence.

    detcomm-bench --quick --out results/bench          # CPU smoke run: gloo, W=4, a handful of small sizes
    detcomm-bench --out results/bench                  # rows 1..8192 x hidden 4096/7168/8192, bf16 and fp32
    detcomm-bench -b 8 -e 128M -f 2 --out results/bench  # nccl-tests style: message sizes 8 B .. 128 MiB, x2
    python -m detcomm.bench ...                        # the same without the console script
    detcomm-bench tp-layouts --quick                   # TP layouts' collective cost (detcomm/bench/tp_layouts.py)
    detcomm-bench rs-ag --nproc 4 --mib 16             # rs_ag_fold vs gather_fold, CPU gloo (detcomm/bench/rs_ag.py)

Prints a progress bar (stderr) and the markdown tables (stdout); writes results.json, results.csv, results.md
and latency_vs_size.png, divergence_vs_size.png, ratio_vs_size.png under --out. Needs matplotlib and tqdm.
The multicast-off variables of docs/spec.md §8 are set for this process and every rank it starts, unless
--allow-multicast (the user's opt-in; the bench still never creates a multicast object).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from ..dtypes import size_of

__all__ = ["main"]

FULL_ROWS = tuple(1 << i for i in range(14))  # 1 .. 8192
FULL_HIDDEN = (4096, 7168, 8192)
QUICK_ROWS = (1, 4, 32)
QUICK_HIDDEN = (4096,)


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _nbytes(text: str) -> int:
    """A message size as nccl-tests writes it: 8, 64K, 128M, 1G (powers of 1024; a trailing B is allowed)."""
    t = text.strip().upper().removesuffix("B")
    if t[-1:] in "KMG" and t[:-1].isdigit():
        return int(t[:-1]) * _UNITS[t[-1]]
    if t.isdigit() and int(t) > 0:
        return int(t)
    raise argparse.ArgumentTypeError(f"expected a size in bytes like 8, 64K, 128M or 1G, got {text!r}")


def byte_sweep(minbytes: int, maxbytes: int, factor: int, *, dtypes: Sequence[str], hidden: int,
               group: int) -> list[tuple[str, int, int]]:
    """nccl-tests' sizes ``minbytes, minbytes*factor, ... <= maxbytes`` as (dtype, hidden, rows) for each dtype.

    A message of at least one row is whole rows of ``hidden`` elements; a shorter one is ``group`` rows (the
    largest W, so reduce-scatter and all-gather can split it) of fewer elements, else one row. Sizes that are not
    a whole number of elements, or above one row but not a whole number of rows, are skipped.
    """
    if minbytes > maxbytes:
        raise ValueError(f"-b {minbytes} is larger than -e {maxbytes}")
    if factor < 2:
        raise ValueError(f"-f must be >= 2, got {factor}")
    sizes = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        size *= factor
    out = []
    for dtype in dtypes:
        for size in sizes:
            n, rest = divmod(size, size_of(dtype))
            if rest or n == 0:
                continue
            if n >= hidden:
                if n % hidden == 0:
                    out.append((dtype, hidden, n // hidden))
            elif n % group == 0:
                out.append((dtype, n // group, group))
            else:
                out.append((dtype, n, 1))
    if not out:
        raise ValueError(f"no size in -b {minbytes} .. -e {maxbytes} is a whole number of elements and rows")
    return out


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="detcomm-bench", description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: CPU gloo, W=4, rows {','.join(map(str, QUICK_ROWS))} x hidden 4096, bf16+fp32")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default ./bench-results)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: gloo processes; cuda: NCCL processes (one GPU each) and/or W streams of one GPU")
    p.add_argument("--worlds", type=_ints, help="group sizes of the process harnesses (default: 4 on CPU, "
                   "the GPU count on CUDA when >= 2)")
    p.add_argument("--stream-worlds", type=_ints, help="CUDA only: W ranks as W streams of GPU 0 (workspace "
                   "routes) for these W (default 4,8 on CUDA)")
    p.add_argument("--rows", type=_ints, help="row counts (default 1,2,4,...,8192)")
    p.add_argument("-b", "--minbytes", type=_nbytes, help="nccl-tests style sweep: smallest message size (8, 64K, "
                   "128M, 1G); sizes go up by -f to -e, in whole rows of --hidden (one value, default 4096); "
                   "replaces --rows")
    p.add_argument("-e", "--maxbytes", type=_nbytes, help="nccl-tests style sweep: largest message size")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="nccl-tests style sweep: size factor (default 2)")
    p.add_argument("--hidden", type=_ints, help="hidden sizes (default 4096,7168,8192)")
    p.add_argument("--fp32-hidden", type=_ints, help="hidden sizes for fp32 (default: as --hidden)")
    p.add_argument("--dtypes", type=_names, default=("bfloat16", "float32"), help="default bfloat16,float32")
    p.add_argument("--collectives", type=_names, default=("all_reduce", "reduce_scatter", "all_gather"))
    p.add_argument("--iters", type=int, default=50, help="timed calls per point (>= 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    p.add_argument("--graph-calls", type=int, default=4, help="calls captured per CUDA graph (one replay = one sample)")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replay timing")
    p.add_argument("--no-numerics", action="store_true", help="skip the divergence columns")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--budget-s", type=float, help="stop measuring after this many seconds (the rest is written "
                   "as 'skipped: time budget')")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--from-json", type=Path, metavar="RESULTS_JSON",
                   help="measure nothing: re-render the tables, CSV and plots of an earlier results.json into --out")
    p.add_argument("--allow-multicast", action="store_true",
                   help="opt in to NVLink multicast (docs/spec.md §8); it still needs hardware support and none of the "
                        "multicast-off variables set")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (0, or 1 when a measured point ended in an error)."""
    rest = list(sys.argv[1:] if argv is None else argv)
    if rest[:1] == ["tp-layouts"]:
        from .tp_layouts import main as tp_layouts_main

        return tp_layouts_main(rest[1:])
    if rest[:1] == ["rs-ag"]:
        from .rs_ag import main as rs_ag_main

        return rs_ag_main(rest[1:])
    args = _parser().parse_args(argv)
    if not args.allow_multicast:
        from detcomm.envelope import MULTICAST_OFF_ENV

        os.environ.update(MULTICAST_OFF_ENV)  # docs/spec.md §8: before any communicator; ranks inherit it
    from . import report

    if args.from_json is not None:
        try:
            result = report.load_result(args.from_json)
        except (OSError, ValueError) as e:
            _parser().error(str(e))
        return _write(result, args.out, plots=not args.no_plots)

    import torch

    from . import sweep

    device = args.device
    if args.quick and device == "auto":
        device = "cpu"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ngpu = torch.cuda.device_count() if device == "cuda" else 0
    if args.quick:
        worlds, stream_worlds = args.worlds or (4,), args.stream_worlds or ()
        rows, hidden = args.rows or QUICK_ROWS, args.hidden or QUICK_HIDDEN
    else:
        default_worlds = (4,) if device == "cpu" else ((ngpu,) if ngpu >= 2 else ())
        worlds = args.worlds if args.worlds is not None else default_worlds
        stream_worlds = args.stream_worlds if args.stream_worlds is not None else ((4, 8) if device == "cuda" else ())
        rows, hidden = args.rows or FULL_ROWS, args.hidden or FULL_HIDDEN
    command = "detcomm-bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    explicit: tuple[tuple[str, int, int], ...] = ()
    if (args.minbytes is None) != (args.maxbytes is None):
        _parser().error("-b/--minbytes and -e/--maxbytes go together")
    if args.minbytes is not None:
        if args.rows or (args.hidden and len(args.hidden) > 1) or args.fp32_hidden:
            _parser().error("-b/-e choose the sizes: drop --rows and --fp32-hidden, and give at most one --hidden")
        h = args.hidden[0] if args.hidden else QUICK_HIDDEN[0]
        try:
            explicit = tuple(byte_sweep(args.minbytes, args.maxbytes, args.stepfactor, dtypes=args.dtypes, hidden=h,
                                        group=max((*worlds, *stream_worlds), default=1)))
        except (ValueError, KeyError) as e:
            _parser().error(str(e))
        rows = tuple(sorted({r for _, _, r in explicit}))
        hidden = tuple(sorted({hh for _, hh, _ in explicit}))
    try:
        cfg = sweep.BenchConfig(
            device=device, worlds=tuple(worlds), stream_worlds=tuple(stream_worlds), rows=tuple(rows),
            hidden=tuple(hidden), fp32_hidden=args.fp32_hidden, dtypes=tuple(args.dtypes),
            collectives=tuple(args.collectives), iters=args.iters, warmup=args.warmup, graph_calls=args.graph_calls,
            graph=not args.no_graph, numerics=not args.no_numerics, seed=args.seed, budget_s=args.budget_s,
            allow_multicast=args.allow_multicast, progress=not args.no_progress, command=command,
            explicit_shapes=explicit)
    except ValueError as e:
        _parser().error(str(e))
    if not cfg.worlds and not cfg.stream_worlds:
        _parser().error("nothing to run: no process group size (--worlds) and no --stream-worlds")
    return _write(sweep.run_bench(cfg), args.out, plots=not args.no_plots)


def _write(result: dict, out: Path, *, plots: bool) -> int:
    from . import plots as plotting
    from . import report

    paths = report.write_outputs(result, out)
    if plots:
        plotting.write_plots(result, out)
    print(paths["md"].read_text(), end="")
    written = sorted(str(p) for p in out.iterdir())
    print(f"\nwrote {', '.join(written)}", file=sys.stderr)
    return 1 if any(p["status"].startswith("error") for p in result["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
