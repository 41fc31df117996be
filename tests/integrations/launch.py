"""Launching an example under ``crashproof run`` on two ranks, as the integration tests do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from crashproof.telemetry import read_events
from tests.conftest import EXAMPLES


def run_example(
    script: str, run_dir: Path, *script_args: str
) -> tuple[int, list[dict[str, Any]], str]:
    """``crashproof run --nproc-per-node 2 examples/SCRIPT ARGS``: exit code, events, output."""
    command = [sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2"]
    command += ["--run-dir", str(run_dir), "--metrics-port", "-1"]
    command += [str(EXAMPLES / script), *script_args]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return proc.returncode, list(read_events(run_dir / "events.jsonl")), proc.stdout + proc.stderr
