"""Failure economics: how often a job fails, how often it should checkpoint, and what it keeps.

Pure functions of a few numbers, standard library only, so the planner (``crashproof plan``), the
adaptive save policies (:class:`crashproof.policy.Young`, :class:`crashproof.policy.Daly`) and a
notebook all compute the same thing. This module does not measure anything: the policies measure
checkpoint costs and failures; the run's real goodput comes from its event log.

The failure model, and its conventions (docs/planning.md has the derivations and the limits):

- Failures of each device arrive as a Poisson process (exponential times between failures,
  independent devices, a failed device repaired at once). A daily failure probability ``p`` and a
  per-device MTBF in hours are two names for one rate: ``p = 1 - exp(-24 / mtbf)``, so
  ``mtbf = -24 / ln(1 - p)``.
- A synchronous job stops when any one of its devices fails, so the job's (cluster) MTBF is the
  device MTBF divided by the number of devices.
- Young's and Daly's intervals are the compute time between the ends of two checkpoints, not
  counting the write; the functions that take a cost and an MTBF work in any one unit of time.

Sources: J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM
17(9), 1974; J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", Future Generation Computer Systems 22(3), 2006.
"""

from __future__ import annotations

import math
import operator

__all__ = [
    "cluster_mtbf",
    "daily_prob_from_mtbf_hours",
    "daly_interval",
    "device_mtbf",
    "expected_failures",
    "expected_goodput",
    "expected_loss_per_failure",
    "expected_overhead",
    "mtbf_hours_from_daily_prob",
    "p_no_failure",
    "two_tier",
    "young_interval",
]

_HOURS_PER_DAY = 24.0


def _positive(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _devices(value: int) -> int:
    try:
        count = operator.index(value)  # an int, or NumPy's; 2.5 devices is a mistake, not 2
    except TypeError:
        raise ValueError(f"devices must be a whole number >= 1, got {value!r}") from None
    if count < 1:
        raise ValueError(f"devices must be a whole number >= 1, got {value!r}")
    return count


def _probability(name: str, value: float, *, zero_ok: bool) -> float:
    low_ok = value >= 0 if zero_ok else value > 0
    if not (math.isfinite(value) and low_ok and value < 1):
        interval = "[0, 1)" if zero_ok else "(0, 1)"
        raise ValueError(f"{name} must be a probability in {interval}, got {value!r}")
    return float(value)


def p_no_failure(devices: int, daily_failure_prob: float, days: float) -> float:
    """The chance that none of ``devices`` fails in ``days``: ``(1 - p) ** (devices * days)``.

    Computed as ``exp(devices * days * log1p(-p))``, which keeps its precision for the tiny ``p``
    of real hardware. ``p = 0`` (never fails) is allowed and gives 1.
    """
    n = _devices(devices)
    p = _probability("daily_failure_prob", daily_failure_prob, zero_ok=True)
    d = _positive("days", days)
    return math.exp(n * d * math.log1p(-p))


def mtbf_hours_from_daily_prob(daily_failure_prob: float) -> float:
    """A device's MTBF in hours from its daily failure probability: ``-24 / ln(1 - p)``.

    Slightly less than ``24 / p``: a device that fails early in a day is repaired and can fail
    again the same day, so the rate behind a daily probability ``p`` is ``-ln(1 - p) > p``.
    """
    p = _probability("daily_failure_prob", daily_failure_prob, zero_ok=False)
    return -_HOURS_PER_DAY / math.log1p(-p)


def daily_prob_from_mtbf_hours(mtbf_hours: float) -> float:
    """A device's daily failure probability from its MTBF in hours: ``1 - exp(-24 / mtbf)``."""
    return -math.expm1(-_HOURS_PER_DAY / _positive("mtbf_hours", mtbf_hours))


def cluster_mtbf(device_mtbf: float, devices: int) -> float:
    """The job's MTBF when any one device failing stops it: ``device_mtbf / devices``."""
    return _positive("device_mtbf", device_mtbf) / _devices(devices)


def device_mtbf(cluster_mtbf: float, devices: int) -> float:
    """The per-device MTBF behind a job's MTBF: ``cluster_mtbf * devices``."""
    return _positive("cluster_mtbf", cluster_mtbf) * _devices(devices)


def expected_failures(devices: int, days: float, device_mtbf_hours: float) -> float:
    """Failures expected in ``days``: ``devices * days * 24 / device_mtbf_hours``, which is also
    ``days * 24 / cluster_mtbf_hours``."""
    hours = _positive("days", days) * _HOURS_PER_DAY
    return _devices(devices) * hours / _positive("device_mtbf_hours", device_mtbf_hours)


def young_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Young's optimum checkpoint interval, ``sqrt(2 C M)``, in the unit of ``C`` and ``M``.

    It minimises the first-order overhead ``C / tau + tau / (2 M)``: the share of time spent
    writing, plus the half interval lost, on average, at each failure.
    """
    c = _positive("checkpoint_cost", checkpoint_cost)
    return math.sqrt(2.0 * c * _positive("mtbf", mtbf))


def daly_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum interval, in the unit of ``C`` and ``M``::

        sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C    when C < 2M
        M                                                          otherwise

    A perturbation solution for the optimum of :func:`expected_goodput`'s exact model. When
    ``C < 2M`` it is between ``5C/9`` and ``2C/3`` shorter than Young's; its goodput stays within
    0.2% of the best even where a checkpoint costs as much as the MTBF, where Young's loses 12%.
    """
    c = _positive("checkpoint_cost", checkpoint_cost)
    m = _positive("mtbf", mtbf)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def expected_goodput(
    interval: float, checkpoint_cost: float, restart_cost: float, mtbf: float
) -> float:
    """The expected share of wall time that is useful training, in [0, 1].

    Daly's complete model: the job computes for ``tau`` (``interval``), writes for ``C``, and a
    failure (exponential, mean ``M``, possibly during a write or a restart) costs a restart ``R``
    and the segment in progress. The expected wall time per unit of useful work is then
    ``M * exp(R / M) * (exp((tau + C) / M) - 1) / tau``, and the goodput is its inverse. Evaluated
    in logarithms so that intervals far longer than the MTBF give a tiny goodput, not an overflow.
    All four arguments in one unit of time; ``restart_cost`` may be 0.
    """
    tau = _positive("interval", interval)
    c = _positive("checkpoint_cost", checkpoint_cost)
    r = _non_negative("restart_cost", restart_cost)
    m = _positive("mtbf", mtbf)
    x = (tau + c) / m
    # ln(exp(x) - 1): expm1 is exact for small x, and overflows for x > ~709 where this does not
    log_expm1 = math.log(math.expm1(x)) if x < 30.0 else x + math.log1p(-math.exp(-x))
    goodput = math.exp(math.log(tau / m) - r / m - log_expm1)
    return min(1.0, max(0.0, goodput))  # at most tau / (tau + C) < 1 exactly; clip the rounding


def expected_overhead(
    interval: float, checkpoint_cost: float, restart_cost: float, mtbf: float
) -> float:
    """The expected share of wall time lost to checkpoint writes, failures and restarts:
    ``1 - expected_goodput(...)`` (same arguments)."""
    return 1.0 - expected_goodput(interval, checkpoint_cost, restart_cost, mtbf)


def expected_loss_per_failure(
    interval: float, checkpoint_cost: float, restart_cost: float, mtbf: float
) -> float:
    """The wall time one failure costs, on average, in :func:`expected_goodput`'s model.

    Of the wall time, a share ``g`` (the goodput) is useful, ``g * C / tau`` goes to the writes
    of the segments that complete, and the rest to failures: the compute and writes of the
    segments they interrupt, and the restarts (including restarts that fail). Failures arrive
    every ``M`` of wall time, so each costs ``M * (1 - g * (tau + C) / tau)``. When ``tau``, ``C``
    and ``R`` are small against ``M`` this is the familiar ``(tau + C) / 2 + R``: half the
    segment in progress plus the restart; it is always less than that, and never more than ``M``.
    """
    goodput = expected_goodput(interval, checkpoint_cost, restart_cost, mtbf)
    kept = goodput * (interval + checkpoint_cost) / interval  # useful plus completed writes
    return mtbf * max(0.0, 1.0 - kept)


def two_tier(
    *,
    memory_cost: float,
    memory_restart: float,
    disk_cost: float,
    disk_restart: float,
    mtbf: float,
    recoverable: float,
) -> tuple[float, float, float]:
    """Frequent snapshots in memory beside rare checkpoints on disk: Young's interval for each,
    and the goodput. Returns ``(memory interval, disk interval, goodput)``.

    A share ``recoverable`` of the failures (``p``: a crashed or hung process, its node alive)
    resumes from the newest memory snapshot, the others (a lost node) from the newest checkpoint
    on disk. Each kind of failure arrives at its own rate, ``p / M`` and ``(1 - p) / M``, and
    each tier is a Young problem of its own: ``m = sqrt(2 C_m M / p)``,
    ``d = sqrt(2 C_d M / (1 - p))``. To first order the wall time lost is the writes of both
    and, per failure, half the interval of its tier plus its restart::

        overhead = C_m / m + C_d / d + (p (m / 2 + R_m) + (1 - p) (d / 2 + R_d)) / M

    and the goodput is ``1 - overhead`` (clipped to [0, 1]). First order: accurate while both
    intervals and restarts are small against the MTBF, as :func:`expected_goodput`'s
    ``sqrt(2 C / M) + R / M`` is for one tier. ``0 < recoverable < 1``; costs in one unit.
    """
    p = _probability("recoverable", recoverable, zero_ok=False)  # (below 1: a lost node)
    c_m, c_d = _positive("memory_cost", memory_cost), _positive("disk_cost", disk_cost)
    r_m = _non_negative("memory_restart", memory_restart)
    r_d = _non_negative("disk_restart", disk_restart)
    m_total = _positive("mtbf", mtbf)
    memory = young_interval(c_m, m_total / p)
    disk = young_interval(c_d, m_total / (1.0 - p))
    lost = p * (memory / 2.0 + r_m) + (1.0 - p) * (disk / 2.0 + r_d)
    overhead = c_m / memory + c_d / disk + lost / m_total
    return memory, disk, min(1.0, max(0.0, 1.0 - overhead))
