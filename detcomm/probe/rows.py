"""Op row-count mapper (docs/spec.md §7 (row-count mapper)): at which row counts t does row 0 of an op's output change its bits?

A kernel that picks its tiling, split-K or warp partition from the number of rows it is handed computes row 0
with a different association order at some row counts; a request's row then depends on how many neighbours
shared its batch. The mapper runs ``op(x[:t])`` for t = 1..T on fixed inputs and records every t where row
0's bits differ from t-1 ("a new reduction-order class begins at t"), how many of its elements changed and by
how many ulps. ``--pad-to T_pad`` runs the same op at a fixed padded row width (docs/spec.md §7 (row-count mapper)'s fix): the rows
beyond t are filler and the output keeps only the first t, so every t runs one kernel configuration and the
table must come out empty.

    python -m detcomm.probe rows --shape 1024 512 --shape 4096 1024 --max-rows 64
    python -m detcomm.probe rows --op mypkg.kernels:my_linear --width 512 --json rows.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from detcomm.dtypes import FLOAT_NAMES, from_name, name_of
from detcomm.invariance import changed_mask, ulp_distance

from ..tables import format_table
from .table import emit

__all__ = ["Boundary", "RowMap", "map_rows", "matmul_op", "load_op", "main"]

Op = Callable[[torch.Tensor], torch.Tensor]



@dataclass(frozen=True)
class Boundary:
    """A row count at which row 0's output bits differ from those at t - 1.

    Attributes:
        t: the first row count of the new class.
        changed: elements of row 0 whose bits changed.
        elements: elements in row 0.
        max_ulps: largest change in units of the output dtype's last place (inf when NaN is involved).
    """

    t: int
    changed: int
    elements: int
    max_ulps: float


@dataclass(frozen=True)
class RowMap:
    """One op's map over t = 1..max_rows."""

    op: str
    input_shape: tuple[int, ...]
    dtype: str
    max_rows: int
    pad_to: int | None
    boundaries: tuple[Boundary, ...]

    def describe(self) -> str:
        """Seed 002's cell: "t=17 (368 of 1024 elements, max 2 ulps); ..." or "none — invariant for t <= T"."""
        if not self.boundaries:
            return f"none - invariant for t <= {self.max_rows}"
        return "; ".join(
            f"t={b.t} ({b.changed} of {b.elements} elements, max {b.max_ulps:g} ulp{'s' if b.max_ulps != 1 else ''})"
            for b in self.boundaries
        )

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["boundaries"] = [asdict(b) for b in self.boundaries]
        return d


def map_rows(op: Op, x: torch.Tensor, *, max_rows: int | None = None, pad_to: int | None = None, name: str = "op") -> RowMap:
    """Map the row counts at which ``op``'s row 0 changes bits.

    Args:
        op: maps a [t, ...] tensor to a tensor whose dim 0 is the same t (rows are independent inputs).
        x: the inputs, [T, ...]; ``op`` sees ``x[:t]`` (row 0 is always the same row).
        max_rows: the largest t (default: all rows of ``x``).
        pad_to: if given, call ``op`` on ``x[:t]`` followed by rows t..pad_to-1 of ``x`` as filler and keep
            the first t output rows: a fixed padded width, under which the map must be empty.
        name: what the report calls the op.

    Raises:
        ValueError: bad row counts, or an op whose output does not keep the row dimension.
    """
    total = x.shape[0]
    max_rows = total if max_rows is None else max_rows
    if not 1 <= max_rows <= total:
        raise ValueError(f"max_rows must be in 1..{total} (rows of x), got {max_rows}")
    if pad_to is not None and not max_rows <= pad_to <= total:
        raise ValueError(f"pad_to must be in {max_rows}..{total} (max_rows..rows of x), got {pad_to}")
    boundaries: list[Boundary] = []
    prev: torch.Tensor | None = None
    for t in range(1, max_rows + 1):
        inp = x[:pad_to] if pad_to is not None else x[:t]
        out = op(inp)
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != inp.shape[0]:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{name}: output must keep the row dimension ({inp.shape[0]} rows), got {got}")
        row0 = out[0].detach().to("cpu").reshape(-1).clone()
        if prev is not None:
            mask = changed_mask(row0, prev)
            if bool(mask.any()):
                ulps = float(ulp_distance(row0, prev)[mask].max())
                boundaries.append(Boundary(t, int(mask.sum()), row0.numel(), ulps))
        prev = row0
    return RowMap(name, tuple(x.shape[1:]), name_of(x.dtype), max_rows, pad_to, tuple(boundaries))


def matmul_op(n: int, k: int, *, dtype: torch.dtype, device: str, seed: int) -> tuple[Op, str]:
    """``x @ W.T`` with a fixed random W of shape [n, k] (docs/spec.md §7 (row-count mapper) names shapes [N x K], out x in)."""
    if n < 1 or k < 1:
        raise ValueError(f"--shape needs positive N K, got {n} {k}")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    return (lambda x: torch.matmul(x, w.T)), f"matmul [{n}x{k}]"


def load_op(spec: str) -> Op:
    """Resolve ``pkg.mod:fn`` (or ``pkg.mod:Obj.attr``) to a callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--op wants an import path 'pkg.mod:fn', got {spec!r}")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--op {spec!r}: cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--op {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--op {spec!r} is not callable")
    return obj  # type: ignore[return-value]


def _inputs(rows: int, width: int, *, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    # Ordinary activations (standard normal), as docs/spec.md §7 (row-count mapper) measured: the point is the kernel's order, not an
    # adversarial payload.
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(rows, width, generator=g).to(dtype).to(device)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m detcomm.probe rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs=2, type=int, action="append", metavar=("N", "K"), default=[],
                   help="torch.matmul of x[t, K] with a fixed W[N, K]^T; repeatable")
    p.add_argument("--op", action="append", default=[], metavar="PKG.MOD:FN",
                   help="any callable mapping x[t, WIDTH] to [t, ...]; repeatable")
    p.add_argument("--width", type=int, default=256, help="input row width K for --op (default 256)")
    p.add_argument("--max-rows", type=int, default=64, help="largest row count T (default 64)")
    p.add_argument("--pad-to", type=int, default=None, metavar="T_PAD",
                   help="run every t at this fixed padded row width (must be >= --max-rows)")
    p.add_argument("--dtype", choices=sorted(FLOAT_NAMES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for CPU kernels")
    p.add_argument("--json", metavar="PATH", help="also write the maps as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m detcomm.probe rows``; prints the table, returns 0 (a map is a measurement)."""
    ns = build_parser().parse_args(argv)
    if not ns.shape and not ns.op:
        ns.shape = [[1024, 512]]
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    dtype = from_name(ns.dtype)
    total = max(ns.max_rows, ns.pad_to or 0)
    maps: list[RowMap] = []
    for n, k in ns.shape:
        op, name = matmul_op(n, k, dtype=dtype, device=ns.device, seed=ns.seed)
        x = _inputs(total, k, dtype=dtype, device=ns.device, seed=ns.seed)
        maps.append(map_rows(op, x, max_rows=ns.max_rows, pad_to=ns.pad_to, name=name))
    for spec in ns.op:
        x = _inputs(total, ns.width, dtype=dtype, device=ns.device, seed=ns.seed)
        maps.append(map_rows(load_op(spec), x, max_rows=ns.max_rows, pad_to=ns.pad_to, name=spec))

    pad = f", fixed padded width {ns.pad_to}" if ns.pad_to else ""
    title = f"row-count map: row 0's bits at t = 1..{ns.max_rows} vs t-1 ({ns.dtype}, {ns.device}{pad})"
    emit(format_table(["op", "input row width K", "class boundaries"],
                      [[m.op, "x".join(map(str, m.input_shape)), m.describe()] for m in maps], title=title))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"device": ns.device, "dtype": ns.dtype, "maps": [m.to_json() for m in maps]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
