"""A layout's arithmetic (detcomm/layout.py says what each layout is): what a rank sends of its input, and how the
stacked rows a route moved combine into the result, so that a route is "move the rows, then the layout's combine".

``sent(layout, x)`` is a rank's message as [k, rows, *shape]: its row (k = 1, plain), its V/W fp32 partials
(k = V/W, the shard order) or its subtree's fp32 root (k = 1, the tree; folded here, before anything travels).
A route moves the messages so that a rank holds [W, k, ...] in rank order, which ``combine`` reads as the
operands [W*k, ...] of:
  - plain: the canonical fold in rank order (docs/spec.md §1; ``op="avg"``: the fp32 fold, one division by W,
    one rounding), through the group's leaf;
  - order(V): the canonical fold over the V shards in shard order (rank r's slab j is shard r*V/W + j), through the
    leaf (fold.fold_shards);
  - tree(V): the top log2(W) levels of the tree over the W roots, one rounding (tree.tree_fold).
"""

from __future__ import annotations

import torch

from ..layout import Kind, Layout
from ..sites import ReduceOp
from . import tree
from .fold import FoldFn, average, fold_shards

__all__ = ["sent", "combine"]


def sent(layout: Layout, x: torch.Tensor) -> torch.Tensor:
    """What this rank sends of its input ``x`` ([rows, *shape] plain, [V/W, rows, *shape] fp32 virtual), as
    [k, rows, *shape]."""
    if layout.kind is Kind.TREE:
        return tree.subtree(x).contiguous().unsqueeze(0)
    return x if layout.virtual else x.unsqueeze(0)


def combine(layout: Layout, moved: torch.Tensor, dtype: torch.dtype, op: ReduceOp, fold: FoldFn) -> torch.Tensor:
    """The result in ``dtype`` of the messages a route moved, ``moved`` [W, k, rows, *rest] in rank order (any
    rows and trailing block the route chose: the combine is element-wise over them)."""
    assert op.sums, "routing sends only floating-point SUM and AVG here"
    stacked = moved.reshape(-1, *moved.shape[2:])
    if layout.kind is Kind.TREE:
        return tree.tree_fold(stacked, dtype)
    if layout.kind is Kind.ORDER:
        return fold_shards(stacked, dtype, fold)
    if op is ReduceOp.AVG:
        return average(fold(stacked, torch.float32), stacked.shape[0], dtype)
    return fold(stacked, dtype)
