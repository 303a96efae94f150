"""The a2a_fold route for reduce-scatter: all-to-all of the row blocks, then the canonical fold.

Rank r sends its row block q to rank q and receives block r from every rank, in rank order, so it holds
exactly the W inputs of its own output rows: no extra traffic over a ring reduce-scatter, and the fold of
those W blocks is the canonical fold.

Virtual-shard sites (docs/spec.md §9.1), input this rank's [V/W, rows, *shape] fp32 partials (slab j = global
shard r*V/W + j):
  - reduce-scatter: the same exchange of row blocks, each carrying V/W slabs; rank r receives the V shards of
    its rows, in shard order, and folds them;
  - all-reduce: rank q receives column block q (ceil(n/W) of a row's n elements; the last block is padded with
    zeros that are dropped) of every rank's slabs, folds the V shards of its columns and rounds them, and an
    all-gather of the rounded blocks gives every rank the whole rows. Each rank receives the other ranks' V/W
    fp32 slabs of its column block (1/W of a row) and their rounded blocks: W times fewer fp32 bytes than
    gather_fold, in two collectives instead of one (byte counts: docs/spec.md §9.1).
A tree-order site (``shard_fold="tree"``, docs/spec.md §9.1 "The tree order") exchanges the same blocks of its
subtree root (this rank's V/W slabs folded locally, one fp32 value per element) and folds the top log2(W) levels
of the tree over the W received blocks: the reduce-scatter of a plain fold with fp32 messages.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..numerics import tree
from ..numerics.fold import Leaf, average, fold_shards
from ..sites import BoundRoute, Collective, ReduceOp, Route, Site
from .base import bind_from
from .guard import MessageGuard, exchange_blocks
from .native import NativeRoute


class A2AFoldRoute:
    route = Route.A2A_FOLD

    def __init__(self, native: NativeRoute, leaf: Leaf) -> None:
        self.native = native
        self.leaf = leaf

    def bind(self, site: Site) -> BoundRoute:
        # The call guard inside the exchanged blocks where the group's messages live in device memory (guard.py).
        guard = MessageGuard(site, native=self.native) if self.native.in_message else None
        if site.virtual_shards is not None and site.shard_fold == "tree":
            dtype = site.dtype
            return bind_from(self.route, site, {
                Collective.ALL_REDUCE: lambda x, a: self.tree_all_reduce(x, dtype, guard=guard),
                Collective.REDUCE_SCATTER: lambda x, a: self.tree_reduce_scatter(x, dtype, guard=guard),
            }, guard=guard)
        if site.virtual_shards is not None:
            dtype = site.dtype
            return bind_from(self.route, site, {
                Collective.ALL_REDUCE: lambda x, a: self.virtual_all_reduce(x, dtype, guard=guard),
                Collective.REDUCE_SCATTER: lambda x, a: self.virtual_reduce_scatter(x, dtype, guard=guard),
            }, guard=guard)
        return bind_from(self.route, site,
                         {Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, site.op, guard=guard)},
                         guard=guard)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, *, guard: MessageGuard | None = None) -> torch.Tensor:
        assert op.sums, "routing sends only floating-point SUM and AVG here"
        w = self.native.world_size
        n = x.shape[0] // w
        stacked = exchange_blocks(self.native, x.view(w, n, *x.shape[1:]), guard, contiguous=x.is_cuda)
        if op is ReduceOp.AVG:
            return average(self.leaf.fold(stacked, torch.float32), w, x.dtype)
        return self.leaf.fold(stacked, x.dtype)

    # -- virtual shards ------------------------------------------------------------------------------------------
    def _exchange(self, blocks: torch.Tensor, guard: MessageGuard | None) -> torch.Tensor:
        """``blocks`` [W, V/W, ...]: block q goes to rank q. Returns [V, ...]: what every rank sent this rank, in
        rank order, so in shard order."""
        return exchange_blocks(self.native, blocks, guard, contiguous=True).view(-1, *blocks.shape[2:])

    def virtual_reduce_scatter(self, x: torch.Tensor, dtype: torch.dtype, *,
                               guard: MessageGuard | None = None) -> torch.Tensor:
        w = self.native.world_size
        k, rows = x.shape[0], x.shape[1]
        blocks = x.view(k, w, rows // w, *x.shape[2:]).transpose(0, 1)  # [dest, V/W, rows/W, *shape]
        return fold_shards(self._exchange(blocks, guard), dtype, self.leaf.fold)

    def virtual_all_reduce(self, x: torch.Tensor, dtype: torch.dtype, *, guard: MessageGuard | None = None) -> torch.Tensor:
        w = self.native.world_size
        k, rows = x.shape[0], x.shape[1]
        n = math.prod(x.shape[2:])
        c = -(-n // w)  # columns per block; the last block is zero-padded
        flat = F.pad(x.reshape(k, rows, n), (0, w * c - n))
        blocks = flat.view(k, rows, w, c).permute(2, 0, 1, 3)  # [dest, V/W, rows, c]
        mine = fold_shards(self._exchange(blocks, guard), dtype, self.leaf.fold)  # [rows, c] in dtype
        whole = self.native.all_gather(mine.contiguous()).view(w, rows, c)
        return whole.permute(1, 0, 2).reshape(rows, w * c)[:, :n].reshape(rows, *x.shape[2:])

    # -- the tree order: the blocks carry this rank's subtree root, one fp32 value per element -------------------
    def tree_reduce_scatter(self, x: torch.Tensor, dtype: torch.dtype, *,
                            guard: MessageGuard | None = None) -> torch.Tensor:
        w = self.native.world_size
        rows = x.shape[1]
        blocks = tree.subtree(x).reshape(w, 1, rows // w, *x.shape[2:])  # [dest, 1, rows/W, *shape]
        return tree.tree_fold(self._exchange(blocks, guard), dtype)

    def tree_all_reduce(self, x: torch.Tensor, dtype: torch.dtype, *, guard: MessageGuard | None = None) -> torch.Tensor:
        w = self.native.world_size
        rows = x.shape[1]
        n = math.prod(x.shape[2:])
        c = -(-n // w)  # columns per block; the last block is zero-padded
        flat = F.pad(tree.subtree(x).reshape(rows, n), (0, w * c - n))
        blocks = flat.view(rows, w, c).permute(1, 0, 2).unsqueeze(1)  # [dest, 1, rows, c]
        mine = tree.tree_fold(self._exchange(blocks, guard), dtype)  # [rows, c] in dtype
        whole = self.native.all_gather(mine.contiguous()).view(w, rows, c)
        return whole.permute(1, 0, 2).reshape(rows, w * c)[:, :n].reshape(rows, *x.shape[2:])
