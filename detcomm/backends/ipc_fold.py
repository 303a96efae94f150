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
from .base import Bound, Call, bind_from


class IpcFoldBackend:
    route = Route.IPC_FOLD

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace

    def bind(self, site: Site) -> BoundRoute:
        label = site.name
        coll = Collective.ALL_REDUCE if site.collective is Collective.ALL_REDUCE_RMSNORM else site.collective
        ws = self.workspace
        reachable = ws.variants(coll.value, site.dtype, site.row_numel, site.max_rows)
        in_place = False
        all_reduce: Call = lambda x, a: self.all_reduce(x, site.op, out=a.out, label=label)  # noqa: E731
        if coll is Collective.ALL_REDUCE and reachable:
            # The hot path of decode: everything that depends only on the site is prepared here, once.
            assert site.op is ReduceOp.SUM, "routing sends only floating-point SUM here"
            fast = ws.bind_all_reduce(site.dtype, site.row_numel, label=label)
            all_reduce = lambda x, a: fast(x, a.out)  # noqa: E731
            in_place = True  # the site-bound kernels write in place (Workspace.bind_all_reduce says why)
        bound = bind_from(self.route, site, {
            Collective.ALL_REDUCE: all_reduce,
            Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, site.op, out=a.out, label=label),
            Collective.ALL_GATHER: lambda x, a: self.all_gather(x, out=a.out, label=label),
        })
        forced: dict[str, Call] = {}
        for v in reachable:
            if coll is Collective.ALL_REDUCE:
                kw: dict[str, object] = {"chunk_rows": 1} if v == "chunked" else {"algo": v}
                forced[v] = lambda x, a, kw=kw: ws.all_reduce(x, label=label, **kw)  # type: ignore[misc]
            elif coll is Collective.REDUCE_SCATTER:
                kw = {"chunk_rows": 1} if v == "chunked" else {}
                forced[v] = lambda x, a, kw=kw: ws.reduce_scatter(x, label=label, **kw)  # type: ignore[misc]
            else:
                kw = {"chunk_rows": 1} if v == "chunked" else {}
                forced[v] = lambda x, a, kw=kw: ws.all_gather(x, label=label, **kw)  # type: ignore[misc]
        return Bound(bound.route, bound.site, bound.call, forced, in_place=in_place)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp, *, out: torch.Tensor | None = None,
                   label: str | None = None) -> torch.Tensor:
        assert op is ReduceOp.SUM, "routing sends only floating-point SUM here"
        return self.workspace.all_reduce(x, out=out, label=label)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, *, out: torch.Tensor | None = None,
                       label: str | None = None) -> torch.Tensor:
        assert op is ReduceOp.SUM, "routing sends only floating-point SUM here"
        return self.workspace.reduce_scatter(x, out=out, label=label)

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None, label: str | None = None) -> torch.Tensor:
        return self.workspace.all_gather(x, out=out, label=label)

    def close(self) -> None:
        self.workspace.close()
