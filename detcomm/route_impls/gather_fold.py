"""The gather_fold route: all-gather every rank's input, then the canonical fold locally.

World-size times the traffic of a reduction, on any platform, any W, across nodes. Every rank folds the same
gathered bytes with the same leaf, so all ranks hold identical bits, and a row's result depends only on that
row's W inputs: not on the row count, its offset, or the stream.

A virtual-shard site (docs/spec.md §9.1) gathers every rank's V/W fp32 partials instead: rank r's slab j is
global shard r*V/W + j, so the gathered [W, V/W, ...] block is the V shards in shard order, and every rank folds
all V of them (V/W fp32 slabs per rank on the wire, against one dtype row for a plain site). A tree-order site
(``shard_fold="tree"``, docs/spec.md §9.1 "The tree order") folds its own subtree first and gathers one fp32 root
per rank (rank order is the tree's leaf order); every rank folds the top log2(W) levels.
"""

from __future__ import annotations

import torch

from ..numerics import tree
from ..numerics.fold import Leaf, average, fold_shards
from ..sites import BoundRoute, Collective, ReduceOp, Route, Site
from .base import bind_from
from .guard import MessageGuard, gather
from .native import NativeRoute


class GatherFoldRoute:
    route = Route.GATHER_FOLD

    def __init__(self, native: NativeRoute, leaf: Leaf) -> None:
        self.native = native
        self.leaf = leaf

    def bind(self, site: Site) -> BoundRoute:
        # The call guard inside the gathered messages where the group's messages live in device memory (guard.py).
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
        return bind_from(self.route, site, {
            Collective.ALL_REDUCE: lambda x, a: self.all_reduce(x, site.op, guard=guard),
            Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, site.op, guard=guard),
        }, guard=guard)

    def _gathered(self, x: torch.Tensor, guard: MessageGuard | None, *, contiguous: bool = False) -> torch.Tensor:
        # The torch leaf folds strided views; the CUDA leaf reads one contiguous [W, ...] block.
        return gather(self.native, x, guard, contiguous=contiguous or x.is_cuda)

    def _fold(self, stacked: torch.Tensor, dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
        assert op.sums, "routing sends only floating-point SUM and AVG here"
        if op is ReduceOp.AVG:
            return average(self.leaf.fold(stacked, torch.float32), stacked.shape[0], dtype)
        return self.leaf.fold(stacked, dtype)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp, *, guard: MessageGuard | None = None) -> torch.Tensor:
        return self._fold(self._gathered(x, guard), x.dtype, op)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, *, guard: MessageGuard | None = None) -> torch.Tensor:
        n = x.shape[0] // self.native.world_size
        r = self.native.rank
        return self._fold(self._gathered(x, guard)[:, r * n : (r + 1) * n], x.dtype, op)

    # -- virtual shards: x is this rank's [V/W, rows, *shape] fp32 partials -------------------------------------
    def _shards(self, x: torch.Tensor, guard: MessageGuard | None) -> torch.Tensor:
        """All V shards' partials [V, rows, *shape] in shard order (rank r's slab j is shard r*V/W + j)."""
        return self._gathered(x, guard, contiguous=True).view(-1, *x.shape[1:])

    def virtual_all_reduce(self, x: torch.Tensor, dtype: torch.dtype, *, guard: MessageGuard | None = None) -> torch.Tensor:
        return fold_shards(self._shards(x, guard), dtype, self.leaf.fold)

    def virtual_reduce_scatter(self, x: torch.Tensor, dtype: torch.dtype, *,
                               guard: MessageGuard | None = None) -> torch.Tensor:
        n = x.shape[1] // self.native.world_size
        r = self.native.rank
        return fold_shards(self._shards(x, guard)[:, r * n : (r + 1) * n], dtype, self.leaf.fold)

    # -- the tree order: x is this rank's [V/W, rows, *shape] fp32 partials, the leaves of its subtree ------------
    def _roots(self, x: torch.Tensor, guard: MessageGuard | None) -> torch.Tensor:
        """Every rank's subtree root [W, rows, *shape] fp32, in rank order (the top levels' leaf order)."""
        return self._gathered(tree.subtree(x).contiguous(), guard)

    def tree_all_reduce(self, x: torch.Tensor, dtype: torch.dtype, *, guard: MessageGuard | None = None) -> torch.Tensor:
        return tree.tree_fold(self._roots(x, guard), dtype)

    def tree_reduce_scatter(self, x: torch.Tensor, dtype: torch.dtype, *,
                            guard: MessageGuard | None = None) -> torch.Tensor:
        n = x.shape[1] // self.native.world_size
        r = self.native.rank
        return tree.tree_fold(self._roots(x, guard)[:, r * n : (r + 1) * n], dtype)
