"""A campaign: launch ``crashproof run``, inject the scheduled faults one at a time, watch.

Faults never overlap: each is injected when its own time (seconds after the run started, the
origin of the run's report too) or step has come, whatever the faults listed before it wait for,
**and** the previous one is resolved, i.e. detected and recovered from (a checkpoint beyond it
committed), or given up on after ``resolve_timeout_s``. So every detection and every lost step
belongs to one fault, and a fault's effect on the data (a NaN's skipped batch) is durable before
the next fault could undo it. A fault aimed at a rank waits until that rank is training (its
heartbeat in the ``step`` phase). Every injection is recorded in ``RUN_DIR/chaos.jsonl`` as it
happens. When the schedule is done the run is left to finish; then each injection is assessed
(:mod:`crashproof.chaos._analysis`).

The campaign only signals the trainers of the run's newest attempt and writes the seams' control
files (``RUN_DIR/chaos/``); the supervisor is never touched. Whatever happens to the campaign
itself, stopped ranks are continued and the run is stopped before it returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from tqdm import tqdm

from crashproof._rundir import RunDir
from crashproof._runfiles import open_run_file
from crashproof._seams import ENV_CHAOS_NAN, ENV_CHAOS_STORAGE, read_fired, write_control
from crashproof.chaos._analysis import Injection, assess
from crashproof.chaos._faults import DutyCycle, corrupt_memory, corrupt_newest, send, stop_all
from crashproof.chaos._schedule import Fault
from crashproof.chaos._watch import RunView
from crashproof.checkpoint import committed_steps
from crashproof.storage import LocalStorage
from crashproof.telemetry import is_event_log

__all__ = ["Campaign", "CampaignResult", "run_crashproof"]

log = logging.getLogger("crashproof.chaos")

_POLL_S = 0.02
_PROGRESS_EVERY_S = 0.25


def open_console(directory: str, name: str) -> IO[str]:
    """The file ``directory/name`` to append a run's console output to (the campaign's own
    directory, new or empty when it began: never through a link)."""
    return os.fdopen(open_run_file(directory, name, "append"), "a")


def run_crashproof(
    run_args: list[str], env: dict[str, str], console: IO[str]
) -> subprocess.Popen[str]:
    """Start ``crashproof run RUN_ARGS`` in a session of its own, its output into ``console``."""
    return subprocess.Popen(
        [sys.executable, "-m", "crashproof.cli", "run", *run_args],
        env=env,
        stdout=console,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def stop_run(proc: subprocess.Popen[str], *, grace_s: float = 30.0) -> None:
    """Stop ``crashproof run`` and everything it started: SIGTERM (it stops its trainers), then
    SIGKILL to its whole session after ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass(kw_only=True)
class CampaignResult:
    injections: list[Injection]
    not_injected: list[Fault]
    blocked: dict[str, str] = field(default_factory=dict)
    """Faults of ``not_injected`` that were due for longer than the resolve timeout but could
    not be injected, by id, with why (a campaign that silently skipped them proved nothing)."""
    exitcode: int | None
    """``crashproof run``'s exit code (None: it had to be stopped)."""
    outcome: str | None
    """``run_end``'s outcome."""
    wall_s: float
    timed_out: bool = False


@dataclass(kw_only=True)
class Campaign:
    run_args: list[str]
    """``crashproof run`` arguments, placeholders already filled in."""
    run_dir: str
    """The run's ``--run-dir`` (RUN_DIR)."""
    schedule: list[Fault]
    seed: int = 0
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    console_path: str
    """Where the run's console output goes."""
    resolve_timeout_s: float = 300.0
    """How long to wait for a fault to be detected and recovered from before giving up on it."""
    timeout_s: float | None = None
    """Stop the run after this long (None: let it finish however long it takes)."""
    echo: bool = True
    """Print a line per injection and resolution."""
    progress: bool = False
    """Show a live bar of the training's step (on a terminal), faults injected and attempts."""
    _view: RunView = field(init=False)
    _rng: random.Random = field(init=False)
    _stopped: set[int] = field(default_factory=set)
    _cycles: dict[str, DutyCycle] = field(default_factory=dict)
    _armed: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _bar: tqdm[Any] | None = None
    _bar_at: float = 0.0
    _waiting: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Faults due but not injectable yet: since when (Unix time), and why not."""

    def __post_init__(self) -> None:
        self._view = RunView(self.run_dir)
        self._rng = random.Random(f"{self.seed}:inject")
        layout = RunDir(self.run_dir)
        self._log_path = layout.chaos_log
        self._seams = {kind: layout.chaos_control(kind) for kind in ("nan", "storage")}

    @property
    def view(self) -> RunView:
        return self._view

    @property
    def nan_control(self) -> str:
        return self._seams["nan"]

    def run(self) -> CampaignResult:
        os.makedirs(os.path.dirname(self.nan_control), exist_ok=True)
        env = dict(self.env)
        for kind, variable in (("nan", ENV_CHAOS_NAN), ("storage", ENV_CHAOS_STORAGE)):
            if any(f.kind == kind for f in self.schedule):
                write_control(self._seams[kind], [])
                env[variable] = self._seams[kind]
        self._record(
            "campaign_start",
            seed=self.seed,
            run_args=self.run_args,
            schedule=[f.to_json() for f in self.schedule],
        )
        pending = deque(self.schedule)
        injections: list[Injection] = []
        current: Injection | None = None
        timed_out = False
        with open_console(*os.path.split(self.console_path)) as console:
            launched = time.monotonic()
            proc = run_crashproof(self.run_args, env, console)
            if self.progress:
                # disable=None: no bar where stderr is not a terminal (a log file, CI)
                self._bar = tqdm(
                    desc="training",
                    bar_format="{desc}: step {n} | {elapsed} | {postfix}",
                    disable=None,
                    dynamic_ncols=True,
                )
            try:
                while True:
                    running = proc.poll() is None
                    self._view.refresh()
                    self._show_progress(len(injections))
                    if current is not None:
                        self._follow(current)
                        if current.resolved:
                            self._resolved(current)
                            current = None
                    if current is None and pending and running:
                        current = self._inject_first_ready(pending, injections[-1:])
                        if current is not None:
                            injections.append(current)
                    if not running:
                        break
                    if self.timeout_s is not None and time.monotonic() - launched > self.timeout_s:
                        timed_out = True
                        log.error("the run took longer than %.0f s: stopping it", self.timeout_s)
                        break
                    time.sleep(_POLL_S)
            finally:
                self._release()
                stop_run(proc)
                if self._bar is not None:
                    self._bar.close()
                    self._bar = None
        self._view.refresh()
        for n, inj in enumerate(injections):
            until = injections[n + 1].ts if n + 1 < len(injections) else None
            self._follow(inj, final=True, until=until)
        end = self._view.ended()
        result = CampaignResult(
            injections=injections,
            not_injected=list(pending),
            blocked=self._blocked(pending),
            exitcode=None if timed_out else proc.returncode,
            outcome=str(end.get("outcome")) if end else None,
            wall_s=self._elapsed(),
            timed_out=timed_out,
        )
        self._record(
            "campaign_end",
            exitcode=result.exitcode,
            outcome=result.outcome,
            injected=len(injections),
            not_injected=[f.id for f in result.not_injected],
        )
        return result

    def _blocked(self, pending: Iterable[Fault]) -> dict[str, str]:
        """Of the faults never injected, those the run kept training past for longer than the
        resolve timeout after they came due (a fault due while the run was shutting down, or
        ended, is not blocked: the run ended first)."""
        progress = [float(e["ts"]) for e in self._view.of("progress") + self._view.of("checkpoint")]
        last = max(progress, default=0.0)
        return {
            f.id: f"due, and training went on {last - since:.0f} s without a chance to inject it: {why}"
            for f in pending
            if f.id in self._waiting
            for since, why in [self._waiting[f.id]]
            if last - since > self.resolve_timeout_s
        }

    # -- injecting -------------------------------------------------------------------------

    def _elapsed(self) -> float:
        """Seconds since the run started: its first ``run_start`` event, the origin of every time
        the campaign and ``crashproof report`` show (0 until the supervisor has started)."""
        starts = self._view.of("run_start")
        return max(0.0, time.time() - float(starts[0]["ts"])) if starts else 0.0

    def _inject_first_ready(
        self, pending: deque[Fault], previous: list[Injection]
    ) -> Injection | None:
        """Inject the first pending fault whose own trigger has come and whose target can be hit
        now (each fault waits for its own time or step, not for the faults listed before it; a
        NaN at a step, armed ahead of that step, waits for its turn in the list); None: none is
        ready."""
        for position, fault in enumerate(list(pending)):
            if position > 0 and fault.kind == "nan" and fault.at_step is not None:
                continue  # armed ahead of its step, so only in its turn: it would hold the others
            injection = self._try_inject(fault, previous)
            if injection is not None:
                pending.remove(fault)
                return injection
        return None

    def _try_inject(self, fault: Fault, previous: list[Injection]) -> Injection | None:
        """Inject ``fault`` if it is due and its target can be hit now; None: not yet."""
        elapsed = self._elapsed()
        if fault.at_s is not None and elapsed < self._due_s(fault, previous):
            return None
        early_nan = fault.kind == "nan" and fault.at_step is not None  # armed ahead of its step
        if fault.at_step is not None and not early_nan and self._view.step() < fault.at_step:
            return None
        target = self._view.ranks().get(fault.rank)
        beat = self._view.heartbeat(target) if target is not None else None
        training = beat is not None and beat.phase == "step"
        since = self._waiting.get(fault.id, (time.time(), ""))[0]  # wall time, as events
        if not early_nan and not training:
            self._waiting[fault.id] = (since, f"rank {fault.rank} was not training")
            return None
        if fault.kind == "corrupt" and not self._corruptible(previous):
            self._waiting[fault.id] = (
                since,
                "no committed checkpoint whose fallback keeps the previous fault's recovery",
            )
            return None
        inj = Injection(
            fault=fault,
            due_s=fault.at_s,
            at_s=elapsed,
            ts=time.time(),
            pid=target.pid if target is not None else None,
            attempt=self._view.attempt,
            step=beat.step if beat is not None else -1,
        )
        getattr(self, f"_inject_{fault.kind}")(inj)
        self._record(
            "inject",
            id=fault.id,
            kind=fault.kind,
            rank=fault.rank,
            pid=inj.pid,
            attempt=inj.attempt,
            step=inj.step,
            at_s=round(inj.at_s, 3),
            params=dict(fault.params),
            details=inj.details,
        )
        self._say(
            f"[chaos] {inj.at_s:6.1f}s  {fault.id} {fault.kind} rank {fault.rank} at step {inj.step}"
            + (f"  {_brief(inj.details)}" if inj.details else "")
        )
        return inj

    def _due_s(self, fault: Fault, previous: list[Injection]) -> float:
        """When a time-triggered fault is due. One that came due while the previous fault was
        still being resolved gets its gap from that fault's due time again, counted from the
        resolution: injected the moment the previous one resolved (right after a checkpoint
        committed, which is what resolves a fault) every such fault would hit at the cheapest
        moment and understate the work lost. Exponential gaps stay exponential either way."""
        assert fault.at_s is not None
        if not previous or previous[-1].resolved_at_s is None or previous[-1].due_s is None:
            return fault.at_s
        before = previous[-1]
        assert before.resolved_at_s is not None and before.due_s is not None
        if fault.at_s >= before.resolved_at_s:
            return fault.at_s
        return before.resolved_at_s + max(0.0, fault.at_s - before.due_s)

    def _corruptible(self, previous: list[Injection]) -> bool:
        """Whether a corruption can be injected now: something is committed, and the checkpoint
        a restore will fall back to is not older than the previous fault's step. Otherwise the
        fallback would undo that fault's recovery (a NaN rollback's decision to skip a batch is
        in the checkpoints after it only) and the two faults' costs would mix."""
        root = self._view.checkpoint_root()
        if root is None:
            return False
        if "://" in root:
            return True  # not a local directory: the injection reports that it cannot corrupt it
        found = committed_steps(LocalStorage(), root)
        if not found:
            return False
        fallback = found[1][0] if len(found) > 1 else 0
        return not previous or fallback >= previous[-1].step

    def _inject_kill(self, inj: Injection) -> None:
        assert inj.pid is not None
        send(inj.pid, signal.SIGKILL)

    def _inject_hang(self, inj: Injection) -> None:
        assert inj.pid is not None
        if send(inj.pid, signal.SIGSTOP):
            self._stopped.add(inj.pid)

    def _inject_straggler(self, inj: Injection) -> None:
        assert inj.pid is not None
        p = inj.fault.params
        self._cycles[inj.fault.id] = DutyCycle(
            inj.pid, stop=float(p["stop"]), period_s=float(p["period_s"]), for_s=float(p["for_s"])
        )
        inj.details = {"stopped_s": round(float(p["stop"]) * float(p["period_s"]), 4)}

    def _inject_corrupt(self, inj: Injection) -> None:
        root = self._view.checkpoint_root()
        assert root is not None
        ranks = sorted(self._view.ranks().values(), key=lambda p: p.rank != inj.fault.rank)
        pids = stop_all([p.pid for p in ranks])  # nothing commits while the file is damaged
        try:
            inj.details = corrupt_newest(root, str(inj.fault.params["mode"]), self._rng)
            agent = self._view.agent_pid()
            if agent is not None:  # the restore would prefer the snapshots there
                inj.details["memory"] = corrupt_memory(agent, inj.fault.rank, self._rng)
        except (OSError, ValueError) as exc:
            inj.details = {"error": f"{type(exc).__name__}: {exc}"}
            inj.gave_up = True
            for pid in pids:
                send(pid, signal.SIGCONT)
            return
        for pid in pids:  # the fault's rank first: the supervisor names it as the one that died
            send(pid, signal.SIGKILL)

    def _inject_nan(self, inj: Injection) -> None:
        step = inj.fault.at_step if inj.fault.at_step is not None else inj.step + 1
        self._arm("nan", {"id": inj.fault.id, "rank": inj.fault.rank, "step": step})
        inj.details = {"armed_for_step": step}

    def _inject_storage(self, inj: Injection) -> None:
        p = inj.fault.params
        entry = {"id": inj.fault.id, "rank": inj.fault.rank, "error": p["error"],
                 "files": int(p["files"]), "hang_s": float(p["hang_s"])}  # fmt: skip
        self._arm("storage", entry)

    def _arm(self, kind: str, entry: dict[str, Any]) -> None:
        armed = self._armed.setdefault(kind, [])
        armed.append(entry)
        write_control(self._seams[kind], armed)

    # -- following --------------------------------------------------------------------------

    def _follow(self, inj: Injection, *, final: bool = False, until: float | None = None) -> None:
        """Update ``inj`` from what the seams and the run show; give up on it when its time is
        out (continuing a rank left stopped, ending a slowdown)."""
        kind = inj.fault.kind
        if kind in self._seams and inj.fired_ts is None:
            fired = [r for r in read_fired(self._seams[kind]) if r.get("id") == inj.fault.id]
            if fired:
                inj.fired_ts = float(fired[0]["ts"])
                if kind == "nan":
                    inj.step = int(fired[0]["step"])
                inj.details["fired"] = [
                    {k: v for k, v in r.items() if k not in ("id", "rank")} for r in fired
                ]
                self._record("fired", id=inj.fault.id, kind=kind, records=inj.details["fired"])
        cycle = self._cycles.get(inj.fault.id)
        if cycle is not None and inj.end_ts is None and not cycle.running:
            inj.end_ts = cycle.ended_ts or time.time()
            inj.end_step = self._view.step()
            inj.details["cycles"] = cycle.cycles
        assess(inj, self._view, until=until)
        waited = time.time() - inj.ts
        if not inj.resolved and (final or waited > self.resolve_timeout_s):
            inj.gave_up = True
            if inj.pid in self._stopped and inj.pid is not None:
                send(inj.pid, signal.SIGCONT)
            if cycle is not None:
                cycle.finish()

    def _resolved(self, inj: Injection) -> None:
        inj.resolved_at_s = self._elapsed()
        self._record(
            "resolved",
            id=inj.fault.id,
            detected_by=inj.detected_by,
            recovered_by=inj.recovered_by,
            lost_steps=inj.lost_steps,
            gave_up=inj.gave_up,
            not_needed=inj.not_needed,
        )
        if inj.passed:
            seen = f"detected by {inj.detected_by}" if inj.detected else str(inj.not_needed)
            outcome = f"{seen}; recovered: {inj.recovered_by}"
        else:
            outcome = f"NOT {'recovered' if inj.detected else 'detected'} (gave up)"
        self._say(f"[chaos] {self._elapsed():6.1f}s  {inj.fault.id} {outcome}")

    def _release(self) -> None:
        """Leave no rank stopped and no slowdown running."""
        for cycle in self._cycles.values():
            cycle.finish()
        for pid in self._stopped:
            send(pid, signal.SIGCONT)

    def _show_progress(self, injected: int) -> None:
        """Move the bar to the furthest step of the newest attempt (back, after a restore: the
        work a failure lost shows), a few times a second."""
        if self._bar is None or time.monotonic() - self._bar_at < _PROGRESS_EVERY_S:
            return
        self._bar_at = time.monotonic()
        step = self._view.step()
        if step >= 0:
            self._bar.n = step
        self._bar.set_postfix_str(
            f"attempt {max(self._view.attempt, 0)}, faults {injected}/{len(self.schedule)}",
            refresh=False,
        )
        self._bar.refresh()

    def _record(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ts": time.time(), "event": event, **fields}, default=str)
        os.makedirs(self.run_dir, exist_ok=True)
        name = os.path.relpath(self._log_path, self.run_dir)
        fd = open_run_file(self.run_dir, name, "append", own=is_event_log)
        with os.fdopen(fd, "a") as f:
            f.write(line + "\n")

    def _say(self, text: str) -> None:
        log.info("%s", text)
        if self._bar is not None:
            self._bar.write(text)  # above the bar, which stays at the bottom
        elif self.echo:
            print(text, flush=True)


def _brief(details: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in details.items() if k != "fired")
