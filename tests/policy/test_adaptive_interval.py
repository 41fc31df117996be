"""``Young()`` / ``Daly()``: the interval follows the measured checkpoint cost and the failures
the run has seen (the event log's restarts), starting from the user's prior."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

import crashproof as cp
from crashproof.errors import ConfigError
from crashproof.policy import SaveContext
from crashproof.telemetry._events import ENV_RUN_DIR


def _ctx(step: int, now: float, last_step: int, last_s: float, cost: float | None) -> SaveContext:
    return SaveContext(step, now, last_step, last_s, last_blocking_s=cost, last_persist_s=cost)


def test_the_first_save_comes_after_the_minimum_interval_then_young_sets_it() -> None:
    policy = cp.Young(mtbf_hours=1.0, min_interval_s=5.0)
    assert not policy.should_save(_ctx(1, 104.0, 0, 100.0, None))
    assert policy.should_save(_ctx(2, 105.0, 0, 100.0, None))  # 5 s: the calibration save
    policy.should_save(_ctx(3, 106.0, 2, 105.0, 2.0))  # it paused training 2 s
    expected = math.sqrt(2 * 2.0 * policy.mtbf_s())
    assert policy.interval_s == pytest.approx(expected, rel=1e-3)
    assert 100 < policy.interval_s < 130  # sqrt(2 * 2 s * 3600 s) = 120 s
    assert not policy.should_save(_ctx(4, 105.0 + expected - 1, 2, 105.0, 2.0))
    assert policy.should_save(_ctx(5, 105.0 + expected + 1, 2, 105.0, 2.0))


def test_the_interval_follows_the_median_cost_and_never_undercuts_a_background_write() -> None:
    policy = cp.Young(mtbf_hours=1.0, min_interval_s=1.0)
    for cost in (0.5, 8.0, 0.5):  # one slow save (a busy disk) does not move the median
        policy.should_save(_ctx(10, 0.0, 9, 0.0, cost))
    assert policy.interval_s == pytest.approx(math.sqrt(2 * 0.5 * policy.mtbf_s()), rel=1e-3)
    slow_write = SaveContext(11, 0.0, 9, 0.0, last_blocking_s=0.01, last_persist_s=500.0)
    policy.should_save(slow_write)
    assert policy.interval_s >= 500.0


def test_daly_is_below_young_for_the_same_cost_and_mtbf() -> None:
    young, daly = cp.Young(mtbf_hours=0.5), cp.Daly(mtbf_hours=0.5)
    for policy in (young, daly):
        policy.should_save(_ctx(1, 0.0, 0, 0.0, 60.0))
    assert 0 < daly.interval_s < young.interval_s


def test_failures_in_the_run_log_shorten_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = time.time() - 3600.0  # the run started an hour ago
    events = [{"ts": started, "event": "run_start"}]
    events += [
        {"ts": started + 60 * i, "event": "restart", "reason": "killed by SIGKILL"}
        for i in range(1, 10)
    ]
    events.append({"ts": started + 900, "event": "restart", "reason": "membership change"})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path))
    policy = cp.Young(mtbf_hours=24.0, prior_failures=1.0)
    policy.should_save(_ctx(1, 0.0, 0, 0.0, 1.0))
    # posterior mean: (1 x 24 h + 1 h) / (1 + 9 failures) = 2.5 h
    assert policy.mtbf_s() == pytest.approx((24 * 3600 + 3600) / 10, rel=0.01)
    unsupervised = cp.Young(mtbf_hours=24.0)
    monkeypatch.delenv(ENV_RUN_DIR)
    unsupervised.should_save(_ctx(1, 0.0, 0, 0.0, 1.0))
    assert policy.interval_s < unsupervised.interval_s / 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="mtbf_hours=0"):
        cp.Young(mtbf_hours=0)
    with pytest.raises(ConfigError, match="min_interval_s"):
        cp.Daly(min_interval_s=10, max_interval_s=5)


def test_a_manager_with_young_measures_its_own_saves(tmp_path: Path) -> None:
    state = cp.TrainState(model=torch.nn.Linear(4, 4))
    policy = cp.Young(mtbf_hours=1.0, min_interval_s=0.05)
    with cp.CheckpointManager(
        str(tmp_path), every=policy, handle_signals=False, async_save=False
    ) as ckpt:
        saved = []
        for step in range(1, 1000):
            time.sleep(0.002)
            if ckpt.maybe_save(step, state):
                saved.append(step)
            if saved and step > saved[0] + 2:
                break
        cost, persist = ckpt.stats.last_blocking_s, ckpt.stats.last_persist_s
    assert len(saved) == 1  # the calibration save after 0.05 s; the next is seconds away
    assert policy.interval_s == pytest.approx(
        max(0.05, math.sqrt(2 * cost * policy.mtbf_s()), persist), rel=0.01
    )
    assert policy.interval_s > 1.0  # sqrt(2 x >=1 ms x 1 h) >= 2.7 s


def test_cheaper_checkpoints_get_a_shorter_interval() -> None:
    cheap, dear = cp.Young(mtbf_hours=2.0), cp.Young(mtbf_hours=2.0)
    for _ in range(3):
        cheap.should_save(_ctx(10, 0.0, 9, 0.0, 0.2))
        dear.should_save(_ctx(10, 0.0, 9, 0.0, 20.0))
    # sqrt(2 C M): a 100x cheaper checkpoint is saved 10x as often
    assert cheap.interval_s == pytest.approx(dear.interval_s / 10, rel=0.01)
