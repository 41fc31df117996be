"""Restart decisions: back off between failed attempts, stop a crash loop, and keep to the
restart budget.

A crash loop is a run that fails again and again without getting further: ``attempts``
consecutive failed attempts none of which finished a step past the furthest step the run had
reached before it. Restarting it only burns the restart budget (and, on a shared cluster, other
people's time), so the supervisor stops with a report instead. An attempt that gets further and
then fails is progress, however slowly, and resets the count: such a run is not a loop, its
budget is ``--max-restarts``. An attempt that fails during start-up or restore, before finishing
a step, made no progress and counts.

"The furthest step reached" is the run's: the furthest any failed attempt finished, and the step
the first attempt restored (a resumed run that fails at start-up has not got past its own
checkpoint).

Backoff: a restart after progress is immediate (recovery speed is the point); the first restart
without progress waits ``backoff_s``, each further one twice as long, up to ``backoff_max_s``.

The restart budget is a rate, not a lifetime total: ``--max-restarts`` restarts within any
``--restart-window`` (an hour by default). A month-long run meets independent failures every few
hours, each of which it survives; a lifetime count (torchrun's meaning) would end it on the
hundredth, however much it progressed in between. A rate still stops a run that fails faster than
it can make use of its restarts. ``--restart-window 0`` is torchrun's lifetime count.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from crashproof._units import format_duration

__all__ = ["CrashLoopPolicy", "Failure", "RestartBudget"]


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt, as the supervisor saw it."""

    attempt: int
    """Restart count of the attempt (0: the first launch)."""
    step: int
    """The furthest step any rank of this node had finished in the attempt (-1: none)."""
    rank: int | None
    """The global rank that failed first (None: unknown, e.g. a hang seen everywhere)."""
    reason: str
    """What happened: an exit code, a signal, a hang, with the last error when known."""
    start_step: int = -1
    """The step the attempt started from (the one its ranks restored; -1: none)."""


@dataclass(kw_only=True, slots=True)
class CrashLoopPolicy:
    attempts: int = 3
    """Consecutive failed attempts without progress that make a crash loop (0: never)."""
    backoff_s: float = 1.0
    """The wait before the first restart without progress; doubled for each further one."""
    backoff_max_s: float = 30.0
    """The longest wait between two restarts."""
    failures: list[Failure] = field(default_factory=list)

    def record(self, failure: Failure) -> None:
        self.failures.append(failure)

    def _judge(self) -> tuple[int, int]:
        """(consecutive failures without progress at the end, the run's furthest step)."""
        stalled, furthest = 0, -1
        for failure in self.failures:
            before = max(furthest, failure.start_step)
            if failure.step > before:
                stalled = 0  # it got further: progress, whatever came before
            else:
                stalled += 1
            furthest = max(before, failure.step)
        return stalled, furthest

    @property
    def stalled(self) -> int:
        """Consecutive failures, up to the last, that did not get past the furthest step."""
        return self._judge()[0]

    @property
    def furthest_step(self) -> int:
        """The furthest step the run has reached, over every failed attempt (-1: none)."""
        return self._judge()[1]

    def is_crash_loop(self) -> bool:
        return self.attempts > 0 and self.stalled >= self.attempts

    def backoff(self) -> float:
        """Seconds to wait before the next restart."""
        stalled = self.stalled
        if stalled == 0:
            return 0.0
        return float(min(self.backoff_max_s, self.backoff_s * 2.0 ** (stalled - 1)))


@dataclass(kw_only=True, slots=True)
class RestartBudget:
    """At most ``max_restarts`` restarts after failures within any ``window_s`` seconds."""

    max_restarts: int
    window_s: float
    """The span the budget counts over (0: the whole run, as torchrun counts)."""
    _restarts: deque[float] = field(default_factory=deque)
    """When each counted restart was granted (monotonic seconds), oldest first."""

    def used(self, now: float) -> int:
        """Restarts counted against the budget at ``now``: those within the window."""
        if self.window_s > 0:
            while self._restarts and self._restarts[0] <= now - self.window_s:
                self._restarts.popleft()
        return len(self._restarts)

    def grant(self, now: float) -> bool:
        """Whether a failure at ``now`` may be restarted; a granted restart is counted."""
        if self.used(now) >= self.max_restarts:
            return False
        self._restarts.append(now)
        return True

    def describe(self) -> str:
        """The budget in words: "30 restarts per 1 h", or "3 restarts in all"."""
        plural = "restart" if self.max_restarts == 1 else "restarts"
        if self.window_s <= 0:
            return f"{self.max_restarts} {plural} in all"
        return f"{self.max_restarts} {plural} per {format_duration(self.window_s)}"
