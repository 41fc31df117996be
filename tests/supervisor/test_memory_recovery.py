"""Recovery from the agent's memory under ``crashproof run``: real agents, real trainer
processes (two ranks, gloo), real crashes and SIGKILLs.

A trainer that crashes resumes from the newest snapshot its agent holds, never touching the
disk, and ends bit for bit where an uninterrupted run ends; the memory is freed when the run
ends, and when the agent itself is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from crashproof.telemetry import read_events
from tests.integrations.launch import finish, start

TINY = ["--steps", "40", "--workers", "0", "--batch-size", "8"]


def test_a_crashed_trainer_resumes_from_the_agents_memory_bit_for_bit(tmp_path: Path) -> None:
    # No checkpoint reaches the disk before the crash (every 50 steps): only memory can save it.
    common = [*TINY, "--every", "50", "--memory-every", "5", "--staging-buffers", "2"]
    clean = start("train_tiny.py", tmp_path / "a", "--run-dir", str(tmp_path / "a"), *common,
                  "--dump", str(tmp_path / "a.st"))  # fmt: skip
    crashed = start("train_tiny.py", tmp_path / "b", "--run-dir", str(tmp_path / "b"), *common,
                    "--crash-at", "38", "--dump", str(tmp_path / "b.st"))  # fmt: skip
    code_b, events, output = finish(crashed)
    code_a, _, output_a = finish(clean)
    assert code_a == 0, output_a[-3000:]
    assert code_b == 0, output[-3000:]
    [restore] = [e for e in events if e["event"] == "restore"]
    # Step 35's snapshot, or an earlier one when the machine was too busy for the snapshots to
    # keep up (a snapshot never waits: one due while the buffers are busy is skipped).
    assert restore["kind"] == "memory" and restore["step"] % 5 == 0, restore
    assert 5 <= restore["step"] <= 35, restore
    assert restore["bytes"] > 0
    assert "memory of crashproof run's agent" in restore["source"]
    # The agent checked its snapshots once the crashed trainer was gone, while the next one
    # started: the restore copied the checked bytes without hashing them again.
    [checked] = [e for e in events if e["event"] == "memory_checked"]
    assert checked["snapshots"] >= 1 and checked["bytes"] > 0, checked
    assert restore["verified_by"] == "agent", restore
    expected, got = load_file(tmp_path / "a.st"), load_file(tmp_path / "b.st")
    assert expected.keys() == got.keys()
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not different, f"differs from the uninterrupted run: {different}"


def _segments(token: str) -> list[str]:
    """Every process's descriptor or mapping of a segment of the memory host ``token``."""
    needle = f"memfd:crashproof:{token}:"
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if needle in os.readlink(f"/proc/{pid}/fd/{fd}"):
                        found.append(f"{pid} fd {fd}")
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps") as maps:
                found += [f"{pid} maps" for line in maps if needle in line]
        except OSError:
            continue
    return found


def _gone_within(token: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := _segments(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _memory_token(run_dir: Path, proc: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            events = list(read_events(run_dir / "events.jsonl"))
        except FileNotFoundError:
            events = []
        held = [e for e in events if e["event"] == "memory_held"]
        if held:
            return str(held[0]["segment"]).split(":")[1]
        assert proc.poll() is None, "the run ended before it held any memory"
        time.sleep(0.05)
    raise AssertionError("no memory_held event in 120 s")


def test_the_agents_memory_is_freed_at_the_end_and_after_a_sigkill(tmp_path: Path) -> None:
    # Two runs at once: one ends normally, the other's agent is SIGKILLed mid-run.
    args = [*TINY, "--every", "50", "--memory-every", "2", "--hidden", "512"]
    ending = start("train_tiny.py", tmp_path / "a", "--run-dir", str(tmp_path / "a"), *args)
    killed = start("train_tiny.py", tmp_path / "b", "--run-dir", str(tmp_path / "b"), *args,
                   "--steps", "100000")  # fmt: skip
    try:
        token_killed = _memory_token(tmp_path / "b", killed[0])
        token_ending = _memory_token(tmp_path / "a", ending[0])
        assert _segments(token_killed), "the segments should be mapped while the run trains"
        killed[0].send_signal(signal.SIGKILL)  # the agent, with no chance to clean up
        assert not _gone_within(token_killed, 15), "shared memory outlived a SIGKILLed agent"
        code, _, output = finish(ending)
        assert code == 0, output[-3000:]
        assert not _gone_within(token_ending, 5), "shared memory outlived the run"
    finally:
        for proc, _ in (killed, ending):
            if proc.poll() is None:
                proc.kill()
        finish(killed, timeout=30)
