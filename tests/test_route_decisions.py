"""The route table's decisions, frozen: for site configurations (collective, dtype, op, rows, row width, the layout:
plain, shard order or tree over V, a forced route) x W x envelopes x group capabilities, every candidate route and
its reason, or the refusal (tests/route_decisions.txt.xz, xz-compressed text, generated from the code of 297d585 before the layout became
one value, detcomm/numerics/layout.py). Static: ``Router.candidates`` needs no group.

Regenerate (only for a deliberate change of a decision, said in the commit):
    PYTHONPATH=. python tests/test_route_decisions.py --write
"""

from __future__ import annotations

import hashlib
import itertools
import lzma
import sys
from pathlib import Path

import torch

from detcomm.envelope import resolve_numerics
from detcomm.route import Router
from detcomm.sites import Capabilities, Collective, ReduceOp, Route, Site

TABLE = Path(__file__).with_name("route_decisions.txt.xz")
WORLDS = (1, 2, 3, 4, 8)
ENVELOPES = (("auto", {}), ("rl-bitwise", {}), ("rl-bitwise+rsag", {"force_deterministic_rsag": True}))
# (name, capabilities less W): no workspace, an armed one with the init defaults, a small one that refuses or
# chunks wide rows, and two hosts (rs_ag_fold's other break-even).
CAPS = (("cpu", dict(backend="gloo", device_type="cpu")),
        ("ws", dict(backend="nccl", device_type="cuda", workspace=True, workspace_max_rows=2048,
                    workspace_bytes=32 << 20)),
        ("ws_small", dict(backend="nccl", device_type="cuda", workspace=True, workspace_max_rows=64,
                          workspace_bytes=64 << 10)),
        ("hosts2", dict(backend="nccl", device_type="cuda", hosts=2)))
LAYOUTS = ((None, "order"), (4, "order"), (6, "order"), (8, "order"), (4, "tree"), (8, "tree"))
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_reduce_rmsnorm", "all_gather", "argmax")
ROUTES = (None, *Route)
# (max_rows, row width): one row of a narrow site; a decode batch; a prefill chunk above the armed rows; rows wider
# than the small workspace's launch; and a few of them.
SHAPES = ((1, 64), (2048, 4096), (16384, 4096), (2048, 65536), (64, 65536))


def _sites() -> list[Site | str]:
    out: list[Site | str] = []
    for coll, dtype, op, (rows, width), (v, fold), route in itertools.product(
            COLLECTIVES, (torch.bfloat16, torch.float32, torch.int32), ("sum", "avg", "max"), SHAPES, LAYOUTS, ROUTES):
        if coll == "argmax" and op != "max":
            continue
        kw = {} if v is None else {"virtual_shards": v, "shard_fold": fold}
        try:
            out.append(Site("s", Collective(coll), dtype, (width,), rows, ReduceOp(op), route=route, **kw))
        except (ValueError, TypeError) as e:
            out.append(f"{coll} {dtype} {op} {rows}x{width} V={v} {fold} route={route}: site refused: {e}")
    return out


def _lines() -> list[str]:
    sites = _sites()
    lines = [s for s in sites if isinstance(s, str)]
    for (env, sw), (cname, caps), w in itertools.product(ENVELOPES, CAPS, WORLDS):
        router = Router(resolve_numerics(env.split("+")[0], **sw), Capabilities(world_size=w, **caps))  # type: ignore[arg-type]
        for s in sites:
            if isinstance(s, str):
                continue
            head = f"{env} {cname} W{w} {s.route.value if s.route else '-'} {s.describe()}"
            try:
                lines.append(head + " -> " + " || ".join(f"{d.route.value}: {d.why}" for d in router.candidates(s)))
            except ValueError as e:
                lines.append(f"{head} -> refused: {e}")
    return lines


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def test_route_decisions_unchanged() -> None:
    lines = _lines()
    want = lzma.decompress(TABLE.read_bytes()).decode().splitlines()
    assert want[0] == f"# sha256 {_digest(want[1:])}", "route_decisions.txt was edited by hand"
    got = lines
    diff = [(a, b) for a, b in zip(want[1:], got) if a != b]
    assert not diff and len(want) - 1 == len(got), (len(want) - 1, len(got), diff[:3])


def test_route_decisions_negative_control() -> None:
    """The comparison sees one changed reason among the table's lines (so the test above can fail)."""
    lines = _lines()
    i = next(i for i, ln in enumerate(lines) if "tree order" in ln)
    changed = [*lines[:i], lines[i].replace("tree order", "tree  order"), *lines[i + 1:]]
    assert _digest(changed) != _digest(lines)
    assert changed != lzma.decompress(TABLE.read_bytes()).decode().splitlines()[1:]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    body = _lines()
    TABLE.write_bytes(lzma.compress((f"# sha256 {_digest(body)}\n" + "\n".join(body) + "\n").encode(), preset=9))
    print(f"wrote {len(body)} lines to {TABLE}")
