"""The goodput ledger: where a run's wall-clock time went, computed from its event log.

Every second between the first ``run_start`` and the last event (``run_end``, or whatever came
last in a run still going) is booked to exactly one part: *productive* (computing steps the run
kept), or one of the losses: checkpoint pauses, work lost to a failure and computed again,
detection, restart, restore, and *other* (start-up, shutdown, anything the log cannot place). The
parts are cut from one timeline in order, so they always add up to the wall time; ETTR, the
effective training time ratio, is productive over wall. ``docs/goodput.md`` explains each part
and the assumptions behind it.

This module owns the arithmetic. It does not classify failures
(:mod:`crashproof.telemetry._failures` does), render (:mod:`crashproof.telemetry._report`) or plan
(:mod:`crashproof.telemetry._planner`); what the events mean is ``docs/events.md``.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from crashproof._rundir import RunDir
from crashproof.telemetry import read_events
from crashproof.telemetry._attempts import (
    Attempt,
    Segment,
    Session,
    conclude,
    find_segments,
    keep_segments,
    split_attempts,
    split_sessions,
)
from crashproof.telemetry._failures import blamed_hang
from crashproof.telemetry._fields import Event, int_field, number_field
from crashproof.telemetry._records import Breakdown, FailureRecord, Ledger, Marker, TimelinePoint

__all__ = [
    "Breakdown",
    "FailureRecord",
    "Ledger",
    "Marker",
    "TimelinePoint",
    "compute_ledger",
    "read_ledger",
]


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
    attempt: Attempt
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
        (
            e
            for e in events
            if isinstance(e.get("event"), str) and number_field(e, "ts") is not None
        ),
        key=lambda e: float(e["ts"]),
    )
    sessions = split_sessions(ordered)
    if not sessions:
        return _empty(run_dir)
    times = [
        t for e in ordered if e["event"] == "progress" if (t := number_field(e, "step_time_s"))
    ]
    step_s = statistics.median(times) if times else None
    per_session: list[list[Attempt]] = []
    index = 0
    for n, session in enumerate(sessions):
        attempts = split_attempts(session)
        for i, attempt in enumerate(attempts):
            attempt.index, index = index, index + 1
            after = attempts[i + 1] if i + 1 < len(attempts) else None
            conclude(attempt, after, session, later=n < len(sessions) - 1)
            starts = [e["ts"] for e in attempt.starts]
            lower = max(starts) if starts else (attempt.restart or {}).get("ts", session.start)
            find_segments(attempt, lower, step_s)
        per_session.append(attempts)
    segments = [s for attempts in per_session for a in attempts for s in a.segments]
    keep_segments(segments, ended_badly=sessions[-1].outcome not in (None, "succeeded"))
    tally, costs = _book(sessions, per_session)
    return _ledger(run_dir, sessions, per_session, segments, tally, costs)


def _book(sessions: list[Session], per_session: list[list[Attempt]]) -> tuple[_Tally, list[_Cost]]:
    tally = _Tally(sessions[0].start)
    costs: list[_Cost] = []
    pending: dict[str, float] | None = None  # the last failure's downtime, until its restore
    position = 0
    for n, (session, attempts) in enumerate(zip(sessions, per_session, strict=True)):
        tally.to(session.start, "restart_s", cost=pending)  # the run was down between launches
        for attempt in attempts:
            setup = "other_s" if attempt.index == 0 else "restart_s"
            if attempt.restart is not None:
                stop_begin = attempt.restart["ts"] - (
                    number_field(attempt.restart, "stop_s") or 0.0
                )
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


def _emergency_s(seg: Segment) -> float:
    return sum(
        number_field(e, "seconds") or 0.0
        for e in seg.attempt.trainer
        if e["event"] == "emergency_checkpoint"
    )


def _restored_from(seg: Segment | None) -> str | None:
    """Where the restore that began ``seg`` read its state, as its event says."""
    if seg is None or seg.restore is None:
        return None
    kind = seg.restore.get("kind")
    if isinstance(kind, str):
        return kind
    return "tier" if "://" in str(seg.restore.get("source", "")) else "local"


def _rollback_reason(seg: Segment) -> tuple[str, str]:
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
    sessions: list[Session],
    per_session: list[list[Attempt]],
    segments: list[Segment],
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
                restored_from=_restored_from(after),
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


def _timeline(attempts: list[Attempt]) -> list[TimelinePoint]:
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
            if (step := int_field(e, "step")) is not None and step >= 0
        ]
    return points


def _markers(
    sessions: list[Session], attempts: list[Attempt], failures: list[FailureRecord]
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
            kind, step = e["event"], int_field(e, "step")
            if kind == "checkpoint":
                label = f"checkpoint of step {step}: paused {number_field(e, 'blocking_s') or 0.0:.2f} s"
                markers.append(Marker(ts=e["ts"], kind="checkpoint", step=step, label=label))
            elif kind == "restore":
                label = f"restored step {step} in {number_field(e, 'seconds') or 0.0:.2f} s"
                markers.append(Marker(ts=e["ts"], kind="restore", step=step, label=label))
            elif kind == "numerics_rollback":
                key = (e.get("step"), e.get("rolled_back_to"))
                if key not in rollbacks_seen:  # every rank logs it
                    rollbacks_seen.add(key)
                    label = f"{e.get('kind')} at step {step}: rolled back to {key[1]}"
                    markers.append(Marker(ts=e["ts"], kind="rollback", step=step, label=label))
        for h in [h for h in attempt.hangs if h is blamed_hang(attempt.hangs)]:
            label = f"hang: rank {h.get('rank')} silent {number_field(h, 'silent_s') or 0.0:.1f} s"
            markers.append(Marker(ts=h["ts"], kind="hang", step=int_field(h, "step"), label=label))
        for e in attempt.notes:
            if e["event"] == "notice":
                label = f"preemption notice: {e.get('source')}"
                markers.append(Marker(ts=e["ts"], kind="preemption", step=None, label=label))
    return markers


def read_ledger(
    run_dir: str | os.PathLike[str], on_malformed: Callable[[int, str], None] | None = None
) -> Ledger:
    """The ledger of the run in ``run_dir`` (``crashproof run --run-dir``), from its
    ``events.jsonl``; raises FileNotFoundError naming the file when there is none. Malformed
    lines are skipped, each reported to ``on_malformed`` (:func:`read_events`)."""
    path = RunDir(os.fspath(run_dir)).events
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no event log at {path}: pass the directory given to `crashproof run --run-dir`"
        )
    return compute_ledger(read_events(path, on_malformed), run_dir=os.fspath(run_dir))
