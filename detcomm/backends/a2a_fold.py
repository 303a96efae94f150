"""The a2a_fold route for reduce-scatter: all-to-all of the row blocks, then the canonical fold.

Rank r sends its row block q to rank q and receives block r from every rank, in rank order, so it holds
exactly the W inputs of its own output rows: no extra traffic over a ring reduce-scatter, and the fold of
those W blocks is the canonical fold.
"""

from __future__ import annotations

import torch

from ..fold import Leaf, average
from ..route import BoundRoute, Collective, ReduceOp, Route, Site
from .base import bind_from
from .guard import CallGuard, split
from .native import NativeBackend


class A2AFoldBackend:
    route = Route.A2A_FOLD

    def __init__(self, native: NativeBackend, leaf: Leaf) -> None:
        self.native = native
        self.leaf = leaf

    def bind(self, site: Site) -> BoundRoute:
        guard = CallGuard(site)
        return bind_from(self.route, site,
                         {Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, site.op, guard=guard)})

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, *, guard: CallGuard | None = None) -> torch.Tensor:
        assert op.sums, "routing sends only floating-point SUM and AVG here"
        w = self.native.world_size
        n = x.shape[0] // w
        block = x.view(w, n, *x.shape[1:])
        if guard is None or not guard.applies(x, staged=self.native.stage):
            stacked = self.native.all_to_all(x, [n] * w, [n] * w).view(w, n, *x.shape[1:])
        else:
            # Every destination block carries the same header, so each rank receives all W ranks' headers.
            header = guard.next_header().to(x.device)
            msgs = torch.cat([block.reshape(w, -1).view(torch.uint8), header.expand(w, -1)], dim=1)
            recv = self.native.all_to_all(msgs, [1] * w, [1] * w)
            stacked, headers = split(recv, block[0], contiguous=x.is_cuda)
            guard.check(headers)
        if op is ReduceOp.AVG:
            return average(self.leaf.fold(stacked, torch.float32), w, x.dtype)
        return self.leaf.fold(stacked, x.dtype)
