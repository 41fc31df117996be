"""When to save: small objects with one method, combined with ``|``.

``EverySteps(500) | EverySeconds(1800)`` saves when either says so. Policies see the step being
finished and the time and step of the last save, so they hold no hidden state of their own and
the manager can restart them after a restore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from crashproof._arguments import is_count, is_positive_seconds, real, whole
from crashproof.errors import ConfigError

__all__ = ["AnyOf", "EverySeconds", "EverySteps", "SavePolicy", "is_save_policy"]


@dataclass(frozen=True, slots=True)
class SaveContext:
    step: int
    """The step just finished (the checkpoint would hold the state after it)."""
    now_s: float
    """Monotonic time now, in seconds."""
    last_save_step: int
    """Step of the last save, or of the restore point (0 at a fresh start)."""
    last_save_s: float
    """Monotonic time of the last save, or of the manager's start."""
    last_blocking_s: float | None = None
    """How long the last save paused training (None: no save yet)."""
    last_persist_s: float | None = None
    """How long the last committed save took to write and commit (None: none yet)."""


class SavePolicy(Protocol):
    @property
    def same_on_every_rank(self) -> bool:
        """True when every rank reaches the same decision from the step alone (no clocks)."""
        ...

    def should_save(self, ctx: SaveContext) -> bool: ...

    def __or__(self, other: SavePolicy) -> SavePolicy: ...


class _Combinable:
    def __or__(self, other: SavePolicy) -> SavePolicy:
        return AnyOf((self, other))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class EverySteps(_Combinable):
    """Save every ``n`` steps (when the step is a multiple of ``n``)."""

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", whole(self.n))  # (a numpy integer: an int, for JSON)
        if not is_count(self.n):
            raise ConfigError(f"EverySteps(n={self.n!r}): n must be a whole number of steps >= 1")

    @property
    def same_on_every_rank(self) -> bool:
        return True

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0


@dataclass(frozen=True, slots=True)
class EverySeconds(_Combinable):
    """Save when at least ``seconds`` have passed since the last save."""

    seconds: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "seconds", real(self.seconds))
        if not is_positive_seconds(self.seconds):
            raise ConfigError(
                f"EverySeconds({self.seconds!r}): the interval must be a positive, finite number "
                "of seconds"
            )

    @property
    def same_on_every_rank(self) -> bool:
        return False  # each rank reads its own clock

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step > ctx.last_save_step and ctx.now_s - ctx.last_save_s >= self.seconds


@dataclass(frozen=True, slots=True)
class AnyOf(_Combinable):
    """Save when any of ``policies`` says so."""

    policies: tuple[SavePolicy, ...]

    def __post_init__(self) -> None:
        for policy in self.policies:
            if not is_save_policy(policy):
                raise ConfigError(
                    f"{policy!r} combined with | is not a save policy: use EverySteps, "
                    "EverySeconds, Young or Daly"
                )

    @property
    def same_on_every_rank(self) -> bool:
        return all(p.same_on_every_rank for p in self.policies)

    def should_save(self, ctx: SaveContext) -> bool:
        # Ask every policy (no short-circuit) so stateful policies all see every step.
        return any([p.should_save(ctx) for p in self.policies])


def is_save_policy(value: Any) -> bool:
    """Whether ``value`` is a save policy (it answers ``should_save``), not a number or a
    class given where an instance is wanted."""
    return not isinstance(value, type) and callable(getattr(value, "should_save", None))
