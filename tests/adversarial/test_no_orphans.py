"""Promise: whenever ``crashproof run`` dies, by any signal and in any phase, every process it
started (the warm forkserver, the trainers, their children, multiprocessing's helpers) is gone
within a second.

Found porting a real DDP script: SIGKILL of the agent left both warm-started trainers training
on their own (they held the forkserver's "alive" pipe and died only with the forkserver), and
checkpoints went from 6 to 15 after the agent was dead. Each test kills the agent in one phase
and looks for every process carrying the run's environment marker, whoever its parent is by then.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.supervisor._runs import Run, gone_within, output, start_run

WITHIN_S = 1.0


def _wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill_and_check(run: Run, sig: signal.Signals = signal.SIGKILL) -> None:
    before = run.processes()
    assert before, "the phase under test should have processes of the run"
    os.kill(run.pid, sig)
    run.wait(timeout=10)
    left = gone_within(run, WITHIN_S)
    assert not left, f"still running {WITHIN_S} s after the agent died: {left} (before: {before})"


KEEPER = " -I -S /dev/fd/"
"""How the keeper's command line looks: it names neither crashproof nor the run."""


def _of_kind(run: Run, part: str) -> list[int]:
    return [pid for pid, cmd in run.processes().items() if part in cmd]


def _checkpoints(run: Run) -> set[str]:
    root = run.run_dir / "ckpt"
    return {p.name for p in root.glob("step_*")} if root.exists() else set()


def test_sigkill_while_training_leaves_no_trainer_and_no_worker(
    tmp_path: Path, runs: list[Run]
) -> None:
    run = start_run(
        tmp_path / "run",
        [],
        ["--steps", "100000", "--every", "2", "--helpers", "2", "--spawn-helper"],
    )
    runs.append(run)
    run.wait_for("checkpoint", 90)
    # two trainers, each with two forked and one spawned child, the forkserver, the tracker
    _wait_until(lambda: len(run.processes()) >= 10, 30, "every helper to start")
    # A sweep by name meant for the job (`pkill -9 -f crashproof`) must not reach the keeper.
    [keeper] = _of_kind(run, KEEPER)
    keeper_cmd = run.processes()[keeper].split(" ", 1)[1]  # past the interpreter's own path
    assert "crashproof" not in keeper_cmd and "keeper" not in keeper_cmd, keeper_cmd
    assert str(run.run_dir) not in keeper_cmd, keeper_cmd
    _kill_and_check(run)
    after = _checkpoints(run)
    time.sleep(1.0)
    assert _checkpoints(run) == after, "checkpoints were still written after the agent died"
    stopped = run.events("orphans_stopped")
    assert stopped and stopped[0]["agent_ended"] == "died"


def test_sigkill_during_startup_while_the_forkserver_imports(
    tmp_path: Path, runs: list[Run]
) -> None:
    run = start_run(tmp_path / "run", [], ["--steps", "100000"])
    runs.append(run)
    # The forkserver spends a second or more on the trainers' imports before the rendezvous ends.
    # It is forked from the agent (its command line is the agent's), or, where it cannot be,
    # started as multiprocessing starts it.
    _wait_until(
        lambda: _of_kind(run, "crashproof.cli run") or _of_kind(run, "multiprocessing.forkserver"),
        60,
        "the forkserver",
    )
    assert not run.events("rank_start")
    _kill_and_check(run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def test_an_unhandled_signal_during_rendezvous(tmp_path: Path, runs: list[Run]) -> None:
    # Two nodes wanted, one present: the agent waits in the rendezvous. SIGALRM: a signal the
    # agent has no handler for ends it as abruptly as SIGKILL.
    options = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-id", "orphans",
               "--rdzv-endpoint", f"localhost:{_free_port()}"]  # fmt: skip
    run = start_run(tmp_path / "run", options, ["--steps", "100000"])
    runs.append(run)
    run.wait_for("run_start", 60)
    _wait_until(lambda: _of_kind(run, KEEPER), 10, "the keeper")
    time.sleep(0.5)
    assert not run.events("rank_start")
    _kill_and_check(run, signal.SIGALRM)


def test_sigkill_during_the_backoff_between_restarts(tmp_path: Path, runs: list[Run]) -> None:
    run = start_run(
        tmp_path / "run",
        ["--max-restarts", "10", "--crash-loop-attempts", "10"],
        ["--steps", "100000", "--fail-at-start-from", "0"],  # no progress: it backs off 1 s
    )
    runs.append(run)
    [restart] = run.wait_for("restart", 90)
    assert restart["backoff_s"] >= 1
    assert time.time() - restart["ts"] < restart["backoff_s"] - 0.3, "missed the backoff"
    _kill_and_check(run)


def test_sigkill_while_waiting_for_uploads(tmp_path: Path, runs: list[Run]) -> None:
    control = tmp_path / "faults.json"
    # every upload of the agent's (rank null: not a trainer's) stalls for a minute
    control.write_text(json.dumps({"faults": [
        {"id": "slow", "rank": None, "error": "hang", "hang_s": 60, "files": 1000}
    ]}))  # fmt: skip
    run = start_run(
        tmp_path / "run",
        [],
        ["--steps", "4", "--every", "2", "--remote", str(tmp_path / "durable")],
        env={"CRASHPROOF_CHAOS_STORAGE": str(control)},
    )
    runs.append(run)
    run.wait_for("checkpoint", 90, count=2)
    time.sleep(1.0)  # the trainers are done or waiting in close(); the agent's upload stalls
    assert run.proc.poll() is None and not run.events("replicated")
    _kill_and_check(run)


def _without_keeper(run: Run) -> None:
    """Kill the keeper first: what is left is the kernel's parent-death chain (forkserver with
    the agent, trainers with their parent, forked children with their trainer), which must hold
    alone (``kill -9`` of the keeper and the agent together, an OOM sweep)."""
    [keeper] = _of_kind(run, KEEPER)
    os.kill(keeper, signal.SIGKILL)


def test_sigkill_during_the_shutdown_grace_with_the_keeper_gone(
    tmp_path: Path, runs: list[Run]
) -> None:
    run = start_run(
        tmp_path / "run",
        ["--preemption-grace", "60"],
        ["--steps", "100000", "--every", "2", "--ignore-sigterm", "--helpers", "1"],
    )
    runs.append(run)
    run.wait_for("checkpoint", 90)
    _wait_until(lambda: len(run.processes()) >= 6, 30, "every helper to start")
    os.kill(run.pid, signal.SIGTERM)  # the trainers ignore it: the agent waits out the grace
    time.sleep(1.0)
    assert run.proc.poll() is None
    _without_keeper(run)
    _kill_and_check(run)
    assert not run.events("orphans_stopped"), output(run)


def test_sigkill_of_a_cold_started_run_with_the_keeper_gone(
    tmp_path: Path, runs: list[Run]
) -> None:
    run = start_run(
        tmp_path / "run",
        ["--cold-start"],
        ["--steps", "100000", "--every", "2", "--helpers", "2"],
    )
    runs.append(run)
    run.wait_for("checkpoint", 90)
    _wait_until(lambda: len(run.processes()) >= 6, 30, "every helper to start")
    _without_keeper(run)
    _kill_and_check(run)
    assert not run.events("orphans_stopped"), output(run)


# -- programs started with an environment of their own ----------------------------------------
# The reported case: `subprocess.Popen(["sleep", ...], env={"PATH": ...})` from a trainer carries
# no token and has no parent-death signal: it outlived a SIGKILL of the agent, and even a normal
# end (exit 75, alive 8 s later). The trainers run in sessions of the run's own, and the keeper
# ends what is left in those sessions.


def _alive(pid: int, record: str) -> bool:
    """Whether ``pid`` is still a child the trainer recorded in the file named ``record``."""
    tag = "0." + record.rsplit("-", 1)[1]
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return tag.encode() in cmd and state != "Z"


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Path]:
    """The file the trainer records its clean-environment children in; any left are killed."""
    record = tmp_path / f"children-{uuid.uuid4().int % 10**12}"
    yield record
    if record.exists():
        for pid in map(int, record.read_text().split()):
            if _alive(pid, record.name):
                os.kill(pid, signal.SIGKILL)


def _started_children(run: Run, record: Path) -> list[int]:
    _wait_until(lambda: record.exists() and len(record.read_text().split()) >= 3, 60, "children")
    pids = [int(p) for p in record.read_text().split()]
    dead = [pid for pid in pids if not _alive(pid, record.name)]
    assert not dead, (dead, [e["event"] for e in run.events()], output(run)[-3000:])
    return pids


def _children_gone_within(record: Path, pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(_alive(pid, record.name) for pid in pids):
        left = [pid for pid in pids if _alive(pid, record.name)]
        assert time.monotonic() < deadline, f"still running {seconds} s after the agent: {left}"
        time.sleep(0.02)


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_sigkill_leaves_no_program_started_with_an_environment_of_its_own(
    tmp_path: Path, runs: list[Run], children: Path, start: str
) -> None:
    run = start_run(
        tmp_path / "run",
        ["--cold-start"] if start == "cold" else [],
        ["--steps", "100000", "--every", "2", "--clean-env-children", str(children)],
    )
    runs.append(run)
    pids = _started_children(run, children)
    run.wait_for("checkpoint", 90)
    os.kill(run.pid, signal.SIGKILL)
    run.wait(timeout=10)
    _children_gone_within(children, pids, WITHIN_S)
    assert not gone_within(run, WITHIN_S)
    _wait_until(lambda: run.events("orphans_stopped"), 10, "the keeper's report")
    killed = {p["pid"] for e in run.events("orphans_stopped") for p in e["processes"]}
    assert set(pids) <= killed


@pytest.mark.parametrize("end", ["finished", "preempted"])
def test_a_normal_end_leaves_no_program_started_with_an_environment_of_its_own(
    tmp_path: Path, runs: list[Run], children: Path, end: str
) -> None:
    steps = "12" if end == "finished" else "100000"
    run = start_run(
        tmp_path / "run",
        [],
        ["--steps", steps, "--every", "4", "--clean-env-children", str(children)],
    )
    runs.append(run)
    pids = _started_children(run, children)
    if end == "preempted":
        run.wait_for("checkpoint", 90)
        os.kill(run.pid, signal.SIGTERM)
    code = run.wait(timeout=90)
    assert code == (0 if end == "finished" else 75), output(run)
    # the keeper gives the run's own processes up to 2 s to exit by themselves first
    _children_gone_within(children, pids, 2 + WITHIN_S)
    _wait_until(lambda: run.events("orphans_stopped"), 10, "the keeper's report")
    [stopped] = run.events("orphans_stopped")
    assert stopped["agent_ended"] == "normally"
    assert set(pids) <= {p["pid"] for p in stopped["processes"]}


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_a_failed_attempts_programs_are_gone_before_the_next_attempt(
    tmp_path: Path, runs: list[Run], children: Path, start: str
) -> None:
    """What a trainer started with an environment of its own, which no parent-death signal
    reaches, used to run on beside every later attempt until the run ended."""
    run = start_run(
        tmp_path / "run",
        (["--cold-start"] if start == "cold" else []) + ["--max-restarts", "2"],
        # 150 steps: the second attempt trains ~145 steps (seconds), long past the check that
        # the run is still going right after the restart
        ["--steps", "150", "--every", "4", "--fail-at", "6", "--fail-rank", "0",
         "--fail-attempts", "1", "--clean-env-children", str(children)],
    )  # fmt: skip
    runs.append(run)
    pids = _started_children(run, children)
    run.wait_for("restart", 90)
    _children_gone_within(children, pids, WITHIN_S)
    assert run.proc.poll() is None, "ended with the run, not at the restart"
    [stopped] = run.events("leftovers_stopped")
    assert set(pids) <= set(stopped["pids"]) and stopped["attempt"] == 0
    assert run.wait(timeout=120) == 0, output(run)
