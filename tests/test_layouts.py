"""The layout value (detcomm/layout.py) and its arithmetic (detcomm/numerics/layout.py), on one process: which W
each layout serves, and the bits of "what each rank sends, stacked in rank order, then the layout's combine"
against the exact oracles (tests/oracle.py's fold, test_tree_fold's tree definition), with negative controls.
The routes that move the messages between real ranks are tests/test_virtual_shards.py and test_tree_fold.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, to_bits, to_torch
from detcomm.layout import PLAIN, Kind, Layout
from detcomm.numerics.fold import portable_fold
from detcomm.numerics.layout import combine, sent
from detcomm.sites import Collective, ReduceOp, Site
from test_tree_fold import DTYPES, PARTIALS, WIDTHS, V, order_oracle, tree_oracle


def test_each_layout_serves_its_worlds() -> None:
    assert Layout.of(None, "order") is PLAIN and not PLAIN.virtual
    order, tree = Layout.of(12, "order"), Layout.of(8, "tree")
    assert (order.kind, order.shards, tree.kind) == (Kind.ORDER, 12, Kind.TREE)
    assert Site("s", Collective.ALL_REDUCE, torch.float32, (4,), 2, virtual_shards=8, shard_fold="tree").layout == tree
    assert [w for w in range(1, 13) if PLAIN.world_refusal(w) is None] == list(range(1, 13))
    assert [w for w in range(1, 13) if order.world_refusal(w) is None] == [1, 2, 3, 4, 6, 12]
    assert [w for w in range(1, 13) if tree.world_refusal(w) is None] == [1, 2, 4, 8]
    assert "power of two dividing V=8" in (tree.world_refusal(3) or "")
    assert "not divisible by the group's world size W=5" in (order.world_refusal(5) or "")
    # What a rank holds and sends of one row: V/W slabs; all of them in the shard order, one root in the tree.
    assert (order.per_rank(4), order.sent(4), tree.per_rank(4), tree.sent(4), PLAIN.sent(4)) == (3, 3, 2, 1, 1)


def _moved(layout: Layout, partials: torch.Tensor, w: int) -> torch.Tensor:
    """Every rank's message stacked in rank order, [W, k, rows, width]: what a route's gather delivers."""
    k = V // w
    return torch.stack([sent(layout, partials[r * k : (r + 1) * k]) for r in range(w)])


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_virtual_combine_bits_equal_oracle(w: int) -> None:
    order, tree = Layout(Kind.ORDER, V), Layout(Kind.TREE, V)
    differ = 0
    for dt in DTYPES:
        for width in WIDTHS:
            bits = PARTIALS[(dt, width)]
            partials = to_torch(bits, "float32")
            dtype = getattr(torch, dt)
            got_order = to_bits(combine(order, _moved(order, partials, w), dtype, ReduceOp.SUM, portable_fold))
            got_tree = to_bits(combine(tree, _moved(tree, partials, w), dtype, ReduceOp.SUM, portable_fold))
            np.testing.assert_array_equal(got_order, order_oracle(bits, dt))
            np.testing.assert_array_equal(got_tree, tree_oracle(bits, dt))
            differ += int((got_order != got_tree).sum())
    assert differ > 0  # negative control: the payload tells the two combines apart


def _moved_plain(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([sent(PLAIN, x) for x in xs])


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
def test_plain_combine_bits_equal_oracle(op: ReduceOp) -> None:
    for dt in DTYPES:
        inputs = [ill_bits(6, 9, dt, seed=41, rank=q) for q in range(3)]
        moved = _moved_plain([to_torch(b, dt) for b in inputs])
        got = to_bits(combine(PLAIN, moved, getattr(torch, dt), op, portable_fold))
        want = (oracle.fold_oracle if op is ReduceOp.SUM else oracle.avg_oracle)(inputs, dt)
        np.testing.assert_array_equal(got, want)
        # Negative control: the ranks in another order give other bits on the ill-conditioned payload.
        rev = to_bits(combine(PLAIN, moved.flip(0), getattr(torch, dt), op, portable_fold))
        assert not np.array_equal(rev, want)
