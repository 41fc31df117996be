"""The campaign's verdict: the JSON report, the table and the summary line.

A campaign **passes** when the run succeeded, every fault injected was detected (or needed no
detection: a corrupted checkpoint the restore never read, see ``not_needed``) and recovered from,
every fault given explicitly (``--fault``) was injected, and, with ``--compare-baseline``, the
final checkpoint is bit for bit the baseline's. ETTR comes from the goodput ledger
(:func:`crashproof.telemetry.read_ledger`), the same arithmetic as ``crashproof report``.
"""

from __future__ import annotations

import os
from typing import Any

from crashproof._console import wrapped_cell
from crashproof._files import write_json_atomically
from crashproof.chaos._analysis import Injection
from crashproof.chaos._baseline import Comparison
from crashproof.chaos._campaign import CampaignResult

__all__ = ["build_report", "ettr_of", "format_table", "summary_line", "write_report"]


def ettr_of(run_dir: str) -> tuple[float | None, str]:
    """The run's effective training time ratio and where it comes from."""
    from crashproof.telemetry import read_ledger

    try:
        ledger = read_ledger(run_dir)
    except (OSError, ValueError, KeyError) as exc:
        return None, f"unavailable: {exc}"
    return round(ledger.ettr, 4), "goodput ledger"


def build_report(
    *,
    result: CampaignResult,
    run_dir: str,
    seed: int,
    explicit: bool,
    baseline: Comparison | None,
    baseline_exitcode: int | None,
    baseline_run_dir: str | None,
) -> dict[str, Any]:
    injections = result.injections
    ettr, ettr_source = ettr_of(run_dir)
    passed = (
        result.exitcode == 0
        and bool(injections)
        and all(i.passed for i in injections)
        and not (explicit and result.not_injected)
        and not result.blocked
        and (baseline is None or (baseline.identical and baseline_exitcode == 0))
    )
    return {
        "run_dir": run_dir,
        "seed": seed,
        "faults": [i.to_json() for i in injections],
        "not_injected": [
            {**f.to_json(), "blocked": result.blocked.get(f.id)} for f in result.not_injected
        ],
        "injected": len(injections),
        "detected": sum(i.detected for i in injections),
        "recovered": sum(i.recovered for i in injections),
        "not_needed": sum(i.not_needed is not None for i in injections),
        "lost_steps": sum(i.lost_steps for i in injections),
        "run": {
            "exitcode": result.exitcode,
            "outcome": result.outcome,
            "wall_s": round(result.wall_s, 3),
            "timed_out": result.timed_out,
        },
        "ettr": ettr,
        "ettr_source": ettr_source,
        "baseline": None
        if baseline is None
        else {
            **baseline.to_json(),
            "run_dir": baseline_run_dir,
            "exitcode": baseline_exitcode,
        },
        "passed": passed,
    }


def write_report(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json_atomically(path, report, indent=2, durable=True)


def _yes(value: bool) -> str:
    return "yes" if value else "NO"


def format_table(injections: list[Injection]) -> list[str]:
    """One line per fault: kind, when, rank, step, detected by, recovered, lost steps."""
    header = f"{'fault':<5} {'kind':<9} {'at':>7} {'rank':>4} {'step':>6}  {'detected by':<58} {'recovered':<9} {'lost steps':>10}"
    lines = [header]
    for i in injections:
        said = i.detected_by or (f"not needed: {i.not_needed}" if i.not_needed else "NOT DETECTED")
        first, *more = wrapped_cell(said, 58)
        lead = f"{i.fault.id:<5} {i.fault.kind:<9} {i.at_s:>6.1f}s {i.fault.rank:>4} {i.step:>6}  "
        lines.append(f"{lead}{first:<58} {_yes(i.recovered):<9} {i.lost_steps:>10}")
        lines += [" " * len(lead) + line for line in more]  # the rest of the words, not cut
    return lines


def summary_line(report: dict[str, Any]) -> str:
    parts = [
        f"{report['injected']} fault(s) injected, {report['detected']} detected, "
        f"{report['recovered']} recovered, {report['lost_steps']} step(s) recomputed",
    ]
    if report["not_needed"]:
        parts.append(f"{report['not_needed']} needed no detection (see not_needed)")
    blocked = sum(f["blocked"] is not None for f in report["not_injected"])
    if len(report["not_injected"]) > blocked:
        ended = len(report["not_injected"]) - blocked
        parts.append(f"{ended} not injected (the run ended first)")
    if blocked:
        parts.append(f"{blocked} never injectable though due (see not_injected)")
    run = report["run"]
    parts.append(f"run {run['outcome'] or 'did not end'} (exit {run['exitcode']})")
    if report["ettr"] is not None:
        parts.append(f"ETTR {report['ettr']:.3f}")
    baseline = report["baseline"]
    if baseline is not None:
        if baseline["identical"]:
            parts.append(
                f"final state bit-identical to the baseline (step {baseline['step']}, "
                f"{baseline['tensors']} tensors)"
            )
        else:
            why = baseline["problem"] or "; ".join(baseline["differences"][:3])
            parts.append(f"final state DIFFERS from the baseline: {why}")
    return "; ".join(parts) + (": PASSED" if report["passed"] else ": FAILED")
