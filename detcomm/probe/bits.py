"""Bit-level comparison for the probes: the definitions live in detcomm.invariance (one NaN rule, one ulp
distance for every measurement); this module re-exports them under the probes' names."""

from __future__ import annotations

from detcomm.invariance import bits, changed_mask, ulp_distance

__all__ = ["bits", "changed_mask", "ulp_distance"]
