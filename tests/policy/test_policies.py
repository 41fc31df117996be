"""Save policies (when to save) and retention policies (what to keep), alone, combined with
``|``, and as the manager applies them after every commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import crashproof
from crashproof import (
    ConfigError,
    EverySeconds,
    EverySteps,
    KeepAll,
    KeepEvery,
    KeepLast,
    TrainState,
)
from crashproof.policy import SaveContext


def _ctx(step: int, now_s: float = 0.0, last_save_step: int = 0, last_save_s: float = 0.0) -> Any:
    return SaveContext(
        step=step, now_s=now_s, last_save_step=last_save_step, last_save_s=last_save_s
    )


# -- when to save ----------------------------------------------------------------------------


def test_every_steps_saves_exactly_at_multiples() -> None:
    policy = EverySteps(5)
    saved = [step for step in range(1, 23) if policy.should_save(_ctx(step, last_save_step=0))]
    assert saved == [5, 10, 15, 20]
    assert [s for s in range(1, 4) if EverySteps(1).should_save(_ctx(s))] == [1, 2, 3]


def test_every_steps_ignores_time() -> None:
    assert not EverySteps(5).should_save(_ctx(4, now_s=1e9, last_save_s=0.0))
    assert EverySteps(5).should_save(_ctx(5, now_s=0.0, last_save_s=0.0))


def test_every_seconds_saves_once_the_interval_has_passed_since_the_last_save() -> None:
    policy = EverySeconds(10)
    assert not policy.should_save(_ctx(3, now_s=109.99, last_save_step=2, last_save_s=100.0))
    assert policy.should_save(_ctx(3, now_s=110.0, last_save_step=2, last_save_s=100.0))
    assert policy.should_save(_ctx(3, now_s=500.0, last_save_step=2, last_save_s=100.0))
    # The clock is the context's: the same step at an earlier "now" does not save.
    assert not policy.should_save(_ctx(3, now_s=101.0, last_save_step=2, last_save_s=100.0))


def test_every_seconds_does_not_save_the_step_it_already_saved() -> None:
    # Right after a restore, the restored step is the last save: saving it again is pointless.
    assert not EverySeconds(10).should_save(_ctx(7, now_s=1e6, last_save_step=7, last_save_s=0.0))


def test_combined_save_policies_save_when_either_says_so() -> None:
    policy = EverySteps(5) | EverySeconds(10)
    assert policy.should_save(_ctx(5, now_s=1.0, last_save_step=4, last_save_s=0.0))  # steps
    assert policy.should_save(_ctx(6, now_s=30.0, last_save_step=5, last_save_s=15.0))  # time
    assert policy.should_save(_ctx(10, now_s=30.0, last_save_step=5, last_save_s=15.0))  # both
    assert not policy.should_save(_ctx(6, now_s=20.0, last_save_step=5, last_save_s=15.0))


def test_save_policies_chain_with_more_than_two() -> None:
    policy = EverySteps(7) | EverySteps(11) | EverySeconds(1000)
    saved = [s for s in range(1, 25) if policy.should_save(_ctx(s, now_s=0.0))]
    assert saved == [7, 11, 14, 21, 22]


@pytest.mark.parametrize(
    "make",
    [
        lambda: EverySteps(0),
        lambda: EverySteps(-5),
        lambda: EverySeconds(0),
        lambda: EverySeconds(-1.0),
        lambda: EverySeconds(float("nan")),
        lambda: KeepLast(0),
        lambda: KeepLast(-1),
        lambda: KeepEvery(steps=0),
        lambda: KeepEvery(steps=-10),
    ],
    ids=[
        "EverySteps(0)",
        "EverySteps(-5)",
        "EverySeconds(0)",
        "EverySeconds(-1)",
        "EverySeconds(nan)",
        "KeepLast(0)",
        "KeepLast(-1)",
        "KeepEvery(0)",
        "KeepEvery(-10)",
    ],
)
def test_invalid_policy_arguments_raise_configerror(make: Any) -> None:
    with pytest.raises(ConfigError):
        make()


_NOT_A_COUNT = [1.5, True, "10", None, float("nan"), float("inf")]


@pytest.mark.parametrize("value", _NOT_A_COUNT, ids=repr)
def test_a_count_that_is_not_a_whole_number_is_refused_by_every_policy(value: Any) -> None:
    """``EverySteps(1.5)`` would save at every third step (``step % 1.5``), ``EverySteps(True)``
    at every step, ``KeepLast("3")`` fail at the first retention: refused where given, naming
    the value."""
    from crashproof import KeepBest, KeepDaily, KeepHourly, KeepWeekly

    for make in (EverySteps, KeepLast, KeepDaily, KeepHourly, KeepWeekly):
        with pytest.raises(ConfigError, match="whole number"):
            make(value)
    with pytest.raises(ConfigError, match="whole number"):
        KeepEvery(steps=value)
    with pytest.raises(ConfigError, match="whole number"):
        KeepBest("loss", n=value)


def test_counts_of_numpy_integers_are_whole_numbers() -> None:
    import numpy as np

    assert EverySteps(np.int64(5)).should_save(_ctx(10, now_s=0.0))
    assert KeepLast(np.int32(2)).keep([1, 2, 3]) == {2, 3}
    # kept as ints and floats: a policy's spec goes into JSON (the hand-over to the agent)
    import json

    from crashproof import KeepWithin
    from crashproof.policy import policy_from_spec, policy_to_spec

    policy = KeepLast(np.int64(3)) | KeepWithin(hours=np.float32(2))
    assert policy_from_spec(json.loads(json.dumps(policy_to_spec(policy)))) == policy
    assert type(EverySteps(np.int64(5)).n) is int


@pytest.mark.parametrize("value", [True, "60", float("inf"), float("nan"), None], ids=repr)
def test_times_that_are_not_finite_numbers_are_refused(value: Any) -> None:
    from crashproof import Daly, KeepWithin, Young

    with pytest.raises(ConfigError, match="finite"):
        EverySeconds(value)
    with pytest.raises(ConfigError, match="finite"):
        KeepWithin(hours=value)
    for adaptive in (Young, Daly):
        with pytest.raises(ConfigError, match="finite"):
            adaptive(mtbf_hours=value)


def test_what_is_not_a_policy_is_refused_when_combined_with_one() -> None:
    from crashproof import KeepBest

    with pytest.raises(ConfigError, match="not a save policy"):
        EverySteps(5) | 10  # type: ignore[operator]
    with pytest.raises(ConfigError, match="not a save policy"):
        EverySteps(5) | EverySteps  # type: ignore[operator]
    with pytest.raises(ConfigError, match="not a retention policy"):
        KeepLast(2) | "KeepLast(3)"  # type: ignore[operator]
    with pytest.raises(ConfigError, match="name the metric"):
        KeepBest(3)  # type: ignore[arg-type]


# -- what to keep ----------------------------------------------------------------------------


def test_keep_last_keeps_the_newest_n() -> None:
    assert KeepLast(2).keep(list(range(1, 11))) == {9, 10}
    assert KeepLast(5).keep([3, 8]) == {3, 8}
    assert KeepLast(1).keep([100, 200, 300]) == {300}
    assert KeepLast(3).keep([]) == set()


def test_keep_every_keeps_the_milestones() -> None:
    assert KeepEvery(steps=100).keep([50, 100, 150, 200, 250, 1000]) == {100, 200, 1000}
    assert KeepEvery(steps=100).keep([50, 150]) == set()


def test_keep_all_keeps_everything() -> None:
    assert KeepAll().keep([1, 5, 9]) == {1, 5, 9}


def test_combined_retention_keeps_what_either_keeps() -> None:
    policy = KeepLast(2) | KeepEvery(steps=100)
    assert policy.keep([50, 100, 150, 200, 250, 300, 350]) == {100, 200, 300, 350}
    assert policy.keep([100, 200]) == {100, 200}
    assert (KeepLast(1) | KeepEvery(steps=3) | KeepEvery(steps=5)).keep(list(range(1, 11))) == {
        3,
        5,
        6,
        9,
        10,
    }


# -- the manager applies retention after every commit ----------------------------------------


class KeepNothing:
    """A retention policy that proposes to delete every checkpoint."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set()

    def __or__(self, other: Any) -> Any:
        raise NotImplementedError


def _state() -> TrainState:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _saved_steps(manager: crashproof.CheckpointManager) -> set[int]:
    return {info.step for info in manager.list()}


def test_retention_after_each_commit_keeps_last_two_and_milestones(tmp_path: Path) -> None:
    state = _state()
    root = tmp_path / "ckpt"
    with crashproof.CheckpointManager(
        str(root), keep=KeepLast(2) | KeepEvery(steps=5), async_save=False
    ) as manager:
        for step in range(1, 11):
            manager.save(step, state)
            milestones = {s for s in range(1, step + 1) if s % 5 == 0}
            assert _saved_steps(manager) == milestones | ({step - 1, step} - {0}), f"after {step}"
        # After step 10 the two newest are 9 and 10: 8 went when 10 committed.
        assert _saved_steps(manager) == {5, 9, 10}
        assert all(info.valid for info in manager.list())
    # Nothing else is left on disk: no temporary or trash directories either.
    assert {int(p.name.removeprefix("step_")) for p in root.iterdir()} == {5, 9, 10}


def test_maybe_save_follows_the_save_policy(tmp_path: Path) -> None:
    state = _state()
    with crashproof.CheckpointManager(str(tmp_path / "ckpt"), every=EverySteps(4)) as manager:
        decisions = [manager.maybe_save(step, state) for step in range(1, 11)]
        assert [step for step, saved in zip(range(1, 11), decisions, strict=True) if saved] == [
            4,
            8,
        ]
        assert _saved_steps(manager) == {4, 8}


def test_retention_never_deletes_the_newest_checkpoint(tmp_path: Path) -> None:
    state = _state()
    root = str(tmp_path / "ckpt")
    with crashproof.CheckpointManager(root, keep=KeepNothing()) as manager:  # type: ignore[arg-type]
        for step in (1, 2, 3):
            manager.save(step, state)
            assert _saved_steps(manager) == {step}
    with crashproof.CheckpointManager(root) as manager:
        assert manager.restore(_state()) == 3


def test_prune_never_deletes_the_newest_checkpoint(tmp_path: Path) -> None:
    state = _state()
    with crashproof.CheckpointManager(str(tmp_path / "ckpt")) as manager:
        for step in (1, 2, 3):
            manager.save(step, state)
        assert manager.prune(KeepNothing(), dry_run=True) == [1, 2]  # type: ignore[arg-type]
        assert _saved_steps(manager) == {1, 2, 3}
        assert manager.prune(KeepNothing()) == [1, 2]  # type: ignore[arg-type]
        assert _saved_steps(manager) == {3}
