"""Failure economics: the optimal checkpoint interval (placeholder until the planner lands)."""

from __future__ import annotations

import math

__all__ = ["daly_interval", "young_interval"]


def young_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Young (1974): sqrt(2 C M), in the units of C and M."""
    return math.sqrt(2.0 * checkpoint_cost * mtbf)


def daly_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Daly (2006), higher order: sqrt(2CM)(1 + sqrt(C/2M)/3 + (C/2M)/9) - C when C < 2M, else M."""
    c, m = checkpoint_cost, mtbf
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c
