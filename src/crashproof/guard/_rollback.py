"""Rolling back past an anomaly: which checkpoint to return to and which data to leave out.

A ``NumericsGuard`` with the ``rollback`` action restores the newest checkpoint taken before the
trouble began and, unless it first replays the same data (``replay_first``: a transient fault such
as a flipped bit does not come back), skips the data the bad steps consumed. For that it needs to
know, for each recent step, which positions of the epoch's order that step received: the
:class:`DataLedger` records them from the :class:`~crashproof.ResumableSampler`.

A second anomaly at the same data after a replay is not a new problem: the window is then skipped
and recorded (:class:`SkippedData`), never replayed again. A run that keeps rolling back without
getting past its furthest anomaly stops after ``max_rollbacks``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from crashproof.state import ResumableSampler

__all__ = ["DataLedger", "SkippedData", "Window"]

Window = tuple[int, int, int]
"""Positions ``start:end`` of epoch ``epoch``'s order: ``(epoch, start, end)``."""


@dataclass(frozen=True, slots=True)
class SkippedData:
    """A stretch of data left out after it made training diverge."""

    anomaly_step: int
    """The step at which the anomaly was detected."""
    first_step: int
    """The first step whose data is skipped (where a spike began; else ``anomaly_step``)."""
    windows: tuple[Window, ...]
    """The positions skipped, as ``(epoch, start, end)`` of each epoch's sample order."""
    rolled_back_to: int
    """The checkpoint step training went back to."""


class DataLedger:
    """Which data each of the last ``keep`` steps received (empty without a sampler)."""

    def __init__(self, sampler: ResumableSampler | None, keep: int) -> None:
        self.sampler = sampler
        self._steps: deque[tuple[int, tuple[Window, ...]]] = deque(maxlen=keep)

    def record(self, step: int) -> tuple[Window, ...]:
        """What ``step`` received (everything since the previous step was recorded)."""
        windows = tuple(self.sampler.take_received()) if self.sampler is not None else ()
        self._steps.append((step, windows))
        return windows

    def between(self, first: int, last: int) -> tuple[Window, ...]:
        """The windows received by steps ``first`` to ``last`` (as far as they are recorded),
        adjacent ones joined."""
        joined: list[Window] = []
        for step, windows in self._steps:
            for epoch, start, end in windows if first <= step <= last else ():
                if joined and joined[-1][0] == epoch and joined[-1][2] == start:
                    joined[-1] = (epoch, joined[-1][1], end)
                else:
                    joined.append((epoch, start, end))
        return tuple(joined)

    def forget_after(self, step: int) -> None:
        """Drop what steps after ``step`` received: a rollback undid them."""
        while self._steps and self._steps[-1][0] > step:
            self._steps.pop()
