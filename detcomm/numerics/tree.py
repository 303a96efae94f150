"""The tree order over virtual shards (docs/spec.md §9.1 "The tree order"): a fixed balanced binary tree.

For V (a power of two) fp32 shard partials p_0 .. p_{V-1} in shard order, per element::

    T(i, 1) = p_i
    T(i, n) = fp32_add_rn(T(i, n/2), T(i + n/2, n/2))        # no FMA, no flush-to-zero
    out     = round_to_nearest_even(fp32_add_rn(T(0, V), +0.0) -> dtype)   # NaN results canonical (§1)

Rank r of W (W a power of two dividing V) holds the leaves of the subtree T(r*V/W, V/W), folds it locally
(``subtree``) and sends only that root; the W roots are the leaves of the top log2(W) levels (``subtree`` again)
and ``root`` adds +0.0 and rounds once. The tree of every W is the same tree, so the bits are the same at every
W and on every route. Each level is one torch elementwise add of two fp32 tensors: one IEEE fp32 addition per
element, never contracted into an FMA and never flushing subnormals (the fold leaf's argument, fold.py); the
+0.0 at the root makes a sum of zeros +0.0 (a tree of -0.0 leaves would otherwise give -0.0).

Every function is capturable in a CUDA graph (elementwise kernels on fixed shapes; the canonical NaN is cached
per device by fold.canonical_nan).
"""

from __future__ import annotations

import torch

from .fold import canonicalize_nan

__all__ = ["subtree", "root", "tree_fold", "reference_tree", "is_power_of_two"]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def subtree(leaves: torch.Tensor) -> torch.Tensor:
    """T(0, n) of ``leaves`` [n, *rest] (fp32, n a power of two): the fp32 root [*rest], not rounded and without
    the +0.0 (an inner node of a larger tree). n = 1 returns the leaf itself."""
    assert leaves.dtype == torch.float32, "the tree adds fp32 partials"
    n = leaves.shape[0]
    assert is_power_of_two(n), f"a balanced tree needs a power-of-two leaf count, got {n}"
    level = leaves
    while n > 1:
        # Pairs (2k, 2k+1) of this level are the children of node k of the next one: T(i, 2m) = T(i, m) + T(i+m, m).
        n //= 2
        pairs = level.reshape(n, 2, *level.shape[1:])
        level = torch.add(pairs[:, 0], pairs[:, 1])
    return level[0]


def root(acc: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The tree's result from its fp32 root T(0, V): +0.0 added once, one round-to-nearest-even to ``out_dtype``,
    canonical NaN."""
    assert acc.dtype == torch.float32
    acc = acc + 0.0
    return canonicalize_nan(acc if out_dtype == torch.float32 else acc.to(out_dtype))


def tree_fold(leaves: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The whole tree of ``leaves`` [V, *rest] fp32 in shard order: the site's result [*rest] in ``out_dtype``."""
    return root(subtree(leaves), out_dtype)


def reference_tree(leaves: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The definition, recursion for recursion (what the self-checks compare a route with; ``tree_fold`` is the
    level-by-level form the routes run): ``leaves`` [V, *rest] fp32 -> [*rest] in ``out_dtype``."""
    if leaves.dtype != torch.float32 or not is_power_of_two(leaves.shape[0]):
        raise ValueError(f"the tree takes [V, ...] fp32 leaves with V a power of two, got {leaves.dtype} "
                         f"{list(leaves.shape)}")

    def t(i: int, n: int) -> torch.Tensor:
        if n == 1:
            return leaves[i]
        return torch.add(t(i, n // 2), t(i + n // 2, n // 2))

    acc = torch.add(t(0, leaves.shape[0]), torch.zeros_like(leaves[0]))
    return canonicalize_nan(acc if out_dtype == torch.float32 else acc.to(out_dtype))
