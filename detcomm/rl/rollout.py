"""Sampled rollouts on the serving engine: the requests packed into shared T_pad-row steps, T = 1 (or any
temperature) Gumbel-max sampling with a seeded key per (request, position).

Every step is the engine's ``forward`` (prefill chunks and decode rows of all requests, packed) and its
``logprobs`` (the vocabulary-parallel log-softmax, identical bits on every rank); a token is the argmax of
``logprobs / T + detcomm.tp.gumbel_noise(key)`` over the whole vocabulary, computed on every rank from the same
bits (no collective), so the sample does not depend on W or on which requests share a step. Returns each
request's tokens and their sampling-time logprobs (of the unscaled distribution: what a trainer recomputes).
Collective (same arguments on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..tp import gumbel_noise

__all__ = ["sample"]


def _key(seed: int, request: int, position: int) -> int:
    return (seed * 1_000_003 + request) * 65_537 + position


def sample(lm: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
           seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    """Continue every prompt by ``max_new_tokens`` sampled tokens (``temperature`` 0: the argmax of the
    logprobs) through the engine's own scheduler (``TPCausalLM.generate`` with a sampler). Returns per prompt the
    new token ids and their fp32 logprobs. Collective."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    vocab = lm.config.vocab_size

    def pick(request: int, position: int, logprobs: torch.Tensor) -> int:
        if temperature == 0:
            return int(torch.argmax(logprobs))
        noise = gumbel_noise(_key(seed, request, position), vocab).to(logprobs.device)
        return int(torch.argmax(logprobs / temperature + noise))

    return lm.generate(prompts, max_new_tokens=max_new_tokens, sampler=pick)
