"""The rs_ag_fold route for all-reduce: a reduce-scatter by all-to-all and the canonical fold, then an
all-gather of the rounded blocks. The bandwidth-optimal canonical all-reduce where no workspace serves a site.

A call's input (rows x row) is flattened and split into W column blocks of c = ceil(n/W) elements (the last
zero-padded; the padding is dropped from the result). An all-to-all gives rank q block q of every rank, in rank
order; rank q folds those W blocks (the plain layout's combine, detcomm/numerics/layout.py; docs/spec.md §1:
fp32 from +0.0 in rank order, one rounding, canonical NaN; ``op="avg"``: the fp32 fold, one division by W, one
rounding) and an all-gather of the W rounded blocks gives
every rank the whole result, moved bit for bit (a -0.0 result stays -0.0). The fold is element-wise, so where
the block boundaries fall moves no bit: a row's result depends only on its W inputs, not on the batch, its
offset or W's divisibility, and equals gather_fold's and the workspace's.

Bytes received per rank: (W-1)/W of the message in each collective, 2(W-1)/W in all (a ring all-reduce's),
against gather_fold's W-1 times the message; two collectives instead of one, so the router takes it only above
a static break-even size (route.py, ``rs_ag_refusal``).

On CUDA the fold of the W blocks is one launch of the CUDA fold leaf (csrc/fold_local.cu through
detcomm/numerics/cuda_leaf.py) on the contiguous [W, c] block the all-to-all wrote; nothing on the call path
synchronizes with the host but the call guard's comparison (guard.py: on an NCCL group the header travels in the
all-to-all's blocks and is read back after it; inside a CUDA-graph capture it is left out, so a call is capturable).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout import PLAIN
from ..sites import BoundRoute, Collective, ReduceOp, Route, Site
from .base import bind_from
from .guard import MessageGuard, exchange_blocks
from .host_fold import HostFoldRoute

__all__ = ["RsAgFoldRoute"]


class RsAgFoldRoute(HostFoldRoute):
    route = Route.RS_AG_FOLD

    def bind(self, site: Site) -> BoundRoute:
        guard = self._guard(site)
        return bind_from(self.route, site,
                         {Collective.ALL_REDUCE: lambda x, a: self.all_reduce(x, site.op, guard=guard)}, guard=guard)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp, *, guard: MessageGuard | None = None) -> torch.Tensor:
        """The canonical all-reduce of ``x`` (SUM or AVG). Collective over the group."""
        assert op.sums, "routing sends only floating-point SUM and AVG here"
        w = self.native.world_size
        n = x.numel()
        c = -(-n // w)  # elements per block; the last block is zero-padded
        flat = x.reshape(-1)
        if w * c != n:
            flat = F.pad(flat, (0, w * c - n))
        # Block q goes to rank q; rank q receives block q of every rank, in rank order.
        stacked = exchange_blocks(self.native, flat.view(w, c), guard, contiguous=x.is_cuda)
        mine = self._fold(stacked.unsqueeze(1), x.dtype, op, PLAIN)
        return self.native.all_gather(mine)[:n].view(x.shape)
