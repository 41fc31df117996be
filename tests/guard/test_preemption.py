"""Preemption: a notice mid-interval becomes an emergency checkpoint of that very step and exit
code 75; running the same command again finishes the run bit for bit like one never stopped.

Notices come as SIGTERM to ``crashproof run`` (Kubernetes, SLURM), SIGUSR1 (SLURM's
``--signal``), or a cloud metadata notice from a local server answering like AWS, GCP or Azure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from crashproof.link import PreemptionListener
from crashproof.link._heartbeat import read_heartbeat
from crashproof.telemetry import read_events
from tests.conftest import EXAMPLES, step_records
from tests.metadata_server import MetadataServer

STEPS = 400
EVERY = 50


def _command(tmp: Path, name: str, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2",
        "--run-dir", str(tmp / name / "supervisor"), *options,
        str(EXAMPLES / "train_tiny.py"),
        "--run-dir", str(tmp / "ckpt" / name), "--steps", str(STEPS), "--every", str(EVERY),
        "--samples", "400", "--workers", "1",
        "--step-log", str(tmp / name / "steps.jsonl"), "--dump", str(tmp / name / "final.safetensors"),
    ]  # fmt: skip


def _events(tmp: Path, name: str) -> list[dict[str, Any]]:
    path = tmp / name / "supervisor" / "events.jsonl"
    return list(read_events(path)) if path.exists() else []


def _wait_mid_interval(tmp: Path, name: str, proc: subprocess.Popen[str]) -> int:
    """Block until rank 0 is between two checkpoints, well into the run; returns its step."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        for path in (tmp / name / "supervisor").glob("heartbeats/*/local_rank_0"):
            beat = read_heartbeat(str(path))
            if (
                beat is not None
                and beat.phase == "step"
                and beat.step > 60
                and beat.step % EVERY > 10
            ):
                return beat.step
        time.sleep(0.001)
    raise AssertionError(f"the run never reached the middle of an interval: {proc.poll()}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("reference")
    done = subprocess.run(_command(tmp, "ref"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp / "ref"


def _stop_and_resume(
    tmp: Path,
    reference: Path,
    options: list[str],
    notify: Any,
    *,
    new_machine: Any = None,
    resume: bool = True,
) -> tuple[list[dict[str, Any]], str]:
    proc = subprocess.Popen(
        _command(tmp, "run", *options), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        notified_at = _wait_mid_interval(tmp, "run", proc)
        notify(proc)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, out[-4000:]
    stopped = _events(tmp, "run")
    [emergency] = [e for e in stopped if e["event"] == "emergency_checkpoint"]
    # The step at which the ranks saw the notice (a poller may take a while: it need not be the
    # step the notice was sent at, and may happen to be a periodic checkpoint's step).
    assert emergency["saved"] and emergency["step"] >= notified_at, (
        f"notified after step {notified_at}: {emergency}\n{out[-4000:]}"
    )
    assert stopped[-1]["event"] == "run_end" and stopped[-1]["outcome"] == "preempted"
    assert not [e for e in stopped if e["event"] == "restart"]  # a notice is no failure
    if not resume:
        return stopped, out
    if new_machine is not None:
        new_machine()  # the requeued job runs where no notice is pending
    # the same command again: resumes from the emergency checkpoint and finishes
    again = subprocess.run(
        _command(tmp, "run", *options), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    restores = [e for e in _events(tmp, "run") if e["event"] == "restore"]
    assert restores[-1]["step"] == emergency["step"]
    expected, final = (
        load_file(reference / "final.safetensors"),
        load_file(tmp / "run" / "final.safetensors"),
    )
    assert [k for k in expected if not torch.equal(expected[k], final[k])] == []
    for rank in (0, 1):
        log = f"steps.jsonl.rank{rank}"
        assert step_records(tmp / "run" / log) == step_records(reference / log)
    return stopped, out


def test_sigterm_to_crashproof_run_saves_the_current_step_and_resumes_exactly(
    tmp_path: Path, reference: Path
) -> None:
    stopped, out = _stop_and_resume(
        tmp_path, reference, [], lambda p: p.send_signal(signal.SIGTERM)
    )
    assert "resumable" in out
    # the console tells it: the emergency checkpoint's step, and the outcome in the summary
    [emergency] = [e for e in stopped if e["event"] == "emergency_checkpoint"]
    assert f"WARNING emergency checkpoint: step {emergency['step']} saved in" in out, out[-3000:]
    assert "outcome      preempted (exit 75)" in out


def test_sigusr1_from_slurm_is_a_notice_too(tmp_path: Path, reference: Path) -> None:
    # The stop is SIGUSR1's own; the resume after it is the one the SIGTERM test proves exact.
    events, out = _stop_and_resume(
        tmp_path, reference, [], lambda p: p.send_signal(signal.SIGUSR1), resume=False
    )
    assert [e["source"] for e in events if e["event"] == "notice"] == ["SIGUSR1"]
    assert "WARNING preemption notice (SIGUSR1): the trainers checkpoint and stop" in out
    assert "WARNING preempted: the trainers stopped after step" in out


# End to end with one provider: each provider's notice is read the same way by the agent once its
# poller reports it, and tests/supervisor/test_cloud.py reads every provider's notice (AWS's
# token first, GCP's and Azure's formats) from the same local metadata server.
@pytest.mark.parametrize("provider", ["aws"])
def test_a_cloud_notice_stops_the_run_resumably(
    tmp_path: Path, reference: Path, metadata: MetadataServer, provider: str
) -> None:
    def announce(proc: subprocess.Popen[str]) -> None:
        metadata.preempted = True

    written: dict[str, Any] = {}

    def new_machine() -> None:
        # what the supervisor told the trainers (a new run removes a previous run's notice)
        written.update(json.loads((tmp_path / "run" / "supervisor" / "notice.json").read_text()))
        metadata.preempted = False

    events, _ = _stop_and_resume(
        tmp_path, reference, ["--preemption", provider], announce, new_machine=new_machine
    )
    [notice] = [e for e in events if e["event"] == "notice"]
    assert provider in notice["source"]
    notice_file = written
    assert notice_file["source"] == provider and notice_file["seconds_left"] > 0


def test_listeners_of_many_managers_never_closed_all_hear_a_signal_without_recursing() -> None:
    """Each manager's listener is installed over the one before; managers never closed leave
    theirs in the chain. Thousands of them (more than Python's recursion allows) all get the
    notice from one signal, and the user's own handler beyond them is called once."""
    heard: list[int] = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: heard.append(signum))
    listeners = [PreemptionListener((signal.SIGUSR1,)) for _ in range(3000)]
    try:
        for listener in listeners:
            assert listener.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(1000):  # the signal is handled between bytecodes
            pass
        assert all(listener.notice is not None for listener in listeners)
        assert heard == [signal.SIGUSR1]
    finally:
        for listener in reversed(listeners):
            listener.uninstall()
        signal.signal(signal.SIGUSR1, original)
