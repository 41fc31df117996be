"""Promise: a trainer that hangs after it is done is still watched.

Found once in ~13 launches: after ``ckpt.close()`` rank 1 deadlocked in gloo's process-group
destructor at interpreter exit; the supervisor no longer watched a "done" trainer and the run
hung forever. The done phase has its own allowance (``--done-timeout``): a trainer that closed
its manager (its work is committed) and does not exit within it is ended, reported with a
``done_hang`` event (and its stacks), and the run ends as it would have: 0 when every rank's
work was committed. Work after close that keeps beating is not ended.
"""

from __future__ import annotations

from pathlib import Path

from crashproof.link._heartbeat import Heartbeat
from crashproof.supervisor._hang import HangConfig, HangDetector
from tests.supervisor._runs import Run, output, start_run


def test_the_done_phase_has_its_own_allowance() -> None:
    detector = HangDetector(HangConfig(done_timeout_s=5, step_timeout_s=1000))
    done = Heartbeat(pid=1, step=40, beat_s=0.0, phase="done", phase_started_s=0.0, max_gap_s=0)
    assert detector.check(done, now_s=4.9) is None
    verdict = detector.check(done, now_s=5.1)
    assert verdict is not None and verdict.phase == "done" and verdict.timeout_s == 5
    assert verdict.step == 40


def test_a_rank_that_never_exits_after_close_is_ended_and_the_run_succeeds(
    tmp_path: Path, runs: list[Run]
) -> None:
    run = start_run(
        tmp_path / "run",
        ["--done-timeout", "2", "--max-restarts", "3"],
        ["--steps", "6", "--every", "3", "--hang-after-close", "1"],
    )
    runs.append(run)
    code = run.wait(timeout=90)  # before the fix: forever
    text = output(run)
    assert code == 0, text
    # rank 0 may wait for rank 1 in its own process-group teardown: then it is ended too
    hangs = {e["rank"]: e for e in run.events("done_hang")}
    hang = hangs[1]
    assert hang["step"] == 6 and hang["silent_s"] >= 2 and hang["past_timeout"]
    assert hang["stacks"] and "trainer.py" in Path(hang["stacks"]).read_text()
    exits = {e["rank"]: e for e in run.events("rank_exit")}
    assert exits[1]["ended_after_done"] and exits[1]["exitcode"] == -9
    assert exits[0]["exitcode"] == 0 or exits[0]["ended_after_done"]
    assert not run.events("restart") and not run.events("hang")  # no failure, no restart
    assert [e["step"] for e in run.events("checkpoint")] == [3, 6]  # the work was committed
    assert run.events("run_end")[0]["outcome"] == "succeeded"
    assert hang["silent_s"] < 20  # ended soon after its 2 s allowance, whatever the load


def test_every_rank_hanging_after_close_is_ended(tmp_path: Path, runs: list[Run]) -> None:
    run = start_run(
        tmp_path / "run",
        ["--done-timeout", "2", "--cold-start"],
        ["--steps", "4", "--every", "2", "--hang-after-close", "all"],
    )
    runs.append(run)
    code = run.wait(timeout=90)
    assert code == 0, output(run)
    assert sorted(e["rank"] for e in run.events("done_hang")) == [0, 1]
    assert not run.events("restart")


def test_work_after_close_that_keeps_beating_is_not_ended(tmp_path: Path, runs: list[Run]) -> None:
    run = start_run(
        tmp_path / "run",
        ["--done-timeout", "1"],
        ["--steps", "4", "--every", "2", "--work-after-close", "3"],
    )
    runs.append(run)
    code = run.wait(timeout=90)
    text = output(run)
    assert code == 0, text
    assert not run.events("done_hang")
    assert "rank 1 finished at step 4" in text and "rank 0 finished at step 4" in text
