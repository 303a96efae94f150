"""The a2a_fold route for reduce-scatter: all-to-all of the row blocks, then the canonical fold.

Rank r sends its row block q to rank q and receives block r from every rank, in rank order, so it holds
exactly the W inputs of its own output rows: no extra traffic over a ring reduce-scatter, and the fold of
those W blocks is the canonical fold.

One call path for every layout (docs/spec.md §9.1; detcomm/layout.py): the blocks carry what each rank sends in
the site's layout (numerics/layout.py ``sent``: its rows, its V/W fp32 partials, slab j = global shard r*V/W + j,
or its subtree's fp32 root), and the layout's combine folds the W received blocks (in rank order, in shard order,
or the top log2(W) levels of the tree).
  - reduce-scatter: the exchange of row blocks above, each carrying the layout's k slabs;
  - all-reduce (virtual layouts): rank q receives column block q (ceil(n/W) of a row's n elements; the last block
    is padded with zeros that are dropped) of every rank's message, combines and rounds it, and an all-gather of
    the rounded blocks gives every rank the whole rows: W times fewer fp32 bytes than gather_fold in the shard
    order, in two collectives instead of one (byte counts: docs/spec.md §9.1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..layout import PLAIN, Layout
from ..numerics.layout import sent
from ..sites import BoundRoute, Collective, ReduceOp, Route, Site
from .base import Call, bind_from
from .guard import MessageGuard, exchange_blocks
from .host_fold import HostFoldRoute


class A2AFoldRoute(HostFoldRoute):
    route = Route.A2A_FOLD

    def bind(self, site: Site) -> BoundRoute:
        guard = self._guard(site)
        layout, dtype, op = site.layout, site.dtype, site.op
        table: dict[Collective, Call] = {
            Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, op, layout=layout, dtype=dtype,
                                                                        guard=guard)}
        if layout.virtual:  # a plain all-reduce by column blocks is rs_ag_fold's (one block per element range)
            table[Collective.ALL_REDUCE] = lambda x, a: self.all_reduce(x, op, layout=layout, dtype=dtype, guard=guard)
        return bind_from(self.route, site, table, guard=guard)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, *, layout: Layout = PLAIN,
                       dtype: torch.dtype | None = None, guard: MessageGuard | None = None) -> torch.Tensor:
        """This rank's block of rows of the result, in ``dtype`` (default x's), of every rank's ``x`` in ``layout``
        (plain [rows, *shape]; virtual [V/W, rows, *shape] fp32). Collective."""
        w = self.native.world_size
        mine = sent(layout, x)  # [k, rows, *shape]
        k, rows = mine.shape[0], mine.shape[1]
        blocks = mine.view(k, w, rows // w, *mine.shape[2:]).transpose(0, 1)  # [dest, k, rows/W, *shape]
        return self._fold(self._exchange(blocks, guard), dtype or x.dtype, op, layout)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp, *, layout: Layout, dtype: torch.dtype,
                   guard: MessageGuard | None = None) -> torch.Tensor:
        """The result of a virtual layout's all-reduce: rank q combines column block q of every rank's message, and
        an all-gather of the rounded blocks gives every rank the whole rows. Collective."""
        w = self.native.world_size
        mine = sent(layout, x)  # [k, rows, *shape]
        k, rows = mine.shape[0], mine.shape[1]
        n = math.prod(mine.shape[2:])
        c = -(-n // w)  # columns per block; the last block is zero-padded
        flat = F.pad(mine.reshape(k, rows, n), (0, w * c - n))
        blocks = flat.view(k, rows, w, c).permute(2, 0, 1, 3)  # [dest, k, rows, c]
        block = self._fold(self._exchange(blocks, guard), dtype, op, layout)  # [rows, c] in dtype
        whole = self.native.all_gather(block.contiguous()).view(w, rows, c)
        return whole.permute(1, 0, 2).reshape(rows, w * c)[:, :n].reshape(rows, *x.shape[2:])

    def _exchange(self, blocks: torch.Tensor, guard: MessageGuard | None) -> torch.Tensor:
        """``blocks`` [W, k, ...]: block q goes to rank q. Returns [W, k, ...]: what every rank sent this rank, in
        rank order (so the V shards in shard order)."""
        return exchange_blocks(self.native, blocks, guard, contiguous=blocks.is_cuda)
