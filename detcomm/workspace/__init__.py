"""The CUDA-IPC workspace: the canonical fold (docs/spec.md §1) as one-store / one-shot / two-shot all-reduce,
reduce-scatter and all-gather kernels over symmetric device memory, on one node.

Public surface (what the core calls; see docs/INTERFACES.md):
    Workspace.create(group, *, device, capacity_bytes, max_rows_armed, ...) -> Workspace   # collective
    Workspace.in_process(world_size, *, device, capacity_bytes, ...) -> list[Workspace]     # one process, W views
    ws.all_reduce(x, *, algo=, chunk_rows=, label=) / ws.reduce_scatter(x) / ws.all_gather(x)   # collective
    ws.close()  # collective        ws.abort() / ws.check() / ws.synchronize()  # local (WorkspaceFailed)
    ws.variants(collective, dtype, row_numel, max_rows) -> ["one_store", "one_shot", "two_shot", "chunked", ...]  # local
    ws.refused  # {module: reason} for dtypes whose kernels could not be built (refused alone)
    WorkspaceUnavailable, WorkspaceFailed (detcomm.errors)

Importing this package needs neither cupy nor a GPU, nor torch: the router reads plan and admission (torch-free)
without loading the workspace itself, whose names load on first access (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import admission, plan

if TYPE_CHECKING:
    from .workspace import Workspace, WorkspaceFailed, WorkspaceUnavailable

__all__ = ["Workspace", "WorkspaceFailed", "WorkspaceUnavailable", "admission", "plan"]

_LAZY = frozenset({"Workspace", "WorkspaceFailed", "WorkspaceUnavailable"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(".workspace", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
