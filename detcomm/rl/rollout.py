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

from ..tp import Segment, gumbel_noise

__all__ = ["sample"]


def _key(seed: int, request: int, position: int) -> int:
    return (seed * 1_000_003 + request) * 65_537 + position


def sample(lm: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
           seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    """Continue every prompt by ``max_new_tokens`` sampled tokens (``temperature`` 0: greedy). Returns per prompt
    the new token ids and their fp32 logprobs. Collective."""
    c = lm.cfg
    if max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"max_new_tokens must be >= 1 and temperature >= 0, got {max_new_tokens}, {temperature}")
    for p in prompts:
        if not 1 <= len(p) or len(p) + max_new_tokens > c.max_context:
            raise ValueError(f"a prompt of {len(p)} tokens plus {max_new_tokens} new ones must fit "
                             f"max_context={c.max_context} (ServingConfig)")
    caches = [lm.new_cache() for _ in prompts]
    fed = [0] * len(prompts)
    out: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in prompts]
    vocab = lm.config.vocab_size
    while any(len(o[0]) < max_new_tokens for o in out):
        work: list[tuple[int, Segment]] = []
        budget = c.t_pad
        for i, p in enumerate(prompts):  # decode rows first, then prefill chunks (the engine's generate order)
            if fed[i] == len(p) and 0 < len(out[i][0]) < max_new_tokens and budget:
                work.append((i, Segment(caches[i], [out[i][0][-1]], len(p) + len(out[i][0]) - 1)))
                budget -= 1
        for i, p in enumerate(prompts):
            if fed[i] < len(p) and budget:
                n = min(budget, len(p) - fed[i])
                work.append((i, Segment(caches[i], list(p[fed[i] : fed[i] + n]), fed[i], sample=fed[i] + n == len(p))))
                fed[i] += n
                budget -= n
        logits, picks = lm.forward([seg for _, seg in work])
        if not picks:
            continue
        lps = lm.logprobs(logits)  # [S, vocab], the same bits on every rank
        for j, k in enumerate(picks):
            i = work[k][0]
            pos = len(prompts[i]) + len(out[i][0])
            if temperature == 0:
                tok = int(torch.argmax(lps[j]))
            else:
                noise = gumbel_noise(_key(seed, i, pos), vocab).to(lps.device)
                tok = int(torch.argmax(lps[j] / temperature + noise))
            out[i][0].append(tok)
            out[i][1].append(lps[j, tok].cpu())
    return [(t, torch.stack(l)) for t, l in out]
