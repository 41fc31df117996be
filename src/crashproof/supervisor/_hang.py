"""When a trainer that stopped beating is hung: per-phase allowances and a calibrated step timeout.

A trainer is hung when its heartbeat is older than the allowance of the phase it is in:

* ``startup`` (import to first step or restore): ``startup_timeout_s``;
* ``restore`` and ``save``: their own allowances, so a slow checkpoint is not a hang;
* ``step``: ``step_timeout_s`` when given, otherwise calibrated from what the run showed: the
  longest gap between two finished steps seen so far, times ``auto_factor``, and never below
  ``auto_floor_s`` (until ``calibration_steps`` gaps were seen the start-up allowance applies,
  so a first step that compiles or autotunes is not a hang);
* ``done`` (the training loop closed its checkpoint manager, so its work is committed):
  ``done_timeout_s`` to exit. A trainer still there after that (seen: a deadlock in gloo's
  process-group destructor at interpreter exit) is ended by the agent, not restarted: its work
  is safe. Work after ``close()`` that takes longer calls ``crashproof.heartbeat()``.

Calibration outlives restarts: the step time of a run does not change when it restarts.
This module only decides; the agent reads the heartbeats and acts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from crashproof.errors import ConfigError
from crashproof.link import Heartbeat

__all__ = ["HangConfig", "HangDetector", "Verdict", "culprit"]


@dataclass(kw_only=True, slots=True)
class HangConfig:
    step_timeout_s: float | None = None
    """Seconds without a finished step before a training rank is hung; None: calibrated."""
    auto_factor: float = 10.0
    """Calibrated step timeout: this many times the longest step gap seen."""
    auto_floor_s: float = 60.0
    """Calibrated step timeout: never below this (GC pauses, slow batches, logging)."""
    calibration_steps: int = 5
    """Step gaps to see before the calibrated timeout applies."""
    startup_timeout_s: float = 600.0
    """From the trainer's start (its ``import crashproof``) to its first step or restore."""
    restore_timeout_s: float = 600.0
    """For a restore, from its start."""
    save_timeout_s: float = 600.0
    """For the blocking part of a save (a synchronous save writes everything)."""
    done_timeout_s: float = 120.0
    """From closing the checkpoint manager (or the last beat after it) to the process's exit."""

    def __post_init__(self) -> None:
        for name in (
            "auto_factor",
            "auto_floor_s",
            "startup_timeout_s",
            "restore_timeout_s",
            "save_timeout_s",
            "done_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"HangConfig({name}={getattr(self, name)}): must be positive")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ConfigError(
                f"HangConfig(step_timeout_s={self.step_timeout_s}): must be positive, or None to calibrate"
            )


@dataclass(frozen=True, slots=True)
class Verdict:
    """A hung trainer: how long it has been silent, in which phase, against which allowance."""

    silent_s: float
    phase: str
    timeout_s: float
    step: int


@dataclass(slots=True)
class HangDetector:
    config: HangConfig = field(default_factory=HangConfig)
    _gaps: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    _seen: dict[int, float] = field(default_factory=dict)  # pid -> beat time of the last record

    def observe(self, beat: Heartbeat) -> None:
        """Take in a record's step gap, once per record (records are read every monitor
        interval, and a trainer may not have written a new one since)."""
        if beat.max_gap_s > 0 and self._seen.get(beat.pid) != beat.beat_s:
            self._gaps.append(beat.max_gap_s)
        self._seen[beat.pid] = beat.beat_s

    def step_timeout_s(self) -> float | None:
        """The allowance of the step phase now; None while still calibrating."""
        if self.config.step_timeout_s is not None:
            return self.config.step_timeout_s
        if len(self._gaps) < self.config.calibration_steps:
            return None
        return max(self.config.auto_floor_s, self.config.auto_factor * max(self._gaps))

    def timeout_s(self, phase: str) -> float | None:
        """The allowance of ``phase``; None: no limit."""
        c = self.config
        if phase == "step":
            step = self.step_timeout_s()
            return step if step is not None else c.startup_timeout_s
        return {
            "startup": c.startup_timeout_s,
            "restore": c.restore_timeout_s,
            "save": c.save_timeout_s,
            "done": c.done_timeout_s,
            "exiting": c.done_timeout_s,
        }.get(phase)

    def check(self, beat: Heartbeat, now_s: float) -> Verdict | None:
        """A verdict if the trainer behind ``beat`` is hung at ``now_s`` (``time.monotonic()``)."""
        self.observe(beat)
        timeout = self.timeout_s(beat.phase)
        silent = now_s - beat.beat_s
        if timeout is None or silent <= timeout:
            return None
        return Verdict(silent_s=silent, phase=beat.phase, timeout_s=timeout, step=beat.step)


_HALTED_STATES = frozenset({"T", "t", "D", "Z"})
"""Process states of a rank that cannot be waiting on its peers: stopped, traced, in
uninterruptible I/O, dead."""

_COLLECTIVE_FRAMES = (
    "distributed_c10d.py",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "_wait_for_",
)
"""What a stack waiting on its peers shows (torch.distributed's Python frames)."""


def culprit(
    hung: Mapping[int, Verdict], states: Mapping[int, str | None], stacks: Mapping[int, str]
) -> int:
    """Which of the ``hung`` ranks (by global rank) stopped the others.

    When one rank stalls, its peers block in their next collective and fall silent too, within a
    step of it; the longest silence alone picks either. In order: the rank furthest behind (a
    rank ahead of it finished a step it did not); a rank halted (stopped, in uninterruptible
    I/O) over one that may be waiting; a rank whose Python stack is not inside a collective over
    one that is; then the longest silence.
    """

    def in_collective(rank: int) -> bool:
        path = stacks.get(rank)
        if path is None:
            return False
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()[-20000:]  # the newest dump is at the end
        except OSError:
            return False
        return any(frame in text for frame in _COLLECTIVE_FRAMES)

    def key(rank: int) -> tuple[int, bool, bool, float]:
        verdict = hung[rank]
        halted = (states.get(rank) or "")[:1] in _HALTED_STATES
        return (verdict.step, not halted, in_collective(rank), -verdict.silent_s)

    return min(hung, key=key)
