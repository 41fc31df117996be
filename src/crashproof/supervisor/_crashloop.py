"""Restart decisions: back off between failed attempts, and stop a crash loop.

A crash loop is a run that fails again and again without getting further: ``attempts`` failures
in a row where none reached a step beyond the furthest step of the failures before it. Restarting
it only burns the restart budget (and, on a shared cluster, other people's time), so the
supervisor stops with a report instead. A run that progresses between failures, however slowly,
is not a loop; its budget is ``--max-restarts``.

Backoff: the first restart after progress is immediate (recovery speed is the point); each
further failure without progress doubles the wait, up to ``backoff_max_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CrashLoopPolicy", "Failure"]


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt, as the supervisor saw it."""

    attempt: int
    """Restart count of the attempt (0: the first launch)."""
    step: int
    """The furthest step any rank of this node had finished (-1: none)."""
    rank: int | None
    """The global rank that failed first (None: unknown, e.g. a hang seen everywhere)."""
    reason: str
    """What happened: an exit code, a signal, a hang, with the last error when known."""


@dataclass(kw_only=True, slots=True)
class CrashLoopPolicy:
    attempts: int = 3
    """Failures in a row without progress that make a crash loop."""
    backoff_s: float = 1.0
    """The wait before the second restart without progress; doubled for each further one."""
    backoff_max_s: float = 30.0
    failures: list[Failure] = field(default_factory=list)

    def record(self, failure: Failure) -> None:
        self.failures.append(failure)

    def _stalled(self) -> int:
        """Failures since (and including) the last one that got further than all before it."""
        stalled, best = 0, None
        for failure in self.failures:
            if best is None or failure.step > best:
                stalled, best = 1, failure.step
            else:
                stalled += 1
        return stalled

    def is_crash_loop(self) -> bool:
        return self.attempts > 0 and self._stalled() >= self.attempts

    def backoff(self) -> float:
        """Seconds to wait before the next restart."""
        stalled = self._stalled()
        if stalled <= 1:
            return 0.0
        return float(min(self.backoff_max_s, self.backoff_s * 2.0 ** (stalled - 2)))
