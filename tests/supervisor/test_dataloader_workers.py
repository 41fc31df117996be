"""A SIGKILLed rank whose DataLoader workers hold copies of its sockets: its peers must fail at
once, not when the orphaned workers notice (DataLoader's watchdog checks every 5 s). crashproof
makes every child a trainer forks from its main thread die with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import EXAMPLES


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait(path: Path, what: str, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in _events(path) if e["event"] == what]
        if found:
            return found
        assert time.monotonic() < deadline, f"no {what} event in {timeout} s"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def test_a_killed_rank_with_dataloader_workers_is_seen_at_once(tmp_path: Path) -> None:
    events = tmp_path / "sup" / "events.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2",
         "--max-restarts", "1", "--run-dir", str(tmp_path / "sup"), str(EXAMPLES / "train_tiny.py"),
         "--run-dir", str(tmp_path / "train"), "--steps", "100000", "--every", "50", "--workers", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        _wait(events, "progress", 90)
        rank1 = [e for e in _events(events) if e["event"] == "rank_start" and e["rank"] == 1][-1]
        workers = _children(rank1["pid"])
        assert len(workers) >= 2, "rank 1 should have its DataLoader workers"
        killed_at = time.time()
        os.kill(rank1["pid"], signal.SIGKILL)
        exit_event = _wait(events, "rank_exit", 30)[0]
        assert exit_event["ts"] - killed_at < 2.0, "the group took too long to notice the kill"
        time.sleep(0.5)
        assert not any(os.path.exists(f"/proc/{w}") and _state(w) != "Z" for w in workers), (
            "rank 1's workers outlived it"
        )
        _wait(events, "restore", 60)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
