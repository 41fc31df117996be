"""How fast does a run recover from a SIGKILLed rank under ``crashproof run``, and under torchrun?

Target of the supervisor issue: the time from a SIGKILL of one rank to the first finished step
after restore is at most half of what plain ``torchrun --max-restarts`` achieves with the same
script on the same machine.

The trainer is ``recovery_trainer.py``: a 2-layer MLP trained with gloo DDP on 2 ranks, steps
padded to ``--step-s`` (50 ms), an asynchronous crashproof checkpoint every ``--every`` steps, and
a restore of the newest checkpoint on every start. Each rank appends timestamped marks to a
timeline file: ``process_start`` (first line of the script, before ``import torch``),
``imported``, ``pg_ready`` (``init_process_group`` returned), ``ddp_ready``, ``restored`` and
its first finished ``step``.

The same trainer runs under three launchers, in one invocation on one machine:

* ``torchrun``: ``torchrun --standalone --nproc-per-node 2 --max-restarts N``, plain (the
  benchmark removes ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` from the environment of every run, so
  each launcher runs with its own default);
* ``crashproof``: ``crashproof run --nproc-per-node 2 --max-restarts N``, warm start (trainers
  forked from a process that already imported torch and crashproof);
* ``crashproof-cold``: the same with ``--cold-start`` (``python script.py`` per trainer, as
  torchrun does), which separates the gain of the warm start from the rest.

``--launchers`` can add two more: ``crashproof-preload`` (warm start with ``--preload
torch._dynamo``, the module DDP's constructor imports on first use) and ``torchrun-fresh-store``
(torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, crashproof's fix for restarts that read
the previous attempt's gloo addresses from torchrun's shared store).

For every launcher: start a run with a fresh checkpoint directory and wait for both ranks to
step; then, ``--kills`` times, sleep a random interval (``--interval``), SIGKILL a random rank
(its pid from the newest ``process_start`` of that rank) at ``t_kill``, and wait for the first
``step`` mark after ``t_kill`` from both ranks. Recovery = the later of the two minus
``t_kill``. The intervals and ranks are drawn once from ``--seed`` and every launcher gets the
same sequence. The kills are split into ``--rounds`` rounds; each round runs every launcher
(order rotated per round) in a fresh run for its share of the kills, so that slow drifts of a
shared machine's load hit every launcher alike.

Where the time goes, along the critical path (for each mark the later of the two new ranks):

* detect+stop: ``t_kill`` -> ``process_start``: the launcher notices the exit, stops the
  survivor, re-runs its rendezvous and starts (exec or fork) the new trainers;
* import: ``process_start`` -> ``imported`` (near zero with a warm start: the point of it);
* init_pg: ``imported`` -> ``pg_ready``: the trainers' rendezvous in ``init_process_group``;
* ddp: ``pg_ready`` -> ``ddp_ready``: building the model and DDP (weights broadcast, lazy
  imports);
* restore: ``ddp_ready`` -> ``restored``: building the checkpoint manager and restoring;
* first step: ``restored`` -> ``step``.

The parts add up to the recovery. For crashproof, detect+stop is split further by the agent's
events (``events.jsonl``, see ``EVENT_PARTS``): noticed, stop, rendezvous, start, to script.

A restart that does not reach a step within ``--stall-s`` seconds is *stalled*: it is recorded
with what each rank reached, the trainers' Python stacks (asked for with SIGUSR1) and the
launcher's last log lines; its run is killed, and the remaining kills of the round go to a fresh
run. A restart whose first new trainers fail (the launcher then restarts again) counts as failed
attempts inside that recovery, and the table also gives the median of the recoveries that took a
single attempt. Runs are always torn down by SIGKILL to the launcher's process group and to every
process that carries the run's token in its environment (torch puts exec'd trainers in sessions
of their own).

Progress goes to stderr, the tables (and with ``--json`` every recovery) to stdout. About 6
minutes at the defaults on a 2-vCPU VM (each stalled restart adds ``--stall-s``). Run from the
repository root::

    .venv/bin/python benchmarks/recovery.py --markdown --json
    .venv/bin/python benchmarks/recovery.py --kills 2 --rounds 1 --interval 3-4   # ~1.5 min check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRAINER = Path(__file__).resolve().parent / "recovery_trainer.py"
DEFAULT_DIR = REPO / ".bench-tmp" / "recovery"
TOKEN_VAR = "CRASHPROOF_RECOVERY_BENCH_TOKEN"
"""Set in every launched run's environment; inherited by every process of the run."""
RANKS = 2
POLL_S = 0.2
"""How often the driver looks at the timelines. Only decides when it stops waiting: the times
come from the trainers' own stamps, so a slow poll costs no accuracy, and a fast one would
take CPU from the recovery it measures on a 2-core machine."""

PARTS = [
    ("detect+stop", None, "process_start"),
    ("import", "process_start", "imported"),
    ("init_pg", "imported", "pg_ready"),
    ("ddp", "pg_ready", "ddp_ready"),
    ("restore", "ddp_ready", "restored"),
    ("first step", "restored", "step"),
]
"""The breakdown of a recovery: (name, from mark, to mark); None is the kill."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- launchers -----------------------------------------------------------------------------------


def launcher_command(name: str, max_restarts: int, run_dir: Path) -> list[str]:
    """The command line of ``name`` up to the script (the trainer and its arguments follow)."""
    common = ["--nproc-per-node", str(RANKS), "--max-restarts", str(max_restarts)]
    if name in ("torchrun", "torchrun-fresh-store"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *common]
    crashproof = [sys.executable, "-m", "crashproof.cli", "run", *common]
    crashproof += ["--run-dir", str(run_dir / "crashproof")]
    extra = {
        "crashproof": [],
        "crashproof-cold": ["--cold-start"],
        "crashproof-preload": ["--preload", "torch._dynamo"],
    }
    if name not in extra:
        raise ValueError(f"unknown launcher {name!r}")
    return crashproof + extra[name]


def launcher_env(name: str, env: dict[str, str]) -> dict[str, str]:
    # Every launcher with its own default: crashproof sets it for itself, plain torchrun does not.
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if name == "torchrun-fresh-store":
        # torchrun with crashproof's fix of the stale-address restarts, to tell that fix's share
        # of the difference from the rest.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


LAUNCHERS = [
    "torchrun",
    "crashproof",
    "crashproof-cold",
    "crashproof-preload",
    "torchrun-fresh-store",
]
DEFAULT_LAUNCHERS = "torchrun,crashproof,crashproof-cold"


# -- a run ---------------------------------------------------------------------------------------


class Timelines:
    """Reads the trainers' timeline files incrementally (complete lines only)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.marks: list[dict[str, Any]] = []
        self._offsets: dict[Path, int] = {}

    def refresh(self) -> list[dict[str, Any]]:
        for path in sorted(self.directory.glob("rank*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next look
            for line in data[:end].splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    self.marks.append(json.loads(line))
            self._offsets[path] = offset + end
        return self.marks

    def first_after(self, event: str, after: float) -> dict[int, dict[str, Any]]:
        """Per rank, the earliest ``event`` mark stamped after ``after``."""
        found: dict[int, dict[str, Any]] = {}
        for mark in self.refresh():
            if mark["event"] == event and mark["ts"] > after:
                rank = mark["rank"]
                if rank not in found or mark["ts"] < found[rank]["ts"]:
                    found[rank] = mark
        return found

    def newest_pid(self, rank: int) -> int | None:
        starts = [m for m in self.refresh() if m["event"] == "process_start" and m["rank"] == rank]
        return max(starts, key=lambda m: m["ts"])["pid"] if starts else None

    def of_pid(self, pid: int) -> dict[str, dict[str, Any]]:
        """The marks of one trainer process, by event (the first of each)."""
        marks: dict[str, dict[str, Any]] = {}
        for mark in self.marks:
            if mark["pid"] == pid:
                marks.setdefault(mark["event"], mark)
        return marks


class Run:
    """One launch of the trainer under one launcher, in a directory of its own."""

    def __init__(self, launcher: str, directory: Path, args: argparse.Namespace) -> None:
        self.launcher = launcher
        self.directory = directory
        directory.mkdir(parents=True)
        self.timelines = Timelines(directory / "timeline")
        self.token = uuid.uuid4().hex
        command = launcher_command(launcher, args.max_restarts, directory)
        command += [str(TRAINER), "--timeline", str(self.timelines.directory)]
        command += ["--ckpt", str(directory / "ckpt"), "--every", str(args.every)]
        command += ["--step-s", str(args.step_s), *getattr(args, "trainer_args", [])]
        env = launcher_env(launcher, dict(os.environ))
        env[TOKEN_VAR] = self.token
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO / "src"), env.get("PYTHONPATH")])
        )
        self.log_path = directory / "launcher.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.started = time.time()
        # A session of its own, so that stop() can kill the launcher and everything in its group.
        self.proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def exited(self) -> int | None:
        return self.proc.poll()

    def wait_for_steps(self, after: float, timeout_s: float) -> dict[int, dict[str, Any]] | None:
        """Both ranks' first ``step`` mark after ``after``; None if not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            steps = self.timelines.first_after("step", after)
            if len(steps) == RANKS:
                return steps
            if time.monotonic() > deadline or self.exited() is not None:
                return None
            time.sleep(POLL_S)

    def log_tail(self, lines: int = 40) -> list[str]:
        self._log.flush()
        text = self.log_path.read_bytes()[-20000:].decode(errors="replace")
        return text.splitlines()[-lines:]

    def events(self) -> list[dict[str, Any]]:
        """crashproof's event log of this run (empty under torchrun)."""
        path = self.directory / "crashproof" / "events.jsonl"
        if not path.exists():
            return []
        events = []
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
        return events

    def stop(self) -> None:
        """SIGKILL the launcher's group, then every process carrying this run's token."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        # Trainers exec'd by torch elastic live in sessions of their own, and a forkserver child
        # may still be on its way: sweep until nothing of this run is left.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = list(processes_with_token(self.token))
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        else:
            log(f"  WARNING: processes of run {self.directory.name} still alive after SIGKILL")
        self._log.close()


def processes_with_token(token: str) -> Iterator[int]:
    """Pids whose environment holds ``TOKEN_VAR=token`` (this user's processes only)."""
    needle = f"{TOKEN_VAR}={token}".encode() + b"\0"
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    yield int(entry.name)
        except OSError:  # gone, or not ours
            continue


# -- measuring -----------------------------------------------------------------------------------


@dataclass
class Recovery:
    """One kill and what followed."""

    launcher: str
    kill: int
    """Index of the kill in the schedule (the same index means the same interval and rank)."""
    run: str
    rank: int
    pid: int
    interval_s: float
    t_kill: float
    outcome: str = "ok"
    """"ok", "stalled" (no step within --stall-s), "launcher exited (code)", or "run gone
    before the kill" (not counted as a restart)."""
    recovery_s: float | None = None
    parts_s: dict[str, float] = field(default_factory=dict)
    attempts: int = 0
    """Trainer groups started after the kill (1: the first restart worked)."""
    failed_attempts: int = 0
    """Of those, the ones that did not recover (all of them when stalled)."""
    restart: int | None = None
    """TORCHELASTIC_RESTART_COUNT of the trainers that recovered."""
    restored_step: int | None = None
    errors: list[str] = field(default_factory=list)
    """Errors the trainers started after the kill died of (failed attempts)."""
    events: dict[str, Any] = field(default_factory=dict)
    """crashproof only: the agent's view of detect+stop, from its events (see EVENT_PARTS)."""
    reached: dict[int, str] = field(default_factory=dict)
    """Stalled only: the last mark of each rank's newest process."""
    log_tail: list[str] = field(default_factory=list)
    """Stalled only: the launcher's last output lines."""
    loadavg: list[float] = field(default_factory=list)


def measure(run: Run, recovery: Recovery, steps: dict[int, dict[str, Any]]) -> None:
    """Fill in the recovery time and its breakdown from both ranks' first steps after the kill."""
    timelines = run.timelines
    per_rank = {rank: timelines.of_pid(mark["pid"]) for rank, mark in steps.items()}
    recovery.recovery_s = max(m["ts"] for m in steps.values()) - recovery.t_kill
    previous = recovery.t_kill
    for name, _, to in PARTS:
        # The critical path: a mark counts when the later rank reaches it.
        reached = max(marks[to]["ts"] for marks in per_rank.values() if to in marks)
        recovery.parts_s[name] = round(reached - previous, 4)
        previous = reached
    recovery.recovery_s = round(recovery.recovery_s, 4)
    started = {
        m["restart"]
        for m in timelines.marks
        if m["event"] == "process_start" and m["ts"] > recovery.t_kill
    }
    recovery.attempts = len(started)
    recovery.failed_attempts = recovery.attempts - 1
    recovery.restart = max(m["restart"] for m in steps.values())
    recovery.restored_step = per_rank[recovery.rank].get("restored", {}).get("step")
    recovery.errors = failed_attempt_errors(timelines, recovery.t_kill, recovery.restart)


def failed_attempt_errors(timelines: Timelines, t_kill: float, restart: int | None) -> list[str]:
    """The errors of trainers started after the kill that are not the recovered attempt."""
    new_pids = {
        m["pid"]
        for m in timelines.marks
        if m["event"] == "process_start" and m["ts"] > t_kill and m["restart"] != restart
    }
    return [
        f"rank {m['rank']} restart {m['restart']}: {m['error']}"
        for m in timelines.marks
        if m["event"] == "error" and m["pid"] in new_pids
    ]


def diagnose_stall(run: Run, recovery: Recovery) -> None:
    """Record how far each rank got, and why the launcher may be stuck."""
    marks = run.timelines.refresh()
    for rank in range(RANKS):
        pid = run.timelines.newest_pid(rank)
        own = [m for m in marks if m["pid"] == pid]
        if pid is None or not own:
            recovery.reached[rank] = "nothing"
            continue
        last = own[-1]
        new = "new process" if own[0]["ts"] > recovery.t_kill else "no new process"
        recovery.reached[rank] = (
            f"{new} (pid {pid}, restart {last['restart']}): last mark {last['event']!r} "
            f"{last['ts'] - recovery.t_kill:+.2f} s after the kill"
        )
    started = {
        m["restart"] for m in marks if m["event"] == "process_start" and m["ts"] > recovery.t_kill
    }
    recovery.attempts = recovery.failed_attempts = len(started)
    recovery.errors = failed_attempt_errors(run.timelines, recovery.t_kill, None)
    # Where the stuck trainers are: they print their Python stacks on SIGUSR1 (the launcher's
    # log has them then).
    for rank in range(RANKS):
        pid = run.timelines.newest_pid(rank)
        if pid is not None and any(m["pid"] == pid and m["ts"] > recovery.t_kill for m in marks):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)
    recovery.log_tail = run.log_tail()


EVENT_PARTS = ["noticed", "stop", "rendezvous", "start", "to script"]
"""detect+stop as crashproof's agent saw it, from events.jsonl: *noticed* (kill -> the agent's
first ``rank_exit``), *stop* (``stop_s`` of the ``restart`` event: the survivors stopped),
*rendezvous* (the ``restart`` event -> the trainers' start begins: backoff and re-rendezvous),
*start* (``start_s`` of ``rank_start``: starting the trainers) and *to script* (``rank_start`` ->
the later ``process_start``: until the script's first line runs)."""


def attach_events(run: Run, recoveries: list[Recovery]) -> None:
    """crashproof: split each recovery's detect+stop by the agent's events."""
    events = run.events()
    for rec in recoveries:
        after = [e for e in events if e["ts"] >= rec.t_kill]
        exit_ = next((e for e in after if e["event"] == "rank_exit"), None)
        restart = next((e for e in after if e["event"] == "restart"), None)
        if exit_ is None or restart is None:
            continue
        start = next(
            (e for e in after if e["event"] == "rank_start" and e["ts"] >= restart["ts"]), None
        )
        rec.events = {
            "noticed": round(exit_["ts"] - rec.t_kill, 4),
            "stop": restart.get("stop_s"),
            "detect_s": restart.get("detect_s"),
            "backoff_s": restart.get("backoff_s"),
        }
        if start is not None:
            began = start["ts"] - start["start_s"]
            rec.events["rendezvous"] = round(began - restart["ts"], 4)
            rec.events["start"] = start["start_s"]
            if rec.outcome == "ok":
                script = rec.t_kill + rec.parts_s["detect+stop"]
                rec.events["to script"] = round(script - start["ts"], 4)


@dataclass
class Schedule:
    intervals_s: list[float]
    ranks: list[int]


def make_schedule(args: argparse.Namespace) -> Schedule:
    rng = random.Random(args.seed)
    low, high = args.interval
    intervals = [round(rng.uniform(low, high), 3) for _ in range(args.kills)]
    return Schedule(intervals, [rng.randrange(RANKS) for _ in range(args.kills)])


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, schedule: Schedule) -> None:
        self.args = args
        self.work = work
        self.schedule = schedule
        self.recoveries: list[Recovery] = []
        self.start_failures: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []

    def start(self, launcher: str) -> Run | None:
        """A fresh run whose two ranks are stepping; None (recorded) if it never gets there."""
        run = Run(launcher, self.work / f"{len(self.runs):02d}-{launcher}", self.args)
        self.runs.append({"run": run.directory.name, "launcher": launcher})
        if run.wait_for_steps(0.0, self.args.startup_timeout) is not None:
            self.runs[-1]["startup_s"] = round(time.time() - run.started, 2)
            return run
        failure = {
            "launcher": launcher,
            "run": run.directory.name,
            "exitcode": run.exited(),
            "log_tail": run.log_tail(),
        }
        log(f"  {launcher}: the run did not start stepping: {failure}")
        self.start_failures.append(failure)
        run.stop()
        return None

    def block(self, launcher: str, kills: list[int]) -> None:
        """Run the given kills of the schedule under ``launcher``, fresh runs as needed."""
        pending = list(kills)
        while pending:
            run = self.start(launcher)
            if run is None:
                return  # these kills are lost; the start failure is reported
            log(f"  {launcher}: run {run.directory.name} stepping, load {loadavg()}")
            done: list[Recovery] = []
            try:
                while pending:
                    rec = self.kill_and_wait(run, pending.pop(0))
                    done.append(rec)
                    if rec.outcome != "ok":
                        break  # a fresh run for the rest
            finally:
                run.stop()
                attach_events(run, done)
                self.recoveries += done

    def kill_and_wait(self, run: Run, kill: int) -> Recovery:
        interval, rank = self.schedule.intervals_s[kill], self.schedule.ranks[kill]
        time.sleep(interval)
        pid = run.timelines.newest_pid(rank)
        assert pid is not None  # the run is stepping: both ranks have started
        t_kill = time.time()
        rec = Recovery(run.launcher, kill, run.directory.name, rank, pid, interval, t_kill)
        try:
            if run.exited() is not None:
                raise ProcessLookupError
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # the run died by itself meanwhile: nothing to measure
            rec.outcome = f"run gone before the kill (launcher exit {run.exited()})"
            rec.log_tail = run.log_tail()
            log(f"  {run.launcher} kill {kill}: {rec.outcome}")
            return rec
        steps = run.wait_for_steps(t_kill, self.args.stall_s)
        rec.loadavg = loadavg()
        if steps is not None:
            measure(run, rec, steps)
            parts = " ".join(f"{k} {v:.2f}" for k, v in rec.parts_s.items())
            extra = f", {rec.attempts} attempts" if rec.attempts != 1 else ""
            log(
                f"  {run.launcher} kill {kill} (rank {rank}): {rec.recovery_s:.2f} s "
                f"[{parts}]{extra}, load {rec.loadavg[0]}"
            )
            return rec
        code = run.exited()
        rec.outcome = "stalled" if code is None else f"launcher exited ({code})"
        diagnose_stall(run, rec)
        log(f"  {run.launcher} kill {kill} (rank {rank}): {rec.outcome.upper()}")
        for rank_, reached in rec.reached.items():
            log(f"    rank {rank_}: {reached}")
        for error in rec.errors:
            log(f"    {error}")
        for line in rec.log_tail:
            log(f"    | {line}")
        return rec

    def run_all(self, launchers: list[str]) -> None:
        kills = list(range(self.args.kills))
        rounds = max(1, min(self.args.rounds, len(kills)))
        blocks = [kills[i::rounds] for i in range(rounds)]
        for number, block in enumerate(blocks):
            order = launchers[number % len(launchers) :] + launchers[: number % len(launchers)]
            log(f"round {number + 1}/{rounds}: kills {block}, order {order}")
            for launcher in order:
                self.block(launcher, block)


# -- summary and output ------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarize(bench: Bench, launchers: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for launcher in launchers:
        recs = [r for r in bench.recoveries if r.launcher == launcher]
        ok = [r for r in recs if r.outcome == "ok" and r.recovery_s is not None]
        times = [r.recovery_s for r in ok if r.recovery_s is not None]
        events = {
            key: median([r.events[key] for r in ok if r.events.get(key) is not None])
            for key in EVENT_PARTS
        }
        clean = [r.recovery_s for r in ok if r.attempts == 1 and r.recovery_s is not None]
        summary[launcher] = {
            "kills": len(recs),
            "recovered": len(ok),
            "stalled": sum(r.outcome == "stalled" for r in recs),
            "launcher_exited": sum(r.outcome.startswith("launcher exited") for r in recs),
            "failed_attempts": sum(r.failed_attempts for r in recs),
            "start_failures": sum(f["launcher"] == launcher for f in bench.start_failures),
            "median_s": median(times),
            "min_s": round(min(times), 3) if times else None,
            "max_s": round(max(times), 3) if times else None,
            "clean": len(clean),
            "median_clean_s": median(clean),
            "parts_median_s": {name: median([r.parts_s[name] for r in ok]) for name, _, _ in PARTS},
            "events_median_s": events,
        }
    return summary


def ratios(summary: dict[str, Any]) -> dict[str, float | None]:
    def ratio(a: str, b: str, key: str) -> float | None:
        x = summary.get(a, {}).get(key)
        y = summary.get(b, {}).get(key)
        return round(x / y, 3) if x is not None and y else None

    pairs = [
        ("crashproof", "torchrun"),
        ("crashproof-cold", "torchrun"),
        ("crashproof-preload", "torchrun"),
        ("crashproof", "torchrun-fresh-store"),
        ("crashproof", "crashproof-cold"),
        ("crashproof-preload", "crashproof"),
    ]
    out = {f"{a} / {b}": ratio(a, b, "median_s") for a, b in pairs if a in summary and b in summary}
    # The same without the restarts that needed more than one attempt: how the launchers compare
    # when torchrun's restart goes right the first time.
    for a, b in pairs[:4]:
        if a in summary and b in summary:
            out[f"{a} / {b}, first-attempt restarts only"] = ratio(a, b, "median_clean_s")
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(out: dict[str, Any]) -> str:
    summary, config = out["summary"], out["config"]
    lines = [
        f"**Recovery from a SIGKILLed rank** (2 ranks, gloo DDP, {config['step_s'] * 1000:.0f} ms "
        f"steps, checkpoint every {config['every']} steps; {config['kills']} kills per launcher "
        f"every {config['interval'][0]:g}-{config['interval'][1]:g} s, {config['rounds']} rounds; "
        f"stalled = no step within {config['stall_s']:g} s; load {out['loadavg_before']} before, "
        f"{out['loadavg_after']} after)",
        "",
        "| launcher | median s | min s | max s | recovered | stalled | failed attempts "
        "| first-attempt median s (n) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        stalled = s["stalled"] + s["launcher_exited"]
        lines.append(
            f"| {name} | {fmt(s['median_s'])} | {fmt(s['min_s'])} | {fmt(s['max_s'])} | "
            f"{s['recovered']}/{s['kills']} | {stalled} | {s['failed_attempts']} | "
            f"{fmt(s['median_clean_s'])} ({s['clean']}) |"
        )
    lines += ["", "**Where the time goes** (medians, s; the critical path over the two ranks)", ""]
    header = [name for name, _, _ in PARTS]
    lines.append("| launcher | " + " | ".join(header) + " |")
    lines.append("|---|" + "---:|" * len(header))
    for name, s in summary.items():
        parts = [fmt(s["parts_median_s"][h]) for h in header]
        lines.append(f"| {name} | " + " | ".join(parts) + " |")
    agents = {n: s for n, s in summary.items() if any(s["events_median_s"].values())}
    if agents:
        lines += ["", "**detect+stop from crashproof's events** (medians, s)", ""]
        lines.append("| launcher | " + " | ".join(EVENT_PARTS) + " |")
        lines.append("|---|" + "---:|" * len(EVENT_PARTS))
        for name, s in agents.items():
            ev = [fmt(s["events_median_s"][k], 3) for k in EVENT_PARTS]
            lines.append(f"| {name} | " + " | ".join(ev) + " |")
    lines += ["", "| ratio of medians | value |", "|---|---:|"]
    lines += [f"| {k} | {fmt(v)} |" for k, v in out["ratios"].items()]
    target = out["ratios"].get("crashproof / torchrun")
    if target is not None:
        verdict = "met" if target <= 0.5 else "NOT met"
        lines += ["", f"Target crashproof / torchrun <= 0.5: **{verdict}** ({target:.2f})."]
    problems = [r for r in out["recoveries"] if r["outcome"] != "ok" or r["errors"]]
    if problems or out["start_failures"]:
        lines += ["", "Problems:", ""]
        for r in problems:
            lines.append(
                f"- {r['launcher']} kill {r['kill']} ({r['run']}): {r['outcome']}, "
                f"{r['attempts']} attempts ({r['failed_attempts']} failed)"
                + "".join(f"; {e}" for e in r["errors"][:3])
                + "".join(f"; rank {k}: {v}" for k, v in r["reached"].items())
            )
        for f in out["start_failures"]:
            lines.append(f"- {f['launcher']} ({f['run']}): did not start, exit {f['exitcode']}")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------


def interval(text: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    bounds = (float(low), float(high or low))
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: give LOW-HIGH seconds, 0 < LOW <= HIGH")
    return bounds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--kills", type=int, default=5, help="kills per launcher")
    p.add_argument("--interval", type=interval, default=(8.0, 12.0), metavar="LOW-HIGH",
                   help="seconds of training between a recovery and the next kill (uniform)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the intervals and killed ranks")
    p.add_argument("--rounds", type=int, default=2,
                   help="split the kills into this many rounds, each a fresh run per launcher")  # fmt: skip
    p.add_argument("--launchers", default=DEFAULT_LAUNCHERS,
                   help=f"comma-separated, from {', '.join(LAUNCHERS)}")  # fmt: skip
    p.add_argument("--max-restarts", type=int, default=100, help="--max-restarts of every run")
    p.add_argument("--stall-s", type=float, default=60.0,
                   help="a restart without a step after this long is stalled")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds for a fresh run to reach its first step")  # fmt: skip
    p.add_argument("--step-s", type=float, default=0.05, help="trainer step time (padded)")
    p.add_argument("--every", type=int, default=20, help="trainer checkpoint interval in steps")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="scratch dir for runs")
    p.add_argument("--keep", action="store_true",
                   help="keep the run directories (logs, timelines, events) under --dir")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--markdown", action="store_true", help="print markdown tables (the default)")
    args = p.parse_args(argv)
    args.launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    unknown = sorted(set(args.launchers) - set(LAUNCHERS))
    if unknown or not args.launchers:
        p.error(f"--launchers: unknown {unknown}; choose from {LAUNCHERS}")
    if args.kills < 1 or args.rounds < 1 or args.stall_s <= 0:
        p.error("--kills and --rounds must be >= 1 and --stall-s > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = args.dir.resolve()
    created_base = not base.exists()
    work = base / f"run-{os.getpid()}"
    work.mkdir(parents=True)
    schedule = make_schedule(args)
    bench = Bench(args, work, schedule)
    before = loadavg()
    log(f"schedule: intervals {schedule.intervals_s}, ranks {schedule.ranks}; load {before}")
    started = time.monotonic()
    try:
        bench.run_all(args.launchers)
    finally:
        if args.keep:
            log(f"run directories kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            if created_base:
                with contextlib.suppress(OSError):
                    base.rmdir()
    summary = summarize(bench, args.launchers)
    out: dict[str, Any] = {
        "config": {
            "kills": args.kills,
            "interval": list(args.interval),
            "seed": args.seed,
            "rounds": min(args.rounds, args.kills),
            "launchers": args.launchers,
            "max_restarts": args.max_restarts,
            "stall_s": args.stall_s,
            "step_s": args.step_s,
            "every": args.every,
            "cpus": os.cpu_count(),
        },
        "schedule": asdict(schedule),
        "loadavg_before": before,
        "loadavg_after": loadavg(),
        "wall_s": round(time.monotonic() - started, 1),
        "summary": summary,
        "ratios": ratios(summary),
        "runs": bench.runs,
        "start_failures": bench.start_failures,
        "recoveries": [asdict(r) for r in bench.recoveries],
    }
    if args.json:
        print(json.dumps(out, indent=2))
    if args.markdown or not args.json:
        print(markdown(out))
    log(f"done in {out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
