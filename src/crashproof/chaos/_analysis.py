"""Did the job notice each fault, and get over it? Matching injections to the run's events.

For each injection: the event that shows it was **detected**, by kind:

| kind | detected by |
|---|---|
| kill | the ``rank_exit`` of the killed process |
| hang | a ``hang`` event (the stopped rank's, or a peer's stuck waiting for it) |
| nan | the ``numerics`` event of the step the seam made non-finite |
| corrupt | a ``restore`` from a step older than the corrupted one (or the trainer's "skipping checkpoint step N" line, when nothing older was left); *not needed* when the restore came from memory at that step or a newer one |
| storage | the error in a rank's ``rank_exit`` or log (``enospc``, ``eio``); a ``checkpoint`` whose ``persist_s`` shows the stall, or a ``hang`` (``hang``) |
| straggler | a ``straggler`` event naming the rank |

A fault that stopped the group is matched to its failure in the goodput ledger
(:func:`crashproof.telemetry.compute_ledger`, classified by
:func:`crashproof.telemetry.failure_kind`): the first attempt after the fault that ended with a
rank's failure or a hang. It was **recovered** from when, after the detection (and, for a
straggler, after the slowdown ended), a checkpoint of a step beyond the furthest step reached
before the fault (the failure's ``step_reached``) was committed, or the run finished. Its **lost
work** is what had to be computed again: the failure's ``lost_steps`` once the run went on from a
restore (0 until it does); for a NaN rollback, the steps finished before the anomaly minus the
step rolled back to. ``lost_s`` prices those steps at the run's median step time (``progress``
events). Faults that cost no restart and no rollback lose no steps.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from crashproof.chaos._schedule import Fault
from crashproof.chaos._watch import Event, RunView
from crashproof.telemetry import GROUP_FAILURES, FailureRecord, failure_kind

__all__ = ["Injection", "assess", "median_step_s"]

_SEAM_KINDS = ("nan", "storage")


@dataclass(kw_only=True)
class Injection:
    """One fault as it happened, and (once :func:`assess` ran) what became of it."""

    fault: Fault
    due_s: float | None
    """When it was due, seconds after the run started (None: a step trigger)."""
    at_s: float
    """When it was injected (armed, for the seam kinds), seconds after the run started."""
    ts: float
    """The same moment, Unix time."""
    pid: int | None
    attempt: int
    """The attempt it hit (``rank_start``'s ``restart``)."""
    step: int
    """The furthest step the target had finished when it was injected (for ``nan``: the step
    whose loss was made non-finite, once it fired)."""
    details: dict[str, Any] = field(default_factory=dict)
    fired_ts: float | None = None
    """Seam kinds: when the trainer fired it (None: not yet)."""
    end_ts: float | None = None
    """A straggler: when the slowdown ended."""
    end_step: int | None = None
    detected: bool = False
    detected_by: str | None = None
    detect_s: float | None = None
    recovered: bool = False
    recovered_by: str | None = None
    lost_steps: int = 0
    lost_s: float = 0.0
    resolved_at_s: float | None = None
    """When the campaign saw it resolved, seconds after the run started."""
    gave_up: bool = False
    """The campaign stopped waiting for it (``--resolve-timeout``) or the run ended first."""
    not_needed: str | None = None
    """Why the fault turned out to need no detection: a corrupted checkpoint that the restore
    after it never had to read, since the agent's memory (or its peers') held that step or a
    newer one, verified."""

    @property
    def resolved(self) -> bool:
        """Nothing more is to be waited for: given up, or passed."""
        return self.gave_up or self.passed

    @property
    def passed(self) -> bool:
        """Detected (or shown not to need detecting) and recovered from."""
        return (self.detected or self.not_needed is not None) and self.recovered

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.fault.id,
            "kind": self.fault.kind,
            "trigger": self.fault.trigger,
            "due_s": self.due_s,
            "at_s": round(self.at_s, 3),
            "resolved_at_s": None if self.resolved_at_s is None else round(self.resolved_at_s, 3),
            "rank": self.fault.rank,
            "pid": self.pid,
            "attempt": self.attempt,
            "step": self.step,
            "params": dict(self.fault.params),
            "details": self.details,
            "detected": self.detected,
            "detected_by": self.detected_by,
            "detect_s": None if self.detect_s is None else round(self.detect_s, 3),
            "recovered": self.recovered,
            "recovered_by": self.recovered_by,
            "lost_steps": self.lost_steps,
            "lost_s": round(self.lost_s, 3),
            "not_needed": self.not_needed,
        }


def median_step_s(view: RunView) -> float | None:
    """The run's median step time, from its ``progress`` events."""
    times = [float(e["step_time_s"]) for e in view.of("progress") if e.get("step_time_s")]
    return statistics.median(times) if times else None


def assess(inj: Injection, view: RunView, *, until: float | None = None) -> None:
    """Bring ``inj``'s detection, recovery and lost work up to date with ``view``'s events.

    ``until``: when the next fault was injected. Detections and failures from then on are the
    next fault's doing (a recovery may still be seen later)."""
    if inj.fault.kind == "corrupt" and not inj.detected and inj.not_needed is None:
        inj.not_needed = _corruption_not_read(inj, view, until)
    if not inj.detected and inj.not_needed is None:
        found = _detection(inj, view, until)
        if found is not None:
            inj.detected, inj.detected_by = True, found[0]
            # None when only a trainer's log line showed it: such a line carries no time
            inj.detect_s = None if found[1] is None else max(0.0, found[1] - inj.ts)
    failure = _failure(inj, view, until)
    if (inj.detected or inj.not_needed is not None) and not inj.recovered:
        recovery = _recovery(inj, view, failure)
        if recovery is not None:
            inj.recovered, inj.recovered_by = True, recovery
    inj.lost_steps = _lost_steps(inj, view, failure, until)
    step_s = median_step_s(view)
    inj.lost_s = inj.lost_steps * step_s if step_s is not None else 0.0


def _first(events: list[Event], **match: Any) -> Event | None:
    return next((e for e in events if all(e.get(k) == v for k, v in match.items())), None)


def _start(inj: Injection) -> float:
    """From when the fault's effects can show: its injection, or its firing (seam kinds)."""
    if inj.fault.kind in _SEAM_KINDS and inj.fired_ts is not None:
        return inj.fired_ts
    return inj.ts


def _detection(
    inj: Injection, view: RunView, until: float | None
) -> tuple[str, float | None] | None:
    """What showed the fault (in words) and when (None: a log line, whose time is unknown); None
    while nothing has."""
    kind, rank, after = inj.fault.kind, inj.fault.rank, _start(inj)
    if kind in _SEAM_KINDS and inj.fired_ts is None:
        return None
    if kind == "kill":
        e = _first(view.of("rank_exit", after=after, before=until), pid=inj.pid)
        if e is not None:
            how = e.get("signal") or f"exit code {e.get('exitcode')}"
            return f"rank_exit: rank {e.get('rank')} {how}", float(e["ts"])
    elif kind == "hang" or (kind == "storage" and inj.fault.params.get("error") == "hang"):
        hangs = view.of("hang", after=after, before=until)
        e = _first(hangs, rank=rank) or (hangs[0] if hangs else None)
        if e is not None:
            return (
                f"hang: rank {e.get('rank')} silent {float(e.get('silent_s', 0)):.1f} s in "
                f"phase {e.get('phase')} (process state {e.get('process_state')})",
                float(e["ts"]),
            )
        if kind == "storage":
            return _slow_save(inj, view, after, until)
    elif kind == "nan":
        e = _first(view.of("numerics", after=after, before=until), step=inj.step)
        if e is not None:
            what = f"numerics: {e.get('kind')} loss at step {inj.step}, {e.get('action')}"
            return what, float(e["ts"])
    elif kind == "corrupt":
        return _corruption_seen(inj, view, until)
    elif kind == "storage":
        marker = f"crashproof chaos fault {inj.fault.id}"
        for e in view.of("rank_exit", after=after, before=until):
            if marker in str(e.get("error") or ""):
                return f"rank_exit: rank {e.get('rank')}: {e.get('error')}", float(e["ts"])
        line = view.find_in_logs(marker, from_attempt=inj.attempt)
        if line is not None:
            return f"trainer log: {line[:300]}", None
    elif kind == "straggler":
        e = _first(view.of("straggler", after=after, before=until), rank=rank)
        if e is not None:
            return (
                f"straggler: rank {rank} at {float(e.get('ratio', 0)):.2f}x its peers' work per "
                f"step ({e.get('basis')})",
                float(e["ts"]),
            )
    return None


def _slow_save(
    inj: Injection, view: RunView, after: float, until: float | None
) -> tuple[str, float] | None:
    """A save that took at least most of the injected stall."""
    hang_s = float(inj.fault.params.get("hang_s", 0))
    for e in view.of("checkpoint", after=after, before=until):
        if float(e.get("persist_s", 0)) >= 0.8 * hang_s:
            return (
                f"checkpoint: step {e.get('step')} took {float(e['persist_s']):.1f} s to persist "
                f"(stalled {hang_s:.1f} s)",
                float(e["ts"]),
            )
    return None


def _corruption_seen(
    inj: Injection, view: RunView, until: float | None
) -> tuple[str, float | None] | None:
    corrupted = inj.details.get("step")
    if corrupted is None:
        return None
    for e in view.of("restore", after=inj.ts, before=until):
        if int(e["step"]) < int(corrupted):
            return (
                f"restore: from step {e['step']}, skipping the corrupted step {corrupted}",
                float(e["ts"]),
            )
        if int(e["step"]) == int(corrupted):
            return None  # restored the damaged checkpoint as if it were whole: missed
    line = view.find_in_logs(f"skipping checkpoint step {corrupted}:", from_attempt=inj.attempt + 1)
    if line is not None:
        return f"trainer log: {line[:300]}", None
    return None


def _corruption_not_read(inj: Injection, view: RunView, until: float | None) -> str | None:
    """Why the damaged checkpoint never had to be read: the first restore after the fault came
    from memory (the agent's, or its peers') at the corrupted step or a newer one."""
    corrupted = inj.details.get("step")
    restores = view.of("restore", after=inj.ts, before=until)
    if corrupted is None or not restores:
        return None
    first = restores[0]
    if first.get("kind") not in ("memory", "peer") or int(first["step"]) < int(corrupted):
        return None
    where = "the agent's memory" if first.get("kind") == "memory" else "the peers' memory"
    return (
        f"restored step {first['step']} from {where}: the damaged checkpoint of step "
        f"{corrupted} was never read"
    )


def _failure(inj: Injection, view: RunView, until: float | None) -> FailureRecord | None:
    """The ledger's record of the first failure of the group after the fault (a rank's, or a
    hang); None when it caused none."""
    start, end = _start(inj), math.inf if until is None else until

    def after_fault(ts: float) -> bool:
        return start <= ts < end

    # The ledger reads the whole log: only once the log shows a failure to look up.
    if not any(
        failure_kind(e) in GROUP_FAILURES and after_fault(float(e.get("ts", 0)))
        for e in view.events
    ):
        return None
    return next(
        (f for f in view.ledger().failures if f.kind in GROUP_FAILURES and after_fault(f.ts)),
        None,
    )


def _reached(inj: Injection, failure: FailureRecord | None) -> int:
    """The furthest step finished before the fault's consequences: what recovery must pass."""
    if failure is not None:
        return failure.step_reached
    if inj.fault.kind == "straggler" and inj.end_step is not None:
        return inj.end_step
    return inj.step


def _recovery(inj: Injection, view: RunView, failure: FailureRecord | None) -> str | None:
    if inj.fault.kind == "straggler" and inj.end_ts is None:
        return None  # still being slowed down
    reached = _reached(inj, failure)
    after = max(_start(inj), inj.end_ts or 0.0)
    for e in view.of("checkpoint", after=after):
        if int(e["step"]) > reached:
            return f"checkpoint step {e['step']} committed"
    end = view.ended()
    if end is not None and end.get("outcome") == "succeeded":
        return "the run finished"
    return None


def _lost_steps(
    inj: Injection, view: RunView, failure: FailureRecord | None, until: float | None
) -> int:
    if failure is not None:
        # Nothing is computed again until the run goes on (the ledger counts the steps after the
        # newest checkpoint of a run that ended on the failure as lost; a campaign does not).
        return failure.lost_steps if failure.step_restored is not None else 0
    if inj.fault.kind == "nan" and inj.fired_ts is not None:
        # Not the ledger's figure: it counts the anomalous step too, a campaign the steps
        # finished before it.
        e = _first(view.of("numerics_rollback", after=inj.fired_ts, before=until), step=inj.step)
        if e is not None and e.get("rolled_back_to") is not None:
            return max(0, inj.step - 1 - int(e["rolled_back_to"]))
    return 0
