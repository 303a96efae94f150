"""Bit-level comparison of tensors: which elements changed, and by how many units in the last place.

Probes compare bits, never values: -0.0 == +0.0 and NaN != NaN as values, but a row whose -0.0 became +0.0
has changed. The distance in ulps maps each float's bits to an integer that is monotone in the value
(sign-magnitude to two's complement), so adjacent floats differ by 1 and the distance crosses zero correctly.
"""

from __future__ import annotations

import torch

__all__ = ["INT_VIEW", "bits", "changed_mask", "ulp_distance"]

# Same-width integer views of the floating dtypes the probes handle.
INT_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``x`` (an integer tensor of the same width); integers are returned as they are."""
    if x.dtype in INT_VIEW:
        return x.contiguous().view(INT_VIEW[x.dtype])
    if x.dtype.is_floating_point or x.dtype.is_complex:
        raise ValueError(f"no bit view for dtype {x.dtype}; supported: {sorted(str(d) for d in INT_VIEW)}")
    return x


def changed_mask(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do ``a`` and ``b`` differ in any bit? Shapes and dtypes must match."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    return bits(a) != bits(b)


def _ordered(x: torch.Tensor) -> torch.Tensor:
    i = bits(x).to(torch.int64)
    width = torch.iinfo(INT_VIEW[x.dtype]).bits
    magnitude = i & ((1 << (width - 1)) - 1)
    # Negative floats: order by negated magnitude, so -0.0 and +0.0 both map to 0.
    return torch.where(i < 0, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values of the dtype lie between ``a`` and ``b`` (float64 result).

    0 for equal bits and for the pair (-0.0, +0.0); +inf where exactly one side is NaN or both are NaN with
    different bits (no finite distance means anything there). Integer tensors: the absolute difference.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    if not a.dtype.is_floating_point:
        return (a.to(torch.float64) - b.to(torch.float64)).abs()
    dist = (_ordered(a) - _ordered(b)).abs().to(torch.float64)
    nan = torch.isnan(a) | torch.isnan(b)
    return torch.where(nan & changed_mask(a, b), torch.full_like(dist, float("inf")), torch.where(nan, 0.0, dist))
