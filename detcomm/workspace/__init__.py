"""The CUDA-IPC workspace: the canonical fold (docs/spec.md §1) as one-store / one-shot / two-shot all-reduce,
reduce-scatter and all-gather kernels over symmetric device memory, on one node.

Public surface (what the core calls; see docs/INTERFACES.md):
    Workspace.create(group, *, device, capacity_bytes, max_rows_armed, ...) -> Workspace   # collective
    Workspace.in_process(world_size, *, device, capacity_bytes, ...) -> list[Workspace]     # one process, W views
    ws.all_reduce(x, *, algo=, chunk_rows=, label=) / ws.reduce_scatter(x) / ws.all_gather(x)   # collective
    ws.close()  # collective        ws.abort() / ws.check() / ws.synchronize()  # local (WorkspaceFailed)
    ws.variants(collective, dtype, row_numel, max_rows) -> ["lamport", "one_shot", "two_shot", "chunked", ...]  # local
    ws.refused  # {module: reason} for dtypes whose kernels could not be built (refused alone)
    WorkspaceUnavailable, WorkspaceFailed (detcomm.errors)

Importing this package needs neither cupy nor a GPU.
"""

from . import plan
from .workspace import Workspace, WorkspaceFailed, WorkspaceUnavailable

__all__ = ["Workspace", "WorkspaceFailed", "WorkspaceUnavailable", "plan"]
