"""Plain-text tables for the probes' reports (no dependency; the output is also what CI logs show)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["format_table", "emit"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, title: str | None = None) -> str:
    """Columns padded to their widest cell, a rule under the header; numbers right-aligned."""
    cells = [[str(c) for c in headers]] + [[_cell(c) for c in row] for row in rows]
    if any(len(r) != len(headers) for r in cells):
        raise ValueError("every row needs one cell per header")
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()

    out = [title] if title else []
    out.append(line(cells[0]))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "inf" if value == float("inf") else f"{value:g}"
    return str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def emit(*blocks: str) -> None:
    """Print blocks separated by blank lines, one write per line with its newline: mpiexec tags output per
    read (Open MPI --tag-output), so a line split across writes, or one long write split across reads,
    gets a rank tag in its middle."""
    for line in "\n\n".join(blocks).split("\n"):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
