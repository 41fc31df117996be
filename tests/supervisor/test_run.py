"""``crashproof run`` end to end: real agents, real trainer processes, gloo, real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from crashproof.supervisor.launch import (
    DEFAULT_METRICS_PORT,
    EXIT_BUDGET_SPENT,
    EXIT_CRASH_LOOP,
    EXIT_PREEMPTED,
)
from crashproof.telemetry import compute_ledger, read_events

TRAINER = Path(__file__).with_name("trainer.py")


def _command(run_dir: Path, options: list[str], script_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "crashproof.cli",
        "run",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(run_dir),
        *options,
        str(TRAINER),
        "--ckpt",
        str(run_dir / "ckpt"),
        *script_args,
    ]


def crashproof_run(
    run_dir: Path, options: list[str], script_args: list[str], timeout: float = 120
) -> tuple[int, list[dict[str, Any]], str]:
    proc = subprocess.run(
        _command(run_dir, options, script_args),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    events = list(read_events(run_dir / "events.jsonl"))
    return proc.returncode, events, proc.stdout + proc.stderr


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def test_a_run_without_failures_finishes_with_zero_and_logs_its_events(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the metrics server does
    deadline = time.monotonic() + 120
    while True:  # hold the default metrics port: another test's run may hold it for a while
        try:
            holder.bind(("127.0.0.1", DEFAULT_METRICS_PORT))
            holder.listen()
            break
        except OSError:
            assert time.monotonic() < deadline, f"port {DEFAULT_METRICS_PORT} never came free"
            time.sleep(0.05)
    with holder:
        code, events, output = crashproof_run(
            tmp_path, ["--quiet"], ["--steps", "12", "--exit-zero"]
        )
    assert code == 0, output
    # the default port was taken: a free one instead, said and recorded
    assert f"metrics port {DEFAULT_METRICS_PORT} is taken" in output
    assert not events[0]["metrics_url"].endswith(f":{DEFAULT_METRICS_PORT}/metrics")
    # --quiet: no INFO lines of its own, and a one-line outcome instead of the summary block
    assert "[crashproof run] INFO" not in output and "summary" not in output
    assert "crashproof run: succeeded (exit 0); ETTR " in output
    assert f"the report: crashproof report {tmp_path}" in output
    kinds = [e["event"] for e in events]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert events[-1]["outcome"] == "succeeded"
    assert len(of(events, "rank_start")) == 2
    assert {e["rank"] for e in of(events, "rank_exit")} == {0, 1}
    assert [e["step"] for e in of(events, "checkpoint")] == [5, 10]
    assert all(e["bytes"] > 0 and e["persist_s"] >= 0 for e in of(events, "checkpoint"))
    # bytes: the whole checkpoint, both ranks' files (what the manifest lists)
    last = of(events, "checkpoint")[-1]
    manifest = json.loads((Path(last["path"]) / "manifest.json").read_text())
    assert last["bytes"] == sum(f["size"] for f in manifest["files"].values())
    assert {n for n in manifest["files"] if n.startswith("rank_00001")}  # rank 1's are counted
    # every rank's output is on the console, prefixed, and in the run directory
    assert "[rank 0] rank 0 finished at step 12" in output
    assert "[rank 1] rank 1 finished at step 12" in output
    logs = list((tmp_path / "logs").rglob("stdout.log"))
    assert any("rank 1 finished" in p.read_text() for p in logs)


def test_a_failed_rank_is_restarted_and_the_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    code, events, output = crashproof_run(
        tmp_path,
        [],  # restarts are on by default
        # rank 0 is busy for 60 s when rank 1 fails: it would notice only at its next collective
        ["--steps", "20", "--fail-at", "12", "--fail-attempts", "1", "--peer-busy-s", "60"],
    )
    assert code == 0, output
    # the console tells the story, a line per event, in order, each beginning with its word
    story = [
        line.split("] ", 1)[1]
        for line in output.splitlines()
        if line.startswith("[crashproof run]")
        and "Prometheus" not in line
        and "metrics port" not in line  # another test on this machine may hold 29600
    ]
    assert story[0].startswith("ERROR failure: rank 1 (pid "), story
    assert "exit code 3 after step 12: rank 1 fails after step 12; seen " in story[0]
    assert story[1] == "WARNING peers stopped: rank 0 (SIGKILL: they cannot go on without rank 1)"
    assert story[2].startswith("WARNING restarting: attempt 1 (29 restarts left of 30 restarts")
    # (the asynchronous saves' snapshots are in the agent's memory: no disk read)
    assert story[3].startswith("INFO restored: step 10 from the agent's memory in "), story
    assert story[3].endswith("2 steps of work lost (reached step 12)"), story
    assert len(story) == 4, story
    # and ends with a summary whose figures are the report's
    summary = output[output.index("crashproof run: summary") :].splitlines()
    rows = dict(line.strip().split("  ", 1) for line in summary[1:] if line.startswith("  "))
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["outcome"] == "succeeded (exit 0)"
    assert rows["attempts"] == "2 (1 restart)" and rows["failures"] == "1: crash 1"
    assert rows["steps lost"] == "2" and rows["final step"] == "20"
    # what the summary read: the log up to the run's end (a late line may follow it)
    end = next(i for i, e in enumerate(events) if e["event"] == "run_end")
    ledger = compute_ledger(events[: end + 1])
    assert rows["ETTR"].startswith(f"{ledger.ettr:.1%} ")
    assert rows["events"] == str(tmp_path / "events.jsonl")
    assert rows["logs"] == str(tmp_path / "logs") and rows["stack dumps"] == "none"
    assert rows["report"].startswith(f"crashproof report {tmp_path}")
    exits = of(events, "rank_exit")
    assert exits[0]["rank"] == 1 and exits[0]["exitcode"] == 3
    assert "fails after step 12" in (exits[0]["error"] or "")
    assert exits[0]["first"] and not exits[0]["stopped"]
    # the supervisor did not wait for rank 0 to find out: it SIGKILLed it at once
    assert (exits[1]["rank"], exits[1]["exitcode"], exits[1]["stopped"]) == (0, -9, True)
    assert exits[1]["error"] is None  # no error of its own
    # seconds after rank 1's exit, not the 60 s rank 0 was busy for (nor torch's 30 s grace);
    # judged on the event log's clock, which a loaded machine stretches far less than the run
    assert exits[1]["ts"] - exits[0]["ts"] < 15, output
    [restart] = of(events, "restart")
    assert restart["restart"] == 1
    [restore] = of(events, "restore")
    assert restore["step"] == 10 and restore["restart"] == 1
    assert "attempt 1 starts at step 10" in output
    # the exit was noticed at the next monitor poll (0.1 s), far within 0.5 s of the trainer's exit
    assert restart["detect_s"] < 0.5


def test_a_rank_failing_at_the_same_step_every_time_is_a_crash_loop(tmp_path: Path) -> None:
    code, events, output = crashproof_run(
        tmp_path, ["--max-restarts", "10"], ["--steps", "30", "--fail-at", "12"]
    )
    assert code == EXIT_CRASH_LOOP, output
    [loop] = of(events, "crash_loop")
    assert loop["rank"] == 1 and loop["step"] == 12 and loop["attempts"] == 3
    assert "exit code 3" in loop["reason"]
    # the first attempt got to step 12 (progress); the next three did not get past it
    assert len(of(events, "rank_start")) == 2 * 4  # four attempts, not eleven
    assert "crash loop" in output and "step 12" in output and "rank 1" in output
    assert of(events, "restart")[-1]["backoff_s"] > 0  # no progress: it backed off


def test_the_restart_budget_is_respected(tmp_path: Path) -> None:
    code, events, output = crashproof_run(
        tmp_path,
        ["--max-restarts", "2"],
        ["--steps", "60", "--fail-at", "7", "--fail-every-attempt"],
    )
    assert code == EXIT_BUDGET_SPENT, output
    [spent] = of(events, "budget_spent")
    assert (spent["rank"], spent["step"], spent["restarts"], spent["max_restarts"]) == (1, 17, 2, 2)
    assert "ERROR budget spent: 2 restarts already within the window (2 restarts per 1 h)" in output
    assert "outcome      restart budget spent (exit 76)" in output
    assert not of(events, "crash_loop")  # it progressed each time: not a loop
    assert len(of(events, "rank_start")) == 2 * 3  # the first attempt and two restarts
    assert [e["step"] for e in of(events, "restore")] == [5, 10]
    assert "restarts are used" in output


def test_the_restart_budget_counts_only_the_restarts_within_its_window(tmp_path: Path) -> None:
    # one restart per half second: each attempt lasts longer than that (7 steps of 0.1 s of
    # sleep each, at least 0.7 s, before its failure), so three failures that each made progress
    # are all restarted; torchrun's lifetime count of one would stop at the second
    code, events, output = crashproof_run(
        tmp_path,
        ["--max-restarts", "1", "--restart-window", "0.5s"],
        ["--steps", "20", "--fail-at", "7", "--fail-every-attempt", "--step-s", "0.1"],
    )
    assert code == 0, output
    assert [e["restart"] for e in of(events, "restart")] == [1, 2, 3]
    assert all(e["remaining_restarts"] == 0 for e in of(events, "restart"))
    assert events[0]["max_restarts"] == 1 and events[0]["restart_window_s"] == 0.5
    assert not of(events, "budget_spent")


def test_a_hung_rank_is_detected_its_stacks_dumped_and_the_run_recovers(tmp_path: Path) -> None:
    code, events, output = crashproof_run(
        tmp_path,
        ["--max-restarts", "2", "--hang-timeout", "2"],
        ["--steps", "20", "--stop-at", "8", "--stop-rank", "0"],
    )
    assert code == 0, output
    hangs = of(events, "hang")
    assert hangs, output
    stopped = [h for h in hangs if h["rank"] == 0]
    assert stopped and stopped[0]["process_state"] == "T"  # SIGSTOP: the kernel says "stopped"
    assert stopped[0]["silent_s"] > 2 and stopped[0]["phase"] == "step"
    # both ranks fell silent (rank 1 waits in a collective); the one that stopped is blamed
    assert [h["rank"] for h in hangs if h["blamed"]] == [0]
    assert "ERROR hang: rank 0 (pid " in output and "process state T" in output
    # The ledger books the stall, from rank 0's last heartbeat to the verdict, as downtime:
    # not as slow steps (the SIGCONT of the stack dump lets the group finish a few more).
    [failure] = compute_ledger(events).failures
    assert (failure.kind, failure.rank) == ("hang", 0)
    assert "rank 0 silent" in failure.reason
    assert stopped[0]["silent_s"] - 0.5 < failure.detect_s < stopped[0]["silent_s"] + 0.5
    for hang in hangs:
        dump = Path(hang["stacks"])
        text = dump.read_text()
        assert "Most recent call first" in text or "most recent call first" in text
        assert "trainer.py" in text  # the Python stack reaches into the training loop
    # The dump's SIGCONT lets the stopped rank run on for a moment before it is killed.
    assert of(events, "restore")[0]["step"] >= 5
    assert not of(events, "emergency_checkpoint")  # a hang is killed, not asked to checkpoint
    assert "rank 1 finished at step 20" in output


def test_sigterm_to_the_supervisor_stops_the_run_as_resumable(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        _command(tmp_path, [], ["--steps", "100000", "--step-s", "0.01"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        events_file = tmp_path / "events.jsonl"
        while time.monotonic() < deadline:
            if events_file.exists() and of(list(read_events(events_file)), "checkpoint"):
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, out
    end = of(list(read_events(tmp_path / "events.jsonl")), "run_end")[0]
    assert end["outcome"] == "preempted" and end["exitcode"] == EXIT_PREEMPTED


@pytest.mark.parametrize("mode", ["--cold-start", "-m"])
def test_cold_start_and_module_mode_run_like_torchrun(tmp_path: Path, mode: str) -> None:
    options = ["--cold-start"] if mode == "--cold-start" else []
    if mode == "-m":
        command = _command(tmp_path, [], ["--steps", "6"])
        i = command.index(str(TRAINER))
        command[i : i + 1] = ["-m", "tests.supervisor.trainer"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "rank 1 finished at step 6" in proc.stdout + proc.stderr
        return
    code, events, output = crashproof_run(tmp_path, options, ["--steps", "6"])
    assert code == 0, output
    assert events[0]["start_method"] == "exec"  # a fresh `python -u trainer.py` per rank


FACTS = """
import json, logging, multiprocessing, os, signal, sys, torch
import numpy as np
print("FACTS " + json.dumps({
    "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigint": repr(signal.getsignal(signal.SIGINT)),
    "parent": os.getppid(),
    "log_handlers": len(logging.getLogger().handlers),
    "cwd": os.getcwd(),
    "rank": int(os.environ["RANK"]),
    "name": __name__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "start_method": multiprocessing.get_start_method(),
    "torch_seed": torch.initial_seed(),
    "numpy": float(np.random.random()),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigusr1_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
}), flush=True)


import atexit, functools
# says when it is destroyed; nothing of it refers back to these globals (no cycle to wait for
# the garbage collector): it goes the moment they do
destroyed = staticmethod(functools.partial(print, "PROBE destroyed", flush=True))
probe = type("Probe", (), {"__del__": destroyed})()
atexit.register(print, "PROBE exit handlers", flush=True)
if os.environ["RANK"] == "1":
    sys.exit(0)
"""


@pytest.mark.parametrize("cold", [False, True])
def test_a_warm_started_trainer_looks_like_a_fresh_interpreter(tmp_path: Path, cold: bool) -> None:
    script = tmp_path / "facts.py"
    script.write_text(FACTS)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crashproof.cli",
            "run",
            "--nproc-per-node",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            *(["--cold-start"] if cold else []),
            str(script),
            "--flag",
            "value",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        # started as a shell starts a background job, with SIGINT ignored: the trainers still get
        # python's own handler, as torch's agent gives them
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    facts = [
        json.loads(line.split("FACTS ", 1)[1])
        for line in proc.stdout.splitlines()
        if "FACTS " in line
    ]
    assert sorted(f["rank"] for f in facts) == [0, 1]
    for f in facts:
        # what a fresh interpreter takes from its start: OpenMP's threads as torchrun sets them
        # (the warm forkserver is forked from the agent, which loaded torch before they were
        # set), Python's own Ctrl-C, no logging set up, the working directory it was started in
        assert (f["omp"], f["threads"]) == ("1", 1)
        assert f["sigint_default"] and f["log_handlers"] == 0 and f["cwd"] == os.getcwd(), (
            f,  # (with the agent's log: whether the forkserver grew from its seed)
            proc.stderr[-4000:],
        )
        assert f["name"] == "__main__"
        assert f["argv"] == [str(script), "--flag", "value"]
        assert f["path0"] == str(tmp_path)
        assert f["start_method"] == "fork"  # the platform default, not the warm forkserver's
        # the forkserver ignores these (so a signal to the group cannot kill it): not the script
        assert f["sigterm_default"] and f["sigusr1_default"]
    # The script's globals outlive its exit handlers, as python keeps them until it finalizes
    # (torn down earlier, a DDP model's gloo process group could hang the trainer), whether the
    # script ends (rank 0) or calls sys.exit(0) (rank 1).
    for rank in (0, 1):
        said = [
            line for line in proc.stdout.splitlines() if line.startswith(f"[rank {rank}] PROBE")
        ]
        assert said[:1] == [f"[rank {rank}] PROBE exit handlers"], proc.stdout
    # unseeded generators differ between ranks, as in separate fresh interpreters
    assert facts[0]["torch_seed"] != facts[1]["torch_seed"]
    assert facts[0]["numpy"] != facts[1]["numpy"]


def test_the_error_shown_is_the_traceback_s_not_a_warning_logged_after_it() -> None:
    from crashproof.supervisor._trainers import _exception_line

    tail = [
        "step 240",
        "Traceback (most recent call last):",
        '  File "train.py", line 9, in <module>',
        "    ckpt.maybe_save(step, state)",
        "crashproof.errors.CheckpointWriteError: [Errno 5] checkpoint of step 240 was not committed",
        "2026-11-27 11:25:45 crashproof.checkpoint: CheckpointManager(ckpt) was not closed before",
    ]
    assert _exception_line(tail).startswith("crashproof.errors.CheckpointWriteError: [Errno 5]")
    assert _exception_line(["just a line", "the last line"]) == "the last line"
