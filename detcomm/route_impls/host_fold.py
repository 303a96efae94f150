"""What the host fold routes (gather_fold, a2a_fold, rs_ag_fold) share: the group's transport and fold leaf, the
call guard a bound site carries in its messages, and the layout's combine of the rows a route moved.

Each route is "move what the site's layout sends, then the layout's combine" (detcomm/numerics/layout.py); the
routes differ only in how they move the rows (an all-gather, an all-to-all of row or column blocks), which is
what each route's own file holds.
"""

from __future__ import annotations

import torch

from ..layout import Layout
from ..numerics.fold import Leaf
from ..numerics.layout import combine
from ..sites import ReduceOp, Site
from .guard import MessageGuard
from .native import NativeRoute


class HostFoldRoute:
    """The base of the host fold routes: ``native`` moves the messages, ``leaf`` folds them."""

    def __init__(self, native: NativeRoute, leaf: Leaf) -> None:
        self.native = native
        self.leaf = leaf

    def _guard(self, site: Site) -> MessageGuard | None:
        # The call guard inside the route's messages where the group's messages live in device memory (guard.py).
        return MessageGuard(site, native=self.native) if self.native.in_message else None

    def _fold(self, moved: torch.Tensor, dtype: torch.dtype, op: ReduceOp, layout: Layout) -> torch.Tensor:
        """The layout's combine of ``moved`` [W, k, ...] (every rank's message in rank order) through the leaf."""
        return combine(layout, moved, dtype, op, self.leaf.fold)
