"""Shared fixtures: paths to the repository's examples and a helper to run them as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def run_python(
    args: list[str], *, timeout: float = 120, check: bool = True, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` in a fresh process; fails the test with its output if it does."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"python {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc  # type: ignore[no-any-return]
