"""The goodput ledger: exact arithmetic on hand-written event logs (each one a small story told
in the comments: what the trainers did and when), robustness to partial logs, and one real run
under ``crashproof run`` with a rank killed."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crashproof.telemetry import Ledger, compute_ledger, read_events, read_ledger
from tests.conftest import EXAMPLES

Event = dict[str, Any]
PARTS = ("checkpoint_s", "lost_s", "detect_s", "restart_s", "restore_s", "other_s")


def sup(ts: float, event: str, **fields: Any) -> Event:
    return {"ts": ts, "event": event, "node": "vm", "agent_pid": 7, **fields}


def trainer(ts: float, event: str, attempt: int, **fields: Any) -> Event:
    return {"ts": ts, "event": event, "rank": 0, "restart": attempt, "pid": 100 + attempt, **fields}


def starts(ts: float, attempt: int) -> list[Event]:
    return [
        sup(ts, "rank_start", rank=r, local_rank=r, world_size=2, pid=100 + attempt + 50 * r,
            restart=attempt, start_s=0.5)
        for r in (0, 1)
    ]  # fmt: skip


def progress(ts: float, attempt: int, step: int, since: int, step_time: float) -> Event:
    return trainer(ts, "progress", attempt, step=step, since_step=since, step_time_s=step_time)


def ckpt(ts: float, attempt: int, step: int, blocking: float) -> Event:
    return trainer(ts, "checkpoint", attempt, step=step, path=f"c/{step}", blocking_s=blocking,
                   persist_s=0.05, bytes=1000)  # fmt: skip


def success(ts: float) -> list[Event]:
    return [sup(ts, "rank_exit", rank=r, exitcode=0) for r in (0, 1)]


def run_end(ts: float, outcome: str = "succeeded", restarts: int = 0) -> Event:
    return sup(ts, "run_end", outcome=outcome, exitcode=0, restarts=restarts, seconds=0.0)


def run_start(ts: float) -> Event:
    return sup(ts, "run_start", run_id="r1", script="train.py", nproc_per_node=2, nnodes="1:1")


# Steps take 0.5 s; checkpoints every 10 steps pause training 0.5 s, right after their step.
NO_FAILURE = [
    run_start(1000.0),
    *starts(1002.0, 0),
    progress(1008.0, 0, 10, 1, 0.5),  # step 1 finished at 1003.5: training began at 1003
    ckpt(1008.6, 0, 10, 0.5),
    progress(1013.5, 0, 20, 10, 0.55),  # 10 steps and one pause
    ckpt(1014.1, 0, 20, 0.5),
    *success(1015.0),
    run_end(1015.5),
]

ONE_KILL = [
    run_start(1000.0),
    *starts(1002.0, 0),
    progress(1008.0, 0, 10, 1, 0.5),
    ckpt(1008.6, 0, 10, 0.5),
    progress(1013.5, 0, 20, 10, 0.55),
    ckpt(1014.1, 0, 20, 0.5),
    # step 25 finished at 1016.5 (a pause and 5 steps after 1013.5); rank 1 is killed
    sup(1017.0, "rank_exit", rank=1, pid=151, exitcode=-9, signal="SIGKILL", error=None,
        first=True, step=25),
    sup(1017.0, "rank_exit", rank=0, pid=100, exitcode=1, signal=None, error="peer gone",
        first=False, step=25),
    sup(1017.5, "restart", restart=1, reason="killed by SIGKILL", remaining_restarts=2,
        stop_s=0.4, detect_s=0.1, backoff_s=0.0),  # noticed at 1017.0, stopping from 1017.1
    *starts(1019.0, 1),
    trainer(1021.0, "restore", 1, step=20, source="c/20", seconds=1.0),
    progress(1026.0, 1, 30, 21, 0.5),
    ckpt(1026.6, 1, 30, 0.5),
    progress(1031.5, 1, 40, 30, 0.55),
    ckpt(1032.1, 1, 40, 0.5),
    *success(1033.0),
    run_end(1033.5, restarts=1),
]  # fmt: skip

FAIL_BEFORE_CHECKPOINT = [
    run_start(1000.0),
    *starts(1001.0, 0),
    progress(1004.0, 0, 6, 1, 0.5),  # training began at 1001
    sup(1006.0, "rank_exit", rank=0, pid=100, exitcode=3, signal=None, error="boom",
        first=True, step=8),  # step 8 finished at 1005
    sup(1006.3, "restart", restart=1, reason="exit code 3: boom", remaining_restarts=2,
        stop_s=0.2, detect_s=0.1, backoff_s=0.0),
    *starts(1007.0, 1),  # no checkpoint: starts again from step 0, at 1007.5
    progress(1010.0, 1, 5, 1, 0.5),
    progress(1012.5, 1, 10, 5, 0.5),
    ckpt(1012.6, 1, 10, 0.2),
    *success(1013.0),
    run_end(1013.2, restarts=1),
]  # fmt: skip

HANG = [
    run_start(1000.0),
    *starts(1001.0, 0),
    progress(1006.0, 0, 10, 1, 0.5),
    ckpt(1006.1, 0, 10, 0.0),
    # step 12 finished at 1007; rank 1 stops; the supervisor sees it at 1011 (silent 4 s),
    # dumps stacks until 1011.5 and logs the hang then
    sup(1011.5, "hang", rank=1, pid=151, step=12, phase="step", silent_s=4.0, timeout_s=3.0,
        process_state="T", stacks=None),
    sup(1011.8, "restart", restart=1, reason="hang: silent for 4.0 s in phase step",
        remaining_restarts=1, stop_s=0.3, detect_s=0.5, backoff_s=0.0),
    *starts(1012.5, 1),
    trainer(1013.5, "restore", 1, step=10, source="c/10", seconds=0.5),
    progress(1018.5, 1, 20, 11, 0.5),
    *success(1019.0),
    run_end(1019.5, restarts=1),
]  # fmt: skip

ROLLBACK = [
    run_start(1000.0),
    *starts(1001.0, 0),
    progress(1006.0, 0, 10, 1, 0.5),
    ckpt(1006.1, 0, 10, 0.0),
    progress(1008.0, 0, 14, 10, 0.5),
    # step 15's loss is NaN (computed by 1008.5): back to step 10, restored by 1009
    trainer(1009.0, "restore", 0, step=10, source="c/10", seconds=0.5),
    *[
        {**trainer(1009.01, "numerics_rollback", 0, step=15, kind="nonfinite", rolled_back_to=10,
                   first_step=15, skipped=[[0, 224, 240]]), "rank": r}
        for r in (0, 1)
    ],
    progress(1014.0, 0, 20, 11, 0.5),
    *success(1014.5),
    run_end(1015.0),
]  # fmt: skip

PREEMPTED_AND_RELAUNCHED = [
    run_start(1000.0),
    *starts(1001.0, 0),
    progress(1006.0, 0, 10, 1, 0.5),
    sup(1006.2, "notice", source="SIGUSR1", signal="SIGUSR1"),
    # step 12 finished at 1007; its emergency checkpoint takes 0.4 s
    ckpt(1007.4, 0, 12, 0.1),
    trainer(1007.4, "emergency_checkpoint", 0, source="SIGUSR1", step=12, seconds=0.4,
            saved=True),
    sup(1007.6, "rank_exit", rank=0, pid=100, exitcode=75, signal=None, error=None, first=True,
        step=12),
    sup(1007.6, "preempted", rank=0, step=12, source="SIGUSR1"),
    run_end(1008.0, outcome="preempted"),
    # launched again 92 s later
    run_start(1100.0),
    *starts(1101.0, 0),
    trainer(1103.0, "restore", 0, step=12, source="c/12", seconds=1.0),
    progress(1107.0, 0, 20, 13, 0.5),
    *success(1107.5),
    run_end(1108.0),
]  # fmt: skip


def parts(ledger: Ledger) -> dict[str, float]:
    return {k: round(v, 9) for k, v in ledger.to_json()["breakdown"].items()}


def assert_adds_up(ledger: Ledger) -> None:
    total = ledger.productive_s + sum(getattr(ledger.breakdown, k) for k in PARTS)
    assert math.isclose(total, ledger.wall_s, rel_tol=1e-9, abs_tol=1e-6), (total, ledger)
    assert ledger.productive_s >= 0 and all(getattr(ledger.breakdown, k) >= 0 for k in PARTS)
    assert 0 <= ledger.ettr <= 1


def test_a_run_without_failures_is_productive_except_for_start_up_pauses_and_shutdown() -> None:
    ledger = compute_ledger(NO_FAILURE)
    assert ledger.wall_s == pytest.approx(15.5)
    assert ledger.productive_s == pytest.approx(10.0)  # 20 steps of 0.5 s
    assert parts(ledger) == pytest.approx(
        {"checkpoint_s": 1.0, "lost_s": 0.0, "detect_s": 0.0, "restart_s": 0.0,
         "restore_s": 0.0, "other_s": 3.0 + 1.0 + 0.5}  # start-up, after step 20, run_end
    )  # fmt: skip
    assert ledger.ettr == pytest.approx(10.0 / 15.5)
    assert ledger.failures == () and ledger.restarts == 0
    assert ledger.final_step == 20 and ledger.outcome == "succeeded"
    assert_adds_up(ledger)


def test_a_killed_rank_costs_the_steps_since_the_checkpoint_detection_restart_and_restore() -> None:
    ledger = compute_ledger(ONE_KILL)
    assert ledger.wall_s == pytest.approx(33.5)
    assert ledger.productive_s == pytest.approx(20.0)  # 40 kept steps of 0.5 s
    assert parts(ledger) == pytest.approx(
        {"checkpoint_s": 2.0, "lost_s": 2.5, "detect_s": 0.5 + 0.1, "restart_s": 2.9,
         "restore_s": 1.0, "other_s": 4.5}
    )  # fmt: skip
    assert_adds_up(ledger)
    [failure] = ledger.failures
    assert (failure.rank, failure.kind, failure.reason) == (1, "killed", "killed by SIGKILL")
    assert failure.ts == pytest.approx(1017.0)
    assert (failure.step_reached, failure.step_restored, failure.lost_steps) == (25, 20, 5)
    assert failure.lost_s == pytest.approx(5 * 0.5)  # lost steps x the step time then
    assert failure.detect_s == pytest.approx(0.6)
    assert failure.restart_s == pytest.approx(2.9)  # stop, start, trainer start-up
    assert failure.restore_s == pytest.approx(1.0)
    assert ledger.restarts == 1 and ledger.final_step == 40


def test_a_failure_before_the_first_checkpoint_loses_every_step_computed() -> None:
    ledger = compute_ledger(FAIL_BEFORE_CHECKPOINT)
    [failure] = ledger.failures
    assert (failure.kind, failure.step_reached, failure.step_restored) == ("crash", 8, 0)
    assert failure.lost_steps == 8 and failure.lost_s == pytest.approx(4.0)
    assert "exit code 3" in failure.reason
    assert ledger.productive_s == pytest.approx(5.0)  # only the 10 steps of the second attempt
    assert parts(ledger) == pytest.approx(
        {"checkpoint_s": 0.2, "lost_s": 4.0, "detect_s": 1.1, "restart_s": 1.4,
         "restore_s": 0.0, "other_s": 1.5}
    )  # fmt: skip
    assert_adds_up(ledger)


def test_a_hang_is_detection_time_from_its_last_step_to_the_supervisor_stopping_it() -> None:
    ledger = compute_ledger(HANG)
    [failure] = ledger.failures
    assert (failure.kind, failure.rank, failure.step_reached, failure.lost_steps) == (
        "hang", 1, 12, 2
    )  # fmt: skip
    assert failure.detect_s == pytest.approx(4.0 + 0.5)
    assert parts(ledger) == pytest.approx(
        {"checkpoint_s": 0.0, "lost_s": 1.0, "detect_s": 4.5, "restart_s": 1.5,
         "restore_s": 0.5, "other_s": 2.0}
    )  # fmt: skip
    assert ledger.productive_s == pytest.approx(10.0)
    assert_adds_up(ledger)


def test_a_numerics_rollback_loses_the_steps_after_its_checkpoint_without_a_restart() -> None:
    ledger = compute_ledger(ROLLBACK)
    [failure] = ledger.failures
    assert (failure.kind, failure.step_reached, failure.step_restored) == ("numerics", 15, 10)
    assert failure.lost_steps == 5 and failure.lost_s == pytest.approx(2.5)
    assert failure.restore_s == pytest.approx(0.5) and failure.restart_s == 0.0
    assert ledger.productive_s == pytest.approx(10.0) and ledger.restarts == 0
    assert ledger.breakdown.other_s == pytest.approx(2.0)
    assert [m.kind for m in ledger.markers].count("rollback") == 1  # every rank logs it
    assert_adds_up(ledger)


def test_a_preempted_run_launched_again_loses_nothing_but_its_downtime() -> None:
    ledger = compute_ledger(PREEMPTED_AND_RELAUNCHED)
    [failure] = ledger.failures
    assert (failure.kind, failure.step_reached, failure.step_restored) == ("preempted", 12, 12)
    assert failure.lost_steps == 0 and failure.lost_s == 0.0
    assert ledger.wall_s == pytest.approx(108.0) and ledger.restarts == 1
    assert parts(ledger) == pytest.approx(
        {"checkpoint_s": 0.4, "lost_s": 0.0, "detect_s": 0.2, "restart_s": 0.4 + 92.0 + 2.0,
         "restore_s": 1.0, "other_s": 2.0}  # the emergency save counted once, not twice
    )  # fmt: skip
    assert ledger.productive_s == pytest.approx(10.0)
    assert_adds_up(ledger)


def test_a_torn_last_line_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in ONE_KILL) + '{"ts": 1040.0, "event": "progr'
    )
    assert (
        read_ledger(tmp_path).to_json() == compute_ledger(ONE_KILL, run_dir=str(tmp_path)).to_json()
    )


def test_a_rank_ended_after_it_was_done_is_no_failure() -> None:
    # rank 1 closed its manager after step 20 but did not exit: the supervisor ended it
    events = [
        *NO_FAILURE[:-3],
        sup(1014.8, "done_hang", rank=1, pid=150, step=20, silent_s=0.7, timeout_s=0.5),
        sup(1015.0, "rank_exit", rank=0, exitcode=0),
        sup(1015.0, "rank_exit", rank=1, exitcode=-9, ended_after_done=True),
        run_end(1015.5),
    ]
    ledger = compute_ledger(events)
    assert ledger.failures == () and ledger.outcome == "succeeded"
    assert parts(ledger) == parts(compute_ledger(NO_FAILURE))
    assert_adds_up(ledger)


def test_the_keepers_report_after_the_run_ended_is_no_time_of_the_run() -> None:
    """The keeper logs leftover processes it stopped after the agent exited, past ``run_end``:
    the run's wall time is still the one ``run_end`` reports; without a ``run_end`` (the agent
    died) the report is the launch's last word and counts."""
    orphans = sup(1016.3, "orphans_stopped", agent_ended="normally", processes=[])
    ledger = compute_ledger([*NO_FAILURE, orphans])
    assert ledger.wall_s == pytest.approx(15.5) and ledger.outcome == "succeeded"
    assert_adds_up(ledger)
    died = compute_ledger([*NO_FAILURE[:-1], {**orphans, "agent_ended": "died"}])
    assert died.wall_s == pytest.approx(16.3)
    assert_adds_up(died)


def test_a_run_still_going_ends_at_its_last_event() -> None:
    ledger = compute_ledger(NO_FAILURE[:-3])  # no exits, no run_end
    assert ledger.outcome is None
    assert ledger.wall_s == pytest.approx(14.1)
    assert ledger.productive_s == pytest.approx(10.0)
    assert ledger.failures == ()
    assert_adds_up(ledger)


def test_a_run_that_ran_out_of_restarts_loses_what_its_last_checkpoint_does_not_hold() -> None:
    events = [*ONE_KILL[:8], run_end(1018.0, outcome="restart budget spent")]
    ledger = compute_ledger(events)
    [failure] = ledger.failures
    assert (failure.step_reached, failure.step_restored, failure.lost_steps) == (25, None, 5)
    assert ledger.outcome == "restart budget spent" and ledger.final_step == 20
    assert_adds_up(ledger)


def test_the_json_has_the_documented_keys_and_serialises() -> None:
    data = json.loads(json.dumps(compute_ledger(ONE_KILL).to_json()))
    assert {"ettr", "wall_s", "productive_s", "breakdown", "failures", "restarts"} <= data.keys()
    assert set(data["breakdown"]) == set(PARTS)
    assert data["failures"][0]["step_reached"] == 25
    assert {p["source"] for p in data["timeline"]} >= {"progress", "restore", "rank_exit"}
    assert {m["kind"] for m in data["markers"]} == {"failure", "restart", "checkpoint", "restore"}


def test_no_events_is_an_empty_ledger_and_no_log_names_the_missing_file(tmp_path: Path) -> None:
    assert compute_ledger([]).wall_s == 0 and compute_ledger([]).ettr == 0
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "events.jsonl")):
        read_ledger(tmp_path)


STORIES = [NO_FAILURE, ONE_KILL, FAIL_BEFORE_CHECKPOINT, HANG, ROLLBACK, PREEMPTED_AND_RELAUNCHED]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STORIES).flatmap(lambda s: st.lists(st.sampled_from(s), max_size=len(s))))
def test_any_part_of_a_log_still_adds_up(events: list[Event]) -> None:
    """Lines lost, duplicated or out of order: never a crash, never a negative part."""
    assert_adds_up(compute_ledger(events))


# -- a real run --------------------------------------------------------------------------------

EVERY = 20


def _events(path: Path) -> list[Event]:
    return list(read_events(path)) if path.exists() else []


@pytest.mark.timeout(120)
def test_a_real_run_with_a_killed_rank_has_one_failure_and_adds_up(tmp_path: Path) -> None:
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2",
        "--max-restarts", "3", "--run-dir", str(run), str(EXAMPLES / "train_tiny.py"), "--",
        "--run-dir", str(run), "--steps", "300", "--every", str(EVERY), "--sync",
        "--workers", "0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CRASHPROOF_PROGRESS_INTERVAL_S": "0.25"}
    log = tmp_path / "output.log"
    with open(log, "w") as output:
        proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    try:
        victim = None
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            events = _events(run / "events.jsonl")
            if any(e["event"] == "checkpoint" and e["step"] >= 3 * EVERY for e in events):
                victim = next(e for e in events if e["event"] == "rank_start" and e["rank"] == 1)
                os.kill(victim["pid"], signal.SIGKILL)
                break
            time.sleep(0.02)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert victim is not None, f"the run ended before the kill:\n{out[-3000:]}"
    assert proc.returncode == 0, out[-3000:]

    ledger = read_ledger(run)
    assert_adds_up(ledger)
    events = _events(run / "events.jsonl")
    [end] = [e for e in events if e["event"] == "run_end"]
    assert ledger.wall_s == pytest.approx(end["seconds"], abs=0.05)
    assert 0 < ledger.ettr < 1
    [failure] = ledger.failures
    assert (failure.kind, failure.rank) == ("killed", 1) and "SIGKILL" in failure.reason
    [restore] = [e for e in events if e["event"] == "restore"]
    assert failure.step_restored == restore["step"] and restore["step"] % EVERY == 0
    assert failure.step_reached >= 3 * EVERY
    assert 0 <= failure.lost_steps <= EVERY
    assert failure.lost_steps == failure.step_reached - failure.step_restored
    assert failure.lost_s > 0 or failure.lost_steps == 0
    assert failure.detect_s > 0 and failure.restart_s > 0 and failure.restore_s > 0
    assert ledger.restarts == 1 and ledger.final_step == 300 and ledger.outcome == "succeeded"
    assert {p.attempt for p in ledger.timeline} == {0, 1}
