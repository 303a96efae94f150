"""The canonical fold (docs/spec.md section 1) and the registry of its implementations ("leaves").

For a SUM over W ranks every batch-invariant route computes, element by element::

    acc = +0.0 (fp32)
    for r in 0 .. W-1:  acc = fp32_add_rn(acc, fp32(x_r))   # exact widening, no FMA, no flush-to-zero
    out = round_to_nearest_even(acc -> output dtype)          # one rounding; none for fp32

NaN policy (project-wide, every route and kernel): a NaN result is written as the canonical positive quiet
NaN with an empty payload (fp32 0x7FC00000, bf16 0x7FC0, fp16 0x7E00). IEEE addition leaves the choice of
which input NaN's payload survives to the hardware, so without this a NaN's bits could differ between a CPU
and a GPU leaf, or between two kernels. Inf propagates as IEEE addition says (Inf + -Inf is NaN).

A leaf registers the features it guarantees; a bitwise envelope REQUIRES ``batch_invariant``, so a missing
leaf is a startup error naming what is missing, never a silent fallback. Declaring the feature is a claim,
not a proof: the startup self-checks (detcomm.selfcheck) compare every leaf that serves a bitwise site with
``reference_fold`` and refuse one that differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch

from .._torch_version import require
from ..dtypes import FLOAT_DTYPES, bits_view, info
from ..errors import NoFoldLeaf

require(torch.__version__)  # every route folds through here: an unsupported torch is refused at import

__all__ = [
    "FLOAT_DTYPES",
    "BATCH_INVARIANT",
    "Leaf",
    "Priority",
    "canonical_nan",
    "canonicalize_nan",
    "reference_fold",
    "product_fold",
    "portable_fold",
    "fold_shards",
    "register_leaf",
    "unregister_leaf",
    "select_leaf",
    "registered_leaves",
]

BATCH_INVARIANT = "batch_invariant"

FoldFn = Callable[[torch.Tensor, torch.dtype], torch.Tensor]

def canonical_nan(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The canonical NaN of ``dtype`` as a 0-d tensor, built from its bits (not from float('nan')).

    Cached per (dtype, device): building it uploads from host memory, which a CUDA graph capture forbids, so
    the fold is capturable once it has run on that device outside capture."""
    return _canonical_nan(dtype, str(torch.device(device)))


@functools.cache
def _canonical_nan(dtype: torch.dtype, device: str) -> torch.Tensor:
    bits = info(dtype).nan_bits
    assert bits is not None, f"{dtype} has no NaN"
    int_dtype = bits_view(dtype)
    if int_dtype is torch.int16 and bits >= 0x8000:
        bits -= 0x10000
    return torch.tensor([bits], dtype=int_dtype, device=device).view(dtype)[0]


def canonicalize_nan(t: torch.Tensor) -> torch.Tensor:
    """Replace every NaN in ``t`` by the canonical NaN of its dtype (returns a new tensor)."""
    return torch.where(torch.isnan(t), canonical_nan(t.dtype, t.device), t)


def reference_fold(stacked: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The canonical fold's definition: ``stacked`` is [W, *rest]; returns [*rest] in ``out_dtype``.

    Each ``add_`` is one IEEE fp32 addition per element (torch's elementwise kernels do not contract into
    FMA and do not flush subnormals), and ``.to()`` rounds to nearest even.
    """
    if stacked.dtype not in FLOAT_DTYPES or out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"the fold takes {FLOAT_DTYPES}, got {stacked.dtype} -> {out_dtype}")
    acc = torch.zeros(stacked.shape[1:], dtype=torch.float32, device=stacked.device)
    for r in range(stacked.shape[0]):
        acc.add_(stacked[r].to(torch.float32))
    return canonicalize_nan(acc.to(out_dtype))


def product_fold(stacked: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The canonical PRODUCT (docs/spec.md §1.1): ``stacked`` is [W, *rest] in rank order; returns [*rest].

    ``acc = 1.0``, then for r in 0..W-1 one IEEE multiplication ``acc = acc * wide(x_r)`` (fp32 for bf16 / fp16 /
    fp32, fp64 for fp64; exact widening), then one round-to-nearest-even to ``out_dtype``. A product's rounding
    (and an intermediate overflow or underflow) depends on the order, so the order is the group's rank order,
    never another. The sign of a zero is IEEE's (the XOR of the inputs' signs: order-free, so it is kept); a NaN
    result is the canonical NaN (fp64: torch's quiet NaN, as for the backend's fp64 extrema)."""
    wide = torch.float64 if stacked.dtype == torch.float64 else torch.float32
    if stacked.dtype not in (*FLOAT_DTYPES, torch.float64) or out_dtype != stacked.dtype:
        raise ValueError(f"the product takes one of {(*FLOAT_DTYPES, torch.float64)} to itself, got "
                         f"{stacked.dtype} -> {out_dtype}")
    acc = torch.ones(stacked.shape[1:], dtype=wide, device=stacked.device)
    for r in range(stacked.shape[0]):
        acc.mul_(stacked[r].to(wide))
    if wide == torch.float64:
        return torch.where(torch.isnan(acc), torch.full_like(acc, float("nan")), acc)
    return canonicalize_nan(acc.to(out_dtype))


def average(folded_fp32: torch.Tensor, world_size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``op="avg"`` on the canonical routes: the canonical fold kept in fp32 (not rounded to the dtype), one
    IEEE fp32 division by the world size, then one round-to-nearest-even to ``out_dtype`` (none for fp32).
    NaN results are the canonical NaN, as for every fold."""
    assert folded_fp32.dtype == torch.float32
    return canonicalize_nan(divide_exactly(folded_fp32, world_size).to(out_dtype))


def divide_exactly(t: torch.Tensor, divisor: int) -> torch.Tensor:
    """``t / divisor``, one correctly rounded IEEE division per element, on every device. The divisor is a full
    tensor like t: given a Python or CPU scalar, torch's CUDA kernel multiplies by the rounded reciprocal instead,
    which differs from the division in the last bit for some inputs (seen on an H200: fp16 averages of 3 ranks off
    the CPU's bits). A fill is capturable in a CUDA graph; a host-to-device copy of the divisor would not be."""
    return torch.div(t, torch.full_like(t, divisor))


# The most inputs one leaf call folds in fold_shards: every registered leaf folds at least this many (the CUDA
# leaf's kernels take up to 8).
_SHARD_CHUNK = 8


def fold_shards(stacked: torch.Tensor, out_dtype: torch.dtype, fold: FoldFn) -> torch.Tensor:
    """A virtual-shard site's result (docs/spec.md §9.1): ``stacked`` is the fp32 partials of all V shards
    [V, *rest] in shard order; returns ``reference_fold(stacked, out_dtype)``'s bits through the leaf ``fold``.

    The leaf folds into fp32 (no rounding), then one round-to-nearest-even to ``out_dtype``: a leaf that rounds
    to its input dtype (the CUDA leaf) serves as it is. More than ``_SHARD_CHUNK`` shards are folded in chunks,
    each chunk's fold starting from the previous accumulator: exact, because a fold that starts from +0.0 never
    holds -0.0, and +0.0 + acc == acc for every other acc, so the chained fold adds the same operands in the same
    order as one fold over all V."""
    assert stacked.dtype == torch.float32, "the communicator checks that virtual-shard partials are fp32"
    if stacked.is_cuda:
        stacked = stacked.contiguous()  # the CUDA leaf reads one contiguous block
    acc = fold(stacked[:_SHARD_CHUNK], torch.float32)
    for start in range(_SHARD_CHUNK, stacked.shape[0], _SHARD_CHUNK - 1):
        acc = fold(torch.cat([acc.unsqueeze(0), stacked[start : start + _SHARD_CHUNK - 1]]), torch.float32)
    return acc if out_dtype == torch.float32 else canonicalize_nan(acc.to(out_dtype))


def portable_fold(stacked: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The same bits as ``reference_fold`` with fewer passes over memory: ``x0 + 0.0`` equals ``0.0 + x0``
    bit for bit (IEEE addition commutes; -0.0 + +0.0 is +0.0), and ``add_`` of a bf16/fp16 operand into an
    fp32 accumulator widens each element exactly before its one fp32 addition, with no temporary."""
    if stacked.dtype not in FLOAT_DTYPES or out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"the fold takes {FLOAT_DTYPES}, got {stacked.dtype} -> {out_dtype}")
    acc = stacked[0].to(torch.float32, copy=True).add_(0.0)
    for r in range(1, stacked.shape[0]):
        acc.add_(stacked[r])
    return canonicalize_nan(acc if out_dtype == torch.float32 else acc.to(out_dtype))


class Priority(IntEnum):
    """Selection bands: a vendor leaf registers above the portable one and plain selection takes it."""

    PORTABLE = 0
    VENDOR = 100


@dataclass(frozen=True)
class Leaf:
    """A fold implementation.

    Attributes:
        name: unique name, shown in the route table.
        fold: ``fold(stacked [W, *rest], out_dtype) -> [*rest]``.
        priority: higher wins; equal priorities are ordered by name.
        features: what the leaf guarantees (``"batch_invariant"``: the canonical fold's bits).
        device_types: torch device types it runs on.
    """

    name: str
    fold: FoldFn
    priority: int = Priority.PORTABLE
    features: frozenset[str] = frozenset()
    device_types: frozenset[str] = frozenset({"cpu", "cuda"})


_LEAVES: dict[str, Leaf] = {}


def register_leaf(leaf: Leaf, *, replace: bool = False) -> Leaf:
    """Register a fold leaf. ``replace=True`` swaps a leaf of the same name."""
    if leaf.name in _LEAVES and not replace:
        raise ValueError(f"fold leaf {leaf.name!r} is already registered (pass replace=True to swap it)")
    _LEAVES[leaf.name] = leaf
    return leaf


def unregister_leaf(name: str) -> None:
    _LEAVES.pop(name, None)


def registered_leaves() -> tuple[Leaf, ...]:
    return tuple(sorted(_LEAVES.values(), key=lambda l: (-l.priority, l.name)))


def select_leaf(*, device_type: str, required: frozenset[str] = frozenset()) -> Leaf:
    """The highest-priority leaf for ``device_type`` whose features include ``required``.

    Raises RuntimeError naming what is missing when none qualifies: a bitwise envelope must fail at
    startup rather than run a fold that makes no claim.
    """
    eligible = [l for l in registered_leaves() if device_type in l.device_types and required <= l.features]
    if not eligible:
        have = ", ".join(
            f"{l.name}(features={sorted(l.features)}, devices={sorted(l.device_types)})" for l in registered_leaves()
        ) or "none"
        raise NoFoldLeaf(
            f"no fold leaf for device type {device_type!r} declares the features {sorted(required)}; "
            f"registered leaves: {have}. Register one with detcomm.numerics.fold.register_leaf(Leaf(..., "
            f"features=frozenset({sorted(required)}))) or use numerics='auto'."
        )
    return eligible[0]


register_leaf(
    Leaf(
        name="torch_portable",
        fold=portable_fold,
        priority=Priority.PORTABLE,
        features=frozenset({BATCH_INVARIANT}),
        device_types=frozenset({"cpu", "cuda"}),
    )
)
