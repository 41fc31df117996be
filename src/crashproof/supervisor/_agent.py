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
* keeps to a restart budget per time window (torch's own count is a lifetime's);
* ends trainers that finished (closed their checkpoint manager) but do not exit within the done
  allowance, without counting it a failure: their work is committed;
* writes every start, exit, hang and restart to the event log.

This module is the loop and its decisions. The trainers' heartbeat records are read by
:mod:`~crashproof.supervisor._heartbeats`, signals, stack dumps and exit codes go through
:mod:`~crashproof.supervisor._trainers`, and the events and console lines of hangs, stragglers and
crash loops are worded by :mod:`~crashproof.supervisor._announce`. It does not parse options
(:mod:`crashproof.supervisor.launch` does) or decide what a hang is
(:mod:`crashproof.supervisor._hang`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
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
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousGracefulExitError,
)

from crashproof._rundir import ENV_RUN_DIR, RunDir
from crashproof._runfiles import make_new_dir
from crashproof.link import ENV_HEARTBEAT_DIR, ENV_PARENT_PID, EXIT_PREEMPTED, FINISHED_PHASES
from crashproof.supervisor._announce import (
    announce_budget_spent,
    announce_crash_loop,
    announce_exit,
    announce_hang,
    announce_straggler,
)
from crashproof.supervisor._config import DEFAULT_MAX_RESTARTS, SupervisorConfig
from crashproof.supervisor._crashloop import Failure
from crashproof.supervisor._done import AfterDone, all_finished
from crashproof.supervisor._exits import ExitWatcher, failure_order
from crashproof.supervisor._fence import Fence
from crashproof.supervisor._hang import HangDetector, Verdict
from crashproof.supervisor._heartbeats import GroupHeartbeats
from crashproof.supervisor._keeper import Keeper, forkserver_pid, session_leaders
from crashproof.supervisor._memory_host import MemoryHost
from crashproof.supervisor._memory_peers import Peers
from crashproof.supervisor._rendezvous_state import state_of
from crashproof.supervisor._standby import Standby, count_only_nodes_with_room, warm_forkserver
from crashproof.supervisor._straggler import StragglerDetector
from crashproof.supervisor._trainers import (
    dump_stacks,
    end_leftovers,
    exit_code,
    exit_codes,
    last_error,
    process_state,
    remove_empty_stack_dumps,
    settle_clean_exits,
    signal_name,
    signal_trainers,
    wait_for_exit_codes,
)
from crashproof.telemetry import EventLog

__all__ = ["DEFAULT_MAX_RESTARTS", "UNLIMITED_RESTARTS", "CrashproofAgent", "SupervisorConfig"]

UNLIMITED_RESTARTS = 2**31 - 1
"""The ``WorkerSpec.max_restarts`` the agent gives torch: torch never refuses a restart itself
(its count is a lifetime's), and its restart count (``TORCHELASTIC_RESTART_COUNT``) stays the
number of the attempt."""

log = logging.getLogger(__name__)


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
        keeper: Keeper | None = None,
        memory: MemoryHost | None = None,
        memory_peers: Peers | None = None,
        standby: int = 0,
        fence: Fence | None = None,
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
        self._keeper = keeper
        self._memory = memory
        self._memory_peers = memory_peers
        self._fence = fence
        self._standby = Standby(events, standby)
        count_only_nodes_with_room(spec.rdzv_handler)  # (a full round never restarts for a spare)
        self._warmed = start_method != "forkserver"
        self._sessions: dict[int, int | None] = {}  # the trainers' sessions, by leader
        self.layout = RunDir(config.run_dir)
        self.crash_loop: Failure | None = None
        """The failure that made this run a crash loop, if one did."""
        self.budget_spent: Failure | None = None
        """The failure that found the restart budget spent, if one did."""
        self.preempted: str | None = None
        """What stopped the run early and resumably (a signal or a cloud notice), if anything."""
        self.attempt = 0
        """The attempt (``TORCHELASTIC_RESTART_COUNT``) of the group running now."""
        self._notice: tuple[signal.Signals, str] | None = None  # set by handlers, sent by the loop
        self._long_close = False
        self._grace = max(1, round(config.shutdown_grace_s))  # torch takes whole seconds
        # A session of this agent's own: a requeued job reusing the run directory (same host,
        # perhaps the same pid in a container) never writes into an earlier session's folders.
        self.session = make_new_dir(
            config.run_dir,
            os.path.relpath(self.layout.heartbeats, config.run_dir),
            f"{socket.gethostname()}-{os.getpid()}",
        )
        self.heartbeats = GroupHeartbeats(
            self.layout.heartbeat_dir(self.session),
            HangDetector(config.hang),
            StragglerDetector(config.straggler),
        )
        # Set before the first trainer starts, so the forkserver (started with the first group)
        # and every exec'd trainer inherit them; per-trainer facts come from torch's own variables.
        os.environ[ENV_RUN_DIR] = config.run_dir
        os.environ[ENV_HEARTBEAT_DIR] = self.heartbeats.directory
        os.environ[ENV_PARENT_PID] = str(os.getpid())  # trainers and forkserver die with it
        self._failed_at_s: float | None = None
        self._stop_reason = ""
        self._exits: ExitWatcher | None = None
        self._stopped_by_us: set[int] = set()
        """Trainers SIGKILLed because a peer had failed (their exit is not a failure of theirs)."""
        self._done = AfterDone(events, config.hang.done_timeout_s)
        """Trainers that ended after they were done (work committed): no failure."""
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

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if not self._warmed:  # the trainers' imports, while the agents meet
            self._warmed = True
            warm_forkserver()
        handler = worker_group.spec.rdzv_handler
        self._standby.begin(handler)
        try:
            super()._rendezvous(worker_group)
        except RendezvousConnectionError as exc:
            self._standby.stop()
            if not self._standby.waiting:
                raise
            # A spare left waiting when the run ends: node 0's agent, which hosts the
            # rendezvous, may exit before the spare sees the rendezvous closed.
            log.warning("the run's rendezvous is gone (the run ended, or node 0 was lost): "
                        "this spare was not needed; it stops")  # fmt: skip
            raise RendezvousGracefulExitError(str(exc)) from exc
        except BaseException:
            self._standby.stop()
            raise
        self._standby.end(handler)
        group_rank, nodes = worker_group.group_rank, worker_group.group_world_size
        if self._fence is not None and group_rank is not None and nodes is not None:
            try:  # (a lost node is then out of the next round at once: see _fence)
                self._fence.join_round(handler, worker_group.store, group_rank, nodes)
            except Exception as exc:
                log.warning("a lost node will be known by its keep-alives only: %s", exc)
        if self._memory_peers is not None and group_rank is not None and nodes is not None:
            # The agents learn each other's address, to copy snapshots between them.
            try:
                ranks = [w.global_rank for w in worker_group.workers]
                found = state_of(handler)
                round_number = getattr(found[0], "round", None) if found is not None else None
                world_size = worker_group.workers[0].world_size if worker_group.workers else None
                self._memory_peers.join_round(
                    worker_group.store, group_rank, nodes, ranks, round_number, world_size
                )
            except Exception as exc:  # copies are a bonus: the run goes on without them
                log.warning("memory snapshots will not be copied to other nodes: %s", exc)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.heartbeats.new_attempt()
        started = time.monotonic()
        self.attempt = self.restart_count
        self._stopped_by_us.clear()
        self._done.new_attempt()
        pids: dict[int, Any] = super()._start_workers(worker_group)
        leaders = [*pids.values(), forkserver_pid()]
        self._sessions = session_leaders(leaders)
        if self._keeper is not None:  # what is left of the trainers' sessions dies with the run
            self._keeper.watch_sessions(leaders)
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
        ended = end_leftovers(self._sessions, self.events, self.attempt)
        if ended and self._memory is not None:  # no one is left who could write its snapshots
            self._memory.trainers_stopped()
        remove_empty_stack_dumps(self.layout, self.session, self.attempt)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        membership_change = worker_group.state == WorkerState.HEALTHY
        if self._fence is not None and not membership_change:
            # First, so that a spare is taken in while this node stops its trainers.
            self._fence.fence_lost(worker_group.spec.rdzv_handler)
        budget = self.config.budget
        stop_started = time.monotonic()
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        stopped = time.monotonic()
        backoff = 0.0 if membership_change else self.config.crash_loop.backoff()
        self.events.emit(
            "restart",
            restart=self.restart_count,
            reason="membership change" if membership_change else self._stop_reason,
            remaining_restarts=budget.max_restarts - budget.used(time.monotonic()),
            stop_s=round(stopped - stop_started, 4),
            detect_s=(
                round(stop_started - self._failed_at_s, 4)
                if self._failed_at_s is not None
                else None
            ),
            backoff_s=backoff,
        )
        if backoff:
            time.sleep(backoff)
        self._initialize_workers(worker_group)

    # -- watching ----------------------------------------------------------------------------

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._wake.wait(self._monitor_interval_s)
        self._wake.clear()  # a wake-up after this is seen by the look below, or the next one
        workers = worker_group.workers
        self._note_done_crashes(worker_group)
        self._stop_doomed_peers(worker_group)
        self._send_pending_notice()
        codes = self._exit_codes(worker_group)
        exited = self._exited_s()
        if any(codes[w.local_rank] is None and w.id in exited for w in workers):
            # Seen to end, but its parent (the forkserver, on a busy machine) has not reaped it
            # yet: the next look comes at once rather than a monitor interval later.
            self._wake.set()
        settle_clean_exits(self._pcontext, codes)
        if self._done.ended and not self._done.torch_may_look(
            workers, codes, self.heartbeats.read(workers)
        ):
            result = RunResult(state=WorkerState.HEALTHY)  # a done one crashed; others work on
        else:
            result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            self._note_done_crashes(worker_group)  # those torch stopped, or that crashed since
        if result.state == WorkerState.FAILED and self._all_finished(worker_group):
            # some ended after "done" (by us, or crashed on the way out): all work is committed
            result = RunResult(
                state=WorkerState.SUCCEEDED,
                return_values={w.global_rank: None for w in workers},
            )
        if result.state == WorkerState.SUCCEEDED:
            for worker in workers:
                ended = worker.id in self._done.ended
                self.events.emit(
                    "rank_exit",
                    rank=worker.global_rank,
                    exitcode=exit_code(self._pcontext, worker.local_rank) if ended else 0,
                    **({"ended_after_done": True} if ended else {}),
                )
        elif result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._on_failure(worker_group, result.failures)
        elif result.state == WorkerState.HEALTHY:
            codes = self._exit_codes(worker_group)
            hung = self.heartbeats.hung([w for w in workers if codes[w.local_rank] is None])
            stuck = [(w, v) for w, v in hung if v.phase in FINISHED_PHASES]
            hung = [(w, v) for w, v in hung if v.phase not in FINISHED_PHASES]
            if hung:
                self._on_hang(worker_group, hung)
                return RunResult(state=WorkerState.FAILED)
            if stuck:
                self._end_stuck_after_done(worker_group, stuck)
            self._watch_stragglers(worker_group)
        return result

    def _all_finished(self, worker_group: WorkerGroup) -> bool:
        """Whether every trainer exited 0 or ended after it was done (by us, or by a crash)."""
        codes = self._exit_codes(worker_group)
        return bool(self._done.ended) and all_finished(
            worker_group.workers, codes, self._done.ended
        )

    def _note_done_crashes(self, worker_group: WorkerGroup) -> None:
        codes = self._exit_codes(worker_group)
        if any(code not in (None, 0) for code in codes.values()):  # else: nothing to look at
            self._done.note_crashes(
                worker_group.workers,
                codes,
                self.heartbeats.read(worker_group.workers),
                lambda local_rank: last_error(self._pcontext, local_rank, None),
            )

    def _end_stuck_after_done(
        self, worker_group: WorkerGroup, stuck: list[tuple[Worker, Verdict]]
    ) -> None:
        self._done.end_stuck(
            worker_group.workers,
            self._exit_codes(worker_group),
            self.heartbeats.read(worker_group.workers),
            stuck,
            self._dump_stacks,
        )

    def _stop_doomed_peers(self, worker_group: WorkerGroup) -> None:
        """When a trainer has failed, SIGKILL the ones still running, at once.

        They cannot go on (their next collective waits for the dead rank) nor checkpoint (that
        takes every rank), and torch would first SIGTERM them and wait for them to unwind (a
        collective's error, the interpreter's exit), time every failure pays; to a crashproof
        trainer SIGTERM means "preempted: checkpoint and stop" besides. Their committed
        checkpoints are safe: commits are atomic. A trainer that stopped on a preemption notice
        (exit code 75) or finished (0) dooms no one: its peers are saving or finishing too.
        """
        codes = self._exit_codes(worker_group)
        if all(
            codes[w.local_rank] in (None, 0, EXIT_PREEMPTED) or w.id in self._done.ended
            for w in worker_group.workers
        ):
            return
        running = [w.id for w in worker_group.workers if codes[w.local_rank] is None]
        self._stopped_by_us.update(pid for pid in running if pid is not None)
        signal_trainers(running, signal.SIGKILL)

    def _exit_codes(self, worker_group: WorkerGroup) -> dict[int, int | None]:
        return exit_codes(self._pcontext, worker_group.workers, self._exited_s())

    def _exited_s(self) -> dict[int, float]:
        """When each trainer of this attempt was seen to end, by pid (its exit code may come a
        moment later)."""
        return self._exits.exited_s if self._exits is not None else {}

    def _watch_stragglers(self, worker_group: WorkerGroup) -> None:
        for worker, report in self.heartbeats.straggling(worker_group.workers):
            announce_straggler(self.events, worker, report, self.config.straggler.steps)

    def _on_failure(self, worker_group: WorkerGroup, failures: dict[int, ProcessFailure]) -> None:
        """Log every trainer's exit, the first one to exit as the root cause, and record it."""
        self._failed_at_s = time.monotonic()
        exits = self._exits
        wait_for_exit_codes(self._pcontext, worker_group.workers, self._stopped_by_us, 2.0)
        codes: dict[int, int] = {}
        errors: dict[int | None, str | None] = {}
        for worker in worker_group.workers:
            failure = failures.get(worker.global_rank)
            code = (
                failure.exitcode
                if failure is not None
                else exit_code(self._pcontext, worker.local_rank)
            )
            if code is None:
                continue  # still running: torch stops it next
            codes[worker.local_rank] = code
            # A rank stopped because of its peer has no error of its own to show.
            if worker.id not in self._stopped_by_us:
                errors[worker.id] = last_error(self._pcontext, worker.local_rank, failure)
        workers = failure_order(worker_group.workers, self._stopped_by_us, exits, failures, errors)
        first: Failure | None = None
        furthest = self.heartbeats.furthest_step(worker_group.workers)
        for worker in workers:
            if worker.local_rank not in codes:
                continue
            exitcode = codes[worker.local_rank]
            signame = signal_name(-exitcode) if exitcode < 0 else None
            exited = exits.exited_s.get(worker.id) if exits and worker.id is not None else None
            seen_after = round(self._failed_at_s - exited, 4) if exited is not None else None
            how = f"killed by {signame}" if signame else f"exit code {exitcode}"
            stopped = worker.id in self._stopped_by_us
            error = errors.get(worker.id)
            finished = exitcode == 0 or worker.id in self._done.ended
            announce_exit(
                self.events, worker, exitcode, signame=signame, error=error,
                first=first is None and not finished, step=furthest, stopped=stopped,
                seen_after_s=seen_after,
            )  # fmt: skip
            if finished:
                continue  # exited 0, or after it was done (reported already): no one's failure
            if first is None and exitcode == EXIT_PREEMPTED:
                self._on_preempted(worker.global_rank, furthest)
                return
            if first is None:
                first = Failure(
                    attempt=self.attempt,
                    step=furthest,
                    rank=worker.global_rank,
                    reason=how + (f": {error}" if error else ""),
                    start_step=self.heartbeats.seen_start_step,
                )
        if first is None:
            first = Failure(
                attempt=self.attempt,
                step=furthest,
                rank=None,
                reason="the worker group became unhealthy",
                start_step=self.heartbeats.seen_start_step,
            )
        self._record(first)

    def _on_preempted(self, rank: int, step: int) -> None:
        """A trainer stopped with exit code 75 after its emergency checkpoint: no restart."""
        self.preempted = self.preempted or f"rank {rank} stopped on a notice"
        self._remaining_restarts = 0
        self.events.emit("preempted", rank=rank, step=step, source=self.preempted)

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
        signal_trainers((w.id for w in self._worker_group.workers), sig)

    def _on_hang(self, worker_group: WorkerGroup, hung: list[tuple[Worker, Verdict]]) -> None:
        self._failed_at_s = time.monotonic()
        # The states first: the dump sends SIGCONT, and a stopped process ("T") would look alive.
        states = {w.global_rank: process_state(w.id) for w in worker_group.workers}
        stacks = self._dump_stacks(worker_group.workers)
        # A hung group cannot checkpoint (its collectives do not complete), and a SIGTERM would
        # only start an emergency save that waits out the grace period: kill it now.
        signal_trainers((w.id for w in worker_group.workers), signal.SIGKILL)
        worst_worker, worst = announce_hang(self.events, hung, states, stacks)
        self._record(
            Failure(
                attempt=self.attempt,
                step=self.heartbeats.furthest_step(worker_group.workers),
                rank=worst_worker.global_rank,
                reason=f"hang: silent for {worst.silent_s:.1f} s in phase {worst.phase}",
                start_step=self.heartbeats.seen_start_step,
            )
        )

    def _dump_stacks(self, workers: list[Worker]) -> dict[int, str]:
        """Ask ``workers`` for their Python stacks; returns the files written, by global rank."""
        return dump_stacks(
            {w.global_rank: w.id for w in workers},
            {
                w.global_rank: self.layout.stack_dump(self.session, self.attempt, w.global_rank)
                for w in workers
            },
            self.config.stack_dump_wait_s,
        )

    def _record(self, failure: Failure) -> None:
        policy = self.config.crash_loop
        policy.record(failure)
        self._stop_reason = failure.reason
        if self.preempted is not None:
            return  # the run is stopping: no restart to grant or refuse
        if policy.is_crash_loop():
            self.crash_loop = failure
            self._remaining_restarts = 0  # the base loop then stops the group and returns FAILED
            announce_crash_loop(self.events, failure, policy)
        elif not self.config.budget.grant(time.monotonic()):
            self.budget_spent = failure
            self._remaining_restarts = 0
            announce_budget_spent(self.events, failure, self.config.budget, time.monotonic())
