"""The gather_fold route: all-gather every rank's input, then the canonical fold locally.

World-size times the traffic of a reduction, on any platform, any W, across nodes. Every rank folds the same
gathered bytes with the same leaf, so all ranks hold identical bits, and a row's result depends only on that
row's W inputs: not on the row count, its offset, or the stream.

One call path for every layout (docs/spec.md §9.1; detcomm/layout.py): gather what each rank sends in the site's
layout (numerics/layout.py ``sent``: its row, its V/W fp32 partials in shard order, or its subtree's fp32 root),
then the layout's combine over the gathered [W, k, ...] (the fold in rank order, in shard order, or the top
log2(W) levels of the tree). A reduce-scatter combines this rank's block of rows only.
"""

from __future__ import annotations

import torch

from ..layout import PLAIN, Layout
from ..numerics.layout import sent
from ..sites import BoundRoute, Collective, ReduceOp, Route, Site
from .base import bind_from
from .guard import MessageGuard, gather
from .host_fold import HostFoldRoute


class GatherFoldRoute(HostFoldRoute):
    route = Route.GATHER_FOLD

    def bind(self, site: Site) -> BoundRoute:
        guard = self._guard(site)
        layout, dtype, op = site.layout, site.dtype, site.op
        return bind_from(self.route, site, {
            Collective.ALL_REDUCE: lambda x, a: self.all_reduce(x, op, layout=layout, dtype=dtype, guard=guard),
            Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, op, layout=layout, dtype=dtype,
                                                                        guard=guard),
        }, guard=guard)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp, *, layout: Layout = PLAIN, dtype: torch.dtype | None = None,
                   guard: MessageGuard | None = None) -> torch.Tensor:
        """The result, in ``dtype`` (default x's), of every rank's ``x`` in ``layout`` (plain [rows, *shape];
        virtual [V/W, rows, *shape] fp32). Collective."""
        return self._fold(self._gathered(sent(layout, x), guard), dtype or x.dtype, op, layout)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, *, layout: Layout = PLAIN,
                       dtype: torch.dtype | None = None, guard: MessageGuard | None = None) -> torch.Tensor:
        """all_reduce's result on this rank's block of rows only. Collective."""
        moved = self._gathered(sent(layout, x), guard)  # [W, k, rows, *shape]
        n = moved.shape[2] // self.native.world_size
        r = self.native.rank
        return self._fold(moved[:, :, r * n : (r + 1) * n], dtype or x.dtype, op, layout)

    def _gathered(self, x: torch.Tensor, guard: MessageGuard | None) -> torch.Tensor:
        # The torch leaf folds strided views; the CUDA leaf reads one contiguous [W, ...] block.
        return gather(self.native, x, guard, contiguous=x.is_cuda)
