"""Goodput from Python: what failures will cost a run (:func:`plan`, as ``crashproof plan``)
and what they did cost it (:func:`read_ledger`, as ``crashproof report``).

The code lives in :mod:`crashproof.telemetry`; this module keeps the documented import path.
"""

from __future__ import annotations

from crashproof.telemetry import (
    Breakdown,
    FailureRecord,
    Ledger,
    Marker,
    Plan,
    TimelinePoint,
    compute_ledger,
    daly_interval,
    format_summary,
    plan,
    read_ledger,
    write_html_report,
    young_interval,
)

__all__ = [
    "Breakdown",
    "FailureRecord",
    "Ledger",
    "Marker",
    "Plan",
    "TimelinePoint",
    "compute_ledger",
    "daly_interval",
    "format_summary",
    "plan",
    "read_ledger",
    "write_html_report",
    "young_interval",
]
