"""The events (``docs/events.md``) of what the agent saw: a trainer's exit, a hang (and which rank
caused it), a trainer ended after it was done, a straggler, a crash loop and a spent budget. The console tells them from the
event log (:mod:`crashproof.supervisor._narrator`).

Only records: the agent has decided and acted before it calls these.
"""

from __future__ import annotations

from torch.distributed.elastic.agent.server.api import Worker

from crashproof.link import Heartbeat
from crashproof.supervisor._crashloop import CrashLoopPolicy, Failure, RestartBudget
from crashproof.supervisor._hang import Verdict, culprit
from crashproof.supervisor._straggler import StragglerReport
from crashproof.telemetry import EventLog

__all__ = [
    "announce_budget_spent",
    "announce_crash_loop",
    "announce_done_crash",
    "announce_done_hang",
    "announce_exit",
    "announce_hang",
    "announce_straggler",
]

ByRank = dict[int, str | None]


def announce_exit(
    events: EventLog,
    worker: Worker,
    exitcode: int,
    *,
    signame: str | None,
    error: str | None,
    first: bool,
    step: int,
    stopped: bool,
    seen_after_s: float | None,
) -> None:
    """A trainer's exit in a failed attempt: the ``first`` is the root cause, ``stopped`` ones
    were ended by the agent because a peer failed (and have no error of their own)."""
    events.emit(
        "rank_exit",
        rank=worker.global_rank,
        pid=worker.id,
        exitcode=exitcode,
        signal=signame,
        error=error,
        first=first,
        step=step,
        stopped=stopped,
        **({"seen_after_s": seen_after_s} if first and seen_after_s is not None else {}),
    )


def announce_hang(
    events: EventLog,
    hung: list[tuple[Worker, Verdict]],
    states: ByRank,
    stacks: dict[int, str],
) -> tuple[Worker, Verdict]:
    """One ``hang`` event per silent trainer, the one that stopped the others marked ``blamed``;
    returns that one."""
    by_rank = {worker.global_rank: (worker, verdict) for worker, verdict in hung}
    blamed = culprit({rank: v for rank, (_, v) in by_rank.items()}, states, stacks)
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
            blamed=worker.global_rank == blamed,
        )
    return by_rank[blamed]


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


def announce_done_crash(
    events: EventLog,
    worker: Worker,
    beat: Heartbeat,
    *,
    exitcode: int,
    signal: str | None,
    error: str | None,
) -> None:
    """A trainer that finished its work, then crashed on its way out: no failure, no restart."""
    events.emit(
        "done_crash",
        rank=worker.global_rank,
        pid=worker.id,
        step=beat.step,
        exitcode=exitcode,
        signal=signal,
        error=error,
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
        events.emit("straggler_recovered", **fields)
        return
    fields["window_steps"] = window_steps
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


def announce_budget_spent(
    events: EventLog, failure: Failure, budget: RestartBudget, now: float
) -> None:
    """The failure the restart budget has no restart left for."""
    events.emit(
        "budget_spent",
        rank=failure.rank,
        step=failure.step,
        restarts=budget.used(now),
        max_restarts=budget.max_restarts,
        window_s=budget.window_s,
        reason=failure.reason,
    )
