"""Retention by time and by metric: the seeds' tiered "checkpoint zoo" (everything of the last
hours, one a day for a week, one a week beyond, milestones, the best by a metric), alone, combined,
and as the manager applies it from the manifests of real checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import crashproof as cp
from crashproof import CheckpointFacts as Facts
from crashproof.policy import retained

HOUR, DAY = 3600.0, 86400.0
T0 = 1_700_006_400.0  # a UTC midnight: 2023-11-15 00:00


def _hourly_for(days: int) -> list[Facts]:
    """A checkpoint every hour for ``days`` days, step = hours since T0."""
    return [Facts(step=h, created_unix=T0 + h * HOUR) for h in range(days * 24)]


def test_keep_within_keeps_the_span_before_the_newest_checkpoint_not_before_now() -> None:
    facts = _hourly_for(3)  # made long ago: a clock-based policy would keep nothing
    kept = retained(cp.KeepWithin(hours=6), facts)
    assert kept == set(range(71 - 6, 72))


def test_keep_daily_keeps_the_newest_checkpoint_of_each_of_the_last_n_days() -> None:
    facts = _hourly_for(10)
    assert retained(cp.KeepDaily(7), facts) == {24 * d + 23 for d in range(3, 10)}


def test_keep_weekly_and_hourly_count_periods_that_have_checkpoints() -> None:
    # Two bursts three weeks apart: "last 2 weeks" means the two weeks that have checkpoints.
    facts = [
        Facts(1, T0),
        Facts(2, T0 + HOUR),
        Facts(3, T0 + 21 * DAY),
        Facts(4, T0 + 21 * DAY + 60),
    ]
    assert retained(cp.KeepWeekly(2), facts) == {2, 4}
    assert retained(cp.KeepHourly(1), facts) == {4}


def test_weeks_run_from_monday_to_sunday() -> None:
    saturday, sunday, monday = T0 + 3 * DAY, T0 + 4 * DAY + 23 * HOUR, T0 + 5 * DAY + HOUR
    facts = [Facts(1, saturday), Facts(2, sunday), Facts(3, monday)]  # 2023-11-18, -19, -20
    assert retained(cp.KeepWeekly(5), facts) == {2, 3}


def test_keep_best_keeps_the_n_best_by_the_metric_and_ignores_checkpoints_without_it() -> None:
    facts = [
        Facts(10, T0, {"val_loss": 0.9}),
        Facts(20, T0, {"val_loss": 0.4}),
        Facts(30, T0, {"val_loss": float("nan")}),
        Facts(40, T0, {"val_loss": 0.5, "acc": 0.7}),
        Facts(50, T0, {"acc": 0.9}),
        Facts(60, T0, {"val_loss": True}),  # a bool is not a metric value
    ]
    assert retained(cp.KeepBest("val_loss"), facts) == {20}
    assert retained(cp.KeepBest("val_loss", n=2), facts) == {20, 40}
    assert retained(cp.KeepBest("acc", mode="max"), facts) == {50}


def test_the_seeds_tiered_policy_is_one_expression() -> None:
    # Hourly checkpoints for 60 days, each with a validation loss that is best at hour 100.
    facts = [
        Facts(f.step, f.created_unix, {"val_loss": abs(f.step - 100) + 1.0})
        for f in _hourly_for(60)
    ]
    zoo = (
        cp.KeepWithin(hours=6)
        | cp.KeepDaily(7)
        | cp.KeepWeekly(12)
        | cp.KeepEvery(500)
        | cp.KeepBest("val_loss")
    )
    kept = retained(zoo, facts)
    newest = 60 * 24 - 1
    assert set(range(newest - 6, newest + 1)) <= kept  # the last 6 hours, all of them
    assert {24 * d + 23 for d in range(53, 60)} <= kept  # one a day for a week
    assert {0, 500, 1000} <= kept  # milestones
    assert 100 in kept  # the best model
    # And far fewer than the 1440 made: the weekly tier adds at most 12.
    assert len(kept) <= 7 + 7 + 12 + 3 + 1


def test_time_policies_given_steps_alone_keep_everything_rather_than_guess() -> None:
    assert cp.KeepDaily(1).keep([1, 2, 3]) == {1, 2, 3}
    assert retained(cp.KeepWithin(hours=1), [Facts(1), Facts(2)]) == {1, 2}


@pytest.mark.parametrize(
    "make",
    [
        lambda: cp.KeepWithin(),
        lambda: cp.KeepDaily(0),
        lambda: cp.KeepBest("loss", n=0),
        lambda: cp.KeepBest("loss", mode="median"),  # type: ignore[arg-type]
    ],
)
def test_invalid_tiered_policies_raise_configerror(make: object) -> None:
    with pytest.raises(cp.ConfigError):
        make()  # type: ignore[operator]


def test_the_manager_keeps_the_best_checkpoint_by_the_metadata_saved_with_it(
    tmp_path: Path,
) -> None:
    model = nn.Linear(4, 4)
    state = cp.TrainState(model=model)
    losses = {1: 0.9, 2: 0.3, 3: 0.8, 4: 0.7, 5: 0.6}
    with cp.CheckpointManager(
        tmp_path, keep=cp.KeepLast(2) | cp.KeepBest("val_loss"), handle_signals=False
    ) as ckpt:
        for step, loss in losses.items():
            with torch.no_grad():
                model.weight.add_(1.0)
            ckpt.save(step, state, metadata={"val_loss": loss})
        ckpt.wait()
        assert [i.step for i in ckpt.list()] == [5, 4, 2]
