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


# -- the done phase is final, and a crash on the way out is no failure ---------------------------


def test_nothing_leaves_the_finished_phases(tmp_path: Path) -> None:
    from crashproof.link import HeartbeatWriter, read_heartbeat

    writer = HeartbeatWriter(str(tmp_path / "beat"))
    writer.beat(7)
    writer.set_phase("done")
    for leave in (lambda: writer.beat(8), lambda: writer.set_phase("step"),
                  lambda: writer.restored(3), lambda: writer.set_phase("save")):  # fmt: skip
        leave()
        beat = read_heartbeat(str(tmp_path / "beat"))
        assert beat is not None and beat.phase == "done" and beat.step == 7
    # the script's normal return is the only way on, and nothing leaves it either
    writer.set_phase("exiting")
    for leave in (lambda: writer.beat(8), lambda: writer.set_phase("done"),
                  lambda: writer.restored(3), lambda: writer.set_phase("step")):  # fmt: skip
        leave()
        beat = read_heartbeat(str(tmp_path / "beat"))
        assert beat is not None and beat.phase == "exiting" and beat.step == 7
    writer.close()


def test_a_close_on_the_way_out_of_an_error_is_not_done(tmp_path: Path) -> None:
    from crashproof.link import HeartbeatWriter, SupervisedReporter

    def phase_after_close(exc: BaseException | None) -> str:
        writer = HeartbeatWriter(str(tmp_path / f"beat-{exc!r}"))
        reporter = SupervisedReporter(writer, None, rank=0)
        writer.beat(1)
        try:
            try:
                if exc is not None:
                    raise exc
            finally:
                reporter.closed()
        except BaseException:
            pass
        return writer.phase

    assert phase_after_close(None) == "done"
    assert phase_after_close(SystemExit(0)) == "done"
    assert phase_after_close(RuntimeError("NCCL error")) == "step"
    assert phase_after_close(KeyboardInterrupt()) == "step"
    assert phase_after_close(SystemExit(75)) == "step"  # preempted: the supervisor's to judge


def _finished_without_restart(run: Run, code: int) -> None:
    text = output(run)
    assert code == 0, text
    assert not run.events("restart") and not run.events("hang") and not run.events("crash_loop")
    assert run.events("run_end")[0]["outcome"] == "succeeded", text


def test_a_rank_that_crashes_after_close_is_reported_and_the_run_succeeds(
    tmp_path: Path, runs: list[Run]
) -> None:
    """The reported case: a SIGSEGV after close() (a destructor at exit) ended a finished run as
    a crash loop (three restarts, exit 77)."""
    run = start_run(
        tmp_path / "run",
        ["--max-restarts", "3"],
        ["--steps", "6", "--every", "3", "--after-close", "segv"],
    )
    runs.append(run)
    _finished_without_restart(run, run.wait(timeout=90))
    [crash] = run.events("done_crash")
    assert crash["rank"] == 1 and crash["signal"] == "SIGSEGV" and crash["step"] == 6
    exits = {e["rank"]: e for e in run.events("rank_exit")}
    assert exits[1]["ended_after_done"] and exits[1]["exitcode"] == -11
    assert "rank 1" in output(run) and "SIGSEGV on its way out" in output(run)


def test_every_rank_aborting_after_close_cold_started_is_no_failure(
    tmp_path: Path, runs: list[Run]
) -> None:
    run = start_run(
        tmp_path / "run",
        ["--cold-start"],
        ["--steps", "4", "--every", "2", "--after-close", "abort", "--after-close-rank", "all"],
    )
    runs.append(run)
    _finished_without_restart(run, run.wait(timeout=120))
    # the first to abort is reported; torch may stop the other (done too) before its own abort
    crashes = run.events("done_crash")
    assert crashes and {e["signal"] for e in crashes} == {"SIGABRT"}, crashes
    assert all(e["ended_after_done"] for e in run.events("rank_exit"))


def test_a_crash_after_close_leaves_a_peer_still_working_alone(
    tmp_path: Path, runs: list[Run]
) -> None:
    """torch stops every other trainer when one ends non-zero: rank 0, still working before its
    own close, would be killed and the run restarted. After its close too: its script may still
    export or upload (here 2 s without a beat), and only once the script returned may torch
    stop it (a warm trainer waits for torch to collect its result)."""
    run = start_run(
        tmp_path / "run",
        [],
        ["--steps", "4", "--every", "2", "--after-close", "segv", "--work-before-close", "3",
         "--export-after-close", "2"],
    )  # fmt: skip
    runs.append(run)
    _finished_without_restart(run, run.wait(timeout=90))
    text = output(run)
    assert "rank 0 exported" in text and "rank 0 finished at step 4" in text, text
    exits = {e["rank"]: e for e in run.events("rank_exit")}
    assert exits[1]["ended_after_done"] and exits[1]["exitcode"] == -11
    assert not run.events("done_hang")


def test_a_step_beat_after_close_does_not_make_a_later_hang_a_step_hang(
    tmp_path: Path, runs: list[Run]
) -> None:
    """The reported case: heartbeat(step) after close() put the trainer back in phase "step":
    its hang then cost restarts and ended in a crash loop (exit 77) instead of done_hang."""
    run = start_run(
        tmp_path / "run",
        ["--done-timeout", "2", "--hang-timeout", "2", "--max-restarts", "3"],
        ["--steps", "6", "--every", "3", "--after-close", "beat-step-hang"],
    )
    runs.append(run)
    _finished_without_restart(run, run.wait(timeout=90))
    hang = {e["rank"]: e for e in run.events("done_hang")}[1]
    assert hang["step"] == 6  # the training's last step: the beat after close moved nothing


def test_an_error_that_closes_the_manager_on_its_way_out_is_still_a_failure(
    tmp_path: Path, runs: list[Run]
) -> None:
    """close() in a `finally` (or a `with` block) while an exception propagates commits what was
    saved, but the training did not finish: that trainer is not done, and the group restarts."""
    run = start_run(
        tmp_path / "run",
        [],
        ["--steps", "6", "--every", "2", "--raise-in-loop-at", "3"],
    )
    runs.append(run)
    code = run.wait(timeout=120)
    assert code == 0, output(run)
    assert len(run.events("restart")) == 1 and not run.events("done_crash")
    first = [e for e in run.events("rank_exit") if e.get("first")]
    assert first and first[0]["rank"] == 1 and first[0]["exitcode"] == 1
