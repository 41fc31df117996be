"""Replication by the agent of ``crashproof run``: the uploads to a real S3-protocol server (moto's,
on loopback) are the agent's, so a trainer that crashes does not cut them short; a run whose local
disk is then lost resumes from the bucket and ends bit for bit equal to a run that never failed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from crashproof.checkpoint import committed_steps, verify_checkpoint
from crashproof.storage import storage_for
from crashproof.telemetry import read_events
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.usefixtures("s3_server")


def _run(tmp_path: Path, name: str, train_args: list[str]) -> subprocess.CompletedProcess[str]:
    return _finish(_start(tmp_path, name, train_args))


def _start(tmp_path: Path, name: str, train_args: list[str]) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2", "--metrics-port", "-1",
        "--max-restarts", "0", "--run-dir", str(tmp_path / name),
        str(EXAMPLES / "train_tiny.py"), "--steps", "30", "--every", "5", "--keep", "2",
        "--workers", "0", "--sync", *train_args,
    ]  # fmt: skip
    # --sync: step 15 is committed locally before the crash at step 18 (3 steps of a few ms
    # each can outrun an asynchronous write); the upload is still the agent's to finish.
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_the_agent_finishes_uploads_after_a_crash_and_a_lost_disk_resumes_from_the_bucket(
    tmp_path: Path,
) -> None:
    bucket = f"s3://agent-{uuid.uuid4().hex[:12]}/exp"
    # The run that never fails goes on beside the one that crashes (the machine's cores wait on
    # processes much of the time).
    clean_run = _start(
        tmp_path, "clean", ["--run-dir", str(tmp_path / "a"), "--dump", str(tmp_path / "a.st")]
    )
    common = ["--run-dir", str(tmp_path / "b"), "--remote", bucket]
    crashed = _run(tmp_path, "crashed", [*common, "--crash-at", "18"])
    clean = _finish(clean_run)
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert crashed.returncode != 0  # the trainer died without closing its manager
    root, storage = storage_for(bucket)
    steps = [s for s, _ in committed_steps(storage, root)]
    assert max(steps) == 15, steps  # the newest checkpoint got there all the same
    assert verify_checkpoint(storage, storage.join(root, "step_0000000015")).step == 15
    # ... uploaded by the agent, which outlived the trainers, not by a trainer.
    events = list(read_events(tmp_path / "crashed" / "events.jsonl"))
    uploads = [e for e in events if e["event"] == "replicated"]
    assert {e["step"] for e in uploads} >= {15} and all("agent_pid" in e for e in uploads)
    assert not any(e["event"] == "replication_failed" for e in events)

    shutil.rmtree(tmp_path / "b" / "checkpoints")  # the node and its disk are gone
    resumed = _run(tmp_path, "resumed", [*common, "--dump", str(tmp_path / "b.st")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "starting at step 15" in resumed.stdout
    expected, got = load_file(tmp_path / "a.st"), load_file(tmp_path / "b.st")
    assert expected.keys() == got.keys()
    assert all((expected[k] == got[k]).all() for k in expected)  # bit for bit
    assert max(s for s, _ in committed_steps(storage, root)) == 30
