"""The ``detcomm`` command: ``detcomm demo`` (the collectives alone, on local ranks) and ``detcomm routes`` (the
route table a live group would give a set of sites, without starting one).

``detcomm routes`` decides with the runtime's own router (detcomm.route.Router) on the capabilities a
live group of that kind would find, so the static view cannot drift from what ``init`` does. It starts no
ranks and imports neither a backend nor torch: the router decides from dtype names (detcomm.dtypes answers
sizes and float-ness by name), so the command costs the interpreter start and a few pure-Python modules.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from .dtypes import ALIASES
from .tables import format_table

if TYPE_CHECKING:
    import torch

__all__ = ["SiteSpec", "parse_site", "main"]

# Accepted dtype spellings -> the dtype table's names.
DTYPE_NAMES = ALIASES
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_reduce_rmsnorm", "all_gather", "token_all_gather", "all_to_all",
               "argmax")
_REDUCING = ("all_reduce", "reduce_scatter", "all_reduce_rmsnorm")

# A tensor-parallel decoder layer's sites, for when no --site is given.
_DEFAULT_SITES = (
    "attn.o_proj:all_reduce:bf16:4096:2048",
    "mlp.down_proj:all_reduce:bf16:4096:2048",
    "prefill.o_proj:all_reduce:bf16:4096:16384",
    "attn.o_proj.rs:reduce_scatter:bf16:4096:16384",
    "moe.router_max:all_reduce:fp32:1:2048:max",
    "lm_head.argmax:argmax:bf16:19008:2048",
    "lm_head.gather:all_gather:bf16:19008:2048",
    "tokens.gather:token_all_gather:int64::2048",
    "ep.dispatch:all_to_all:bf16:4096:2048",
)

SITE_HELP = """\
--site NAME:COLLECTIVE:DTYPE:SHAPE:MAX_ROWS[:OP][:vs=V[:fold=tree]]   (repeatable; default: a TP decoder layer's sites)
  COLLECTIVE  all_reduce, reduce_scatter, all_reduce_rmsnorm (the fused all-reduce + residual + RMSNorm of a
              layer boundary: fused or composed, and why; its rule loads torch), all_gather, token_all_gather,
              all_to_all, argmax
  DTYPE       bf16|bfloat16, fp16|half|float16, fp32|float|float32, int8, uint8, int32|int, int64|long
  SHAPE       one row's trailing shape: 4096, or 4,128 (also 4x128); empty for one value per row
  MAX_ROWS    the most rows one call carries (per rank for gathers)
  OP          sum (default), max or min, for all_reduce and reduce_scatter only; argmax is a max by
              definition; the gathers and all_to_all move data and take no op
  vs=V        virtual shards (docs/spec.md §9.1): all_reduce/reduce_scatter sum of V fp32 partial sums
  fold=tree   after vs=V (a power of two): the fixed balanced tree over the shards ("The tree order"), one fp32
              partial per rank on the wire; fold=order (the default) folds the shards in order
examples:
  detcomm routes --backend nccl --world-size 8 --site o_proj:all_reduce:bf16:4096:2048
  detcomm routes --backend gloo --world-size 4 --site lm_head:argmax:bf16:19008:64 --json
  detcomm routes --world-size 4 --site o_proj:all_reduce:bf16:4096:2048:sum:vs=8
  detcomm routes --world-size 4 --site o_proj:all_reduce:bf16:4096:2048:sum:vs=8:fold=tree
  detcomm routes --world-size 4 --site o_proj.add_norm:all_reduce_rmsnorm:bf16:4096:2048:sum:vs=8:fold=tree
  detcomm routes --backend nccl --world-size 16 --nodes 2      (two 8-GPU nodes: docs/multinode.md)
"""


@dataclass(frozen=True)
class SiteSpec:
    """A parsed ``--site`` (names only: no torch needed)."""

    name: str
    collective: str
    dtype: str
    shape: tuple[int, ...]
    max_rows: int
    op: str
    virtual_shards: int | None = None
    shard_fold: str = "order"


def parse_site(spec: str) -> SiteSpec:
    """``NAME:COLLECTIVE:DTYPE:SHAPE:MAX_ROWS[:OP]`` (see SITE_HELP); ValueError naming what is wrong."""
    parts = spec.split(":")
    virtual_shards = None
    shard_fold = "order"
    if len(parts) > 6 and parts[-1].strip().lower().startswith("fold="):
        shard_fold = parts.pop().strip().lower()[5:]
        if shard_fold not in ("order", "tree"):
            raise ValueError(f"--site {spec!r}: fold={shard_fold!r} must be order or tree (after vs=V)")
        if not parts[-1].strip().lower().startswith("vs="):
            raise ValueError(f"--site {spec!r}: fold= orders virtual shards: give vs=V before it")
    if len(parts) > 5 and parts[-1].strip().lower().startswith("vs="):
        v = parts.pop().strip()[3:]
        if not v.isdigit():
            raise ValueError(f"--site {spec!r}: vs={v!r} must be a positive integer (the number of virtual shards)")
        virtual_shards = int(v)
    if len(parts) not in (5, 6):
        raise ValueError(f"--site {spec!r}: expected NAME:COLLECTIVE:DTYPE:SHAPE:MAX_ROWS[:OP], "
                         f"e.g. o_proj:all_reduce:bf16:4096:2048")
    name, coll, dtype, shape, max_rows = (p.strip() for p in parts[:5])
    coll = coll.lower().replace("-", "_")
    if not name:
        raise ValueError(f"--site {spec!r}: the site needs a name")
    if coll not in COLLECTIVES:
        raise ValueError(f"--site {spec!r}: collective {coll!r} is not one of {', '.join(COLLECTIVES)}")
    if dtype.lower() not in DTYPE_NAMES:
        raise ValueError(f"--site {spec!r}: dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    dims = [d for d in re.split(r"[,x×]", shape.strip("()[] ")) if d.strip()] if shape.strip("()[] ") else []
    if not all(d.strip().isdigit() for d in dims):
        raise ValueError(f"--site {spec!r}: shape {shape!r} must be integers separated by ',' (4096 or 4,128), "
                         "or empty")
    if not max_rows.isdigit() or int(max_rows) < 1:
        raise ValueError(f"--site {spec!r}: MAX_ROWS {max_rows!r} must be a positive integer")
    op = parts[5].strip().lower() if len(parts) == 6 else None
    if coll in _REDUCING:
        if op not in (None, "sum", "avg", "max", "min"):
            raise ValueError(f"--site {spec!r}: op {op!r} is not one of sum, avg, max, min")
        op = op or "sum"
    elif coll == "argmax":
        if op not in (None, "max"):
            raise ValueError(f"--site {spec!r}: argmax is a MAX reduction; drop ':{op}'")
        op = "max"
    elif op is not None:
        raise ValueError(f"--site {spec!r}: {coll} moves data and takes no reduce op; drop ':{op}'")
    else:
        op = "sum"
    return SiteSpec(name, coll, DTYPE_NAMES[dtype.lower()], tuple(int(d) for d in dims), int(max_rows), op,
                    virtual_shards, shard_fold)


def _routes(args: argparse.Namespace) -> int:
    from .launch.environment import choose_numerics

    numerics = choose_numerics(args.numerics, env=os.environ)
    specs = [parse_site(s) for s in (args.site or _DEFAULT_SITES)]
    if args.world_size < 1 or args.nodes < 1 or args.workspace_max_rows < 1:
        raise ValueError("--world-size, --nodes and --workspace-max-rows must be positive")
    if args.nodes > args.world_size:
        raise ValueError(f"--nodes {args.nodes} exceeds --world-size {args.world_size}: every node runs at least "
                         "one rank")

    from .envelope import resolve_numerics
    from .route import Router
    from .sites import DEFAULT_WORKSPACE_BYTES, Capabilities, Collective, ReduceOp, Site

    resolved = resolve_numerics(numerics)
    sw = resolved.switches
    cuda = args.backend == "nccl"

    def caps(armed: bool, why: str) -> Capabilities:
        return Capabilities(backend=args.backend, device_type="cuda" if cuda else "cpu", world_size=args.world_size,
                            workspace=armed, workspace_reason=why,
                            workspace_max_rows=args.workspace_max_rows if armed else 0,
                            workspace_bytes=DEFAULT_WORKSPACE_BYTES if armed else 0, hosts=args.nodes)

    # detcomm.init arms the CUDA-IPC workspace on a CUDA group under a batch-invariant envelope; it arms only
    # where every rank proves peer access through CUDA IPC, which one node can and several cannot. The reasons
    # are init's own words (comm.py), in init's order, so the static table reads as the live one.
    if args.nodes > 1:
        no_ws = "ranks on several hosts: CUDA IPC does not cross hosts"
    elif not cuda:
        no_ws = "CPU group: no CUDA-IPC workspace"
    elif sw.force_deterministic_rsag:
        no_ws = "force_deterministic_rsag: no symmetric-memory path"
    elif not sw.batch_invariant_collectives:
        no_ws = "workspace not armed (init(workspace=True) arms it)"
    else:
        no_ws = ""
    arms = not no_ws
    live = Router(resolved, caps(True, "armed") if arms else caps(False, no_ws))
    unarmed = Router(resolved, caps(False, "the workspace did not arm at init"))
    rows = []
    for spec in specs:
        # The dtype by name: Site's checks and the router read only its name and size (detcomm.dtypes), so the
        # static view decides exactly as init would without importing torch.
        s = Site(spec.name, Collective(spec.collective), cast("torch.dtype", spec.dtype), spec.shape,
                 spec.max_rows, ReduceOp(spec.op), virtual_shards=spec.virtual_shards, shard_fold=spec.shard_fold)
        d = live.decide(s)
        condition = ""
        if arms:
            other = unarmed.decide(s)
            if other.route != d.route:
                condition = f"if the workspace arms; else {other.route.value}"
        rows.append({"site": s.name, "collective": s.collective.value,
                     "op": spec.op if s.collective.reduces or s.collective is Collective.ARGMAX else "",
                     "dtype": spec.dtype, "shape": ",".join(map(str, s.shape)),
                     "virtual_shards": ("-" if s.virtual_shards is None else str(s.virtual_shards)
                                        + (" tree" if s.shard_fold == "tree" else "")),
                     "max_rows": str(s.max_rows),
                     "route": d.route.value, "condition": condition, "why": d.why})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"detcomm routes (static view of a live group): numerics={resolved.numerics} backend={args.backend} "
          f"W={args.world_size} nodes={args.nodes}")
    if arms:
        print(f"workspace: init arms the CUDA-IPC workspace on this group when every rank proves CUDA IPC peer access "
              f"at startup\n  (one node); it serves float SUM sites with max_rows <= {args.workspace_max_rows} "
              "(ipc_fold); larger all_reduce sites take it\n  chunked (one row must fit a launch), larger "
              "reduce_scatter sites a2a_fold. Where it does not arm, every site takes its 'else' route.")
    else:
        print(f"workspace: {no_ws}")
    cols = [c for c in rows[0] if (c != "condition" or any(r["condition"] for r in rows))
            and (c != "virtual_shards" or any(r[c] != "-" for r in rows))]
    print(format_table(cols, [[r[c] for c in cols] for r in rows], align="l" * len(cols)))
    return 0


def _parser() -> argparse.ArgumentParser:
    from .launch.environment import DEFAULT_NUMERICS
    from .sites import DEFAULT_WORKSPACE_MAX_ROWS

    p = argparse.ArgumentParser(
        prog="detcomm", description="bitwise batch-invariant collectives",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="the main job (README, \"Two commands\"): a tensor-parallel model at W=4 generating alone, packed\n"
               "and rerun, which must read PASS:\n"
               "  detcomm-launch --nproc 4 --numerics rl-bitwise -m detcomm.probe model\n"
               "`detcomm demo` shows the collectives alone; `detcomm routes` the route table.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", add_help=False,
                   help="W local ranks: route table, self-checks, native vs fold under batch changes "
                   "(detcomm demo --help)")
    r = sub.add_parser(
        "routes", help="the route table a live group would give a set of sites (static; starts no ranks)",
        description="The route each site would take on a live group of this kind, decided by the runtime's own "
        "router (detcomm.route.Router) from static facts; where the choice depends on what init finds "
        "(the CUDA-IPC workspace arming), the 'condition' column says so.",
        epilog=SITE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--numerics", default=None,
                   help=f"numerics envelope (default: $DETCOMM_NUMERICS when exported, else {DEFAULT_NUMERICS})")
    r.add_argument("--backend", default="nccl", choices=("nccl", "gloo"),
                   help="the torch.distributed backend of the group (default nccl: GPUs)")
    r.add_argument("--world-size", type=int, default=8, help="ranks in the group (default 8)")
    r.add_argument("--nodes", type=int, default=1,
                   help="hosts the group spans (default 1); above 1 no CUDA-IPC workspace arms and rs_ag_fold's "
                   "break-even is the network's (docs/multinode.md)")
    r.add_argument("--workspace-max-rows", type=int, default=DEFAULT_WORKSPACE_MAX_ROWS,
                   help=f"init(workspace_max_rows=...) (default {DEFAULT_WORKSPACE_MAX_ROWS})")
    r.add_argument("--site", action="append", metavar="SPEC", help="NAME:COLLECTIVE:DTYPE:SHAPE:MAX_ROWS[:OP] "
                   "(see below)")
    r.add_argument("--json", action="store_true", help="print the table as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return _routes(args)
    except ValueError as e:
        print(f"detcomm routes: error: {e}", file=sys.stderr)
        return 2
