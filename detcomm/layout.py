"""The layout of a reduction (docs/spec.md §9.1): one value that says how a site's partials are laid out over the
ranks and how the stacked rows combine, so that every layer asks it instead of forking on the declaration.

- ``plain``: each rank holds one input row; the rows travel in the site's dtype and combine by the canonical fold in
  rank order (docs/spec.md §1). Serves every W.
- ``order(V)``: each rank holds V/W fp32 partials (slab j of rank r is global shard r*V/W + j); all V/W slabs travel
  and combine by the canonical fold in shard order. Serves every W dividing V.
- ``tree(V)``: each rank holds V/W fp32 partials, the leaves of its subtree; it folds them locally and one fp32
  root per element travels; the W roots combine by the top log2(W) levels of the fixed balanced binary tree
  (docs/spec.md §9.1 "The tree order"). V a power of two; serves every power-of-two W dividing V.

``Site.layout`` derives a site's layout from its declaration (virtual_shards, shard_fold). The combine itself is
arithmetic and lives a layer up, in detcomm/numerics/layout.py; the words here are the route table's. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

__all__ = ["Kind", "Layout", "PLAIN", "SHARD_FOLDS"]


class Kind(str, Enum):
    PLAIN = "plain"
    ORDER = "order"
    TREE = "tree"


# The declarations' spelling of a virtual-shard site's combine (Site.shard_fold): the shard order is the default.
SHARD_FOLDS = (Kind.ORDER.value, Kind.TREE.value)

# What moves, and how a route that moves it combines it (the route table's words): by the route's exchange, an
# all-gather of every rank's message, an all-to-all of row blocks (reduce-scatter), or of column blocks followed by
# an all-gather of the rounded blocks (all-reduce).
_MOVES = {
    Kind.ORDER: {"gather": "canonical fold over the shards after an all-gather of the fp32 partials",
                 "rows": "canonical fold over the shards after an all-to-all of the row blocks of the fp32 partials",
                 "columns": "all-to-all of column blocks of the fp32 partials, canonical fold, all-gather of the "
                            "rounded blocks"},
    Kind.TREE: {"gather": "all-gather of the subtree roots, the top log2(W) levels of the tree",
                "rows": "all-to-all of the row blocks of the subtree roots, the top log2(W) levels of the tree",
                "columns": "all-to-all of column blocks of the subtree roots, the top log2(W) levels, all-gather "
                           "of the rounded blocks"},
}


@dataclass(frozen=True)
class Layout:
    """How a site's partials lie over the ranks and combine: ``kind``, and V (``shards``) for the virtual ones."""

    kind: Kind
    shards: int | None = None

    @staticmethod
    def of(virtual_shards: int | None, shard_fold: str) -> Layout:
        """A declaration's layout (Site validates the pair first)."""
        return PLAIN if virtual_shards is None else Layout(Kind(shard_fold), virtual_shards)

    @property
    def virtual(self) -> bool:
        """Whether calls pass fp32 partials of V virtual shards rather than one row in the site's dtype."""
        return self.kind is not Kind.PLAIN

    def per_rank(self, world_size: int) -> int:
        """The slabs one rank holds per row: V/W partials (1 for plain)."""
        return 1 if self.shards is None else self.shards // world_size

    def sent(self, world_size: int) -> int:
        """The slabs of one row a rank sends: V/W fp32 partials in the shard order, one fp32 root in the tree, one
        row in the site's dtype for plain."""
        return self.per_rank(world_size) if self.kind is Kind.ORDER else 1

    def world_refusal(self, world_size: int) -> str | None:
        """Why this layout cannot serve a group of ``world_size`` ranks (None: it can); the fix is in the words."""
        v, w = self.shards, world_size
        if v is None or v % w == 0:
            return None
        if self.kind is Kind.TREE:
            # V is a power of two (Site), so W divides V exactly when W is a power of two no larger than V.
            return (f"shard_fold='tree' at W={w}: rank r folds the subtree of shards r*V/W .. (r+1)*V/W - 1, so W "
                    f"must be a power of two dividing V={v}; shard_fold='order' serves every W dividing V (declare "
                    f"V a multiple of every TP size you will run, e.g. {math.lcm(w, 8)}, with V/W fp32 partials per "
                    "rank on the wire)")
        return (f"virtual_shards V={v} is not divisible by the group's world size W={w} (rank r owns shards r*V/W .. "
                "(r+1)*V/W - 1); choose V a multiple of every TP size you will run, e.g. 8")

    def held(self, world_size: int) -> str:
        """What each rank holds and sends, in the route table's words (virtual layouts)."""
        k = self.per_rank(world_size)
        if self.kind is Kind.TREE:
            return (f"{self.shards} virtual shards in the tree order, each rank folds its subtree of {k} and sends "
                    "one fp32 root per element")
        return f"{self.shards} virtual shards, {k} fp32 partials per rank"

    def moves(self, how: str) -> str:
        """How a route moves and combines the partials (``how``: "gather", "rows" or "columns"; virtual layouts)."""
        return _MOVES[self.kind][how]

    def spelled(self) -> str:
        """The declaration's words for the layout, as a suffix (Site.describe, the self-checks' labels); "" plain."""
        if self.shards is None:
            return ""
        return f" virtual_shards={self.shards}" + (" shard_fold=tree" if self.kind is Kind.TREE else "")

    def declared(self) -> str:
        """The layout as a forced route's reason names it."""
        return f"{self.shards} virtual shards" + (", tree order" if self.kind is Kind.TREE else "")


PLAIN = Layout(Kind.PLAIN)
