"""The ``detcomm`` command: ``detcomm demo`` (the main job) and ``detcomm routes`` (the static route table)."""

from __future__ import annotations

import argparse
import json
import sys

from .dtypes import TABLE, from_name, name_of
from .envelope import known_envelopes, resolve_numerics
from .route import AutoBackend, Capabilities, Collective, ReduceOp, Site

_DTYPE_NAMES = [d.name for d in TABLE]

# A tensor-parallel decoder layer's sites, for when no --site is given.
_DEFAULT_SITES = (
    "attn.o_proj:all_reduce:bfloat16:4096:2048",
    "mlp.down_proj:all_reduce:bfloat16:4096:2048",
    "prefill.o_proj:all_reduce:bfloat16:4096:16384",
    "attn.o_proj.rs:reduce_scatter:bfloat16:4096:16384",
    "moe.router_max:all_reduce:float32:1:2048:max",
    "lm_head.argmax:argmax:bfloat16:19008:2048",
    "lm_head.gather:all_gather:bfloat16:19008:2048",
    "tokens.gather:token_all_gather:int64::2048",
    "ep.dispatch:all_to_all:bfloat16:4096:2048",
)


def parse_site(spec: str) -> Site:
    """``name:collective:dtype:shape:max_rows[:op]``; shape is ``x``-separated (``4096``, ``8x128``, empty)."""
    parts = spec.split(":")
    if len(parts) not in (5, 6):
        raise ValueError(f"--site {spec!r}: expected name:collective:dtype:shape:max_rows[:op]")
    name, coll, dtype, shape, max_rows = parts[:5]
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"--site {spec!r}: dtype must be one of {sorted(_DTYPE_NAMES)}")
    op = parts[5] if len(parts) == 6 else ("max" if coll == "argmax" else "sum")
    dims = tuple(int(d) for d in shape.split("x")) if shape else ()
    return Site(name, Collective(coll), from_name(dtype), dims, int(max_rows), ReduceOp(op))


def _routes(args: argparse.Namespace) -> int:
    resolved = resolve_numerics(args.numerics)
    device = "cuda" if args.backend == "nccl" else "cpu"
    caps = Capabilities(backend=args.backend, device_type=device, world_size=args.world_size,
                        workspace_reason="static view: the workspace is probed at startup")
    auto = AutoBackend(resolved, caps)
    sites = [parse_site(s) for s in (args.site or _DEFAULT_SITES)]
    rows = []
    for s in sites:
        d = auto.decide(s)
        rows.append({"site": s.name, "collective": s.collective.value,
                     "op": s.op.value if s.collective.reduces or s.collective is Collective.ARGMAX else "",
                     "dtype": name_of(s.dtype), "shape": "x".join(map(str, s.shape)),
                     "max_rows": str(s.max_rows), "route": d.route.value, "why": d.why})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print(f"detcomm routes (static): numerics={resolved.numerics} backend={args.backend} W={args.world_size}")
    print("  ".join(c.ljust(widths[c]) for c in cols).rstrip())
    print("  ".join("-" * widths[c] for c in cols))
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols).rstrip())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="detcomm", description="bitwise batch-invariant collectives")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="W local ranks: route table, self-checks, native vs fold under batch changes")
    d.add_argument("rest", nargs=argparse.REMAINDER)
    r = sub.add_parser("routes", help="the route table AutoBackend gives a set of sites (static; no ranks)")
    r.add_argument("--numerics", default="rl-bitwise", choices=known_envelopes())
    r.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    r.add_argument("--world-size", type=int, default=8)
    r.add_argument("--site", action="append", help="name:collective:dtype:shape:max_rows[:op] (repeatable)")
    r.add_argument("--json", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = p.parse_args(argv)
    try:
        return _routes(args)
    except ValueError as e:
        print(f"detcomm routes: {e}", file=sys.stderr)
        return 2
