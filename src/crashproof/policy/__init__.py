"""When to save and what to keep."""

from __future__ import annotations

from crashproof.policy._retention import KeepAll, KeepEvery, KeepLast, RetentionPolicy
from crashproof.policy._save import AnyOf, EverySeconds, EverySteps, SaveContext, SavePolicy

__all__ = [
    "AnyOf",
    "EverySeconds",
    "EverySteps",
    "KeepAll",
    "KeepEvery",
    "KeepLast",
    "RetentionPolicy",
    "SaveContext",
    "SavePolicy",
]
