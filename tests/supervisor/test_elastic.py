"""Elastic membership: two ``crashproof run`` agents on this machine as two nodes, c10d on loopback.

A node that leaves (its agent SIGKILLed) takes its trainers with it; the surviving node
re-rendezvouses and goes on alone with the new world size; a node that joins makes the running
one restart with the larger world. (Restoring a checkpoint across world sizes is resharding, the
distributed issue's work: here each world size keeps its own checkpoint root.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crashproof.supervisor._trainers import process_state as _process_state
from crashproof.telemetry import read_events
from tests.conftest import free_port

TRAINER = Path(__file__).with_name("trainer.py")


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return list(read_events(path)) if path.exists() else []


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@contextmanager
def agent(run_dir: Path, ckpt: Path, port: int, *extra: str) -> Iterator[subprocess.Popen[str]]:
    command = [
        sys.executable, "-m", "crashproof.cli", "run",
        "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "5",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
        "--run-dir", str(run_dir), *extra,
        str(TRAINER), "--ckpt", str(ckpt), "--ckpt-per-world", "--steps", "100000", "--step-s", "0.05",
    ]  # fmt: skip
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.close()


def _world_sizes(run_dir: Path) -> list[int]:
    return [e["world_size"] for e in _events(run_dir) if e["event"] == "rank_start"]


def _progress_after(run_dir: Path, since: float) -> bool:
    return any(
        e["event"] in ("checkpoint", "progress") and e["ts"] > since for e in _events(run_dir)
    )


def test_survivors_go_on_without_a_lost_node_and_take_back_a_new_one(tmp_path: Path) -> None:
    port = free_port()
    ckpt = tmp_path / "ckpt"
    a, b, b2 = tmp_path / "node_a", tmp_path / "node_b", tmp_path / "node_b2"
    for d in (a, b, b2):
        d.mkdir()
    # Keep-alives every 10 s: torch's rendezvous would see node B gone after 30 s; node A's
    # agent sees at once that B's agent is gone, and takes B out of the rendezvous itself.
    slow = ("--rdzv-conf", "keep_alive_interval=10")
    with agent(a, ckpt, port, *slow):
        _wait_for(lambda: (a / "events.jsonl").exists(), 60, "node A to start")
        time.sleep(1)  # node A binds the rendezvous store first: it hosts it
        with agent(b, ckpt, port, *slow) as node_b:
            _wait_for(lambda: 2 in _world_sizes(a), 90, "a world of two nodes")
            _wait_for(lambda: (ckpt / "world_2").exists(), 90, "training with two nodes")
            trainers_b = [e["pid"] for e in _events(b) if e["event"] == "rank_start"]
            os.killpg(node_b.pid, signal.SIGKILL)  # the node is gone: agent and trainer
            node_b.wait(30)
            left = time.time()
            # its trainer must not train on alone (parent-death signal)
            _wait_for(
                lambda: not any(_process_state(p) not in (None, "Z") for p in trainers_b),
                10,
                "node B's trainer to die",
            )
        _wait_for(lambda: _world_sizes(a)[-1:] == [1], 90, "node A alone, world size 1")
        _wait_for(lambda: _progress_after(a, left), 90, "node A training alone")
        alone = [e for e in _events(a) if e["event"] == "rank_start"][-1]
        assert alone["ts"] - left < 20, "the survivor should not wait out B's keep-alives (30 s)"
        [fenced] = [e for e in _events(a) if e["event"] == "node_fenced"]
        assert len(fenced["nodes"]) == 1 and f"_{node_b.pid}_" in fenced["nodes"][0], fenced
        joined = time.time()
        with agent(b2, ckpt, port, *slow):
            _wait_for(lambda: _world_sizes(a)[-1:] == [2], 120, "node A back in a world of two")
            regrown = [e for e in _events(a) if e["event"] == "rank_start"][-1]["ts"]
            assert regrown > joined
            # Rank 0 reports progress for the run; the new rendezvous may give rank 0 to either
            # node, so the steps of the world of two show in one of the two run directories.
            _wait_for(
                lambda: _progress_after(a, regrown) or _progress_after(b2, regrown),
                90,
                "training with the new node",
            )
    restarts = [e for e in _events(a) if e["event"] == "restart"]
    assert any(e["reason"] == "membership change" for e in restarts)
