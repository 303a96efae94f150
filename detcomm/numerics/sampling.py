"""The serving step's token choice on the device: greedy or seeded Gumbel-max sampling, step inputs, not constants.

A captured decode step (detcomm.numerics.step_graph, issue 42) ends with its head: each sampling row's token and
that token's fp32 logprob, packed into one int64 [2, S] tensor so the host reads a step's result in ONE
device-to-host copy. What varies per request (the sampling key, the temperature) is data in the step's static
buffers (``StepInputs``: ``keys`` as int64, ``temps`` as the fp32 bit patterns), never a Python number a graph
would bake in, so one graph serves every request mix of its shape key.

The noise is counter-based: Gumbel noise ``-log(-log(u))`` of vocabulary index j for key k, with u from an integer
hash of (k, j) computed by elementwise int64 ops on the device. It is a function of (key, index) alone (not of
the row's place, the batch, W or which rank holds j), computed on fixed [n, vocab padded to 64] shapes (no CPU
scalar tail). It is NOT ``detcomm.tp.gumbel_noise`` (a CPU generator per key, which a CUDA graph cannot hold):
seeded samples of the in-step sampler differ from detcomm.rl.rollout's callback sampler for the same seed.

Rejected: torch's device generator (its Philox offsets advance per launch, so a key would not name the noise
once captured, and the noise would depend on the number of rows drawn before it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["StepTokens", "sample_key", "keyed_gumbel", "pick", "pack", "unpack", "f32_bits", "from_bits", "check_sampling"]

_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so no int64 product overflows on any
# device (the hash is exact integer arithmetic everywhere).
_C1, _C2, _C3 = 0x7FEB352D, 0x5BD1E995, 0x2C1B3C6D
_PAD = 64  # the noise's columns are padded to a multiple of this (CPU: every element on the vector path)


@dataclass
class StepTokens:
    """One step's token choice (the engines' ``next_tokens``), on the host: each sampling segment's ``tokens`` and
    their fp32 ``logprobs`` (a CPU tensor [S]), and ``picks`` the index of each sampling segment."""

    tokens: list[int]
    logprobs: torch.Tensor
    picks: list[int]


def sample_key(seed: int, request: int, position: int) -> int:
    """The sampling key of (seed, request, position): detcomm.rl.rollout's formula, reduced into int64."""
    k = (seed * 1_000_003 + request) * 65_537 + position
    return k % (1 << 63)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2**32) (three xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    x = x ^ (x >> 13)
    x = (x * _C3) & _M32
    return x ^ (x >> 16)


def keyed_gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 Gumbel noise [n, vocab]: row i, column j a function of (keys[i], j) alone. ``keys``: int64 [n] >= 0."""
    assert keys.dtype == torch.int64 and keys.dim() == 1
    width = -(-vocab // _PAD) * _PAD
    lo, hi = keys & _M32, (keys >> 32) & _M32
    seed = _mix(lo ^ _mix(hi ^ 0x9E3779B9))[:, None]  # [n, 1]
    j = torch.arange(width, dtype=torch.int64, device=keys.device)[None, :]
    bits = _mix(seed ^ _mix(j))
    # u in (0, 1), exact: 23 random bits, a half ulp of offset, one power-of-two scale (no rounding anywhere).
    u = ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return (-torch.log(-torch.log(u)))[:, :vocab]


def pick(logprobs: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's token from its fp32 logprobs over the whole vocabulary [S, vocab] (identical on every rank, so
    no collective): the argmax (first index on ties) of ``logprobs / T + keyed_gumbel(key)`` where the row's
    temperature T > 0, of ``logprobs`` where T == 0. ``temps`` fp32 [S], ``keys`` int64 [S]. int64 [S]."""
    t = temps[:, None]
    noisy = logprobs / torch.where(t > 0, t, torch.ones_like(t)) + keyed_gumbel(keys, logprobs.shape[1])
    return torch.where(t > 0, noisy, logprobs).argmax(dim=1)


def pack(tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """int64 [2, S]: the tokens, then the fp32 logprobs' bit patterns (one device-to-host copy for both)."""
    return torch.stack([tokens.to(torch.int64), logprobs.to(torch.float32).view(torch.int32).to(torch.int64)])


def unpack(packed: np.ndarray) -> tuple[list[int], torch.Tensor]:
    """``pack``'s result on the host: the token ids and their fp32 logprobs (a CPU tensor)."""
    toks = [int(v) for v in packed[0]]
    lps = torch.from_numpy(packed[1].astype(np.int32).view(np.float32).copy())
    return toks, lps


def f32_bits(values: Sequence[float]) -> np.ndarray:
    """Temperatures as the int64 bit patterns of their fp32 values (``StepInputs`` holds int64 fields)."""
    return np.asarray(values, dtype=np.float32).view(np.int32).astype(np.int64)


def from_bits(bits: torch.Tensor) -> torch.Tensor:
    """``f32_bits`` inverted on the device: int64 [n] -> fp32 [n]."""
    return bits.to(torch.int32).view(torch.float32)


def check_sampling(n: int, keys: Sequence[int] | None, temperatures: Sequence[float] | None) -> bool:
    """Whether a step samples (keys and temperatures given, one each per sampling row) or is greedy (neither).
    ValueError for anything else, with the fix."""
    if keys is None and temperatures is None:
        return False
    if keys is None or temperatures is None:
        raise ValueError("sampling takes both keys= and temperatures= (one per sampling row), or neither (greedy)")
    if len(keys) != n or len(temperatures) != n:
        raise ValueError(f"a step with {n} sampling rows takes {n} keys and {n} temperatures, got {len(keys)} and "
                         f"{len(temperatures)}: one per segment with sample=True, in segment order")
    for k in keys:
        if not 0 <= int(k) < 1 << 63:
            raise ValueError(f"a sampling key must be in [0, 2**63), got {k}: use detcomm.numerics.sampling.sample_key")
    for t in temperatures:
        if not (float(t) >= 0.0 and np.isfinite(t)):
            raise ValueError(f"a temperature must be finite and >= 0 (0: greedy on the logprobs), got {t}")
    return True
