"""What kind of failure an event reports, and why an attempt ended: the one classifier.

The goodput ledger books each failure under the kind found here (``docs/goodput.md``); the
metrics endpoint counts failures by it (in its own label words, ``docs/metrics.md``), and
``crashproof chaos`` prices its faults with the ledger's failures. The kinds: ``killed`` (by a
signal), ``crash`` (a non-zero exit code), ``hang``, ``preempted``, ``numerics``, ``storage``
(a durable tier's upload failed); an attempt that ended without any of these is a
``membership change``, ``stopped`` (the run ended on it) or ``lost`` (the log ends).
"""

from __future__ import annotations

from crashproof.exitcodes import EXIT_PREEMPTED
from crashproof.telemetry._fields import Event, int_field, number_field

__all__ = [
    "GROUP_FAILURES",
    "blamed_hang",
    "exit_failure",
    "failure_kind",
    "why_attempt_ended",
]

GROUP_FAILURES = frozenset({"killed", "crash", "hang", "preempted"})
"""The kinds that stop the whole trainer group (and end its attempt)."""


def exit_failure(event: Event) -> str | None:
    """The kind of failure a ``rank_exit`` shows: ``preempted`` (exit code 75, after its
    emergency checkpoint), ``killed`` (by a signal) or ``crash``; None for an exit that is none
    (code 0, no code, or a trainer the agent ended after its work was committed)."""
    code = int_field(event, "exitcode")
    if not code or event.get("ended_after_done"):
        return None
    if code == EXIT_PREEMPTED:
        return "preempted"
    return "killed" if code < 0 or event.get("signal") else "crash"


def failure_kind(event: Event) -> str | None:
    """The failure one event reports (None: it reports none): the ``rank_exit`` of the rank that
    failed first (:func:`exit_failure`), a ``hang`` (one per silent rank), a ``preempted`` stop, a
    ``numerics`` verdict (rank 0's: every rank logs the one they agreed on) or a
    ``replication_failed`` upload (``storage``)."""
    name = event.get("event")
    if name == "rank_exit":
        return exit_failure(event) if event.get("first") else None
    if name == "numerics":
        return "numerics" if event.get("rank", 0) == 0 else None
    return {"hang": "hang", "preempted": "preempted", "replication_failed": "storage"}.get(
        str(name)
    )


def blamed_hang(hangs: list[Event]) -> Event | None:
    """The ``hang`` event of the rank that stopped the others: the one the supervisor marked
    ``blamed``, or (a log from before that mark) the longest silent."""
    if not hangs:
        return None
    marked = [h for h in hangs if h.get("blamed")]
    return marked[0] if marked else max(hangs, key=lambda h: number_field(h, "silent_s") or 0.0)


def why_attempt_ended(
    *,
    failing: list[Event],
    hangs: list[Event],
    notes: dict[str, Event],
    restart: Event | None,
    run_outcome: str | None,
) -> tuple[str, str, int | None]:
    """The kind, the reason and the rank of an attempt that failed.

    ``failing``: its failed exits, the first to fail first; ``hangs``: its ``hang`` events;
    ``notes``: its first ``preempted``, ``crash_loop`` and ``notice`` by name; ``restart``: the
    ``restart`` that began the next attempt; ``run_outcome``: how the run ended, when it ended
    with this attempt.
    """
    first = failing[0] if failing else None
    exit_kind = exit_failure(first) if first is not None else None
    if "preempted" in notes or exit_kind == "preempted":
        source = notes["preempted"].get("source") if "preempted" in notes else None
        kind, reason = "preempted", f"preempted ({source or 'exit code 75'})"
        rank = int_field(notes.get("preempted") or first or {}, "rank")
    elif hangs:
        worst = blamed_hang(hangs) or hangs[0]
        kind, rank = "hang", int_field(worst, "rank")
        reason = (
            f"hang: rank {rank} silent for {number_field(worst, 'silent_s') or 0.0:.1f} s "
            f"in phase {worst.get('phase')}"
        )
    elif first is not None and exit_kind is not None:
        kind, rank = exit_kind, int_field(first, "rank")
        how = (
            f"killed by {first['signal']}"
            if first.get("signal")
            else f"exit code {int_field(first, 'exitcode')}"
        )
        reason = how + (f": {first['error']}" if first.get("error") else "")
    elif restart is not None and restart.get("reason") == "membership change":
        kind, reason, rank = "membership change", "membership change", None
    elif run_outcome not in (None, "succeeded"):
        kind, reason, rank = "stopped", f"the run ended: {run_outcome}", None
    else:
        kind, reason, rank = "lost", "the supervisor stopped logging (killed?)", None
    if restart is not None and restart.get("reason") and kind in ("killed", "crash"):
        reason = str(restart["reason"])  # the agent's own words, with the rank's error
    if "crash_loop" in notes:
        reason += "; crash loop: the supervisor stopped"
    return kind, reason, rank
