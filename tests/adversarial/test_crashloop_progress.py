"""Promise: the crash-loop guard (exit 77, "restarting will not help") judges progress right.

Only consecutive attempts that fail without getting past the furthest step the run reached count;
an attempt that got further resets the count; the report names the run's furthest step. Found:
under random kills (every attempt progressed), a run was stopped with 77 after two failures,
saying "without progress past step -1" while step 1738 had been reached: the attempt that made
the progress was counted as the first of the loop, and the report named the last failure's step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from crashproof.supervisor._crashloop import CrashLoopPolicy, Failure
from crashproof.supervisor.launch import EXIT_BUDGET_SPENT, EXIT_CRASH_LOOP
from tests.supervisor._runs import Run, output, start_run


def _policy(attempts: int, *steps: int | tuple[int, int]) -> CrashLoopPolicy:
    """A policy that saw failures at ``steps`` (a pair: (start step, furthest step))."""
    policy = CrashLoopPolicy(attempts=attempts, backoff_s=1, backoff_max_s=4)
    for i, step in enumerate(steps):
        start, furthest = step if isinstance(step, tuple) else (-1, step)
        policy.record(Failure(attempt=i, step=furthest, rank=1, reason="x", start_step=start))
    return policy


def test_the_reported_case_progress_then_two_startup_failures_is_not_a_loop() -> None:
    policy = _policy(3, 1738, -1, -1)
    assert not policy.is_crash_loop()
    assert policy.stalled == 2 and policy.furthest_step == 1738
    policy.record(Failure(attempt=3, step=-1, rank=0, reason="x"))
    assert policy.is_crash_loop()  # three in a row without getting past 1738
    assert policy.furthest_step == 1738  # the report names the run's furthest, not -1


def test_failures_at_startup_count_from_the_first_attempt() -> None:
    assert not _policy(3, -1, -1).is_crash_loop()
    loop = _policy(3, -1, -1, -1)
    assert loop.is_crash_loop() and loop.furthest_step == -1


@pytest.mark.parametrize("attempts", [1, 2, 3])
def test_every_attempt_getting_further_is_never_a_loop(attempts: int) -> None:
    policy = _policy(attempts)
    for step in (7, 12, 13, 500, 501):  # slowly or fast, each got further
        policy.record(Failure(attempt=0, step=step, rank=1, reason="x"))
        assert not policy.is_crash_loop() and policy.stalled == 0 and policy.backoff() == 0


def test_progress_resets_the_count() -> None:
    # two stalls, progress, two stalls: never three in a row
    assert not _policy(3, 10, 10, 10, 11, 11, 11).is_crash_loop()
    assert _policy(3, 10, 10, 10, 11, 11, 11, 5).is_crash_loop()


def test_a_resumed_attempt_that_fails_before_its_first_step_counts() -> None:
    # restored step 40 (a checkpoint of an earlier run) and failed before finishing one
    policy = _policy(2, (40, 40), (40, 40))
    assert policy.is_crash_loop() and policy.furthest_step == 40
    assert not _policy(2, (40, 41), (40, 42)).is_crash_loop()  # each finished a new step


def test_falling_back_is_not_progress() -> None:
    # a rollback to an older checkpoint: getting to 90 again after 100 is no progress
    assert _policy(2, 100, (80, 90), (80, 95)).is_crash_loop()


def test_backoff_waits_only_after_failures_without_progress() -> None:
    assert _policy(3, 12).backoff() == 0  # got further: restart at once
    assert _policy(3, 12, 12).backoff() == 1
    assert _policy(9, 12, 12, 12).backoff() == 2
    assert _policy(9, 12, 12, 12, 12, 12, 12).backoff() == 4  # capped
    assert _policy(3, 12, 12, 12, 13).backoff() == 0


def test_a_run_that_progressed_then_fails_at_startup_stops_naming_its_furthest_step(
    tmp_path: Path, runs: list[Run]
) -> None:
    # attempt 0 fails after step 7; every later one fails at start-up
    run = start_run(
        tmp_path / "run",
        ["--max-restarts", "10", "--crash-loop-attempts", "2"],
        ["--steps", "100", "--every", "5", "--fail-at", "7", "--fail-attempts", "1",
         "--fail-at-start-from", "1"],
    )  # fmt: skip
    runs.append(run)
    code = run.wait(timeout=120)
    text = output(run)
    assert code == EXIT_CRASH_LOOP, text
    # the progressing attempt did not count: two start-up failures after it, three attempts
    assert len(run.events("rank_start")) == 2 * 3, text
    [loop] = run.events("crash_loop")
    assert loop["step"] == 7 and loop["attempts"] == 2 and loop["last_step"] == -1
    assert "past step 7" in text and "past step -1" not in text


def test_a_run_that_progresses_every_attempt_is_never_a_crash_loop(
    tmp_path: Path, runs: list[Run]
) -> None:
    # --crash-loop-attempts 1: a single failure without progress would stop it
    run = start_run(
        tmp_path / "run",
        ["--max-restarts", "2", "--crash-loop-attempts", "1"],
        ["--steps", "100", "--every", "5", "--fail-at", "7", "--fail-every-attempt"],
    )
    runs.append(run)
    code = run.wait(timeout=120)
    assert code == EXIT_BUDGET_SPENT, output(run)
    assert not run.events("crash_loop")
    assert all(e["backoff_s"] == 0 for e in run.events("restart"))
