"""What the agent tells of what it saw: the event (``docs/events.md``) and the console line of a
hang, a trainer ended after it was done, a straggler and a crash loop.

Only words: the agent has decided and acted before it calls these.
"""

from __future__ import annotations

import logging
import os

from torch.distributed.elastic.agent.server.api import Worker

from crashproof.link import Heartbeat
from crashproof.supervisor._crashloop import CrashLoopPolicy, Failure
from crashproof.supervisor._hang import Verdict
from crashproof.supervisor._straggler import StragglerReport
from crashproof.telemetry import EventLog

__all__ = ["announce_crash_loop", "announce_done_hang", "announce_hang", "announce_straggler"]

log = logging.getLogger(__name__)

ByRank = dict[int, str | None]


def announce_hang(
    events: EventLog,
    hung: list[tuple[Worker, Verdict]],
    states: ByRank,
    stacks: dict[int, str],
    run_dir: str,
) -> tuple[Worker, Verdict]:
    """One ``hang`` event per silent trainer, one error line for the worst; returns the worst."""
    worst_worker, worst = max(hung, key=lambda wv: wv[1].silent_s)
    for worker, verdict in hung:
        events.emit(
            "hang",
            rank=worker.global_rank,
            pid=worker.id,
            step=verdict.step,
            phase=verdict.phase,
            silent_s=round(verdict.silent_s, 3),
            timeout_s=round(verdict.timeout_s, 3),
            process_state=states.get(worker.global_rank),
            stacks=stacks.get(worker.global_rank),
        )
    log.error(
        "hang: rank %d silent for %.1f s in phase %r (allowance %.1f s, process state %s); "
        "stacks of every rank in %s",
        worst_worker.global_rank,
        worst.silent_s,
        worst.phase,
        worst.timeout_s,
        states.get(worst_worker.global_rank),
        os.path.dirname(next(iter(stacks.values()), run_dir)),
    )
    return worst_worker, worst


def announce_done_hang(
    events: EventLog,
    worker: Worker,
    beat: Heartbeat,
    *,
    silent_s: float,
    timeout_s: float,
    past_timeout: bool,
    state: str | None,
    stacks: str | None,
) -> None:
    """A trainer that finished its work but did not exit, ended by the agent."""
    events.emit(
        "done_hang",
        rank=worker.global_rank,
        pid=worker.id,
        step=beat.step,
        silent_s=round(silent_s, 3),
        timeout_s=round(timeout_s, 3),
        past_timeout=past_timeout,
        process_state=state,
        stacks=stacks,
    )
    log.warning(
        "rank %d (pid %s) finished its work (step %d committed) but did not exit for "
        "%.1f s: ended it; stacks in %s",
        worker.global_rank,
        worker.id,
        beat.step,
        silent_s,
        stacks or "(none written)",
    )


def announce_straggler(
    events: EventLog, worker: Worker, report: StragglerReport, window_steps: int
) -> None:
    """A rank that became a straggler (over its last ``window_steps`` steps), or recovered."""
    rank = worker.global_rank
    fields = {
        "rank": rank,
        "step": report.step,
        "ratio": report.ratio,
        "seconds_per_step": round(report.seconds_per_step, 6),
        "peers_median_s": round(report.peers_median_s, 6),
        "basis": report.basis,
    }
    if report.recovered:
        log.info("rank %d is no longer a straggler (%.2fx its peers)", rank, report.ratio)
        events.emit("straggler_recovered", **fields)
        return
    log.warning(
        "rank %d is a straggler: %.2fx its peers' median %s over its last %d steps "
        "(%.4f s vs %.4f s per step)",
        rank,
        report.ratio,
        "work" if report.basis == "compute_section" else "step time",
        window_steps,
        report.seconds_per_step,
        report.peers_median_s,
    )
    events.emit("straggler", **fields)


def announce_crash_loop(events: EventLog, failure: Failure, policy: CrashLoopPolicy) -> None:
    """The failure that made the run a crash loop."""
    events.emit(
        "crash_loop",
        rank=failure.rank,
        step=policy.furthest_step,
        last_step=failure.step,
        attempts=policy.stalled,
        reason=failure.reason,
    )
    log.error(
        "crash loop: %d failed attempts in a row without getting past step %d (the "
        "furthest the run reached); the last one reached step %d: rank %s, %s",
        policy.stalled,
        policy.furthest_step,
        failure.step,
        failure.rank,
        failure.reason,
    )
