"""Chaos under ``crashproof run``: SIGKILL ranks at random moments, again and again; the run
finishes, and its final model, optimizer and EMA equal an uninterrupted run's, bit for bit, with
the same samples and the same loss at every step.

The trainer is ``examples/train_tiny.py`` on 2 ranks (DDP over gloo, DataLoader workers,
dropout, NumPy and Python randomness, OneCycle, GradScaler, EMA, asynchronous saves every few
steps). Kills are seeded and aimed at different moments of an attempt, watched through the
trainers' heartbeats: as soon as a rank starts, while it restores, while it saves (the blocking
part), and a random number of steps into training (which may land in a background persist).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from crashproof.link._heartbeat import Heartbeat, read_heartbeat
from crashproof.telemetry import compute_ledger, read_events
from tests.conftest import EXAMPLES, step_records

STEPS = 300
MOMENTS = ["startup", "training", "restore", "save", "training"]


def _command(tmp: Path, name: str) -> list[str]:
    return [
        sys.executable, "-m", "crashproof.cli", "run",
        "--nproc-per-node", "2", "--max-restarts", "20", "--crash-loop-attempts", "0",
        "--run-dir", str(tmp / name / "supervisor"),
        str(EXAMPLES / "train_tiny.py"),
        "--run-dir", str(tmp / name), "--steps", str(STEPS), "--every", "7", "--samples", "400",
        "--step-log", str(tmp / name / "steps.jsonl"), "--dump", str(tmp / name / "final.safetensors"),
    ]  # fmt: skip


def _starts(events_path: Path) -> list[dict[str, Any]]:
    if not events_path.exists():
        return []
    return [e for e in read_events(events_path) if e["event"] == "rank_start"]


def _beat(run_dir: Path, local_rank: int, pid: int) -> Heartbeat | None:
    for path in run_dir.glob(f"heartbeats/*/local_rank_{local_rank}"):
        beat = read_heartbeat(str(path))
        if beat is not None and beat.pid == pid:
            return beat
    return None


def _next_attempt(events: Path, after: int, proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    """The rank starts once an attempt beyond the first ``after`` starts has started both ranks."""
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        starts = _starts(events)
        if len(starts) >= after + 2 and len(starts) % 2 == 0:
            return starts
        time.sleep(0.002)
    return []


def _chaos(proc: subprocess.Popen[str], tmp: Path, rng: random.Random) -> list[tuple[str, bool]]:
    """Kill a rank once per moment in MOMENTS; returns (moment, whether it was hit) per kill."""
    supervisor = tmp / "chaos" / "supervisor"
    events = supervisor / "events.jsonl"
    done: list[tuple[str, bool]] = []
    seen = 0
    for moment in MOMENTS:
        starts = _next_attempt(events, seen, proc)
        if not starts:
            return done
        seen = len(starts)
        start = starts[-1 - rng.randrange(2)]
        pid, rank = start["pid"], start["rank"]
        hit = moment == "startup"
        steps_in = rng.randint(1, 40)  # for "training": this many steps into the attempt
        first_step: int | None = None
        until = time.monotonic() + 20
        while not hit and time.monotonic() < until and proc.poll() is None:
            beat = _beat(supervisor, start["local_rank"], pid)
            if beat is not None and moment == "restore" and beat.phase == "step":
                break  # a restore shorter than a poll on a busy machine: missed, kill now
            if beat is not None and moment in ("restore", "save"):
                hit = beat.phase == moment
            elif beat is not None and beat.phase == "step":
                first_step = beat.step if first_step is None else first_step
                hit = beat.step >= first_step + steps_in
            time.sleep(0.0005)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            hit = False
        done.append((f"{moment} (rank {rank})", hit))
    return done


@pytest.mark.timeout(600)
def test_random_kills_under_crashproof_run_end_bit_identical_to_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference = subprocess.run(
        _command(tmp_path, "reference"), capture_output=True, text=True, timeout=300, env=env
    )
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    rng = random.Random(20261122)
    proc = subprocess.Popen(
        _command(tmp_path, "chaos"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        kills = _chaos(proc, tmp_path, rng)
        print("kills:", kills)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-5000:]
    assert len(kills) == len(MOMENTS), f"the run ended before every kill landed: {kills}"
    assert kills[0][1], "the first kill lands during start-up"
    assert sum(hit for _, hit in kills) >= 3, f"too few kills landed where aimed: {kills}"
    events = list(read_events(tmp_path / "chaos" / "supervisor" / "events.jsonl"))
    assert len([e for e in events if e["event"] == "restart"]) >= len(MOMENTS)
    assert [e for e in events if e["event"] == "restore"], (
        "at least one restart resumed from a checkpoint"
    )

    # the promise's bound: with asynchronous saves every 7 steps, a failure loses fewer than
    # two intervals (the save in flight may be lost; the one before it is committed)
    for failure in compute_ledger(events).failures:
        restored = failure.step_restored if failure.step_restored is not None else 0
        assert failure.step_reached - restored < 2 * 7, failure

    expected = load_file(tmp_path / "reference" / "final.safetensors")
    final = load_file(tmp_path / "chaos" / "final.safetensors")
    assert final.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(final[k], expected[k])]
    assert not different, (
        f"after kills {kills}: tensors differ from the uninterrupted run: {different}"
    )
    for rank in (0, 1):
        log = f"steps.jsonl.rank{rank}"
        assert step_records(tmp_path / "chaos" / log) == step_records(
            tmp_path / "reference" / log
        ), f"rank {rank} saw other samples or losses than the uninterrupted run (kills: {kills})"
