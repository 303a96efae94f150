"""What the vLLM plugin does, read once per process from the environment (docs/vllm.md "The variables").

The plugin is off unless ``DETCOMM_VLLM=1``: installing detcomm next to vLLM changes nothing by itself. Every
variable is read in every vLLM process (the engine core and each worker inherit the launching process's
environment), so one ``export`` before ``vllm serve`` or before the script configures all ranks alike; the ranks
then compare the resolved settings when the TP group's communicator starts (``detcomm.init`` refuses an envelope
that differs across ranks, and the plugin compares the rest).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..envelope import default_numerics
from ..numerics.tree import is_power_of_two

__all__ = ["Settings", "LAYOUTS", "read"]

# "fold": vLLM's own layers and GEMMs, every TP all-reduce the canonical fold (batch-invariant at one TP size).
# "tree": TP-size invariance: row-parallel layers as fixed virtual shards summed by the fixed tree, column-parallel
# layers as fixed column blocks (docs/spec.md §9.1), so TP = 1, 2, 4 ... give the same bits.
LAYOUTS = ("fold", "tree")
DEFAULT_VIRTUAL_SHARDS = 8


@dataclass(frozen=True)
class Settings:
    enabled: bool
    numerics: str
    layout: str
    virtual_shards: int
    audit_dir: str | None

    def fingerprint(self) -> dict[str, object]:
        """What must agree across ranks and what keys vLLM's compile cache (a graph compiled without the plugin, or
        with another layout, must not be reused)."""
        return {"enabled": self.enabled, "numerics": self.numerics, "layout": self.layout,
                "virtual_shards": self.virtual_shards, "audit": self.audit_dir is not None}


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={env[name]!r}: set it to 1 (on) or 0 (off)")


def read(env: Mapping[str, str] | None = None) -> Settings:
    """The plugin's settings from ``env`` (default ``os.environ``); ValueError naming the variable when one is
    malformed."""
    env = os.environ if env is None else env
    layout = env.get("DETCOMM_VLLM_LAYOUT", "fold").strip() or "fold"
    if layout not in LAYOUTS:
        raise ValueError(f"DETCOMM_VLLM_LAYOUT={layout!r}: must be one of {LAYOUTS} (docs/vllm.md)")
    raw = env.get("DETCOMM_VLLM_VIRTUAL_SHARDS", str(DEFAULT_VIRTUAL_SHARDS)).strip()
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"DETCOMM_VLLM_VIRTUAL_SHARDS={raw!r}: must be a power of two (e.g. 8)") from None
    if not is_power_of_two(v):
        raise ValueError(f"DETCOMM_VLLM_VIRTUAL_SHARDS={v}: the tree layout needs a power of two (e.g. 8); "
                         "TP-size invariance then holds for every power-of-two TP size that divides it")
    return Settings(enabled=_flag(env, "DETCOMM_VLLM"), numerics=default_numerics(env), layout=layout,
                    virtual_shards=v, audit_dir=env.get("DETCOMM_VLLM_AUDIT") or None)
