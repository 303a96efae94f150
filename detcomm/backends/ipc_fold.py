"""The workspace route: the CUDA-IPC workspace's one-shot / two-shot fold kernels (detcomm.workspace).

The communicator arms the workspace once at startup when the group is on CUDA and a batch-invariant route
could use it; the route carries all-reduce and reduce-scatter SUM of floats for sites whose max_rows is within
the armed rows. The kernels compute the canonical fold bit for bit (the startup self-checks prove it on the
group before a site is routed here); the row count only picks one-shot, two-shot or chunking.
"""

from __future__ import annotations

import torch

from ..route import BoundRoute, Collective, ReduceOp, Route, Site
from ..workspace import Workspace
from .base import bind_from


class IpcFoldBackend:
    route = Route.IPC_FOLD

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace

    def bind(self, site: Site) -> BoundRoute:
        return bind_from(self.route, site, {
            Collective.ALL_REDUCE: lambda x, a: self.all_reduce(x, site.op, out=a.out),
            Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, site.op, out=a.out),
            Collective.ALL_GATHER: lambda x, a: self.all_gather(x, out=a.out),
        })

    def all_reduce(self, x: torch.Tensor, op: ReduceOp, *, out: torch.Tensor | None = None) -> torch.Tensor:
        assert op is ReduceOp.SUM, "routing sends only floating-point SUM here"
        return self.workspace.all_reduce(x, out=out)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, *, out: torch.Tensor | None = None) -> torch.Tensor:
        assert op is ReduceOp.SUM, "routing sends only floating-point SUM here"
        return self.workspace.reduce_scatter(x, out=out)

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.workspace.all_gather(x, out=out)

    def close(self) -> None:
        self.workspace.close()
