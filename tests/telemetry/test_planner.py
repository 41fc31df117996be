"""Failure economics and ``crashproof plan``: the formulas, the worked examples of the seed texts
and of Daly's paper, the errors, and the command in a real process."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crashproof.cli._plan import add_plan_parser, run_plan
from crashproof.errors import ConfigError
from crashproof.telemetry._economics import (
    cluster_mtbf,
    daily_prob_from_mtbf_hours,
    daly_interval,
    device_mtbf,
    expected_failures,
    expected_goodput,
    expected_loss_per_failure,
    expected_overhead,
    mtbf_hours_from_daily_prob,
    p_no_failure,
    young_interval,
)
from crashproof.telemetry._planner import Plan, plan
from tests.conftest import run_python

CONTRACT_KEYS = {
    "p_no_failure",
    "expected_failures",
    "cluster_mtbf_hours",
    "young_interval_hours",
    "daly_interval_hours",
    "expected_overhead_fraction",
    "expected_goodput",
    "compute_cost",
    "expected_failure_cost",
}

# A run that every plan test starts from: the seeds' 1,000 devices at p = 0.001 per day.
RUN: dict[str, Any] = {
    "devices": 1000,
    "days": 30.0,
    "ckpt_minutes": 5.0,
    "restart_minutes": 10.0,
    "cost_per_device_hour": 2.0,
}


# --- the seeds' worked examples ---------------------------------------------------------------


def test_1000_devices_at_p_0_001_survive_a_day_with_probability_0_37() -> None:
    p = p_no_failure(1000, 0.001, 1)
    assert p == pytest.approx(0.999**1000, rel=1e-12)
    assert round(p, 2) == 0.37
    assert 1 - p == pytest.approx(0.63, abs=0.005)  # "a 63% chance of at least one failure"


def test_one_device_survives_30_days_with_probability_0_97() -> None:
    assert round(p_no_failure(1, 0.001, 30), 2) == 0.97


def test_1000_nodes_for_30_days_is_0_999_to_the_30000() -> None:
    p = p_no_failure(1000, 0.001, 30)
    assert p == pytest.approx(0.999**30000, rel=1e-9)
    # The seed prints "0.00000000000009%": the probability is 9.2e-14, i.e. 9.2e-12 percent.
    assert p == pytest.approx(9.22e-14, rel=1e-3)


def test_young_interval_of_a_5_minute_checkpoint_at_12_hour_mtbf_is_1_41_hours() -> None:
    assert round(young_interval(5 / 60, 12), 2) == 1.41
    assert round(young_interval(0.083, 12), 2) == 1.41  # the seed's rounded 0.083 h
    plan_ = plan(**{**RUN, "days": 1.0}, cluster_mtbf_hours=12.0)
    assert round(plan_.young_interval_hours, 2) == 1.41
    assert plan_.young_interval_hours == pytest.approx(math.sqrt(2))


def test_young_interval_on_spot_with_6_hour_mtbf_is_an_hour() -> None:
    # "If T_MTBF is 6 hours for Spot, checkpoint every 30-60 minutes" (5-minute checkpoint)
    assert young_interval(5 / 60, 6) == pytest.approx(1.0)


def test_2000_devices_for_two_weeks_at_2_dollars_cost_1_344_000() -> None:
    result = plan(**{**RUN, "devices": 2000, "days": 14.0}, mtbf_hours=50_000.0)
    assert result.compute_cost == pytest.approx(1_344_000)


@pytest.mark.parametrize(
    ("devices", "days", "price", "cost"),
    [
        (100, 30, 32.77, 2_359_440),  # 100 p4d nodes for 720 h at $32.77
        (1024, 28, 3.0, 2_064_384),  # 1,024 H100 for 4 weeks at $3: "$2.1 million"
        (1024, 1 / 24, 3.0, 3_072),  # "1 hour of lost training = $3,072"
        (512, 3, 1.0, 36_864),  # 72 h on 512 GPUs: "over 36,000 GPU-hours"
    ],
)
def test_compute_cost_of_the_seeds_runs(
    devices: int, days: float, price: float, cost: float
) -> None:
    result = plan(
        **{**RUN, "devices": devices, "days": days, "cost_per_device_hour": price},
        mtbf_hours=50_000.0,
    )
    assert result.compute_cost == pytest.approx(cost)


def test_512_a100s_at_100000_hours_fail_every_8_days_and_3_to_4_times_a_month() -> None:
    assert cluster_mtbf(100_000, 512) == pytest.approx(195.3125)
    assert round(cluster_mtbf(100_000, 512) / 24) == 8
    failures = expected_failures(512, 30, 100_000)
    assert 3 < failures < 4
    assert failures == pytest.approx(30 * 24 / 195.3125)


def test_1000_gpus_at_50000_hours_fail_every_2_days() -> None:
    assert cluster_mtbf(50_000, 1000) / 24 == pytest.approx(2.08, abs=0.01)


@pytest.mark.parametrize(
    ("mtbf_minutes", "expected_minutes"),
    [(24 * 60, 117), (6 * 60, 57), (15, 9.1)],  # Daly (2006), figures 3, 4 and 5
)
def test_daly_interval_matches_the_papers_examples_for_a_5_minute_dump(
    mtbf_minutes: float, expected_minutes: float
) -> None:
    assert daly_interval(5, mtbf_minutes) == pytest.approx(expected_minutes, abs=0.5)


# --- the formulas --------------------------------------------------------------------------------


def test_daily_probability_and_mtbf_are_one_rate() -> None:
    assert mtbf_hours_from_daily_prob(0.001) == pytest.approx(-24 / math.log(0.999))
    assert mtbf_hours_from_daily_prob(0.001) < 24 / 0.001  # repaired devices fail again
    assert daily_prob_from_mtbf_hours(mtbf_hours_from_daily_prob(0.001)) == pytest.approx(0.001)
    assert device_mtbf(cluster_mtbf(24_000, 1000), 1000) == pytest.approx(24_000)


def test_expected_failures_use_the_rate_not_the_daily_probability() -> None:
    # 1000 devices at p = 0.001 for a day: -1000 ln(0.999) = 1.0005, not 1000 * 0.001
    assert expected_failures(1000, 1, mtbf_hours_from_daily_prob(0.001)) == pytest.approx(
        -1000 * math.log(0.999)
    )


def test_daly_interval_is_the_mtbf_once_a_checkpoint_costs_twice_the_mtbf() -> None:
    assert daly_interval(2.0, 1.0) == 1.0
    assert daly_interval(10.0, 1.0) == 1.0
    assert daly_interval(1.99, 1.0) < 1.0


def test_goodput_agrees_with_the_first_order_model_when_checkpoints_are_cheap() -> None:
    c, r, m = 1e-4, 1e-3, 1.0
    tau = young_interval(c, m)
    first_order = c / tau + (tau / 2 + r) / m  # = sqrt(2C/M) + R/M at Young's interval
    assert expected_overhead(tau, c, r, m) == pytest.approx(first_order, rel=0.01)
    assert expected_goodput(tau, c, r, m) == pytest.approx(1 - first_order, rel=1e-3)


def test_goodput_of_an_interval_far_beyond_the_mtbf_is_zero_not_an_overflow() -> None:
    assert expected_goodput(1e6, 1.0, 0.0, 1.0) == 0.0
    assert expected_overhead(1e6, 1.0, 0.0, 1.0) == 1.0


def test_restarts_cost_goodput() -> None:
    assert expected_goodput(1.0, 0.1, 0.5, 10.0) < expected_goodput(1.0, 0.1, 0.0, 10.0)


costs = st.floats(min_value=1e-6, max_value=1e3)
mtbfs = st.floats(min_value=1e-3, max_value=1e6)


@given(costs, mtbfs, st.floats(min_value=0.0, max_value=1e3))
def test_goodput_is_a_share_and_overhead_its_complement(c: float, m: float, r: float) -> None:
    for tau in (young_interval(c, m), daly_interval(c, m)):
        goodput = expected_goodput(tau, c, r, m)
        assert 0.0 <= goodput <= tau / (tau + c)
        assert goodput + expected_overhead(tau, c, r, m) == pytest.approx(1.0)


@given(costs, mtbfs, st.floats(min_value=0.0, max_value=1e3))
def test_a_failure_loses_at_most_half_a_segment_plus_the_restart(
    c: float, m: float, r: float
) -> None:
    tau = daly_interval(c, m)
    lost = expected_loss_per_failure(tau, c, r, m)
    assert 0.0 <= lost <= min(m, (tau + c) / 2 + r) * (1 + 1e-9)


def test_a_rare_failure_loses_half_a_segment_plus_the_restart() -> None:
    tau, c, r, m = 1.0, 0.1, 0.2, 1e4
    assert expected_loss_per_failure(tau, c, r, m) == pytest.approx((tau + c) / 2 + r, rel=1e-4)


@given(costs, mtbfs)
def test_daly_is_shorter_than_young_by_5c_9_to_2c_3(c: float, m: float) -> None:
    if c >= 2 * m:
        return
    gap = young_interval(c, m) - daly_interval(c, m)
    assert 5 * c / 9 * (1 - 1e-9) <= gap <= 2 * c / 3 * (1 + 1e-9)


@given(costs, mtbfs, st.floats(min_value=0.0, max_value=10.0))
def test_daly_interval_loses_less_than_young_and_is_a_local_optimum(
    c: float, m: float, r_share: float
) -> None:
    r = r_share * m
    daly = daly_interval(c, m)
    best = expected_goodput(daly, c, r, m)
    assert best >= expected_goodput(young_interval(c, m), c, r, m) * (1 - 1e-9)
    for off in (0.8, 1.25):
        assert best >= expected_goodput(daly * off, c, r, m) * (1 - 1e-9)


@given(costs, mtbfs, st.floats(min_value=1.01, max_value=100.0))
def test_intervals_and_goodput_grow_with_the_mtbf(c: float, m: float, factor: float) -> None:
    longer = m * factor
    assert young_interval(c, longer) > young_interval(c, m)
    if c < 2 * m:  # Daly's formula steps down where it starts: only within one branch
        assert daly_interval(c, longer) > daly_interval(c, m)
    tau = daly_interval(c, m)
    assert expected_goodput(tau, c, 0.0, longer) >= expected_goodput(tau, c, 0.0, m)


@given(st.integers(1, 100_000), st.floats(1e-9, 0.5), st.floats(1e-3, 1e3))
def test_no_failure_is_the_exponential_of_the_expected_failures(
    devices: int, p: float, days: float
) -> None:
    failures = expected_failures(devices, days, mtbf_hours_from_daily_prob(p))
    assert p_no_failure(devices, p, days) == pytest.approx(math.exp(-failures), rel=1e-9)


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "name", "value"),
    [
        (lambda: p_no_failure(0, 0.001, 1), "devices", 0),
        (lambda: p_no_failure(2.5, 0.001, 1), "devices", 2.5),  # type: ignore[arg-type]
        (lambda: p_no_failure(10, 1.0, 1), "daily_failure_prob", 1.0),
        (lambda: p_no_failure(10, -0.1, 1), "daily_failure_prob", -0.1),
        (lambda: p_no_failure(10, 0.001, -1), "days", -1),
        (lambda: mtbf_hours_from_daily_prob(0.0), "daily_failure_prob", 0.0),
        (lambda: daily_prob_from_mtbf_hours(math.inf), "mtbf_hours", math.inf),
        (lambda: cluster_mtbf(-5, 10), "device_mtbf", -5),
        (lambda: device_mtbf(math.nan, 10), "cluster_mtbf", math.nan),
        (lambda: expected_failures(10, 1, 0), "device_mtbf_hours", 0),
        (lambda: young_interval(0, 12), "checkpoint_cost", 0),
        (lambda: daly_interval(1, -12), "mtbf", -12),
        (lambda: expected_goodput(0, 1, 0, 1), "interval", 0),
        (lambda: expected_goodput(1, 1, -1, 1), "restart_cost", -1),
    ],
)
def test_bad_inputs_raise_value_error_naming_parameter_and_value(
    call: Callable[[], float], name: str, value: float
) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must .*got {value!r}$"):
        call()


def test_p_no_failure_allows_a_device_that_never_fails() -> None:
    assert p_no_failure(1000, 0.0, 30) == 1.0


@pytest.mark.parametrize(
    "rates",
    [{}, {"mtbf_hours": 1000.0, "cluster_mtbf_hours": 1.0}],
    ids=["none", "two"],
)
def test_plan_needs_exactly_one_failure_rate(rates: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="exactly one failure rate"):
        plan(**RUN, **rates)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("devices", -3),
        ("days", 0.0),
        ("ckpt_minutes", 0.0),
        ("restart_minutes", -1.0),
        ("cost_per_device_hour", math.nan),
        ("mtbf_hours", -1.0),
        ("daily_failure_prob", 1.5),
        ("cluster_mtbf_hours", math.inf),
    ],
)
def test_plan_names_the_bad_input(field: str, value: float) -> None:
    rates = ("mtbf_hours", "daily_failure_prob", "cluster_mtbf_hours")
    rate: dict[str, Any] = {} if field in rates else {"mtbf_hours": 24_000.0}
    with pytest.raises(ConfigError, match=rf"^{field} must .*got {value!r}$"):
        plan(**{**RUN, **rate, field: value})


# --- the plan ------------------------------------------------------------------------------------


def test_the_three_forms_of_one_failure_rate_give_one_plan() -> None:
    by_prob = plan(**RUN, daily_failure_prob=0.001)
    per_device = mtbf_hours_from_daily_prob(0.001)
    by_mtbf = plan(**RUN, mtbf_hours=per_device)
    by_cluster = plan(**RUN, cluster_mtbf_hours=per_device / RUN["devices"])
    for other in (by_mtbf, by_cluster):
        mine, theirs = by_prob.to_json(), other.to_json()
        for key in CONTRACT_KEYS:
            assert theirs[key] == pytest.approx(mine[key], rel=1e-9), key


def test_plan_evaluates_overhead_and_failure_cost_at_dalys_interval() -> None:
    result = plan(**RUN, cluster_mtbf_hours=12.0)
    write, restart, hourly = 5 / 60, 10 / 60, 1000 * 2.0
    assert result.daly_interval_hours == pytest.approx(daly_interval(write, 12.0))
    assert result.expected_goodput == pytest.approx(
        expected_goodput(result.daly_interval_hours, write, restart, 12.0)
    )
    assert result.expected_overhead_fraction == pytest.approx(1 - result.expected_goodput)
    assert result.expected_failures == pytest.approx(30 * 24 / 12.0)
    daly = result.daly_interval_hours
    lost = expected_loss_per_failure(daly, write, restart, 12.0)
    assert lost == pytest.approx((daly + write) / 2 + restart, rel=0.05)  # half a segment + R
    assert result.expected_failure_cost == pytest.approx(60 * lost * hourly)
    # The overhead is the failures plus the writes of the segments that complete.
    writes = result.expected_goodput * write / daly * result.compute_cost
    assert result.expected_failure_cost + writes == pytest.approx(
        result.expected_overhead_fraction * result.compute_cost
    )


def test_failures_never_cost_more_than_the_compute_even_when_they_come_every_minute() -> None:
    result = plan(**RUN, cluster_mtbf_hours=1 / 60)
    assert result.expected_goodput < 1e-3
    assert 0.99 * result.compute_cost < result.expected_failure_cost <= result.compute_cost


@pytest.mark.parametrize("rate", [{"mtbf_hours": 0.25}, {"cluster_mtbf_hours": 0.5}])
def test_a_device_failing_every_few_minutes_still_gets_a_plan(rate: dict[str, float]) -> None:
    # Its daily failure probability rounds to 1.0: the odds come from the rate instead.
    result = plan(devices=1, days=1.0, ckpt_minutes=1.0, restart_minutes=1.0,
                  cost_per_device_hour=1.0, **rate)  # fmt: skip
    hours = rate.get("mtbf_hours", rate.get("cluster_mtbf_hours"))
    assert result.p_no_failure == pytest.approx(math.exp(-24 / hours), rel=1e-12)
    assert result.p_no_failure > 0
    assert result.expected_failures == pytest.approx(24 / hours)


def test_plan_json_has_the_contract_keys_and_the_inputs() -> None:
    out = plan(**RUN, daily_failure_prob=0.001).to_json()
    assert set(out) == CONTRACT_KEYS | {"inputs"}
    assert out["inputs"] == {
        **RUN,
        "mtbf_hours": None,
        "daily_failure_prob": 0.001,
        "cluster_mtbf_hours": None,
    }
    assert json.loads(json.dumps(out)) == out


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="crashproof")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["plan", *argv])


ARGV = [
    "--devices",
    "1000",
    "--days",
    "30",
    "--ckpt-minutes",
    "5",
    "--restart-minutes",
    "10",
    "--cost-per-device-hour",
    "2",
]


def test_plan_command_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse([*ARGV, "--daily-failure-prob", "0.001"])
    assert args.func is run_plan
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    assert "chance of none              9.22e-14" in out
    assert "compute                     1,440,000" in out
    assert "Daly interval" in out and "Young interval" in out


def test_plan_command_prints_json_with_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(_parse([*ARGV, "--cluster-mtbf-hours", "12", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == CONTRACT_KEYS | {"inputs"}
    assert out["inputs"]["cluster_mtbf_hours"] == 12.0
    assert out["compute_cost"] == pytest.approx(1_440_000)


def test_plan_command_rejects_a_bad_value_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*ARGV, "--daily-failure-prob", "1.5"]
    assert run_plan(_parse(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--daily-failure-prob must be a probability in (0, 1), got 1.5" in captured.err


@pytest.mark.parametrize(
    "rates",
    [[], ["--mtbf-hours", "1000", "--cluster-mtbf-hours", "1"]],
    ids=["none", "two"],
)
def test_plan_command_needs_exactly_one_failure_rate(
    rates: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse([*ARGV, *rates])
    assert exc.value.code == 2
    assert "--mtbf-hours" in capsys.readouterr().err


def test_crashproof_plan_runs_as_a_real_command() -> None:
    proc = run_python(
        ["-m", "crashproof.cli", "plan", *ARGV, "--daily-failure-prob", "0.001", "--json"]
    )
    out = json.loads(proc.stdout)
    expected: Plan = plan(**RUN, daily_failure_prob=0.001)
    assert out.pop("inputs") == expected.to_json().pop("inputs")
    assert out == pytest.approx({key: getattr(expected, key) for key in CONTRACT_KEYS})


def test_crashproof_plan_exits_2_on_a_bad_value() -> None:
    proc = run_python(["-m", "crashproof.cli", "plan", *ARGV, "--mtbf-hours", "-5"], check=False)
    assert proc.returncode == 2
    assert "--mtbf-hours must be a positive finite number, got -5.0" in proc.stderr


def test_a_plan_gives_what_its_inputs_allow_and_names_what_the_rest_needs() -> None:
    full = plan(**RUN, daily_failure_prob=0.001)
    rate_only = plan(devices=RUN["devices"], days=RUN["days"], daily_failure_prob=0.001)
    for key in ("p_no_failure", "expected_failures", "cluster_mtbf_hours"):
        assert getattr(rate_only, key) == getattr(full, key)
    assert all(
        getattr(rate_only, key) is None
        for key in CONTRACT_KEYS - {"p_no_failure", "expected_failures", "cluster_mtbf_hours"}
    )
    assert rate_only.missing == ["ckpt_minutes", "restart_minutes", "cost_per_device_hour"]
    assert rate_only.loss_per_failure_hours() is None
    with_write = plan(
        devices=RUN["devices"], days=RUN["days"], daily_failure_prob=0.001,
        ckpt_minutes=RUN["ckpt_minutes"],
    )  # fmt: skip
    assert with_write.young_interval_hours == full.young_interval_hours
    assert with_write.daly_interval_hours == full.daly_interval_hours
    assert with_write.expected_goodput is None and with_write.compute_cost is None
    assert full.missing == []


def test_plan_command_answers_without_the_cost_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--devices", "1000", "--days", "30", "--daily-failure-prob", "0.001"]
    assert run_plan(_parse(argv)) == 0
    out = capsys.readouterr().out
    assert "chance of none              9.22e-14" in out
    assert "give --ckpt-minutes for the checkpoint interval" in out
    assert "give --cost-per-device-hour for the costs" in out
    assert run_plan(_parse([*argv, "--ckpt-minutes", "5", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == CONTRACT_KEYS | {"inputs"}, "the JSON keys are kept, null when unknown"
    assert data["daly_interval_hours"] > 0 and data["expected_goodput"] is None
    assert data["inputs"]["restart_minutes"] is None


def test_two_tiers_give_each_tier_youngs_interval_for_its_own_failures() -> None:
    from crashproof.telemetry._economics import two_tier

    memory, disk, goodput = two_tier(
        memory_cost=0.01, memory_restart=0.02, disk_cost=0.1, disk_restart=0.2, mtbf=10.0,
        recoverable=0.9,
    )  # fmt: skip
    assert memory == pytest.approx(math.sqrt(2 * 0.01 * 10.0 / 0.9))
    assert disk == pytest.approx(math.sqrt(2 * 0.1 * 10.0 / 0.1))
    lost = 0.9 * (memory / 2 + 0.02) + 0.1 * (disk / 2 + 0.2)
    assert goodput == pytest.approx(1 - 0.01 / memory - 0.1 / disk - lost / 10.0)

    # Each interval is the optimum of the overhead: a step either way costs more.
    def overhead(m: float, d: float) -> float:
        lost = 0.9 * (m / 2 + 0.02) + 0.1 * (d / 2 + 0.2)
        return 0.01 / m + 0.1 / d + lost / 10.0

    for m, d in (
        (memory * 1.1, disk),
        (memory * 0.9, disk),
        (memory, disk * 1.1),
        (memory, disk * 0.9),
    ):
        assert overhead(m, d) > 1 - goodput


def test_the_plan_shows_the_two_tier_gain_only_with_every_input() -> None:
    base = {"devices": 1024, "mtbf_hours": 50000.0, "days": 30.0, "ckpt_minutes": 2.0,
            "restart_minutes": 10.0}  # fmt: skip
    assert plan(**base).two_tier_goodput is None  # type: ignore[arg-type]
    result = plan(
        **base,
        memory_ckpt_minutes=0.05,
        memory_restart_minutes=1.0,
        memory_recoverable=0.9,  # type: ignore[arg-type]
    )
    assert result.two_tier_goodput is not None and result.one_tier_goodput_first_order is not None
    assert result.two_tier_goodput > result.one_tier_goodput_first_order  # cheap, frequent, quick
    assert result.two_tier_disk_interval_hours > result.young_interval_hours  # type: ignore[operator]
    assert "two_tier_goodput" in result.to_json()
    with pytest.raises(ConfigError, match="memory_recoverable"):
        plan(**base, memory_ckpt_minutes=0.05, memory_restart_minutes=1.0, memory_recoverable=1.0)  # type: ignore[arg-type]
