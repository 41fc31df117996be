"""Stragglers: a rank whose work per step stays well above its peers'.

In data-parallel training every rank waits for the slowest at each step, so one slow device or
throttled host slows the whole job while every rank shows the same step time. What tells the slow
one apart is its own work: the time inside ``CheckpointManager.compute_section()`` (the part of a
step without collectives), which each trainer adds up in its heartbeat. Ranks that mark no section
are compared by their step time instead, which finds stragglers only in jobs whose ranks do not
wait for each other.

A rank is a straggler when its work per step over its last ``steps`` steps (and at least a few
looks at its heartbeat) exceeds ``factor`` times the median of its peers' over theirs (the seeds' "GPU 847 running 30% slower than peers");
it is reported once, and again as recovered when it falls back to half the margin (1.15x for a
factor of 1.3), so a rank near the threshold does not flap. The supervisor
of each node compares the ranks it runs (see docs/supervisor.md).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from crashproof.link import Heartbeat

__all__ = ["StragglerConfig", "StragglerDetector", "StragglerReport"]

_MIN_LOOKS = 5
"""A verdict needs at least this many looks at a rank's heartbeat in its window, however fast the
steps: a window of one or two looks is one burst of noise."""


@dataclass(frozen=True, slots=True)
class StragglerConfig:
    factor: float = 1.3
    """How much slower than the peers' median a rank must be."""
    steps: int = 20
    """Over how many of its recent steps a rank's work is averaged (and so how long it must last)."""


@dataclass(frozen=True, slots=True)
class StragglerReport:
    local_rank: int
    step: int
    ratio: float
    """The rank's work per step over its peers' median."""
    seconds_per_step: float
    peers_median_s: float
    basis: str
    """``compute_section`` or ``step_time``: what was compared."""
    recovered: bool = False


class StragglerDetector:
    """Fed the group's heartbeats at every monitor interval; returns what changed."""

    def __init__(self, config: StragglerConfig) -> None:
        if config.factor <= 1 or config.steps < 1:
            raise ValueError(
                f"straggler factor {config.factor} must be > 1 and steps {config.steps} >= 1"
            )
        self.config = config
        # Per local rank: the pid the history belongs to and (step, seconds) samples, seconds being
        # the cumulative work (or the beat time, without compute sections).
        self._history: dict[int, tuple[int, deque[tuple[int, float]]]] = {}
        self.slow: dict[int, StragglerReport] = {}
        """The ranks reported slow and not yet recovered."""

    def observe(self, beats: dict[int, Heartbeat]) -> list[StragglerReport]:
        for local_rank, beat in beats.items():
            pid, samples = self._history.get(local_rank, (-1, deque()))
            if pid != beat.pid:  # a new process (a restart): its predecessor's history is void
                pid, samples = beat.pid, deque()
                self.slow.pop(local_rank, None)
            if beat.step >= 0 and (not samples or beat.step > samples[-1][0]):
                samples.append((beat.step, beat.work_s if beat.work_s > 0 else beat.beat_s))
                while (
                    len(samples) > _MIN_LOOKS + 1
                    and samples[-1][0] - samples[1][0] >= self.config.steps
                ):
                    samples.popleft()
            self._history[local_rank] = (pid, samples)
        return self._judge(beats)

    def _rates(self, beats: dict[int, Heartbeat]) -> tuple[dict[int, float], str]:
        rates: dict[int, float] = {}
        marked = all(b.work_s > 0 for b in beats.values())
        for local_rank in beats:
            _, samples = self._history[local_rank]
            if len(samples) <= _MIN_LOOKS or samples[-1][0] - samples[0][0] < self.config.steps:
                continue  # not enough steps, or looks, yet to judge this rank
            # The mean over the window: a slow device is slow in every step, a throttled or
            # stalled one in bursts that a median of looks would hide; the window is long enough
            # (steps, and looks) that a single descheduling does not decide.
            (first_step, first_s), (last_step, last_s) = samples[0], samples[-1]
            rates[local_rank] = (last_s - first_s) / (last_step - first_step)
        return rates, "compute_section" if marked else "step_time"

    def _judge(self, beats: dict[int, Heartbeat]) -> list[StragglerReport]:
        rates, basis = self._rates(beats)
        if len(rates) < 2:
            return []
        changes: list[StragglerReport] = []
        for local_rank, rate in rates.items():
            peers = statistics.median(r for k, r in rates.items() if k != local_rank)
            if peers <= 0:
                continue
            ratio = rate / peers
            report = StragglerReport(
                local_rank, beats[local_rank].step, round(ratio, 3), rate, peers, basis
            )
            if ratio > self.config.factor and local_rank not in self.slow:
                self.slow[local_rank] = report
                changes.append(report)
            elif ratio <= 1 + (self.config.factor - 1) / 2 and local_rank in self.slow:
                del self.slow[local_rank]
                changes.append(
                    StragglerReport(
                        local_rank, report.step, report.ratio, rate, peers, basis, recovered=True
                    )
                )
        return changes
