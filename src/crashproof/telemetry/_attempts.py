"""The ledger's reading of an event log: launches of ``crashproof run`` (sessions), the attempts
of each (one per start of the trainers), and within an attempt the segments of training between
restores, with when each step was finished and when each attempt ended.

Everything here estimates *when*; why an attempt failed is :mod:`crashproof.telemetry._failures`'
call, and :mod:`crashproof.telemetry._ledger` books the time to parts.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from crashproof.telemetry._failures import blamed_hang, exit_failure, why_attempt_ended
from crashproof.telemetry._fields import Event, int_field, number_field

__all__ = [
    "Attempt",
    "Segment",
    "Session",
    "conclude",
    "find_segments",
    "keep_segments",
    "split_attempts",
    "split_sessions",
    "stall_time",
]

_TRAINER_EVENTS = frozenset(
    {"restore", "progress", "checkpoint", "emergency_checkpoint", "numerics_rollback"}
)


# -- reading the log ---------------------------------------------------------------------------


@dataclass(slots=True)
class Session:
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


def split_sessions(events: list[Event]) -> list[Session]:
    sessions: list[Session] = []
    for event in events:
        node = str(event.get("node", ""))
        if event["event"] == "run_start":
            # A node that starts again while its last start never ended lost its supervisor.
            if not sessions or not sessions[-1].open_nodes or node in sessions[-1].open_nodes:
                run_id = event.get("run_id")
                sessions.append(Session(event["ts"], run_id=str(run_id) if run_id else None))
            sessions[-1].open_nodes.add(node)
        elif not sessions:
            sessions.append(Session(event["ts"]))
        elif _after_the_end(event, sessions[-1]):
            continue
        sessions[-1].events.append(event)
        if event["event"] == "run_end":
            sessions[-1].run_ends.append(event)
            sessions[-1].open_nodes.discard(node)
    return sessions


def _after_the_end(event: Event, session: Session) -> bool:
    """The keeper's report on leftover processes, logged after the launch's ``run_end`` (it
    waits for the agent to exit): cleanup, not the run's time. (Without a ``run_end`` before it,
    the agent died, and the report is the launch's last word: kept.)"""
    return event["event"] == "orphans_stopped" and bool(session.run_ends) and not session.open_nodes


@dataclass(slots=True)
class Attempt:
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
    segments: list[Segment] = field(default_factory=list)
    end: float = 0.0
    state: str = "open"
    """``failed``, ``succeeded``, or ``open`` (still running when the log ends)."""
    kind: str = ""
    reason: str = ""
    rank: int | None = None
    reached: int = -1


def split_attempts(session: Session) -> list[Attempt]:
    attempts: dict[int, Attempt] = {}
    by_pid: dict[int, int] = {}
    current = 0

    def attempt(number: int) -> Attempt:
        return attempts.setdefault(number, Attempt(number))

    for event in session.events:
        kind, pid = event["event"], int_field(event, "pid")
        number = int_field(event, "restart")
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


def stall_time(attempt: Attempt) -> float | None:
    """When a hung attempt stopped making progress: its stalled rank's last heartbeat (None: the
    attempt did not end in a hang)."""
    hang = blamed_hang(attempt.hangs)
    if hang is None:
        return None
    # ``silent_s`` is measured at the verdict, which is when the attempt ended (the event
    # itself is written after the stacks are dumped)
    return min(attempt.end, float(hang["ts"])) - (number_field(hang, "silent_s") or 0.0)


# -- segments: stretches of training between restores -----------------------------------------


@dataclass(slots=True)
class Segment:
    """Training from one starting step: an attempt's start, or a numerics rollback's restore."""

    attempt: Attempt
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
            number_field(c, "blocking_s") or 0.0
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
        st, step, since = (number_field(progress, k) for k in ("step_time_s", "step", "since_step"))
        if st is None or step is None or since is None or step <= since:
            return st
        pauses = self.blocking(int(since), int(step))
        return max(0.0, (st * (step - since) - pauses) / (step - since))


def find_segments(attempt: Attempt, lower: float, step_s: float | None) -> None:
    """Split an attempt's trainer events at its restores and place each segment in time."""
    events = sorted(attempt.trainer, key=lambda e: e["ts"])
    segments: list[Segment] = []
    for event in events:
        kind, step = event["event"], int_field(event, "step")
        if kind == "restore" and step is not None:
            segments.append(Segment(attempt, step, event))
        elif kind in ("progress", "checkpoint") and step is not None:
            if not segments:
                segments.append(Segment(attempt, 0, None))
            (segments[-1].progress if kind == "progress" else segments[-1].checkpoints).append(
                event
            )
    stalled_at = stall_time(attempt)
    if stalled_at is not None:
        # A hang's downtime starts at the stalled rank's last heartbeat. Steps logged after it
        # were finished only when the supervisor woke the group to dump its stacks: they are not
        # evidence of how long training took (the stall would read as slow steps).
        for seg in segments:
            seg.progress = [p for p in seg.progress if p["ts"] <= stalled_at]
    _match_rollbacks(segments, events)
    failing = [e for e in attempt.exits if exit_failure(e)]
    exit_step = max((int_field(e, "step") or -1 for e in failing), default=-1)
    hang_step = max((int_field(e, "step") or -1 for e in attempt.hangs), default=-1)
    emergency = [e for e in events if e["event"] == "emergency_checkpoint"]
    final_step = max([exit_step, hang_step, *(int_field(e, "step") or -1 for e in emergency)])
    if not segments and final_step > 0:  # failed before its first progress event, from step 0
        segments.append(Segment(attempt, 0, None))
    saved = [int_field(e, "step") for e in emergency if e.get("saved")]
    if segments and saved:
        segments[-1].emergency_step = saved[-1]
    for seg in segments:
        if seg.restore is not None:
            seg.train_from = float(seg.restore["ts"])
            seg.begin = seg.train_from - (number_field(seg.restore, "seconds") or 0.0)
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
            steps.append(int_field(seg.rollback, "step") or 0)
        if last:
            steps.append(final_step)
        seg.reached = max([seg.start_step, *steps])
        seg.reached_at = _reached_at(seg, attempt, step_s)
        seg.anchors = _anchors(seg)
    attempt.segments = segments
    attempt.reached = max((s.reached for s in segments), default=max(final_step, -1))


def _match_rollbacks(segments: list[Segment], events: list[Event]) -> None:
    """Give each segment the ``numerics_rollback`` that ended it: the event (every rank logs
    one) naming the step that the next segment's restore brought back."""
    for event in events:
        restored = int_field(event, "rolled_back_to")
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


def _estimate_start(seg: Segment, lower: float) -> float:
    """When a segment without a restore began training: its first step's start, from the first
    ``progress`` event (its ``since_step`` is the first step this attempt finished); without
    one, when its trainers started (``lower``)."""
    if seg.progress:
        first = seg.progress[0]
        st, step, since = (number_field(first, k) for k in ("step_time_s", "step", "since_step"))
        if st is not None and step is not None and since is not None:
            pure = seg.pure_step_s(first) or 0.0
            t_since = float(first["ts"]) - (step - since) * st
            return max(lower, min(float(first["ts"]), t_since - (since - seg.start_step) * pure))
    return lower


def _reached_at(seg: Segment, attempt: Attempt, step_s: float | None) -> float:
    """When the segment's furthest step was finished."""
    if seg.end_kind == "rollback":
        return seg.end  # the anomaly is found right after its step: the restore follows
    floor = max([seg.train_from, *(float(p["ts"]) for p in seg.progress)])
    stalled_at = stall_time(attempt)
    if seg.end_kind == "failure" and stalled_at is not None:
        return min(max(stalled_at, floor), max(seg.end, floor))
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


def _anchors(seg: Segment) -> list[tuple[int, float]]:
    """(step, time finished) points of a segment, non-decreasing in both."""
    points = [(seg.start_step, seg.train_from)]
    if seg.progress:
        first = seg.progress[0]
        st, since = number_field(first, "step_time_s"), int_field(first, "since_step")
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


def conclude(attempt: Attempt, after: Attempt | None, session: Session, later: bool) -> None:
    """How and when an attempt ended; ``after`` is the next attempt of the session, ``later``
    whether another launch follows this session."""
    failing = sorted(
        (e for e in attempt.exits if exit_failure(e)),
        key=lambda e: (not e.get("first"), e["ts"]),
    )
    succeeded = [
        e["ts"]
        for e in attempt.exits
        if int_field(e, "exitcode") is not None and exit_failure(e) is None
    ]
    notes = {e["event"]: e for e in reversed(attempt.notes)}  # the first of each kind
    restart = after.restart if after is not None else None
    preempted = [notes["preempted"]] if "preempted" in notes else []
    noticed = [e["ts"] for e in [*failing[:1], *attempt.hangs[:1], *preempted]]
    if restart is not None:
        stop_begin = restart["ts"] - (number_field(restart, "stop_s") or 0.0)
        detect = number_field(restart, "detect_s")
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
    if attempt.state == "failed":
        attempt.kind, attempt.reason, attempt.rank = why_attempt_ended(
            failing=failing,
            hangs=attempt.hangs,
            notes=notes,
            restart=restart,
            run_outcome=session.outcome if after is None else None,
        )


def keep_segments(segments: list[Segment], ended_badly: bool) -> None:
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
