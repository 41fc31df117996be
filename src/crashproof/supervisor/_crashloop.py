"""Restart decisions: back off between failed attempts, and stop a crash loop.

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
