"""``crashproof plan``: before a run starts, what its failures will cost and how often to checkpoint.

Owns the step from a run's size, length, failure rate and costs to a :class:`Plan`; the
``plan`` subcommand that prints one is :mod:`crashproof.cli`'s. The formulas are
:mod:`crashproof.telemetry._economics`'s; this module only converts units and picks the
operating point. docs/planning.md derives the model,
states its limits and reproduces the worked examples of the literature with it.

No input has a default: a plan is only as good as its assumptions, and a default would hide one.
What needs only the run's size, length and failure rate (the chance of no failure, the expected
failures, the cluster's MTBF) is given without the rest; the checkpoint interval also needs the
checkpoint's cost, the goodput the restart time, the money the price. An output whose inputs are
missing is None, and :attr:`Plan.missing` names what it would take.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from crashproof.errors import ConfigError
from crashproof.telemetry._economics import (
    _devices,
    _non_negative,
    _positive,
    _probability,
    cluster_mtbf,
    daily_prob_from_mtbf_hours,
    daly_interval,
    device_mtbf,
    expected_failures,
    expected_goodput,
    expected_loss_per_failure,
    mtbf_hours_from_daily_prob,
    p_no_failure,
    two_tier,
    young_interval,
)

__all__ = ["Plan", "PlanInputs", "plan"]


_RATES = ("mtbf_hours", "daily_failure_prob", "cluster_mtbf_hours")
_MEMORY_INPUTS = ("memory_ckpt_minutes", "memory_restart_minutes", "memory_recoverable")
_TWO_TIER_OUTPUTS = (
    "memory_interval_hours",
    "two_tier_disk_interval_hours",
    "two_tier_goodput",
    "one_tier_goodput_first_order",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInputs:
    """What a plan assumes. Exactly one of the three failure rates is given."""

    devices: int
    """Devices in the job (GPUs, or nodes: whatever unit fails as one)."""
    days: float
    """Wall-clock length of the run, in days."""
    ckpt_minutes: float | None = None
    """What one checkpoint costs training: the time the loop pauses to save (needed for the
    checkpoint interval and everything that follows from it)."""
    restart_minutes: float | None = None
    """From a failure to training again: detection, relaunch, loading the checkpoint (may be 0;
    needed for the goodput and the failure cost)."""
    cost_per_device_hour: float | None = None
    """The price of one device for one hour, in any currency (may be 0; needed for the costs)."""
    mtbf_hours: float | None = None
    """Mean time between failures of one device, in hours."""
    daily_failure_prob: float | None = None
    """The chance that one device fails on a given day."""
    cluster_mtbf_hours: float | None = None
    """Mean time between failures of the whole job, in hours."""
    memory_ckpt_minutes: float | None = None
    """What one snapshot into ``crashproof run``'s agent memory costs training (the copy); with
    the two below, the plan adds the two-tier scheme (docs/recovery.md)."""
    memory_restart_minutes: float | None = None
    """From a failure to training again when the state comes from memory."""
    memory_recoverable: float | None = None
    """The share of failures the agent's memory survives (a crashed or hung trainer on a live
    node), in (0, 1); the others (a lost node) need the disk."""

    def __post_init__(self) -> None:
        given = [name for name in _RATES if getattr(self, name) is not None]
        if len(given) != 1:
            raise ConfigError(
                "give exactly one failure rate: mtbf_hours (per device), daily_failure_prob "
                f"(per device) or cluster_mtbf_hours; got {', '.join(given) or 'none'}"
            )
        try:  # the economics' own checks, raised as the configuration error they are here
            _devices(self.devices)
            _positive("days", self.days)
            if self.ckpt_minutes is not None:
                _positive("ckpt_minutes", self.ckpt_minutes)
            if self.restart_minutes is not None:
                _non_negative("restart_minutes", self.restart_minutes)
            if self.cost_per_device_hour is not None:
                _non_negative("cost_per_device_hour", self.cost_per_device_hour)
            if self.mtbf_hours is not None:
                _positive("mtbf_hours", self.mtbf_hours)
            if self.daily_failure_prob is not None:
                _probability("daily_failure_prob", self.daily_failure_prob, zero_ok=False)
            if self.cluster_mtbf_hours is not None:
                _positive("cluster_mtbf_hours", self.cluster_mtbf_hours)
            if self.memory_ckpt_minutes is not None:
                _positive("memory_ckpt_minutes", self.memory_ckpt_minutes)
            if self.memory_restart_minutes is not None:
                _non_negative("memory_restart_minutes", self.memory_restart_minutes)
            if self.memory_recoverable is not None:
                _probability("memory_recoverable", self.memory_recoverable, zero_ok=False)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def rates(self) -> tuple[float, float, float]:
        """The failure rate in all three forms: per-device MTBF (hours), per-device daily
        failure probability, cluster MTBF (hours). The one given is returned as given, so that a
        worked example's ``0.999 ** 1000`` is computed from 0.999, not from a round trip."""
        if self.daily_failure_prob is not None:
            p = self.daily_failure_prob
            per_device = mtbf_hours_from_daily_prob(p)
            return per_device, p, cluster_mtbf(per_device, self.devices)
        if self.mtbf_hours is not None:
            per_device = self.mtbf_hours
            cluster = cluster_mtbf(per_device, self.devices)
        else:
            assert self.cluster_mtbf_hours is not None  # __post_init__: exactly one is set
            cluster = self.cluster_mtbf_hours
            per_device = device_mtbf(cluster, self.devices)
        return per_device, daily_prob_from_mtbf_hours(per_device), cluster


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What failures will do to a run. :meth:`to_json`'s keys are a contract: keep them."""

    inputs: PlanInputs
    p_no_failure: float
    """The chance that the whole run sees no failure at all."""
    expected_failures: float
    """Failures expected over the run's wall time."""
    cluster_mtbf_hours: float
    """The job's MTBF: the per-device MTBF over the number of devices."""
    young_interval_hours: float | None
    """Young's optimum checkpoint interval, ``sqrt(2 C M)`` (C: write, M: cluster MTBF); None
    without ``ckpt_minutes``."""
    daly_interval_hours: float | None
    """Daly's higher-order optimum interval: the operating point of the three fields below; None
    without ``ckpt_minutes``."""
    expected_overhead_fraction: float | None
    """Share of the wall time lost to writes, failures and restarts, saving at Daly's interval;
    None without ``ckpt_minutes`` and ``restart_minutes``."""
    expected_goodput: float | None
    """``1 - expected_overhead_fraction``: the share left for training (None as it is)."""
    compute_cost: float | None
    """``devices * days * 24 * cost_per_device_hour``: the bill for the whole allocation; None
    without the price."""
    expected_failure_cost: float | None
    """What failures waste: ``expected_failures * loss per failure * devices * price``, the loss
    being about ``(daly + C) / 2 + R`` (:func:`plan` says why); None without the price, the
    checkpoint cost or the restart time."""
    memory_interval_hours: float | None = None
    """Two tiers: Young's interval of the memory snapshots, ``sqrt(2 C_m M / p)``; None without
    the memory inputs (and the checkpoint's cost and restart time)."""
    two_tier_disk_interval_hours: float | None = None
    """Two tiers: Young's interval of the disk checkpoints, ``sqrt(2 C M / (1 - p))``: longer
    than one tier's, the disk now covering only the failures memory does not survive."""
    two_tier_goodput: float | None = None
    """Two tiers: the share of wall time left for training, to first order
    (:func:`~crashproof.telemetry._economics.two_tier`)."""
    one_tier_goodput_first_order: float | None = None
    """Disk checkpoints alone at Young's interval, to the same first order
    (``1 - sqrt(2 C / M) - R / M``): what ``two_tier_goodput`` compares with."""

    @property
    def missing(self) -> list[str]:
        """The inputs not given (``ckpt_minutes``, ``restart_minutes``, ``cost_per_device_hour``),
        each of which some output needs."""
        i = self.inputs
        optional = ("ckpt_minutes", "restart_minutes", "cost_per_device_hour")
        # (The memory inputs are an option of their own, not something an output misses.)
        return [name for name in optional if getattr(i, name) is None]

    def loss_per_failure_hours(self) -> float | None:
        """The wall time one failure costs the job, saving at Daly's interval
        (:func:`expected_loss_per_failure`); None without the checkpoint cost or restart time."""
        i = self.inputs
        if self.daly_interval_hours is None or i.ckpt_minutes is None or i.restart_minutes is None:
            return None
        return expected_loss_per_failure(
            self.daly_interval_hours,
            i.ckpt_minutes / 60.0,
            i.restart_minutes / 60.0,
            self.cluster_mtbf_hours,
        )

    def to_json(self) -> dict[str, Any]:
        """The outputs under their own names, and the inputs under ``"inputs"``."""
        out: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "inputs"
        }
        out["inputs"] = dataclasses.asdict(self.inputs)
        # The two-tier scheme's keys, inputs and outputs, only in a plan that asked for it.
        asked = any(out["inputs"][name] is not None for name in _MEMORY_INPUTS)
        if not asked:
            for name in _MEMORY_INPUTS:
                del out["inputs"][name]
            for name in _TWO_TIER_OUTPUTS:
                del out[name]
        return out


def plan(
    *,
    devices: int,
    days: float,
    ckpt_minutes: float | None = None,
    restart_minutes: float | None = None,
    cost_per_device_hour: float | None = None,
    mtbf_hours: float | None = None,
    daily_failure_prob: float | None = None,
    cluster_mtbf_hours: float | None = None,
    memory_ckpt_minutes: float | None = None,
    memory_restart_minutes: float | None = None,
    memory_recoverable: float | None = None,
) -> Plan:
    """The :class:`Plan` of a run (arguments: :class:`PlanInputs`'s fields).

    The overhead, goodput and failure cost assume checkpoints at Daly's interval: of the two, it
    is the closer to the optimum of the exact model that :func:`expected_goodput` evaluates.

    The failure cost charges each expected failure with the wall time it costs the whole job (a
    synchronous job stops as a whole, so on every device), at the job's hourly price. That time
    is :func:`expected_loss_per_failure`: about half the segment of compute and write in progress
    plus the restart, ``(interval + C) / 2 + R``, when failures are rare against the interval, and
    exact in the model otherwise, so the failure cost never exceeds the compute cost. The writes
    of the checkpoints themselves are not a failure cost: the failure cost and the writes
    together are the overhead.

    Raises :class:`~crashproof.errors.ConfigError` (a ``ValueError``) on a bad input, naming it.
    """
    inputs = PlanInputs(
        devices=devices,
        days=days,
        ckpt_minutes=ckpt_minutes,
        restart_minutes=restart_minutes,
        cost_per_device_hour=cost_per_device_hour,
        mtbf_hours=mtbf_hours,
        daily_failure_prob=daily_failure_prob,
        cluster_mtbf_hours=cluster_mtbf_hours,
        memory_ckpt_minutes=memory_ckpt_minutes,
        memory_restart_minutes=memory_restart_minutes,
        memory_recoverable=memory_recoverable,
    )
    per_device_mtbf, daily_prob, cluster = inputs.rates()
    failures = expected_failures(devices, days, per_device_mtbf)
    write_h = None if ckpt_minutes is None else ckpt_minutes / 60.0
    restart_h = None if restart_minutes is None else restart_minutes / 60.0
    # The whole job's price per wall-clock hour.
    hourly = None if cost_per_device_hour is None else devices * cost_per_device_hour
    young = daly = goodput = lost_h = None
    if write_h is not None:
        young, daly = young_interval(write_h, cluster), daly_interval(write_h, cluster)
        if restart_h is not None:
            goodput = expected_goodput(daly, write_h, restart_h, cluster)
            lost_h = expected_loss_per_failure(daly, write_h, restart_h, cluster)
    return Plan(
        inputs=inputs,
        # From the probability when that was given (a worked example's 0.999 ** 1000 exactly),
        # else from the rate: a per-device MTBF under ~40 minutes rounds its daily probability
        # to 1.0.
        p_no_failure=(
            p_no_failure(devices, daily_prob, days)
            if daily_failure_prob is not None
            else math.exp(-days * 24.0 / cluster)
        ),
        expected_failures=failures,
        cluster_mtbf_hours=cluster,
        young_interval_hours=young,
        daly_interval_hours=daly,
        expected_overhead_fraction=None if goodput is None else 1.0 - goodput,
        expected_goodput=goodput,
        compute_cost=None if hourly is None else days * 24.0 * hourly,
        expected_failure_cost=None
        if hourly is None or lost_h is None
        else failures * lost_h * hourly,
        **_two_tier(inputs, cluster),
    )


def _two_tier(inputs: PlanInputs, cluster: float) -> dict[str, float | None]:
    """The two-tier fields of a plan, when its memory inputs (and the disk's) are given."""
    i = inputs
    given = (i.memory_ckpt_minutes, i.memory_restart_minutes, i.memory_recoverable)
    if None in given or i.ckpt_minutes is None or i.restart_minutes is None:
        return {}
    assert i.memory_ckpt_minutes is not None and i.memory_restart_minutes is not None
    assert i.memory_recoverable is not None
    write_h, restart_h = i.ckpt_minutes / 60.0, i.restart_minutes / 60.0
    memory, disk, goodput = two_tier(
        memory_cost=i.memory_ckpt_minutes / 60.0,
        memory_restart=i.memory_restart_minutes / 60.0,
        disk_cost=write_h,
        disk_restart=restart_h,
        mtbf=cluster,
        recoverable=i.memory_recoverable,
    )
    one_tier = 1.0 - math.sqrt(2.0 * write_h / cluster) - restart_h / cluster
    return {
        "memory_interval_hours": memory,
        "two_tier_disk_interval_hours": disk,
        "two_tier_goodput": goodput,
        "one_tier_goodput_first_order": min(1.0, max(0.0, one_tier)),
    }
