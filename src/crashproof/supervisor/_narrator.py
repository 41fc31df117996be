"""The console's story of a run: one line per thing that happened, told from the event log.

Every process of a run writes its events to ``RUN_DIR/events.jsonl`` (the agent: failures,
hangs, restarts; rank 0's trainer: restores, emergency checkpoints, numerics rollbacks; whoever
copies checkpoints to a durable tier: its failures). This narrator follows that file and tells
each event that matters to an operator as one line on the ``crashproof.run`` logger, beginning
with a word to grep for::

    failure:   rank 1 (pid 4242) exit code 3 after step 12: ValueError: ...; seen 0.001 s after it exited
    peers stopped: rank 0 (SIGKILL: they cannot go on without rank 1)
    restarting: attempt 1; restart 1 of 30 per 1 h; failure seen and group stopped in 0.01 s
    restored:  step 10 from the agent's memory in 0.05 s; 2 steps of work lost (reached 12)

The log is the one source: what the console says is what the report will book. The narrator
starts at the log's end when the launch begins, so an earlier launch into the same run
directory is not told again; it reads every quarter second, and :meth:`Narrator.close` reads the
rest before the run's summary.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from crashproof._units import format_duration
from crashproof.telemetry import (
    Event,
    EventTail,
    LogFollower,
    failure_kind,
    int_field,
    number_field,
)

__all__ = ["Narrator", "narrate"]

log = logging.getLogger("crashproof.run")

Line = tuple[int, str]

_POLL_S = 0.25


class _Story:
    """What a line needs from earlier events: the step the last failure reached."""

    def __init__(self, budget: str) -> None:
        self.budget = budget
        self.reached: int | None = None
        """The furthest step of the last failed attempt (None: no failure yet)."""
        self.stopped: list[int] = []
        """Ranks stopped because a peer failed, told in one line with the restart that follows
        (kept across reads of the log: their exits may be logged before the failure's)."""
        self.failed: Any = None
        """The rank whose failure the stopped ranks could not go on without."""

    def failed_at(self, event: Event) -> Any:
        """Remember the step a failure (or an anomaly) reached; returns the step as logged."""
        step = int_field(event, "step")
        if step is not None:
            self.reached = step
        return event.get("step")


def _secs(value: float | None) -> str:
    return format_duration(value) if value is not None else "?"


def _failure(e: Event, story: _Story) -> Line | None:
    if e.get("stopped") or failure_kind(e) not in ("killed", "crash"):
        return None  # not the first to fail, no failure, or a preemption's stop ("preempted")
    step = story.failed_at(e)
    how = f"killed by {e['signal']}" if e.get("signal") else f"exit code {e.get('exitcode')}"
    error = f": {e['error']}" if e.get("error") else ""
    seen = number_field(e, "seen_after_s")
    when = f"; seen {_secs(seen)} after it exited" if seen is not None else ""
    return (
        logging.ERROR,
        f"failure: rank {e.get('rank')} (pid {e.get('pid')}) {how} after step {step}{error}{when}",
    )


def _hang(e: Event, story: _Story) -> Line | None:
    if not e.get("blamed"):
        return None  # the others were waiting for it
    step = story.failed_at(e)
    stacks = e.get("stacks")
    where = f"; stacks of every rank in {os.path.dirname(stacks)}" if stacks else ""
    return (
        logging.ERROR,
        f"hang: rank {e.get('rank')} (pid {e.get('pid')}) stopped after step {step}: silent "
        f"{_secs(number_field(e, 'silent_s'))} in phase {e.get('phase')} (allowance "
        f"{_secs(number_field(e, 'timeout_s'))}, process state {e.get('process_state')}); detected by "
        f"its heartbeat{where}",
    )


def _restart(e: Event, story: _Story) -> Line:
    if e.get("reason") == "membership change":
        return logging.WARNING, f"restarting: attempt {e.get('restart')}: the nodes changed"
    seen, stop = number_field(e, "detect_s"), number_field(e, "stop_s")
    spent = (seen or 0.0) + (stop or 0.0)
    backoff = number_field(e, "backoff_s") or 0.0
    wait = (
        f"; waiting {_secs(backoff)} first: no progress since the last failure" if backoff else ""
    )
    return (
        logging.WARNING,
        f"restarting: attempt {e.get('restart')} ({e.get('remaining_restarts')} restarts left "
        f"of {story.budget}); group stopped {_secs(spent)} after the failure{wait}",
    )


def _restore(e: Event, story: _Story) -> Line:
    step = int_field(e, "step")
    source = str(e.get("source"))
    tier = "durable tier " if "://" in source else ""
    if e.get("kind") == "memory":  # (the source names the rank's slot: noise here)
        source, tier = "the agent's memory", ""
    elif e.get("kind") == "peer":
        source, tier = "the agents' memory (a lost node's part copied from a peer)", ""
    said = f"step {step} from {tier}{source} in {_secs(number_field(e, 'seconds'))}"
    reached, story.reached = story.reached, None
    if reached is None:
        return logging.INFO, f"resumed: {said}"
    lost = reached - step if step is not None else "?"
    return logging.INFO, f"restored: {said}; {lost} steps of work lost (reached step {reached})"


def _emergency(e: Event, _: _Story) -> Line:
    if e.get("saved"):
        return (
            logging.WARNING,
            f"emergency checkpoint: step {e.get('step')} saved in {_secs(number_field(e, 'seconds'))}",
        )
    return (
        logging.WARNING,
        f"emergency checkpoint: not saved at step {e.get('step')} (already committed, or too "
        "near the deadline)",
    )


def _numerics(e: Event, story: _Story) -> Line | None:
    if e.get("rank", 0) != 0:
        return None
    step = story.failed_at(e)
    to = e.get("rolled_back_to")
    what = f"rolled back to step {to}" if to is not None else "no checkpoint before it: skipped"
    return logging.WARNING, f"numerics: {e.get('kind')} at step {step}: {what}"


def _replication_failed(e: Event, _: _Story) -> Line | None:
    if e.get("attempt") != 1:
        return None  # told once per outage; "storage: ... back" ends it
    return (
        logging.WARNING,
        f"storage: copying to {e.get('tier')} failed: {e.get('error')}; retrying (checkpoints "
        f"stay on local disk meanwhile; {len(e.get('pending') or [])} waiting)",
    )


def _straggler(e: Event, _: _Story) -> Line:
    basis = "work" if e.get("basis") == "compute_section" else "step time"
    return (
        logging.WARNING,
        f"straggler: rank {e.get('rank')} at {e.get('ratio')}x its peers' median {basis} over "
        f"its last {e.get('window_steps', '?')} steps ({number_field(e, 'seconds_per_step') or 0:.4f} s "
        f"vs {number_field(e, 'peers_median_s') or 0:.4f} s per step)",
    )


def _checkpoint(e: Event, story: _Story) -> None:
    """Nothing to tell; but a step committed after a failure was seen (a hung group woken to
    dump its stacks goes on for a moment) is work that was not lost."""
    step = int_field(e, "step")
    if story.reached is not None and step is not None:
        story.reached = max(story.reached, step)


_TELL: dict[str, Callable[[Event, _Story], Line | None]] = {
    "checkpoint": _checkpoint,
    "rank_exit": _failure,
    "hang": _hang,
    "restart": _restart,
    "restore": _restore,
    "emergency_checkpoint": _emergency,
    "numerics_rollback": _numerics,
    "replication_failed": _replication_failed,
    "straggler": _straggler,
    "straggler_recovered": lambda e, _: (
        logging.INFO,
        f"straggler: rank {e.get('rank')} is back at {e.get('ratio')}x its peers",
    ),
    "replication_recovered": lambda e, _: (
        logging.INFO,
        f"storage: {e.get('tier')} is back after {_secs(number_field(e, 'down_s'))}",
    ),
    "replication_dropped": lambda e, _: (
        logging.WARNING,
        f"storage: {e.get('tier')} is behind: gave up copying steps {e.get('steps')} to it "
        f"(backlog full); newer ones follow",
    ),
    "notice": lambda e, _: (
        logging.WARNING,
        f"preemption notice ({e.get('source')}): the trainers checkpoint and stop",
    ),
    "preempted": lambda e, _: (
        logging.WARNING,
        f"preempted: the trainers stopped after step {e.get('step')}; the run is resumable: "
        "run the same command again",
    ),
    "done_hang": lambda e, _: (
        logging.WARNING,
        f"done: rank {e.get('rank')} (pid {e.get('pid')}) finished its work (step "
        f"{e.get('step')} committed) but did not exit for {_secs(number_field(e, 'silent_s'))}: ended "
        f"it; stacks in {e.get('stacks') or '(none written)'}",
    ),
    "done_crash": lambda e, _: (
        logging.WARNING,
        f"done: rank {e.get('rank')} (pid {e.get('pid')}) finished its work (step "
        f"{e.get('step')} committed), then "
        + (f"was killed by {e.get('signal')}" if e.get("signal") else f"exited {e.get('exitcode')}")
        + (f" on its way out ({e.get('error')})" if e.get("error") else " on its way out")
        + ": not a failure, not restarted",
    ),
    "crash_loop": lambda e, _: (
        logging.ERROR,
        f"crash loop: {e.get('attempts')} failed attempts in a row without getting past step "
        f"{e.get('step')} (the furthest the run reached); the last one reached step "
        f"{e.get('last_step')}: rank {e.get('rank')}, {e.get('reason')}",
    ),
    "budget_spent": lambda e, story: (
        logging.ERROR,
        f"budget spent: {e.get('restarts')} restarts already within the window ({story.budget}); "
        f"not restarting after rank {e.get('rank')}'s failure after step {e.get('step')}",
    ),
}


def narrate(events: list[Event], story: _Story, node: str) -> list[Line]:
    """The lines that ``events`` (in log order) tell; supervisor events of other nodes are
    theirs to tell. Ranks stopped because a peer failed are told in one line, just before what
    the supervisor did next (restart, or stop), whichever read of the log brought them."""
    lines: list[Line] = []
    for event in events:
        name = str(event.get("event"))
        if "node" in event and event["node"] != node and name != "notice":
            continue
        if name == "rank_exit" and event.get("stopped"):
            story.stopped.append(int(event.get("rank", -1)))
            continue
        if name == "rank_exit" and event.get("first"):
            story.failed = event.get("rank")
        tell = _TELL.get(name)
        line = tell(event, story) if tell is not None else None
        if line is not None:
            lines.append(line)
        if story.stopped and name in _AFTER_A_FAILURE:
            told = _stopped(story.stopped, story.failed)
            if line is not None:
                lines.insert(-1, told)
            else:
                lines.append(told)
            story.stopped, story.failed = [], None
    return lines


_AFTER_A_FAILURE = ("restart", "budget_spent", "crash_loop", "run_end")
"""What the supervisor logs once a failure's peers are stopped."""


def _stopped(ranks: list[int], failed: Any) -> Line:
    names = ", ".join(str(r) for r in sorted(ranks))
    plural = "rank" if len(ranks) == 1 else "ranks"
    why = f"they cannot go on without rank {failed}" if failed is not None else "a peer failed"
    return logging.WARNING, f"peers stopped: {plural} {names} (SIGKILL: {why})"


class Narrator:
    """Follows a run's event log on a thread of its own and tells it on the console."""

    def __init__(self, events_path: str, *, node: str, budget: str) -> None:
        self._tail = EventTail(events_path)
        self._tail.skip_to_end()
        self._story = _Story(budget)
        self._node = node
        self._follower = LogFollower(self._tell, interval_s=_POLL_S, name="crashproof-narrator")

    def _tell(self) -> None:
        for level, line in narrate(self._tail.read_new(), self._story, self._node):
            log.log(level, "%s", line)

    def close(self) -> None:
        """Tell what is left in the log, then stop."""
        self._follower.close()
