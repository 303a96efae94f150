"""Ill-conditioned payloads: the inputs that expose a reduction whose association order moves.

Values whose sum depends on the order they are added in: magnitudes from the bottom to the top of the dtype's
range, near-cancelling values of similar magnitude across ranks, one huge value beside small ones, signed zeros
and subnormals. Deterministic in (seed, rank), identical on every platform (generated on the CPU, moved after).
The self-checks, the demo, the probes and the bench all draw from here so that their numbers compare.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ill_conditioned", "with_specials"]

# Decimal exponent range per dtype, kept inside the finite range so single values never overflow.
_EXP_RANGE = {torch.float32: (-38.0, 37.5), torch.bfloat16: (-38.0, 37.5), torch.float16: (-7.0, 4.0)}
_SUBNORMAL_SCALE = {torch.float32: 1e-40, torch.bfloat16: 5e-40, torch.float16: 3e-5}
_BIG = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float16: 3e4}


def _gen(*keys: int) -> torch.Generator:
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + int(k) + 0x9E3779B9) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def ill_conditioned(
    rows: int, shape: tuple[int, ...], dtype: torch.dtype, *, seed: int, rank: int, world_size: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A [rows, *shape] tensor of ``dtype`` for ``rank``; the per-element value class is shared by every rank
    (drawn from ``seed`` alone) so that ranks cancel each other element by element. With ``world_size`` the
    cancelling pairs are spread over all W ranks (any reordering of ranks is then seen after rounding to bf16
    or fp16, at any W >= 3); without it they follow rank % 3."""
    n = rows * math.prod(shape)
    shared = _gen(seed, 0xC1A55)
    own = _gen(seed, rank + 1)
    lo, hi = _EXP_RANGE[dtype]
    cls = torch.randint(0, 16, (n,), generator=shared)
    base_exp = torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=shared)
    own_exp = torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=own)
    mant = 1.0 + torch.rand(n, dtype=torch.float64, generator=own)
    sign = torch.where(torch.rand(n, generator=own) < 0.5, -1.0, 1.0).to(torch.float64)
    # Default: every rank near the same magnitude with a random sign -> cancellations.
    v = sign * mant * torch.pow(10.0, base_exp)
    # Mixed scales: each rank its own magnitude -> a huge value next to small ones.
    mixed = cls < 5
    v = torch.where(mixed, sign * mant * torch.pow(10.0, own_exp), v)
    # Cancelling triads: by (rank + phase) % 3 a rank holds +big, -big or a small value whose bits lie below
    # big's fp32 ulp. (big - big) + s keeps s; (-big + s) + big loses it. Three phases, so that whichever ranks
    # an order puts first, some element notices, at any W >= 3 and after rounding to bf16 or fp16.
    big = torch.full((n,), _BIG[dtype], dtype=torch.float64)
    small = sign * mant * (1e-3 if dtype == torch.float16 else 1.0)
    if world_size is not None and world_size >= 2:
        # Per element, a random rank holds +big and another -big; every other rank a small value. The smalls
        # the fold adds after the later of the two survive, the others are absorbed: the result names the order.
        plus = torch.randint(0, world_size, (n,), generator=shared)
        minus = (plus + 1 + torch.randint(0, world_size - 1, (n,), generator=shared)) % world_size
        pair = (cls >= 5) & (cls < 8)
        role = torch.where(plus == rank, big, torch.where(minus == rank, -big, small))
        v = torch.where(pair, role, v)
    else:
        for phase in range(3):
            role3 = (rank + phase) % 3
            triad = cls == 5 + phase
            v = torch.where(triad, big if role3 == 0 else (-big if role3 == 1 else small), v)
    v = torch.where(cls == 8, sign * _SUBNORMAL_SCALE[dtype] * mant, v)  # subnormals of both signs
    v = torch.where(cls == 9, sign * 0.0, v)  # +0.0 and -0.0
    v = torch.where(cls == 10, -0.0 * torch.ones_like(v), v)  # all ranks -0.0 -> the fold must give +0.0
    out = v.to(torch.float32).to(dtype)
    return out.view(rows, *shape).to(device)


def with_specials(x: torch.Tensor, *, seed: int, rank: int, fraction: float = 0.02) -> torch.Tensor:
    """``x`` with a few NaN and ±Inf entries (rank-dependent), for the NaN/Inf policy checks."""
    g = _gen(seed, 0x5EC1A1, rank)
    flat = x.detach().to("cpu").reshape(-1).clone()
    r = torch.rand(flat.numel(), generator=g)
    flat[r < fraction / 2] = float("nan")
    flat[(r >= fraction / 2) & (r < fraction * 3 / 4)] = float("inf")
    flat[(r >= fraction * 3 / 4) & (r < fraction)] = float("-inf")
    return flat.view_as(x).to(x.device)
