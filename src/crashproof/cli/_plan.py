"""``crashproof plan``: the options of a :class:`~crashproof.telemetry.Plan`, and the plan
printed as a table or as JSON. The planning itself is :func:`crashproof.telemetry.plan`'s.

The run's size, length and failure rate are required; the checkpoint's cost, the restart time and
the price are not: without them the plan gives what it can and says which flag the rest needs.
"""

from __future__ import annotations

import argparse
import math
import re

from crashproof._console import say
from crashproof.cli._conventions import finite_number, print_json
from crashproof.exitcodes import EXIT_OK, EXIT_USAGE
from crashproof.telemetry import Plan, plan

__all__ = ["add_plan_parser", "run_plan"]


def add_plan_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``plan`` on ``crashproof``'s subcommands; it dispatches through ``func``."""
    p = subparsers.add_parser(
        "plan",
        help="what failures will cost a run, and how often it should checkpoint",
        description="Expected failures, Young's and Daly's checkpoint intervals, goodput and cost "
        "of a run, assuming independent exponential failures (docs/planning.md).",
    )
    p.add_argument("--devices", type=int, required=True, metavar="N", help="devices in the job")
    rate = p.add_mutually_exclusive_group(required=True)
    rate.add_argument("--mtbf-hours", type=finite_number(), metavar="H", help="MTBF of one device")
    rate.add_argument(
        "--daily-failure-prob",
        type=finite_number(),
        metavar="P",
        help="chance one device fails in a day",
    )
    rate.add_argument(
        "--cluster-mtbf-hours", type=finite_number(), metavar="H", help="MTBF of the whole job"
    )
    p.add_argument(
        "--days", type=finite_number(), required=True, help="wall-clock length of the run"
    )
    p.add_argument(
        "--ckpt-minutes",
        type=finite_number(),
        metavar="MIN",
        help="time training pauses for one checkpoint (for the checkpoint interval and goodput)",
    )
    p.add_argument(
        "--restart-minutes",
        type=finite_number(),
        metavar="MIN",
        help="from a failure to training again: detect, relaunch, load (for the goodput)",
    )
    p.add_argument(
        "--cost-per-device-hour",
        type=finite_number(),
        metavar="PRICE",
        help="price of one device for an hour, any currency (for the costs)",
    )
    p.add_argument(
        "--memory-ckpt-minutes",
        type=finite_number(),
        metavar="MIN",
        help="time training pauses for one snapshot into crashproof run's agent memory; with "
        "the two below, the plan adds frequent memory snapshots beside the disk checkpoints",
    )
    p.add_argument(
        "--memory-restart-minutes",
        type=finite_number(),
        metavar="MIN",
        help="from a failure to training again when the state comes from memory",
    )
    p.add_argument(
        "--memory-recoverable",
        type=finite_number(),
        metavar="P",
        help="share of failures the agent's memory survives (a crashed or hung trainer on a live "
        "node), between 0 and 1",
    )
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    """``crashproof plan``: print the plan; exit 2, saying why, on a bad input."""
    try:
        result = plan(
            devices=args.devices,
            days=args.days,
            ckpt_minutes=args.ckpt_minutes,
            restart_minutes=args.restart_minutes,
            cost_per_device_hour=args.cost_per_device_hour,
            mtbf_hours=args.mtbf_hours,
            daily_failure_prob=args.daily_failure_prob,
            cluster_mtbf_hours=args.cluster_mtbf_hours,
            memory_ckpt_minutes=args.memory_ckpt_minutes,
            memory_restart_minutes=args.memory_restart_minutes,
            memory_recoverable=args.memory_recoverable,
        )
    except (ValueError, OverflowError) as exc:
        say("crashproof", f"plan: {_as_flags(str(exc))}")
        return EXIT_USAGE
    beyond = _infinite(result.to_json())
    if beyond:  # e.g. an MTBF of 1e-308 hours: more failures than a float holds
        given = " ".join(
            f"{_flag(n)} {getattr(args, n)}" for n in _INPUTS if getattr(args, n) is not None
        )
        say("crashproof", f"plan: {given}: the {', '.join(beyond)} of these inputs are beyond any "
            "number (infinite); give a realistic failure rate and run length")  # fmt: skip
        return EXIT_USAGE
    if args.json:
        print_json(result.to_json())
    else:
        print(_table(result))
    return EXIT_OK


def _infinite(value: object, key: str = "") -> list[str]:
    """The keys of ``value`` (nested) holding a number that is not finite."""
    if isinstance(value, dict):
        return [k for name, v in value.items() for k in _infinite(v, name)]
    return [key] if isinstance(value, float) and not math.isfinite(value) else []


_INPUTS = (
    "devices",
    "days",
    "ckpt_minutes",
    "restart_minutes",
    "cost_per_device_hour",
    "mtbf_hours",
    "daily_failure_prob",
    "cluster_mtbf_hours",
    "memory_ckpt_minutes",
    "memory_restart_minutes",
    "memory_recoverable",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _as_flags(message: str) -> str:
    """The planner's message, with each input named by its flag (``--daily-failure-prob``)."""
    return re.sub(rf"\b({'|'.join(_INPUTS)})\b", lambda m: _flag(m.group(1)), message)


def _needs(names: list[str], what: str) -> str:
    return f"  give {' and '.join(_flag(n) for n in names)} for {what}"


def _table(r: Plan) -> str:
    i = r.inputs
    per_device_mtbf, daily_prob, _ = i.rates()
    rows = [
        f"{_count(i.devices, 'device')} for {_count(i.days, 'day')} "
        f"({i.devices * i.days * 24:,.0f} device-hours)",
        "failures",
        f"  chance of none              {r.p_no_failure:.3g}",
        f"  expected                    {r.expected_failures:.3g}",
        f"  cluster MTBF                {r.cluster_mtbf_hours:,.2f} h",
        f"  per device                  MTBF {per_device_mtbf:,.0f} h, "
        f"daily failure probability {daily_prob:.3g}",
    ]
    if r.young_interval_hours is None or r.daly_interval_hours is None:
        rows += ["checkpoints", _needs(["ckpt_minutes"], "the checkpoint interval")]
    else:
        restart = "" if i.restart_minutes is None else f", {i.restart_minutes:g} min to restart"
        rows += [
            f"checkpoints ({i.ckpt_minutes:g} min to write{restart})",
            f"  Young interval sqrt(2CM)    {_hours(r.young_interval_hours)}",
            f"  Daly interval               {_hours(r.daly_interval_hours)}  <- assumed below",
        ]
        lost = r.loss_per_failure_hours()
        if r.expected_overhead_fraction is None or r.expected_goodput is None or lost is None:
            rows.append(_needs(["restart_minutes"], "the goodput"))
        else:
            rows += [
                f"  expected overhead           {r.expected_overhead_fraction:.1%}",
                f"  expected goodput            {r.expected_goodput:.1%}",
                f"  lost per failure            {_hours(lost)}",
            ]
    rows += _two_tier_rows(r)
    if r.compute_cost is None:
        rows += ["cost", _needs(["cost_per_device_hour"], "the costs")]
    else:
        rows += [
            f"cost (at {i.cost_per_device_hour:,.2f} per device-hour)",
            f"  compute                     {r.compute_cost:,.0f}",
        ]
        if r.expected_failure_cost is None:
            rows.append(
                _needs([n for n in r.missing if n != "cost_per_device_hour"], "the failure cost")
            )
        else:
            rows.append(f"  expected failure cost       {r.expected_failure_cost:,.0f}")
    return "\n".join(rows)


def _two_tier_rows(r: Plan) -> list[str]:
    """The two-tier scheme, when asked for (a memory input given)."""
    i = r.inputs
    memory = ("memory_ckpt_minutes", "memory_restart_minutes", "memory_recoverable")
    if all(getattr(i, n) is None for n in memory):
        return []
    if r.memory_interval_hours is None or r.two_tier_disk_interval_hours is None:
        needed = [n for n in (*memory, "ckpt_minutes", "restart_minutes") if getattr(i, n) is None]
        return ["memory snapshots beside disk checkpoints", _needs(needed, "the two-tier plan")]
    assert r.two_tier_goodput is not None and r.one_tier_goodput_first_order is not None
    gain = r.two_tier_goodput - r.one_tier_goodput_first_order
    return [
        f"memory snapshots beside disk checkpoints ({i.memory_recoverable:.0%} of failures "
        f"recover from memory, {i.memory_ckpt_minutes:g} min a snapshot, "
        f"{i.memory_restart_minutes:g} min to restart)",
        f"  memory interval             {_hours(r.memory_interval_hours)}",
        f"  disk interval               {_hours(r.two_tier_disk_interval_hours)}",
        f"  expected goodput            {r.two_tier_goodput:.1%} (disk alone, same model: "
        f"{r.one_tier_goodput_first_order:.1%}; {gain:+.1%})",
    ]


def _hours(h: float) -> str:
    return f"{h:,.2f} h ({h * 60:,.0f} min)"


def _count(n: float, unit: str) -> str:
    return f"{n:,g} {unit}" + ("" if n == 1 else "s")
