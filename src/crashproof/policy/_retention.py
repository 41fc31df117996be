"""What to keep: small objects with one method, combined with ``|`` (keep what either keeps).

A retention policy only proposes; the manager always also keeps the newest valid checkpoint and
never touches one being written, whatever the policy says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from crashproof.errors import ConfigError

__all__ = ["KeepAll", "KeepEvery", "KeepLast", "RetentionPolicy"]


class RetentionPolicy(Protocol):
    def keep(self, steps: Sequence[int]) -> set[int]:
        """Of the committed checkpoints' ``steps`` (ascending), those to keep."""
        ...

    def __or__(self, other: RetentionPolicy) -> RetentionPolicy: ...


class _Combinable:
    def __or__(self, other: RetentionPolicy) -> RetentionPolicy:
        return _Union((self, other))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class KeepLast(_Combinable):
    """Keep the newest ``n`` checkpoints."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"KeepLast({self.n}): keep at least 1 checkpoint")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True, slots=True)
class KeepEvery(_Combinable):
    """Keep milestones: every checkpoint whose step is a multiple of ``steps``."""

    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"KeepEvery(steps={self.steps}): steps must be at least 1")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.steps == 0}


@dataclass(frozen=True, slots=True)
class KeepAll(_Combinable):
    """Keep everything (the default)."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(steps)


@dataclass(frozen=True, slots=True)
class _Union(_Combinable):
    policies: tuple[RetentionPolicy, ...]

    def keep(self, steps: Sequence[int]) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(steps)
        return kept
