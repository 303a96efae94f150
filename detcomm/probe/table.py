"""The probes' output, written so that mpiexec's per-rank tags stay whole (the tables themselves come from
detcomm.tables.format_table)."""

from __future__ import annotations

import sys

__all__ = ["emit"]


def emit(*blocks: str) -> None:
    """Print blocks separated by blank lines, one write per line with its newline: mpiexec tags output per
    read (Open MPI --tag-output), so a line split across writes, or one long write split across reads,
    gets a rank tag in its middle."""
    for line in "\n\n".join(blocks).split("\n"):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
