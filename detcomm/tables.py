"""One table formatter for everything detcomm prints: the route table, the probes' reports, the bench's markdown.

Plain text pads every column to its widest cell with a rule under the header; markdown writes GitHub pipe
tables. Numbers (int or float cells, not bool) are right-aligned unless ``align`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table", "cell"]


def cell(value: object) -> str:
    """A cell's text: integral floats as integers (ulp counts), other floats in ``%g`` (``inf`` for infinity),
    everything else ``str``."""
    if isinstance(value, float):
        if value == float("inf"):
            return "inf"
        return str(int(value)) if value.is_integer() and abs(value) < 2**53 else f"{value:g}"
    return str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, title: str | None = None,
                 markdown: bool = False, align: str | None = None) -> str:
    """The table as text. ``align``: one letter per column, ``l`` or ``r`` (default: ``r`` for a column of
    numbers, else ``l``). ``title`` is a line above the table. ValueError when a row's cells do not match
    the headers."""
    cells = [[str(c) for c in headers]] + [[cell(c) for c in row] for row in rows]
    if any(len(r) != len(headers) for r in cells):
        raise ValueError("every row needs one cell per header")
    if align is None:
        align = "".join("r" if rows and all(_is_number(row[i]) for row in rows) else "l" for i in range(len(headers)))
    elif len(align) != len(headers) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one of 'l'/'r' per column ({len(headers)}), got {align!r}")
    out = [title] if title else []
    if markdown:
        out.append("| " + " | ".join(cells[0]) + " |")
        out.append("| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |")
        out.extend("| " + " | ".join(r) + " |" for r in cells[1:])
        return "\n".join(out)
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(r, widths, align)).rstrip()

    out.append(line(cells[0]))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)
