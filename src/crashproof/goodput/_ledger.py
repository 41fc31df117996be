"""The goodput ledger: where a run's wall-clock time went, computed from its event log.

Every second between the first ``run_start`` and the last event (``run_end``, or whatever came
last in a run still going) is booked to exactly one part: *productive* (computing steps the run
kept), or one of the losses: checkpoint pauses, work lost to a failure and computed again,
detection, restart, restore, and *other* (start-up, shutdown, anything the log cannot place). The
parts are cut from one timeline in order, so they always add up to the wall time; ETTR, the
effective training time ratio, is productive over wall. ``docs/goodput.md`` explains each part
and the assumptions behind it.

This module owns the arithmetic. It does not render (:mod:`crashproof.goodput._report`) and
does not plan (:mod:`crashproof.goodput._planner`); what the events mean is ``docs/events.md``.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from crashproof.telemetry import EVENTS_FILE, read_events

__all__ = [
    "Breakdown",
    "FailureRecord",
    "Ledger",
    "Marker",
    "TimelinePoint",
    "compute_ledger",
    "read_ledger",
]

Event = dict[str, Any]

_TRAINER_EVENTS = frozenset(
    {"restore", "progress", "checkpoint", "emergency_checkpoint", "numerics_rollback"}
)


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


# -- reading the log ---------------------------------------------------------------------------


def _num(event: Event, key: str) -> float | None:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _int(event: Event, key: str) -> int | None:
    value = event.get(key)
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else None


@dataclass(slots=True)
class _Session:
    """One launch of ``crashproof run`` (a run directory can hold several: a preempted run is
    launched again into it)."""

    start: float
    events: list[Event] = field(default_factory=list)
    run_id: str | None = None
    run_ends: list[Event] = field(default_factory=list)
    open_nodes: set[str] = field(default_factory=set)

    @property
    def end(self) -> float:
        return self.events[-1]["ts"] if self.events else self.start

    @property
    def outcome(self) -> str | None:
        if not self.run_ends or self.open_nodes:
            return None
        failed = [str(e.get("outcome")) for e in self.run_ends if e.get("outcome") != "succeeded"]
        return failed[0] if failed else "succeeded"


def _sessions(events: list[Event]) -> list[_Session]:
    sessions: list[_Session] = []
    for event in events:
        node = str(event.get("node", ""))
        if event["event"] == "run_start":
            # A node that starts again while its last start never ended lost its supervisor.
            if not sessions or not sessions[-1].open_nodes or node in sessions[-1].open_nodes:
                run_id = event.get("run_id")
                sessions.append(_Session(event["ts"], run_id=str(run_id) if run_id else None))
            sessions[-1].open_nodes.add(node)
        elif not sessions:
            sessions.append(_Session(event["ts"]))
        sessions[-1].events.append(event)
        if event["event"] == "run_end":
            sessions[-1].run_ends.append(event)
            sessions[-1].open_nodes.discard(node)
    return sessions


@dataclass(slots=True)
class _Attempt:
    """One start of the trainer group (``TORCHELASTIC_RESTART_COUNT``) in a session."""

    number: int
    index: int = 0
    restart: Event | None = None
    """The supervisor's ``restart`` event that began this attempt."""
    starts: list[Event] = field(default_factory=list)
    trainer: list[Event] = field(default_factory=list)
    exits: list[Event] = field(default_factory=list)
    hangs: list[Event] = field(default_factory=list)
    notes: list[Event] = field(default_factory=list)
    """``preempted``, ``crash_loop`` and ``notice``."""
    segments: list[_Segment] = field(default_factory=list)
    end: float = 0.0
    state: str = "open"
    """``failed``, ``succeeded``, or ``open`` (still running when the log ends)."""
    kind: str = ""
    reason: str = ""
    rank: int | None = None
    reached: int = -1


def _attempts(session: _Session) -> list[_Attempt]:
    attempts: dict[int, _Attempt] = {}
    by_pid: dict[int, int] = {}
    current = 0

    def attempt(number: int) -> _Attempt:
        return attempts.setdefault(number, _Attempt(number))

    for event in session.events:
        kind, pid = event["event"], _int(event, "pid")
        number = _int(event, "restart")
        if kind == "rank_start":
            current = number if number is not None else current
            if pid is not None:
                by_pid[pid] = current
            attempt(current).starts.append(event)
        elif kind == "restart" and number is not None:
            current = number
            attempt(number).restart = attempt(number).restart or event  # one per node: the first
        elif kind in _TRAINER_EVENTS:
            guess = by_pid.get(pid, current) if pid is not None else current
            attempt(number if number is not None else guess).trainer.append(event)
        elif kind in ("rank_exit", "hang"):
            owner = attempt(by_pid.get(pid, current) if pid is not None else current)
            (owner.exits if kind == "rank_exit" else owner.hangs).append(event)
        elif kind in ("preempted", "crash_loop", "notice"):
            attempt(current).notes.append(event)
    return [attempts[n] for n in sorted(attempts)]


# -- segments: stretches of training between restores -----------------------------------------


@dataclass(slots=True)
class _Segment:
    """Training from one starting step: an attempt's start, or a numerics rollback's restore."""

    attempt: _Attempt
    start_step: int
    restore: Event | None
    begin: float = 0.0
    """When its restore began (or its training, without a restore)."""
    train_from: float = 0.0
    progress: list[Event] = field(default_factory=list)
    checkpoints: list[Event] = field(default_factory=list)
    rollback: Event | None = None
    """The ``numerics_rollback`` that ended it."""
    reached: int = 0
    reached_at: float = 0.0
    end: float = 0.0
    end_kind: str = "open"
    """``rollback``, ``failure``, ``success`` or ``open``."""
    keep_to: int = 0
    anchors: list[tuple[int, float]] = field(default_factory=list)

    emergency_step: int | None = None
    """The step of a saved emergency checkpoint: its pause is the emergency's ``seconds``."""

    def blocking(self, low: int, high: int) -> float:
        """Checkpoint pauses after steps ``low <= step < high`` (a save follows its step)."""
        return sum(
            _num(c, "blocking_s") or 0.0
            for c in self.checkpoints
            if low <= c["step"] < high and c["step"] != self.emergency_step
        )

    def time_of(self, step: int) -> float:
        """When ``step`` was finished: between two anchors, steps take equal time and each
        checkpoint's pause follows its step."""
        anchors = self.anchors
        if step <= anchors[0][0]:
            return anchors[0][1]
        for (s0, t0), (s1, t1) in itertools.pairwise(anchors):
            if step <= s1:
                if s1 <= s0:
                    return t1
                pure = max(0.0, (t1 - t0 - self.blocking(s0, s1)) / (s1 - s0))
                return min(max(t0 + (step - s0) * pure + self.blocking(s0, step), t0), t1)
        return anchors[-1][1]

    def pure_step_s(self, progress: Event) -> float | None:
        """Seconds per step of a ``progress`` interval without the checkpoint pauses in it."""
        st, step, since = (_num(progress, k) for k in ("step_time_s", "step", "since_step"))
        if st is None or step is None or since is None or step <= since:
            return st
        pauses = self.blocking(int(since), int(step))
        return max(0.0, (st * (step - since) - pauses) / (step - since))


def _segments(attempt: _Attempt, lower: float, step_s: float | None) -> None:
    """Split an attempt's trainer events at its restores and place each segment in time."""
    events = sorted(attempt.trainer, key=lambda e: e["ts"])
    segments: list[_Segment] = []
    for event in events:
        kind, step = event["event"], _int(event, "step")
        if kind == "restore" and step is not None:
            segments.append(_Segment(attempt, step, event))
        elif kind in ("progress", "checkpoint") and step is not None:
            if not segments:
                segments.append(_Segment(attempt, 0, None))
            (segments[-1].progress if kind == "progress" else segments[-1].checkpoints).append(
                event
            )
    _match_rollbacks(segments, events)
    failing = [e for e in attempt.exits if (_int(e, "exitcode") or 0) != 0]
    exit_step = max((_int(e, "step") or -1 for e in failing), default=-1)
    hang_step = max((_int(e, "step") or -1 for e in attempt.hangs), default=-1)
    emergency = [e for e in events if e["event"] == "emergency_checkpoint"]
    final_step = max([exit_step, hang_step, *(_int(e, "step") or -1 for e in emergency)])
    if not segments and final_step > 0:  # failed before its first progress event, from step 0
        segments.append(_Segment(attempt, 0, None))
    saved = [_int(e, "step") for e in emergency if e.get("saved")]
    if segments and saved:
        segments[-1].emergency_step = saved[-1]
    for seg in segments:
        if seg.restore is not None:
            seg.train_from = float(seg.restore["ts"])
            seg.begin = seg.train_from - (_num(seg.restore, "seconds") or 0.0)
        else:
            seg.begin = seg.train_from = _estimate_start(seg, lower)
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if last:
            seg.end_kind = {"failed": "failure", "succeeded": "success"}.get(attempt.state, "open")
            seg.end = attempt.end
        else:
            seg.end_kind = "rollback"
            seg.end = segments[i + 1].begin
        steps = [c["step"] for c in seg.progress + seg.checkpoints]
        if seg.rollback is not None:
            steps.append(_int(seg.rollback, "step") or 0)
        if last:
            steps.append(final_step)
        seg.reached = max([seg.start_step, *steps])
        seg.reached_at = _reached_at(seg, attempt, step_s)
        seg.anchors = _anchors(seg)
    attempt.segments = segments
    attempt.reached = max((s.reached for s in segments), default=max(final_step, -1))


def _match_rollbacks(segments: list[_Segment], events: list[Event]) -> None:
    """Give each segment the ``numerics_rollback`` that ended it: the event (every rank logs
    one) naming the step that the next segment's restore brought back."""
    for event in events:
        restored = _int(event, "rolled_back_to")
        if event["event"] != "numerics_rollback" or restored is None:
            continue
        candidates = [
            i
            for i, seg in enumerate(segments[1:], start=1)
            if seg.restore is not None and seg.restore["step"] == restored
        ]
        if candidates:
            i = min(candidates, key=lambda i: abs(segments[i].train_from - event["ts"]))
            segments[i - 1].rollback = segments[i - 1].rollback or event


def _estimate_start(seg: _Segment, lower: float) -> float:
    """When a segment without a restore began training: its first step's start, from the first
    ``progress`` event (its ``since_step`` is the first step this attempt finished); without
    one, when its trainers started (``lower``)."""
    if seg.progress:
        first = seg.progress[0]
        st, step, since = (_num(first, k) for k in ("step_time_s", "step", "since_step"))
        if st is not None and step is not None and since is not None:
            pure = seg.pure_step_s(first) or 0.0
            t_since = float(first["ts"]) - (step - since) * st
            return max(lower, min(float(first["ts"]), t_since - (since - seg.start_step) * pure))
    return lower


def _reached_at(seg: _Segment, attempt: _Attempt, step_s: float | None) -> float:
    """When the segment's furthest step was finished."""
    if seg.end_kind == "rollback":
        return seg.end  # the anomaly is found right after its step: the restore follows
    floor = max([seg.train_from, *(float(p["ts"]) for p in seg.progress)])
    if seg.end_kind == "failure" and attempt.hangs:
        silent = min(_num(h, "silent_s") or 0.0 for h in attempt.hangs)
        return min(max(seg.end - silent, floor), max(seg.end, floor))
    if seg.progress:
        last = seg.progress[-1]
        at, from_step, pure = float(last["ts"]), int(last["step"]), seg.pure_step_s(last)
    else:
        at, from_step, pure = seg.train_from, seg.start_step, step_s
    if pure is None:  # no step time anywhere in the log: the steps took all the time there was
        guess = seg.end if seg.reached > from_step else at
    else:
        guess = at + seg.blocking(from_step, seg.reached) + (seg.reached - from_step) * pure
    return min(max(guess, floor), max(seg.end, floor))


def _anchors(seg: _Segment) -> list[tuple[int, float]]:
    """(step, time finished) points of a segment, non-decreasing in both."""
    points = [(seg.start_step, seg.train_from)]
    if seg.progress:
        first = seg.progress[0]
        st, since = _num(first, "step_time_s"), _int(first, "since_step")
        if st is not None and since is not None and since > seg.start_step:
            points.append((since, first["ts"] - (first["step"] - since) * st))
    points += [(p["step"], p["ts"]) for p in seg.progress]
    points.append((seg.reached, seg.reached_at))
    anchors: list[tuple[int, float]] = []
    for step, at in sorted(points):
        at = min(max(at, seg.train_from), max(seg.reached_at, seg.train_from))
        if anchors and at < anchors[-1][1]:
            at = anchors[-1][1]
        anchors.append((step, at))
    return anchors


def _conclude(attempt: _Attempt, after: _Attempt | None, session: _Session, later: bool) -> None:
    """How and when an attempt ended; ``after`` is the next attempt of the session, ``later``
    whether another launch follows this session."""
    failing = sorted(
        (e for e in attempt.exits if (_int(e, "exitcode") or 0) != 0),
        key=lambda e: (not e.get("first"), e["ts"]),
    )
    succeeded = [e["ts"] for e in attempt.exits if _int(e, "exitcode") == 0]
    notes = {e["event"]: e for e in reversed(attempt.notes)}  # the first of each kind
    restart = after.restart if after is not None else None
    preempted = [notes["preempted"]] if "preempted" in notes else []
    noticed = [e["ts"] for e in [*failing[:1], *attempt.hangs[:1], *preempted]]
    if restart is not None:
        stop_begin = restart["ts"] - (_num(restart, "stop_s") or 0.0)
        detect = _num(restart, "detect_s")
        attempt.end = stop_begin - detect if detect is not None else min([*noticed, stop_begin])
        attempt.state = "failed"
    elif failing or attempt.hangs or "preempted" in notes:
        attempt.end, attempt.state = min(noticed), "failed"
    elif succeeded:
        attempt.end, attempt.state = min(succeeded), "succeeded"
    elif after is not None or later or session.outcome not in (None, "succeeded"):
        attempt.end, attempt.state = session.end, "failed"
    else:  # still running, or a log without exits: open until its last event
        attempt.end, attempt.state = session.end, "open"
    attempt.end = min(max(attempt.end, session.start), session.end)
    if attempt.state != "failed":
        return
    first = failing[0] if failing else None
    code = _int(first, "exitcode") if first is not None else None
    if "preempted" in notes or code == 75:
        source = notes["preempted"].get("source") if "preempted" in notes else None
        attempt.kind, attempt.reason = "preempted", f"preempted ({source or 'exit code 75'})"
        attempt.rank = _int(notes.get("preempted") or first or {}, "rank")
    elif attempt.hangs:
        worst = max(attempt.hangs, key=lambda h: _num(h, "silent_s") or 0.0)
        attempt.kind, attempt.rank = "hang", _int(worst, "rank")
        attempt.reason = (
            f"hang: rank {attempt.rank} silent for {_num(worst, 'silent_s') or 0.0:.1f} s "
            f"in phase {worst.get('phase')}"
        )
    elif first is not None:
        attempt.kind = "killed" if first.get("signal") else "crash"
        attempt.rank = _int(first, "rank")
        error = f": {first['error']}" if first.get("error") else ""
        how = f"killed by {first['signal']}" if first.get("signal") else f"exit code {code}"
        attempt.reason = how + error
    elif restart is not None and restart.get("reason") == "membership change":
        attempt.kind, attempt.reason = "membership change", "membership change"
    elif session.outcome not in (None, "succeeded") and after is None:
        attempt.kind, attempt.reason = "stopped", f"the run ended: {session.outcome}"
    else:
        attempt.kind, attempt.reason = "lost", "the supervisor stopped logging (killed?)"
    if restart is not None and restart.get("reason") and attempt.kind in ("killed", "crash"):
        attempt.reason = str(restart["reason"])
    if "crash_loop" in notes:
        attempt.reason += "; crash loop: the supervisor stopped"


def _keep(segments: list[_Segment], ended_badly: bool) -> None:
    """The furthest step of each segment that no later segment computed again."""
    later = math.inf
    for i in reversed(range(len(segments))):
        seg = segments[i]
        if i == len(segments) - 1 and ended_badly:  # nothing after it: kept what is durable
            durable = [c["step"] for c in seg.checkpoints if c["step"] <= seg.reached]
            keep = max([seg.start_step, *durable])
        else:
            keep = int(min(seg.reached, later))
        seg.keep_to = max(seg.start_step, keep)
        later = min(later, seg.start_step)


_PARTS = ("productive_s", "checkpoint_s", "lost_s", "detect_s", "restart_s", "restore_s", "other_s")


class _Tally:
    """Books consecutive stretches of the wall clock to parts; they cannot overlap or leave gaps,
    so the parts always add up to the wall time."""

    def __init__(self, start: float) -> None:
        self.at = start
        self.parts = dict.fromkeys(_PARTS, 0.0)

    def to(
        self,
        until: float,
        part: str,
        *,
        pause_s: float = 0.0,
        cost: dict[str, float] | None = None,
    ) -> None:
        """Book from the end of the last booking to ``until`` to ``part``, less ``pause_s`` (at
        most all of it) booked to checkpoints; ``cost`` also collects it (a failure's cost)."""
        seconds = max(0.0, until - self.at)
        self.at = max(self.at, until)
        paused = min(max(0.0, pause_s), seconds)
        self.parts["checkpoint_s"] += paused
        self.parts[part] += seconds - paused
        if cost is not None:
            cost[part] = cost.get(part, 0.0) + seconds - paused


@dataclass(slots=True)
class _Cost:
    attempt: _Attempt
    ts: float
    reached: int
    lost_steps: int
    position: int
    lost_from_ts: float
    last_step_ts: float
    """How many segments precede the one the run went on with."""
    kind: str = ""
    reason: str = ""
    rank: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def compute_ledger(events: Iterable[Event], *, run_dir: str | None = None) -> Ledger:
    """The ledger of a run from its events (any order; events without a time are ignored)."""
    ordered = sorted(
        (e for e in events if isinstance(e.get("event"), str) and _num(e, "ts") is not None),
        key=lambda e: float(e["ts"]),
    )
    sessions = _sessions(ordered)
    if not sessions:
        return _empty(run_dir)
    times = [t for e in ordered if e["event"] == "progress" if (t := _num(e, "step_time_s"))]
    step_s = statistics.median(times) if times else None
    per_session: list[list[_Attempt]] = []
    index = 0
    for n, session in enumerate(sessions):
        attempts = _attempts(session)
        for i, attempt in enumerate(attempts):
            attempt.index, index = index, index + 1
            after = attempts[i + 1] if i + 1 < len(attempts) else None
            _conclude(attempt, after, session, later=n < len(sessions) - 1)
            starts = [e["ts"] for e in attempt.starts]
            lower = max(starts) if starts else (attempt.restart or {}).get("ts", session.start)
            _segments(attempt, lower, step_s)
        per_session.append(attempts)
    segments = [s for attempts in per_session for a in attempts for s in a.segments]
    _keep(segments, ended_badly=sessions[-1].outcome not in (None, "succeeded"))
    tally, costs = _book(sessions, per_session)
    return _ledger(run_dir, sessions, per_session, segments, tally, costs)


def _book(
    sessions: list[_Session], per_session: list[list[_Attempt]]
) -> tuple[_Tally, list[_Cost]]:
    tally = _Tally(sessions[0].start)
    costs: list[_Cost] = []
    pending: dict[str, float] | None = None  # the last failure's downtime, until its restore
    position = 0
    for n, (session, attempts) in enumerate(zip(sessions, per_session, strict=True)):
        tally.to(session.start, "restart_s", cost=pending)  # the run was down between launches
        for attempt in attempts:
            setup = "other_s" if attempt.index == 0 else "restart_s"
            if attempt.restart is not None:
                stop_begin = attempt.restart["ts"] - (_num(attempt.restart, "stop_s") or 0.0)
                tally.to(stop_begin, "detect_s", cost=pending)
            for seg in attempt.segments:
                tally.to(seg.begin, setup, cost=pending)
                tally.to(seg.train_from, "restore_s", cost=pending)
                pending, position = None, position + 1
                tally.to(
                    seg.time_of(seg.keep_to),
                    "productive_s",
                    pause_s=seg.blocking(seg.start_step, seg.keep_to),
                )
                cost = None
                if seg.end_kind in ("rollback", "failure"):
                    cost = _Cost(
                        attempt,
                        seg.end,
                        seg.reached,
                        seg.reached - seg.keep_to,
                        position,
                        seg.time_of(seg.keep_to),
                        seg.reached_at,
                    )
                    if seg.end_kind == "rollback":
                        cost.kind, cost.reason = _rollback_reason(seg)
                    costs.append(cost)
                seconds = cost.seconds if cost is not None else None
                tally.to(
                    seg.time_of(seg.reached),
                    "lost_s",
                    pause_s=seg.blocking(seg.keep_to, seg.reached),
                    cost=seconds,
                )
                after = seg.blocking(seg.reached, 2**62)
                if seg.end_kind == "rollback":
                    tally.to(seg.end, "lost_s", cost=seconds)
                elif seg.end_kind == "failure":
                    tally.to(seg.end, "detect_s", pause_s=after + _emergency_s(seg), cost=seconds)
                else:
                    tally.to(seg.end, "other_s", pause_s=after)
                pending = seconds
            if attempt.state == "failed" and not attempt.segments:  # it never trained
                tally.to(attempt.end, setup, cost=pending)
                cost = _Cost(
                    attempt, attempt.end, attempt.reached, 0, position, attempt.end, attempt.end
                )
                costs.append(cost)
                pending = cost.seconds
        tally.to(session.end, "restart_s" if n < len(sessions) - 1 else "other_s", cost=pending)
    return tally, costs


def _emergency_s(seg: _Segment) -> float:
    return sum(
        _num(e, "seconds") or 0.0
        for e in seg.attempt.trainer
        if e["event"] == "emergency_checkpoint"
    )


def _rollback_reason(seg: _Segment) -> tuple[str, str]:
    """The kind and reason of a restore inside an attempt."""
    event = seg.rollback
    if event is None:  # a restore the trainer asked for itself
        return "rollback", f"went back to an earlier checkpoint after step {seg.reached}"
    return "numerics", (
        f"{event.get('kind', 'numerics')} at step {event.get('step')}: "
        f"rolled back to step {event.get('rolled_back_to')}"
    )


def _ledger(
    run_dir: str | None,
    sessions: list[_Session],
    per_session: list[list[_Attempt]],
    segments: list[_Segment],
    tally: _Tally,
    costs: list[_Cost],
) -> Ledger:
    start, end = sessions[0].start, sessions[-1].end
    tally.to(end, "other_s")
    parts = tally.parts
    failures = []
    for cost in costs:
        attempt = cost.attempt
        after = segments[cost.position] if cost.position < len(segments) else None
        failures.append(
            FailureRecord(
                ts=cost.ts,
                attempt=attempt.index,
                rank=attempt.rank if not cost.kind else cost.rank,
                kind=cost.kind or attempt.kind,
                reason=cost.reason or attempt.reason,
                step_reached=cost.reached,
                step_restored=after.start_step if after is not None else None,
                lost_steps=max(0, cost.lost_steps),
                lost_s=cost.seconds.get("lost_s", 0.0),
                detect_s=cost.seconds.get("detect_s", 0.0),
                restart_s=cost.seconds.get("restart_s", 0.0),
                restore_s=cost.seconds.get("restore_s", 0.0),
                lost_from_ts=cost.lost_from_ts,
                last_step_ts=cost.last_step_ts,
                resumed_ts=after.train_from if after is not None else None,
            )
        )
    attempts = [a for group in per_session for a in group]
    return Ledger(
        run_dir=run_dir,
        run_id=next((s.run_id for s in reversed(sessions) if s.run_id), None),
        outcome=sessions[-1].outcome,
        start_ts=start,
        end_ts=end,
        wall_s=end - start,
        productive_s=parts["productive_s"],
        breakdown=Breakdown(**{k: v for k, v in parts.items() if k != "productive_s"}),
        restarts=max(0, len(attempts) - 1),
        final_step=max((s.keep_to for s in segments), default=0),
        failures=tuple(failures),
        timeline=tuple(sorted(_timeline(attempts), key=lambda p: p.ts)),
        markers=tuple(sorted(_markers(sessions, attempts, failures), key=lambda m: m.ts)),
    )


def _empty(run_dir: str | None) -> Ledger:
    zero = Breakdown(
        checkpoint_s=0.0, lost_s=0.0, detect_s=0.0, restart_s=0.0, restore_s=0.0, other_s=0.0
    )
    return Ledger(
        run_dir=run_dir, run_id=None, outcome=None, start_ts=0.0, end_ts=0.0, wall_s=0.0,
        productive_s=0.0, breakdown=zero, restarts=0, final_step=0, failures=(), timeline=(),
        markers=(),
    )  # fmt: skip


def _timeline(attempts: list[_Attempt]) -> list[TimelinePoint]:
    points: list[TimelinePoint] = []
    for attempt in attempts:
        n = attempt.index
        for seg in attempt.segments:
            source = "restore" if seg.restore is not None else "estimate"
            points.append(
                TimelinePoint(ts=seg.train_from, step=seg.start_step, attempt=n, source=source)
            )
            points += [
                TimelinePoint(ts=e["ts"], step=e["step"], attempt=n, source=e["event"])
                for e in seg.progress + seg.checkpoints
            ]
            last = seg.progress[-1]["step"] if seg.progress else seg.start_step
            if seg.reached > last or seg.end_kind in ("failure", "rollback"):
                points.append(
                    TimelinePoint(ts=seg.reached_at, step=seg.reached, attempt=n, source="estimate")
                )
        points += [
            TimelinePoint(ts=e["ts"], step=step, attempt=n, source="rank_exit")
            for e in attempt.exits
            if (step := _int(e, "step")) is not None and step >= 0
        ]
    return points


def _markers(
    sessions: list[_Session], attempts: list[_Attempt], failures: list[FailureRecord]
) -> list[Marker]:
    markers = [
        Marker(ts=s.start, kind="restart", step=None, label="the run was launched again")
        for s in sessions[1:]
    ]
    markers += [
        Marker(ts=f.ts, kind="failure", step=f.step_reached if f.step_reached >= 0 else None,
               label=f"{f.kind}: {f.reason}")
        for f in failures if f.kind not in ("numerics", "rollback")
    ]  # fmt: skip
    for attempt in attempts:
        if attempt.restart is not None:
            r = attempt.restart
            label = f"restart {attempt.index}: {r.get('reason') or 'no reason logged'}"
            markers.append(Marker(ts=r["ts"], kind="restart", step=None, label=label))
        rollbacks_seen: set[tuple[Any, Any]] = set()
        for e in attempt.trainer:
            kind, step = e["event"], _int(e, "step")
            if kind == "checkpoint":
                label = f"checkpoint of step {step}: paused {_num(e, 'blocking_s') or 0.0:.2f} s"
                markers.append(Marker(ts=e["ts"], kind="checkpoint", step=step, label=label))
            elif kind == "restore":
                label = f"restored step {step} in {_num(e, 'seconds') or 0.0:.2f} s"
                markers.append(Marker(ts=e["ts"], kind="restore", step=step, label=label))
            elif kind == "numerics_rollback":
                key = (e.get("step"), e.get("rolled_back_to"))
                if key not in rollbacks_seen:  # every rank logs it
                    rollbacks_seen.add(key)
                    label = f"{e.get('kind')} at step {step}: rolled back to {key[1]}"
                    markers.append(Marker(ts=e["ts"], kind="rollback", step=step, label=label))
        for h in attempt.hangs:
            label = f"hang: rank {h.get('rank')} silent {_num(h, 'silent_s') or 0.0:.1f} s"
            markers.append(Marker(ts=h["ts"], kind="hang", step=_int(h, "step"), label=label))
        for e in attempt.notes:
            if e["event"] == "notice":
                label = f"preemption notice: {e.get('source')}"
                markers.append(Marker(ts=e["ts"], kind="preemption", step=None, label=label))
    return markers


def read_ledger(run_dir: str | os.PathLike[str]) -> Ledger:
    """The ledger of the run in ``run_dir`` (``crashproof run --run-dir``), from its
    ``events.jsonl``; raises FileNotFoundError naming the file when there is none."""
    path = os.path.join(os.fspath(run_dir), EVENTS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no event log at {path}: pass the directory given to `crashproof run --run-dir`"
        )
    return compute_ledger(read_events(path), run_dir=os.fspath(run_dir))
