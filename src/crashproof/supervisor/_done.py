"""Trainers that are done: their work is committed (``close()`` returned on a normal way out),
so nothing they do on the way out is a failure to restart.

A trainer's heartbeat enters phase "done" when it closes its checkpoint manager normally, and
never leaves it (:mod:`crashproof.link._heartbeat`). What can still go wrong is the interpreter's
exit: a destructor that deadlocks (gloo's process-group teardown, seen) or crashes (a native
extension's SIGSEGV or ``abort()``). A restart cannot help either (it would restore the final
step and take the same way out again); it would only spend the budget and end a finished run as a
crash loop. So the agent ends a done trainer that does not exit (``done_hang``) and takes a done
trainer's crash for the end it is (``done_crash``); the run succeeds once every rank exited 0 or
finished so. Exit code 75 is the one exception: a preemption keeps its meaning.

This module only judges; the agent (:mod:`crashproof.supervisor._agent`) acts and reports.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Collection, Mapping

from torch.distributed.elastic.agent.server.api import Worker

from crashproof.link import EXIT_PREEMPTED, FINISHED_PHASES, Heartbeat
from crashproof.supervisor._announce import announce_done_crash, announce_done_hang
from crashproof.supervisor._hang import Verdict
from crashproof.supervisor._trainers import process_state, signal_name, signal_trainers
from crashproof.telemetry import EventLog

__all__ = ["AfterDone", "all_finished", "crashed_after_done"]

Codes = Mapping[int, int | None]
"""Each trainer's exit code by local rank (None: running)."""
Beats = Mapping[int, Heartbeat]
"""Each trainer's heartbeat record by local rank (from its current process)."""


class AfterDone:
    """The trainers of the current attempt that ended after they were done, and their reports."""

    def __init__(self, events: EventLog, done_timeout_s: float) -> None:
        self.events = events
        self.done_timeout_s = done_timeout_s
        self.ended: set[int | None] = set()
        """Their pids: ended by the agent (they did not exit) or crashed on their way out."""
        self.stopped_by_torch: set[int | None] = set()
        """Done trainers torch is about to stop after a done peer's crash (see
        :meth:`torch_may_look`): its SIGTERM or SIGKILL is their end, not a crash to report."""

    def new_attempt(self) -> None:
        self.ended.clear()
        self.stopped_by_torch.clear()

    def note_crashes(
        self,
        workers: list[Worker],
        codes: Codes,
        beats: Beats,
        last_error: Callable[[int], str | None],
    ) -> None:
        """Take the trainers that crashed after they were done for finished; report each once
        (``last_error``: a trainer's last error line, by local rank)."""
        for worker in crashed_after_done(workers, codes, beats, self.ended):
            self.ended.add(worker.id)
            code = codes[worker.local_rank]
            assert code is not None
            if worker.id in self.stopped_by_torch and -code in (signal.SIGTERM, signal.SIGKILL):
                continue
            announce_done_crash(
                self.events,
                worker,
                beats[worker.local_rank],
                exitcode=code,
                signal=signal_name(-code) if code < 0 else None,
                # a signal's stderr ends in faulthandler's noise, not in an error of its own
                error=None if code < 0 else last_error(worker.local_rank),
            )

    def torch_may_look(self, workers: list[Worker], codes: Codes, beats: Beats) -> bool:
        """Whether torch's process context may look at the group now.

        At any non-zero exit torch stops every other trainer, so after a done trainer crashed it
        must not look while another one still works, after its close() too: the script may still
        export, upload or log. Once every trainer still running has returned from its script
        (phase "exiting"), they only wait for torch to collect their return values (a warm
        trainer exits only then), and torch's stop is their end, no failure. One that stays in
        "done" is ended by :meth:`end_stuck` when its done allowance runs out."""
        exited = [w for w in workers if codes[w.local_rank] is not None]
        if not any(w.id in self.ended and codes[w.local_rank] != 0 for w in exited):
            return True  # no done trainer ended non-zero: nothing to hold back
        if not all(_finished(w, codes, self.ended) for w in exited):
            return True  # a real failure besides: torch stops the group as for any failure
        running = [w for w in workers if codes[w.local_rank] is None]
        if any(
            w.local_rank not in beats or beats[w.local_rank].phase != "exiting" for w in running
        ):
            return False
        self.stopped_by_torch.update(w.id for w in running)
        return True

    def end_stuck(
        self,
        workers: list[Worker],
        codes: Codes,
        beats: Beats,
        stuck: list[tuple[Worker, Verdict]],
        dump_stacks: Callable[[list[Worker]], dict[int, str]],
    ) -> None:
        """End trainers that closed their checkpoint manager but did not exit within the done
        allowance (``stuck``), once no rank of the group is still working.

        All the done ones are ended together: torch's process context SIGTERMs the survivors of
        any process that ends non-zero, and a done one SIGTERMed by torch would read as a failure.
        """
        running = [w for w in workers if codes[w.local_rank] is None]
        if any(_working(w, beats) for w in running):
            return  # a rank still works (its own allowance applies); the done ones wait for it
        # Ended already, not yet reaped (a busy host): ended and reported once.
        running = [w for w in running if w.id not in self.ended]
        if not running:
            return
        past_timeout = {w.local_rank for w, _ in stuck}
        states = {w.global_rank: process_state(w.id) for w in running}
        stacks = dump_stacks(running)
        now = time.monotonic()
        self.ended.update(w.id for w in running)
        signal_trainers((w.id for w in running), signal.SIGKILL)
        for worker in running:
            beat = beats[worker.local_rank]
            announce_done_hang(
                self.events,
                worker,
                beat,
                silent_s=now - beat.beat_s,
                timeout_s=self.done_timeout_s,
                past_timeout=worker.local_rank in past_timeout,
                state=states.get(worker.global_rank),
                stacks=stacks.get(worker.global_rank),
            )


def crashed_after_done(
    workers: list[Worker],
    codes: Codes,
    beats: Beats,
    noted: Collection[int | None],
) -> list[Worker]:
    """The trainers (not in ``noted``, by pid) that exited other than 0 or 75 after their last
    heartbeat record (by local rank, from that same process) said "done"."""
    return [
        w
        for w in workers
        if codes[w.local_rank] not in (None, 0, EXIT_PREEMPTED)
        and w.id not in noted
        and not _working(w, beats)
    ]


def _working(worker: Worker, beats: Beats) -> bool:
    """Whether ``worker`` has not finished (no record yet, or one not in a finished phase)."""
    return worker.local_rank not in beats or beats[worker.local_rank].phase not in FINISHED_PHASES


def _finished(worker: Worker, codes: Codes, done: Collection[int | None]) -> bool:
    return codes[worker.local_rank] == 0 or worker.id in done


def all_finished(workers: list[Worker], codes: Codes, done: Collection[int | None]) -> bool:
    """Whether every trainer exited 0 or ended after it was done (its pid in ``done``)."""
    return all(_finished(w, codes, done) for w in workers)
