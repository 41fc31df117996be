"""Launching an example under ``crashproof run`` on two ranks, as the integration tests do.

A test that compares a killed run with an uninterrupted one starts both at once (``start`` then
``finish``): the machine's cores are not all busy while a run waits on its processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crashproof.telemetry import read_events
from tests.conftest import EXAMPLES

Outcome = tuple[int, list[dict[str, Any]], str]


def start(
    script: str | Path, run_dir: Path, *script_args: str, options: Sequence[str] = ()
) -> tuple[subprocess.Popen[str], Path]:
    """Start ``crashproof run --nproc-per-node 2 [OPTIONS] SCRIPT ARGS`` (SCRIPT: a path, or the
    name of a script in ``examples/``)."""
    command = [sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2"]
    command += ["--run-dir", str(run_dir), "--metrics-port", "-1", *options]
    command += [str(EXAMPLES / script), *script_args]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return proc, run_dir


def finish(started: tuple[subprocess.Popen[str], Path], timeout: float = 240) -> Outcome:
    """Its exit code, events and output, once it has ended."""
    proc, run_dir = started
    try:
        output = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, list(read_events(run_dir / "events.jsonl")), output
