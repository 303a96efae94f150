"""The exactness gate: a training step runs only on logprobs bit-equal to the rollout's, under one contract.

``check_contract(trainer, rollout)`` compares the two sides' ``detcomm.rl.contract.Contract`` fields before the
first step and raises ``ContractMismatch`` naming every field that differs. ``check_logprobs(trainer, rollout)``
compares every token's fp32 logprob bitwise (-0.0 and +0.0 differ; a NaN equals only the same NaN bits) and
raises ``LogprobMismatch`` naming the first differing request, the token's position (in the response and in
the sequence), both values (decimal and hex) and their distance in units in the last place. Local.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ContractMismatch, LogprobMismatch
from .contract import Contract

__all__ = ["check_contract", "check_logprobs", "ulp_distance"]


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """fp32 bits as int64 keys whose order is the floats' order (-0.0 just below +0.0): the ulp distance is the
    keys' difference."""
    i = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF) - 1, i)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise count of fp32 values between a and b (0: the same bits), int64."""
    return (_ordered(a) - _ordered(b)).abs()


def check_contract(trainer: Contract, rollout: Contract) -> None:
    """Raise ``ContractMismatch`` unless the two contracts are equal (naming every differing field)."""
    diff = trainer.differences(rollout)
    if diff:
        raise ContractMismatch(
            f"the trainer's and the rollout engine's arithmetic differ in {len(diff)} field(s) (trainer != rollout): "
            f"{'; '.join(diff)}. Their logprobs would not be bit-equal: build both sides with the same layout, V, "
            "dtype, step geometry, envelope and versions (docs/rl.md \"The contract\")")


def check_logprobs(trainer: Sequence[torch.Tensor], rollout: Sequence[torch.Tensor], *,
                   starts: Sequence[int] | None = None) -> None:
    """Raise ``LogprobMismatch`` unless request i's trainer logprobs equal its rollout logprobs bit for bit, for
    every i (``starts[i]``: the sequence position of the request's first scored token, for the message)."""
    if len(trainer) != len(rollout):
        raise ValueError(f"{len(trainer)} trainer requests against {len(rollout)} rollout requests")
    for i, (t, r) in enumerate(zip(trainer, rollout)):
        t, r = t.detach().to(torch.float32).flatten().cpu(), r.detach().to(torch.float32).flatten().cpu()
        if t.shape != r.shape:
            raise ValueError(f"request {i}: {t.numel()} trainer logprobs against {r.numel()} rollout logprobs")
        ulps = ulp_distance(t, r)
        bad = torch.nonzero(ulps).flatten()
        if len(bad):
            j = int(bad[0])
            at = "" if starts is None else f" (sequence position {starts[i] + j})"
            a, b = float(t[j]), float(r[j])
            raise LogprobMismatch(
                f"request {i}, response token {j}{at}: the trainer's logprob {a!r} ({a.hex()}) != the rollout's "
                f"{b!r} ({b.hex()}), {int(ulps[j])} ulp apart ({len(bad)} of {t.numel()} tokens of this request "
                "differ): the training step is refused. The two sides do not compute the same arithmetic "
                "(check_contract names what differs; docs/rl.md \"The gate\")")
