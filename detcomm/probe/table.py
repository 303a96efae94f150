"""The probes' output: tables from detcomm.tables, written so that mpiexec's per-rank tags stay whole."""

from __future__ import annotations

import sys

from detcomm.tables import format_table

__all__ = ["format_table", "emit"]


def emit(*blocks: str) -> None:
    """Print blocks separated by blank lines, one write per line with its newline: mpiexec tags output per
    read (Open MPI --tag-output), so a line split across writes, or one long write split across reads,
    gets a rank tag in its middle."""
    for line in "\n\n".join(blocks).split("\n"):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
