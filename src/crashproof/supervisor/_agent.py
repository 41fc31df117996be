"""The per-node agent: torch elastic's ``LocalElasticAgent``, plus what it does not do.

torch.distributed.elastic starts the trainers, runs the rendezvous, notices exits and restarts the
group within its budget. On top of it this agent

* tells its trainers where to heartbeat and report (environment set once, before any start);
* checks every trainer's heartbeat each monitor interval and treats a silent one as a failure:
  every trainer's Python stack is dumped to the run directory first (``SIGUSR2``, then
  ``SIGCONT`` for a stopped process), then the group is stopped and restarted;
* acts on a trainer's exit the moment it happens (not at the next monitor interval), and
  SIGKILLs the peers of a failed trainer at once: they can neither go on nor checkpoint;
* stops trainers with a short grace period (SIGTERM, then SIGKILL), not torch's 30 s;
* backs off between failures that make no progress, and stops a crash loop with a report;
* ends trainers that finished (closed their checkpoint manager) but do not exit within the done
  allowance, without counting it a failure: their work is committed;
* writes every start, exit, hang and restart to the event log.

It does not parse options (:mod:`crashproof.supervisor.launch` does) or decide what a hang is
(:mod:`crashproof.supervisor._hang`).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from crashproof.link import (
    ENV_HEARTBEAT_DIR,
    ENV_PARENT_PID,
    EXIT_PREEMPTED,
    STACK_DUMP_SIGNAL,
    Heartbeat,
    heartbeat_path,
    read_heartbeat,
    stack_dump_path,
)
from crashproof.supervisor._crashloop import CrashLoopPolicy, Failure
from crashproof.supervisor._exits import ExitWatcher
from crashproof.supervisor._hang import HangConfig, HangDetector, Verdict
from crashproof.supervisor._straggler import StragglerConfig, StragglerDetector
from crashproof.telemetry import ENV_RUN_DIR, EventLog

__all__ = ["CrashproofAgent", "SupervisorConfig"]

log = logging.getLogger(__name__)

_EXIT_CODE_WAIT_S = 0.05
"""How long a look waits for the exit code of a trainer seen to end (reaped by its parent)."""


@dataclass(kw_only=True, slots=True)
class SupervisorConfig:
    run_dir: str
    """Where events, logs, heartbeats and stack dumps go."""
    hang: HangConfig = field(default_factory=HangConfig)
    """When a silent trainer is hung."""
    crash_loop: CrashLoopPolicy = field(default_factory=CrashLoopPolicy)
    """When repeated failures are a crash loop, and the backoff between them."""
    shutdown_grace_s: float = 5.0
    """After SIGTERM, how long trainers get to exit before SIGKILL."""
    stack_dump_wait_s: float = 3.0
    """How long to wait for the stack dumps of a hung group."""
    preemption_grace_s: float = 30.0
    """On a preemption, how long trainers get for their emergency checkpoint before SIGKILL."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """When a rank's work per step is slow enough, for long enough, to be reported."""


class CrashproofAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` that also detects hangs, stops crash loops and logs events."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        config: SupervisorConfig,
        events: EventLog,
        start_method: str = "spawn",
        log_line_prefix_template: str | None = None,
        exit_barrier_timeout: float = 300,
    ) -> None:
        super().__init__(
            spec=spec,
            logs_specs=logs_specs,
            start_method=start_method,
            exit_barrier_timeout=exit_barrier_timeout,
            log_line_prefix_template=log_line_prefix_template,
            # The final shutdown (SIGTERM to the supervisor: a preemption) gives trainers the time
            # of an emergency checkpoint; restarts after a failure use shutdown_grace_s.
            shutdown_timeout=max(1, round(config.preemption_grace_s)),
        )
        self.config = config
        self.events = events
        self.hangs = HangDetector(config.hang)
        self.stragglers = StragglerDetector(config.straggler)
        self.crash_loop: Failure | None = None
        """The failure that made this run a crash loop, if one did."""
        self.preempted: str | None = None
        """What stopped the run early and resumably (a signal or a cloud notice), if anything."""
        self.attempt = 0
        """The attempt (``TORCHELASTIC_RESTART_COUNT``) of the group running now."""
        self._notice: tuple[signal.Signals, str] | None = None  # set by handlers, sent by the loop
        self._long_close = False
        self._grace = max(1, round(config.shutdown_grace_s))  # torch takes whole seconds
        agent_id = f"{socket.gethostname()}-{os.getpid()}"
        self.heartbeat_dir = os.path.join(config.run_dir, "heartbeats", agent_id)
        os.makedirs(self.heartbeat_dir, exist_ok=True)
        # Set before the first trainer starts, so the forkserver (started with the first group)
        # and every exec'd trainer inherit them; per-trainer facts come from torch's own variables.
        os.environ[ENV_RUN_DIR] = config.run_dir
        os.environ[ENV_HEARTBEAT_DIR] = self.heartbeat_dir
        os.environ[ENV_PARENT_PID] = str(os.getpid())  # trainers and forkserver die with it
        self._failed_at_s: float | None = None
        self._stop_reason = ""
        self._exits: ExitWatcher | None = None
        self._stopped_by_us: set[int] = set()
        """Trainers SIGKILLed because a peer had failed (their exit is not a failure of theirs)."""
        self._ended_after_done: set[int] = set()
        """Trainers ended after they were done (work committed) but did not exit: no failure."""
        self._seen_step = -1
        """The furthest step this attempt's heartbeats have shown."""
        self._seen_start_step = -1
        """The step this attempt's ranks restored, as their heartbeats showed it (-1: none)."""
        # torch's loop sleeps a whole monitor interval between looks; ours waits on this event
        # instead, which the exit watcher sets when a trainer exits, so a failure is acted on the
        # moment it happens and a look still comes every interval when nothing does.
        self._wake = threading.Event()
        self._monitor_interval_s = spec.monitor_interval
        spec.monitor_interval = 1e-3  # torch's own sleep: all but gone

    @property
    def restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    # -- starting and stopping ---------------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        for stale in glob.glob(os.path.join(self.heartbeat_dir, "local_rank_*")):
            os.remove(stale)  # a previous attempt's record must not vouch for a new trainer
        started = time.monotonic()
        self.attempt = self.restart_count
        self._stopped_by_us.clear()
        self._ended_after_done.clear()
        self._seen_step = self._seen_start_step = -1
        pids: dict[int, Any] = super()._start_workers(worker_group)
        if self._exits is not None:
            self._exits.close()
        self._exits = ExitWatcher(list(pids.values()), on_exit=self._wake.set)
        self._shorten_shutdown_grace()
        start_s = round(time.monotonic() - started, 4)
        for worker in worker_group.workers:
            self.events.emit(
                "rank_start",
                rank=worker.global_rank,
                local_rank=worker.local_rank,
                world_size=worker.world_size,
                pid=pids.get(worker.local_rank),
                restart=self.attempt,
                start_s=start_s,
            )
        return pids

    def _shorten_shutdown_grace(self) -> None:
        """On a failure torch's process context stops the survivors itself, with a fixed 30 s
        grace: a survivor that ignores SIGTERM (stuck in a collective under a handler) would stall
        the recovery that long. Give its ``close`` our grace period instead."""
        pcontext = self._pcontext
        if pcontext is None:
            return
        close = pcontext.close
        grace = self._grace

        def close_with_grace(death_sig: signal.Signals | None = None, timeout: int = grace) -> None:
            close(death_sig, timeout if self._long_close else min(timeout, grace))

        pcontext.close = close_with_grace  # type: ignore[method-assign]

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # torch's final shutdown on a signal to the supervisor (a preemption) asks for the
        # preemption grace: let that one through uncapped; every other close is a restart's.
        self._long_close = timeout > self._grace
        try:
            super()._shutdown(death_sig, timeout)
        finally:
            self._long_close = False

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(timeout=self._grace)
        # Each trainer opens its stack file at start; keep only those that hold a dump.
        attempt_dir = os.path.dirname(stack_dump_path(self.config.run_dir, self.attempt, 0))
        for path in glob.glob(os.path.join(attempt_dir, "rank_*.txt")):
            if _size(path) == 0:
                os.remove(path)
        with contextlib.suppress(OSError):
            os.rmdir(attempt_dir)  # only if empty

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        membership_change = worker_group.state == WorkerState.HEALTHY
        stop_started = time.monotonic()
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        stopped = time.monotonic()
        backoff = 0.0 if membership_change else self.config.crash_loop.backoff()
        self.events.emit(
            "restart",
            restart=self.restart_count,
            reason="membership change" if membership_change else self._stop_reason,
            remaining_restarts=self._remaining_restarts,
            stop_s=round(stopped - stop_started, 4),
            detect_s=(
                round(stop_started - self._failed_at_s, 4)
                if self._failed_at_s is not None
                else None
            ),
            backoff_s=backoff,
        )
        if backoff:
            log.warning(
                "no progress since the last failure: waiting %.0f s before restarting", backoff
            )
            time.sleep(backoff)
        self._initialize_workers(worker_group)

    # -- watching ----------------------------------------------------------------------------

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._wake.wait(self._monitor_interval_s)
        self._wake.clear()  # a wake-up after this is seen by the look below, or the next one
        self._stop_doomed_peers(worker_group)
        self._send_pending_notice()
        result: RunResult = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and self._all_finished(worker_group):
            # some ended by us after "done": every rank's work is committed
            result = RunResult(
                state=WorkerState.SUCCEEDED,
                return_values={w.global_rank: None for w in worker_group.workers},
            )
        if result.state == WorkerState.SUCCEEDED:
            for worker in worker_group.workers:
                ended = worker.id in self._ended_after_done
                self.events.emit(
                    "rank_exit",
                    rank=worker.global_rank,
                    exitcode=self._exit_code(worker) if ended else 0,
                    **({"ended_after_done": True} if ended else {}),
                )
        elif result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._on_failure(worker_group, result.failures)
        elif result.state == WorkerState.HEALTHY:
            hung = self._hung_workers(worker_group)
            stuck = [(w, v) for w, v in hung if v.phase == "done"]
            hung = [(w, v) for w, v in hung if v.phase != "done"]
            if hung:
                self._on_hang(worker_group, hung)
                return RunResult(state=WorkerState.FAILED)
            if stuck:
                self._end_stuck_after_done(worker_group, stuck)
            self._watch_stragglers(worker_group)
        return result

    def _all_finished(self, worker_group: WorkerGroup) -> bool:
        """Whether every trainer exited 0 or was ended by us after it was done."""
        if not self._ended_after_done:
            return False
        codes = self._exit_codes(worker_group)
        return all(
            w.id in self._ended_after_done or codes[w.local_rank] == 0 for w in worker_group.workers
        )

    def _end_stuck_after_done(
        self, worker_group: WorkerGroup, stuck: list[tuple[Worker, Verdict]]
    ) -> None:
        """End trainers that closed their checkpoint manager (their work is committed) but did
        not exit within the done allowance, once no rank of the group is still working.

        All the done ones are ended together: torch's process context SIGTERMs the survivors of
        any process that ends non-zero, and a done one SIGTERMed by torch would read as a failure.
        """
        codes = self._exit_codes(worker_group)
        beats = self._beats(worker_group.workers)
        running = [w for w in worker_group.workers if codes[w.local_rank] is None]
        if any(w.local_rank not in beats or beats[w.local_rank].phase != "done" for w in running):
            return  # a rank still works (its own allowance applies); the done ones wait for it
        # Ended already, not yet reaped (a busy host): ended and reported once.
        running = [w for w in running if w.id not in self._ended_after_done]
        if not running:
            return
        verdicts = {w.local_rank: v for w, v in stuck}
        states = {w.global_rank: _process_state(w.id) for w in running}
        stacks = self._dump_stacks(worker_group, running)
        now = time.monotonic()
        for worker in running:
            self._ended_after_done.add(worker.id)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(worker.id, signal.SIGKILL)
            beat = beats[worker.local_rank]
            verdict = verdicts.get(worker.local_rank)
            self.events.emit(
                "done_hang",
                rank=worker.global_rank,
                pid=worker.id,
                step=beat.step,
                silent_s=round(now - beat.beat_s, 3),
                timeout_s=round(self.hangs.config.done_timeout_s, 3),
                past_timeout=verdict is not None,
                process_state=states.get(worker.global_rank),
                stacks=stacks.get(worker.global_rank),
            )
            log.warning(
                "rank %d (pid %s) finished its work (step %d committed) but did not exit for "
                "%.1f s: ended it; stacks in %s",
                worker.global_rank,
                worker.id,
                beat.step,
                now - beat.beat_s,
                stacks.get(worker.global_rank, "(none written)"),
            )

    def _stop_doomed_peers(self, worker_group: WorkerGroup) -> None:
        """When a trainer has failed, SIGKILL the ones still running, at once.

        They cannot go on (their next collective waits for the dead rank) nor checkpoint (that
        takes every rank), and torch would first SIGTERM them and wait for them to unwind (a
        collective's error, the interpreter's exit), time every failure pays; to a crashproof
        trainer SIGTERM means "preempted: checkpoint and stop" besides. Their committed
        checkpoints are safe: commits are atomic. A trainer
        that stopped on a preemption notice (exit code 75) or finished (0) dooms no one: its
        peers are saving or finishing too.
        """
        codes = self._exit_codes(worker_group)
        if all(
            codes[w.local_rank] in (None, 0, EXIT_PREEMPTED) or w.id in self._ended_after_done
            for w in worker_group.workers
        ):
            return
        for worker in worker_group.workers:
            if codes[worker.local_rank] is None and worker.id is not None:
                self._stopped_by_us.add(worker.id)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(worker.id, signal.SIGKILL)

    def _exit_codes(self, worker_group: WorkerGroup) -> dict[int, int | None]:
        """Every trainer's exit code by local rank (None: running). A trainer the exit watcher saw
        end has a code a moment later, once the forkserver has reaped it: wait that moment
        (briefly; past it, the next look will tell)."""
        exited = self._exits.exited_s if self._exits is not None else {}
        deadline = time.monotonic() + _EXIT_CODE_WAIT_S
        while True:
            codes = {w.local_rank: self._exit_code(w) for w in worker_group.workers}
            unknown = [
                w for w in worker_group.workers if w.id in exited and codes[w.local_rank] is None
            ]
            if not unknown or time.monotonic() > deadline:
                return codes
            time.sleep(0.002)

    def _watch_stragglers(self, worker_group: WorkerGroup) -> None:
        by_local_rank = {w.local_rank: w for w in worker_group.workers}
        for report in self.stragglers.observe(self._beats(worker_group.workers)):
            rank = by_local_rank[report.local_rank].global_rank
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
                self.events.emit("straggler_recovered", **fields)
            else:
                log.warning(
                    "rank %d is a straggler: %.2fx its peers' median %s over its last %d steps "
                    "(%.4f s vs %.4f s per step)",
                    rank,
                    report.ratio,
                    "work" if report.basis == "compute_section" else "step time",
                    self.config.straggler.steps,
                    report.seconds_per_step,
                    report.peers_median_s,
                )
                self.events.emit("straggler", **fields)

    def _beats(self, workers: Iterable[Worker]) -> dict[int, Heartbeat]:
        """The heartbeat of each worker (by local rank) that has one from its current process."""
        beats = {}
        for worker in workers:
            beat = read_heartbeat(heartbeat_path(self.heartbeat_dir, worker.local_rank))
            if beat is not None and beat.pid == worker.id:
                beats[worker.local_rank] = beat
        return beats

    def _progress(self, beats: Iterable[Heartbeat]) -> tuple[int, int]:
        """(the furthest step, the restored step) of this attempt: from ``beats`` and every
        earlier look (a record can be unreadable at the moment of a failure)."""
        for beat in beats:
            self._seen_step = max(self._seen_step, beat.step)
            self._seen_start_step = max(self._seen_start_step, beat.start_step)
        return self._seen_step, self._seen_start_step

    def _furthest_step(self, worker_group: WorkerGroup) -> int:
        return self._progress(self._beats(worker_group.workers).values())[0]

    def _hung_workers(self, worker_group: WorkerGroup) -> list[tuple[Worker, Verdict]]:
        now = time.monotonic()
        beats = self._beats(worker_group.workers)
        self._progress(beats.values())
        hung = []
        for worker in worker_group.workers:
            beat = beats.get(worker.local_rank)
            if beat is None:
                continue  # not (yet) heartbeating: a script that does not use crashproof
            verdict = self.hangs.check(beat, now)
            if verdict is not None:
                hung.append((worker, verdict))
        return hung

    def _on_failure(self, worker_group: WorkerGroup, failures: dict[int, ProcessFailure]) -> None:
        """Log every trainer's exit, the first one to exit as the root cause, and record it."""
        self._failed_at_s = time.monotonic()
        exits = self._exits
        # torch reports one failure (or all, with the survivors it killed as failures too); the
        # watcher saw the order in which the processes really ended.
        workers = sorted(
            worker_group.workers,
            key=lambda w: (
                exits.order(w.id) if exits else 0.0,
                failures[w.global_rank].timestamp if w.global_rank in failures else 2**62,
            ),
        )
        first: Failure | None = None
        furthest = self._furthest_step(worker_group)
        for worker in workers:
            failure = failures.get(worker.global_rank)
            exitcode = failure.exitcode if failure is not None else self._exit_code(worker)
            if exitcode is None:
                continue  # still running: torch stops it next
            signame = _signal_name(-exitcode) if exitcode < 0 else None
            how = f"killed by {signame}" if signame else f"exit code {exitcode}"
            stopped = worker.id in self._stopped_by_us
            # A rank stopped because of its peer has no error of its own to show.
            error = None if stopped else self._last_error(worker, failure)
            self.events.emit(
                "rank_exit",
                rank=worker.global_rank,
                pid=worker.id,
                exitcode=exitcode,
                signal=signame,
                error=error,
                first=first is None,
                step=furthest,
                stopped=stopped,
            )
            if first is None and exitcode == EXIT_PREEMPTED:
                self._on_preempted(worker.global_rank, furthest)
                return
            if first is None:
                log.error(
                    "rank %d (pid %s) failed first: %s%s",
                    worker.global_rank,
                    worker.id,
                    how,
                    f": {error}" if error else "",
                )
                first = Failure(
                    attempt=self.attempt,
                    step=furthest,
                    rank=worker.global_rank,
                    reason=how + (f": {error}" if error else ""),
                    start_step=self._seen_start_step,
                )
        if first is None:
            first = Failure(
                attempt=self.attempt,
                step=furthest,
                rank=None,
                reason="the worker group became unhealthy",
                start_step=self._seen_start_step,
            )
        self._record(first)

    def _on_preempted(self, rank: int, step: int) -> None:
        """A trainer stopped with exit code 75 after its emergency checkpoint: no restart."""
        self.preempted = self.preempted or f"rank {rank} stopped on a notice"
        self._remaining_restarts = 0
        self.events.emit("preempted", rank=rank, step=step, source=self.preempted)
        log.warning(
            "the trainers stopped after step %d on a preemption notice: the run is resumable", step
        )

    def forward_notice(self, sig: signal.Signals, source: str) -> None:
        """Queue a preemption notice (a signal to the supervisor, or a cloud notice) for every
        trainer; they checkpoint at their next step and exit with code 75.

        Safe in a signal handler or another thread: it only records the notice; the monitor
        loop sends it (and logs it) at its next look, within ``--monitor-interval``. (It does not
        wake the loop: setting a ``threading.Event`` from a signal handler can deadlock on the
        event's own lock, and a notice leaves seconds, not milliseconds.)
        """
        self._notice = (sig, source)

    def _send_pending_notice(self) -> None:
        if self._notice is None:
            return
        sig, source = self._notice
        self._notice = None
        self.preempted = source
        self._remaining_restarts = 0  # from now on a failure ends the run: it is stopping
        self.events.emit("notice", source=source, signal=sig.name)
        log.warning("preemption notice (%s): asking the trainers to checkpoint and stop", source)
        for worker in self._worker_group.workers:
            if worker.id is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(worker.id, sig)

    def _exit_code(self, worker: Worker) -> int | None:
        """A trainer's exit code (negative: the signal), None while it runs or if unknown."""
        pcontext: Any = self._pcontext
        try:
            if hasattr(pcontext, "subprocess_handlers"):  # exec'd trainers
                code: int | None = pcontext.subprocess_handlers[worker.local_rank].proc.poll()
                return code
            mp_code: int | None = pcontext._pc.processes[worker.local_rank].exitcode
            return mp_code
        except (AttributeError, IndexError, KeyError):
            return None

    def _last_error(self, worker: Worker, failure: ProcessFailure | None) -> str | None:
        """The failed trainer's own error: its error file, or the last line of its stderr log."""
        message: Any = failure.message if failure is not None else None
        while isinstance(message, dict):  # error files nest {"message": {"message": ...}}
            message = message.get("message")
        if isinstance(message, str) and message and not message.startswith("To enable traceback"):
            return message.strip().splitlines()[-1][:500]
        pcontext = self._pcontext
        stderr = pcontext.stderrs.get(worker.local_rank) if pcontext is not None else None
        if stderr and os.path.isfile(stderr):
            with open(stderr, "rb") as f:
                f.seek(max(0, os.path.getsize(stderr) - 8192))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
            if lines:
                return lines[-1][:500]
        return None

    def _on_hang(self, worker_group: WorkerGroup, hung: list[tuple[Worker, Verdict]]) -> None:
        self._failed_at_s = time.monotonic()
        # The states first: the dump sends SIGCONT, and a stopped process ("T") would look alive.
        states = {w.global_rank: _process_state(w.id) for w in worker_group.workers}
        stacks = self._dump_stacks(worker_group)
        # A hung group cannot checkpoint (its collectives do not complete), and a SIGTERM would
        # only start an emergency save that waits out the grace period: kill it now.
        for worker in worker_group.workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(worker.id, signal.SIGKILL)
        worst_worker, worst = max(hung, key=lambda wv: wv[1].silent_s)
        for worker, verdict in hung:
            self.events.emit(
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
            os.path.dirname(next(iter(stacks.values()), self.config.run_dir)),
        )
        self._record(
            Failure(
                attempt=self.attempt,
                step=self._furthest_step(worker_group),
                rank=worst_worker.global_rank,
                reason=f"hang: silent for {worst.silent_s:.1f} s in phase {worst.phase}",
                start_step=self._seen_start_step,
            )
        )

    def _dump_stacks(
        self, worker_group: WorkerGroup, workers: list[Worker] | None = None
    ) -> dict[int, str]:
        """Ask every trainer (or ``workers``) for its Python stacks; returns the files written,
        by global rank."""
        workers = worker_group.workers if workers is None else workers
        paths = {
            w.global_rank: stack_dump_path(self.config.run_dir, self.attempt, w.global_rank)
            for w in workers
        }
        sizes = {rank: _size(path) for rank, path in paths.items()}
        for worker in workers:
            for sig in (STACK_DUMP_SIGNAL, signal.SIGCONT):  # a stopped process handles it on CONT
                try:
                    os.kill(worker.id, sig)
                except (ProcessLookupError, PermissionError):
                    break
        deadline = time.monotonic() + self.config.stack_dump_wait_s
        written: dict[int, str] = {}
        while time.monotonic() < deadline and len(written) < len(paths):
            time.sleep(0.05)
            for rank, path in paths.items():
                if rank not in written and _size(path) > sizes[rank]:
                    written[rank] = path
        time.sleep(0.05)  # let the last dumps finish their few lines
        return written

    def _record(self, failure: Failure) -> None:
        policy = self.config.crash_loop
        policy.record(failure)
        self._stop_reason = failure.reason
        if policy.is_crash_loop():
            self.crash_loop = failure
            self._remaining_restarts = 0  # the base loop then stops the group and returns FAILED
            self.events.emit(
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


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R running, S sleeping, T stopped, D disk ...)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"
