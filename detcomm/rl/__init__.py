"""Rollout == trainer, exactly (docs/rl.md): a trainer on the serving engine's own forward, with autograd.

``regions``: the engine's TP collectives as autograd functions (forward the canonical call); ``trainer``: the
teacher-forced recompute and AdamW on the engine's shards; ``rollout``: sampled rollouts; ``contract`` and
``gate``: what fixes the arithmetic, and the refusals; ``reshard``: the weight sync; ``loop``: a GRPO loop over
two process groups; ``colocate``: rollout and trainer in the same processes. The submodules are imported on first
use (``detcomm.hf`` imports ``regions``, and the trainer imports ``detcomm.hf``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["regions", "trainer", "rollout", "contract", "gate", "reshard", "loop", "colocate"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
