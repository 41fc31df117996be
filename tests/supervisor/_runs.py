"""Helpers for tests that start real ``crashproof run`` processes and must leave none behind.

Every process of a run started with :func:`start_run` carries a marker in its environment (the
kernel keeps a process's initial environment in ``/proc/<pid>/environ``, and forked children
share their parent's), so a test can find all of them, the forkserver, the trainers and their
children included, whoever their parent is by then, and :func:`stop_run` can kill all of them
whatever the test's outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

TRAINER = Path(__file__).with_name("trainer.py")
MARKER = "CRASHPROOF_TEST_RUN"


class Run:
    def __init__(self, proc: subprocess.Popen[bytes], run_dir: Path, marker: str) -> None:
        self.proc, self.run_dir, self.marker = proc, run_dir, marker

    @property
    def pid(self) -> int:
        return self.proc.pid

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        try:
            lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        found = [json.loads(line) for line in lines if line.endswith("}")]
        return [e for e in found if kind is None or e["event"] == kind]

    def wait_for(self, kind: str, timeout: float = 60, count: int = 1) -> list[dict[str, Any]]:
        """The events ``kind`` once there are ``count`` of them; fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(kind)
            if len(found) >= count:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended ({self.proc.returncode}) before {kind}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {count} {kind} event(s) in {timeout} s: {self.events()}")
            time.sleep(0.02)

    def processes(self) -> dict[int, str]:
        """Live (not zombie) processes of this run other than the agent: pid -> command line."""
        return {pid: cmd for pid, cmd in marked(self.marker).items() if pid != self.pid}

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


def marked(marker: str) -> dict[int, str]:
    needle = f"\0{MARKER}={marker}\0".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in b"\0" + environ:
            found[int(name)] = cmdline[:160]
    return found


def start_run(
    run_dir: Path,
    options: list[str],
    script_args: list[str],
    *,
    env: dict[str, str] | None = None,
    script: Path = TRAINER,
) -> Run:
    marker = uuid.uuid4().hex
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2",
        "--run-dir", str(run_dir), "--metrics-port", "-1", *options,
        str(script), "--ckpt", str(run_dir / "ckpt"), *script_args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        stdout=open(run_dir.parent / f"{run_dir.name}.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", MARKER: marker, **(env or {})},
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    return Run(proc, run_dir, marker)


def output(run: Run) -> str:
    path = run.run_dir.parent / f"{run.run_dir.name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def stop_run(run: Run) -> None:
    """Kill whatever is left of ``run``: the agent and every process carrying its marker."""
    if run.proc.poll() is None:
        run.proc.kill()
    with_marker = marked(run.marker)
    for pid in with_marker:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.proc.wait(timeout=10)


def gone_within(run: Run, seconds: float) -> dict[int, str]:
    """Wait up to ``seconds`` for every process of ``run`` to end; returns those still alive."""
    deadline = time.monotonic() + seconds
    while True:
        left = run.processes()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)
