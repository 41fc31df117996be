"""When to save and what to keep."""

from __future__ import annotations

from crashproof.policy._adaptive import Daly, Young
from crashproof.policy._retention import (
    CheckpointFacts,
    KeepAll,
    KeepBest,
    KeepDaily,
    KeepEvery,
    KeepHourly,
    KeepLast,
    KeepWeekly,
    KeepWithin,
    RetentionPolicy,
    is_retention_policy,
    policy_from_spec,
    policy_to_spec,
    retained,
)
from crashproof.policy._save import (
    AnyOf,
    EverySeconds,
    EverySteps,
    SaveContext,
    SavePolicy,
    is_save_policy,
)

__all__ = [
    "AnyOf",
    "CheckpointFacts",
    "Daly",
    "EverySeconds",
    "EverySteps",
    "KeepAll",
    "KeepBest",
    "KeepDaily",
    "KeepEvery",
    "KeepHourly",
    "KeepLast",
    "KeepWeekly",
    "KeepWithin",
    "RetentionPolicy",
    "SaveContext",
    "SavePolicy",
    "Young",
    "is_retention_policy",
    "is_save_policy",
    "policy_from_spec",
    "policy_to_spec",
    "retained",
]
