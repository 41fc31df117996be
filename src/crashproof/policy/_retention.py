"""What to keep: small objects combined with ``|`` (keep what either keeps).

A retention policy only proposes; the manager always also keeps the newest valid checkpoint, the
full checkpoints its kept deltas need, and one being written, whatever the policy says.

Policies of steps alone implement ``keep(steps)``. Policies that need more (when a checkpoint was
made, the metrics saved with it) implement ``select(checkpoints)`` over :class:`CheckpointFacts`;
the seeds' tiered "checkpoint zoo" is then one expression::

    KeepWithin(hours=6) | KeepDaily(7) | KeepWeekly(12) | KeepEvery(10_000) | KeepBest("val_loss")

Time-based policies count from the newest checkpoint, not from the clock (as restic's
``--keep-within`` does): pruning a run that stopped a month ago does not wipe it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from crashproof._arguments import is_count, is_real, real, whole
from crashproof.errors import ConfigError

__all__ = [
    "CheckpointFacts",
    "KeepAll",
    "KeepBest",
    "KeepDaily",
    "KeepEvery",
    "KeepHourly",
    "KeepLast",
    "KeepWeekly",
    "KeepWithin",
    "RetentionPolicy",
    "is_retention_policy",
    "policy_from_spec",
    "policy_to_spec",
    "retained",
]


@dataclass(frozen=True, slots=True)
class CheckpointFacts:
    """What a retention policy may look at: a committed checkpoint's step, commit time and the
    ``metadata`` saved with it (``save(..., metadata={"val_loss": 0.31})``)."""

    step: int
    created_unix: float | None = None
    """Unix time of the commit (None: unknown, e.g. an unreadable manifest)."""
    metadata: Mapping[str, Any] = field(default_factory=dict)


class RetentionPolicy(Protocol):
    def keep(self, steps: Sequence[int]) -> set[int]:
        """Of the committed checkpoints' ``steps`` (ascending), those to keep."""
        ...

    def __or__(self, other: RetentionPolicy) -> RetentionPolicy: ...


def retained(policy: RetentionPolicy, checkpoints: Sequence[CheckpointFacts]) -> set[int]:
    """The steps ``policy`` keeps of ``checkpoints``: through ``select`` where the policy has it
    (it may use times and metrics), else through ``keep`` on the steps."""
    select = getattr(policy, "select", None)
    if select is not None:
        return set(select(checkpoints))
    return set(policy.keep(sorted(c.step for c in checkpoints)))


class _Combinable:
    def __or__(self, other: RetentionPolicy) -> RetentionPolicy:
        return _Union((self, other))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class KeepLast(_Combinable):
    """Keep the newest ``n`` checkpoints."""

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", whole(self.n))  # (a numpy integer: an int, for JSON)
        if not is_count(self.n):
            raise ConfigError(f"KeepLast({self.n!r}): keep a whole number of checkpoints, >= 1")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True, slots=True)
class KeepEvery(_Combinable):
    """Keep milestones: every checkpoint whose step is a multiple of ``steps``."""

    steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", whole(self.steps))
        if not is_count(self.steps):
            raise ConfigError(
                f"KeepEvery(steps={self.steps!r}): steps must be a whole number, >= 1"
            )

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.steps == 0}


@dataclass(frozen=True, slots=True)
class KeepAll(_Combinable):
    """Keep everything (the default)."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(steps)


class _ByFacts(_Combinable):
    """A policy that needs :class:`CheckpointFacts`. Given steps alone it keeps them all: with
    no times or metrics to judge by, deleting would be a guess."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(steps)

    def select(self, checkpoints: Sequence[CheckpointFacts]) -> set[int]:
        raise NotImplementedError


def _newest_time(checkpoints: Sequence[CheckpointFacts]) -> float | None:
    times = [c.created_unix for c in checkpoints if c.created_unix is not None]
    return max(times) if times else None


@dataclass(frozen=True, slots=True)
class KeepWithin(_ByFacts):
    """Keep every checkpoint made within this span before the newest one (``hours=6``)."""

    seconds: float = 0.0
    minutes: float = 0.0
    hours: float = 0.0
    days: float = 0.0

    @property
    def span_s(self) -> float:
        return self.seconds + 60 * self.minutes + 3600 * self.hours + 86400 * self.days

    def __post_init__(self) -> None:
        for name in ("seconds", "minutes", "hours", "days"):
            object.__setattr__(self, name, real(getattr(self, name)))
        parts = (self.seconds, self.minutes, self.hours, self.days)
        if not all(is_real(part) and part >= 0 for part in parts) or not is_real(self.span_s):
            raise ConfigError(f"{self!r}: give finite numbers >= 0 (seconds, minutes, ...)")
        if not self.span_s > 0:
            raise ConfigError(f"{self!r}: the span must be positive")

    def select(self, checkpoints: Sequence[CheckpointFacts]) -> set[int]:
        newest = _newest_time(checkpoints)
        if newest is None:
            return {c.step for c in checkpoints}  # no times at all: keep, do not guess
        return {
            c.step
            for c in checkpoints
            if c.created_unix is None or c.created_unix >= newest - self.span_s
        }


@dataclass(frozen=True, slots=True)
class _KeepOnePer(_ByFacts):
    """The newest checkpoint of each of the ``n`` most recent periods that have checkpoints."""

    n: int
    period_s: float = 0.0
    offset_s: float = 0.0
    """Shifts the periods' boundaries (weeks start on Monday, not on the epoch's Thursday)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", whole(self.n))
        if not is_count(self.n):
            raise ConfigError(
                f"{type(self).__name__}({self.n!r}): keep a whole number of periods, >= 1"
            )

    def select(self, checkpoints: Sequence[CheckpointFacts]) -> set[int]:
        newest_of: dict[int, CheckpointFacts] = {}
        for c in checkpoints:
            if c.created_unix is None:
                continue  # judged by other policies; the manager keeps what it must
            period = math.floor((c.created_unix + self.offset_s) / self.period_s)  # UTC-aligned
            best = newest_of.get(period)
            if best is None or (c.created_unix, c.step) > (best.created_unix or 0.0, best.step):
                newest_of[period] = c
        recent = sorted(newest_of, reverse=True)[: self.n]
        return {newest_of[p].step for p in recent}


@dataclass(frozen=True, slots=True)
class KeepHourly(_KeepOnePer):
    """One checkpoint (the newest) of each of the last ``n`` hours that have checkpoints."""

    period_s: float = 3600.0


@dataclass(frozen=True, slots=True)
class KeepDaily(_KeepOnePer):
    """One checkpoint (the newest) of each of the last ``n`` UTC days that have checkpoints."""

    period_s: float = 86400.0


@dataclass(frozen=True, slots=True)
class KeepWeekly(_KeepOnePer):
    """One checkpoint (the newest) of each of the last ``n`` weeks (Monday to Sunday, UTC) that
    have checkpoints."""

    period_s: float = 7 * 86400.0
    offset_s: float = 3 * 86400.0  # 1970-01-01 was a Thursday; Monday 1969-12-29 starts week 0


@dataclass(frozen=True, slots=True)
class KeepBest(_ByFacts):
    """Keep the ``n`` checkpoints with the best value of ``metric`` in their metadata
    (``mode="min"`` for a loss, ``"max"`` for an accuracy). Checkpoints without a finite numeric
    value of ``metric`` do not compete."""

    metric: str
    n: int = 1
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", whole(self.n))
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(
                f"KeepBest({self.metric!r}): name the metric, a key of save(metadata=...)"
            )
        if not is_count(self.n):
            raise ConfigError(f"KeepBest({self.metric!r}, n={self.n!r}): keep a whole number, >= 1")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"KeepBest(mode={self.mode!r}): use 'min' or 'max'")

    def select(self, checkpoints: Sequence[CheckpointFacts]) -> set[int]:
        scored = []
        for c in checkpoints:
            value = c.metadata.get(self.metric)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                scored.append((value if self.mode == "min" else -value, -c.step, c.step))
        return {step for _, _, step in sorted(scored)[: self.n]}


@dataclass(frozen=True, slots=True)
class _Union(_Combinable):
    policies: tuple[RetentionPolicy, ...]

    def __post_init__(self) -> None:
        for policy in self.policies:
            if not is_retention_policy(policy):
                raise ConfigError(
                    f"{policy!r} combined with | is not a retention policy: use KeepLast, "
                    "KeepEvery, KeepWithin, KeepHourly, KeepDaily, KeepWeekly, KeepBest or KeepAll"
                )

    def keep(self, steps: Sequence[int]) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(steps)
        return kept

    def select(self, checkpoints: Sequence[CheckpointFacts]) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= retained(policy, checkpoints)
        return kept


_SPEC_TYPES: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (
        KeepAll,
        KeepBest,
        KeepDaily,
        KeepEvery,
        KeepHourly,
        KeepLast,
        KeepWeekly,
        KeepWithin,
    )
}


def policy_to_spec(policy: RetentionPolicy) -> dict[str, Any] | None:
    """A JSON description of a built-in policy (to hand it to another process); None for a policy
    of the user's own, which cannot be described."""
    if isinstance(policy, _Union):
        parts = [policy_to_spec(p) for p in policy.policies]
        return None if any(p is None for p in parts) else {"type": "any", "of": parts}
    if (
        type(policy).__name__ not in _SPEC_TYPES
        or type(policy) is not _SPEC_TYPES[type(policy).__name__]
    ):
        return None
    fields = {f: getattr(policy, f) for f in policy.__dataclass_fields__}  # type: ignore[attr-defined]
    return {"type": type(policy).__name__, **fields}


def policy_from_spec(spec: Mapping[str, Any]) -> RetentionPolicy:
    """The policy :func:`policy_to_spec` described; only built-in policy types are accepted."""
    kind = spec.get("type")
    if kind == "any":
        parts = [policy_from_spec(p) for p in spec.get("of", [])]
        if not parts:
            raise ConfigError(f"retention spec {spec!r}: 'any' of nothing")
        return _Union(tuple(parts))
    cls = _SPEC_TYPES.get(str(kind))
    if cls is None:
        raise ConfigError(f"retention spec {spec!r}: unknown policy type {kind!r}")
    policy: RetentionPolicy = cls(**{k: v for k, v in spec.items() if k != "type"})
    return policy


def is_retention_policy(value: Any) -> bool:
    """Whether ``value`` is a retention policy (it answers ``keep`` or ``select``), not a number
    or a class given where an instance is wanted."""
    return not isinstance(value, type) and any(
        callable(getattr(value, name, None)) for name in ("keep", "select")
    )
