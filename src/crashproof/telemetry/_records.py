"""What the goodput ledger reports: the breakdown of a run's time, its failures and the points
and markers of its timeline. Computed by :mod:`crashproof.telemetry._ledger`, rendered by
:mod:`crashproof.telemetry._report` and :mod:`crashproof.telemetry._report_html`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Breakdown", "FailureRecord", "Ledger", "Marker", "TimelinePoint"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Breakdown:
    """The wall-clock seconds that were not productive, by cause."""

    checkpoint_s: float
    """Training paused for checkpoints (``blocking_s``) and emergency checkpoints."""
    lost_s: float
    """Steps computed after the checkpoint a run went back to, then computed again."""
    detect_s: float
    """From the last step a failed group finished until the supervisor began to stop it."""
    restart_s: float
    """Stopping the group, backing off, starting the next one, and its start-up until restore."""
    restore_s: float
    """Verifying and loading checkpoints."""
    other_s: float
    """Everything else: the first start-up, the final shutdown, what the log cannot place."""

    def total_s(self) -> float:
        return (
            self.checkpoint_s
            + self.lost_s
            + self.detect_s
            + self.restart_s
            + self.restore_s
            + self.other_s
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureRecord:
    """One interruption: a failed attempt, or a numerics rollback inside one."""

    ts: float
    """When the supervisor noticed it (Unix seconds); a rollback: when its restore began."""
    attempt: int
    """The attempt it ended, counted over the whole log (0: the first launch)."""
    rank: int | None
    """The rank that failed first (None: unknown or not a rank's failure)."""
    kind: str
    """``killed``, ``crash``, ``hang``, ``preempted``, ``numerics``, ``stopped``, ``lost``..."""
    reason: str
    step_reached: int
    """The furthest step the group had finished."""
    step_restored: int | None
    """The step the run went on from (None: it did not go on)."""
    lost_steps: int
    lost_s: float
    detect_s: float
    restart_s: float
    restore_s: float
    lost_from_ts: float
    """When the first lost step began: the step it went on from, finished the first time."""
    last_step_ts: float
    """When ``step_reached`` was finished (estimated from the step times around it)."""
    resumed_ts: float | None
    """When training went on after it: the end of its restore (None: it did not go on)."""
    restored_from: str | None = None
    """Where the restore after it read the state: ``memory`` (the agent's), ``peer`` (copied
    from another node's agent), ``local`` (the checkpoint root) or ``tier`` (None: no restore,
    or a log from before this was recorded)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelinePoint:
    """A step known to be finished at a time: the step timeline of the report."""

    ts: float
    step: int
    attempt: int
    source: str
    """The event it comes from (``progress``, ``restore``, ``checkpoint``, ``rank_exit``), or
    ``estimate``: where the ledger places a segment's first or last step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Marker:
    """Something that happened, for the timeline: ``failure``, ``restart``, ``checkpoint``,
    ``restore``, ``hang``, ``rollback`` or ``preemption``."""

    ts: float
    kind: str
    step: int | None
    label: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Ledger:
    """Where a run's time went."""

    run_dir: str | None
    run_id: str | None
    outcome: str | None
    """``run_end``'s outcome of the last launch (None: the run has not ended)."""
    start_ts: float
    end_ts: float
    wall_s: float
    productive_s: float
    breakdown: Breakdown
    restarts: int
    """Attempts after the first, relaunches of the whole run included."""
    final_step: int
    """The furthest step known to be finished and kept."""
    failures: tuple[FailureRecord, ...]
    timeline: tuple[TimelinePoint, ...]
    markers: tuple[Marker, ...]

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive seconds over wall seconds (0 for no time)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def parts(self) -> dict[str, float]:
        """Productive seconds and each loss, keyed as in the JSON; they add up to ``wall_s``."""
        return {"productive_s": self.productive_s, **asdict(self.breakdown)}

    def to_json(self) -> dict[str, Any]:
        return {"ettr": self.ettr, **asdict(self)}
