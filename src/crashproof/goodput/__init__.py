"""Goodput: what failures will cost a run (``crashproof plan``) and what they did cost it (the
ledger and ``crashproof report``)."""

from __future__ import annotations

from crashproof.goodput._economics import daly_interval, young_interval
from crashproof.goodput._ledger import (
    Breakdown,
    FailureRecord,
    Ledger,
    Marker,
    TimelinePoint,
    compute_ledger,
    read_ledger,
)
from crashproof.goodput._planner import Plan, plan
from crashproof.goodput._report import (
    add_report_parser,
    format_summary,
    run_report,
    write_html_report,
)

__all__ = [
    "Breakdown",
    "FailureRecord",
    "Ledger",
    "Marker",
    "Plan",
    "TimelinePoint",
    "add_report_parser",
    "compute_ledger",
    "daly_interval",
    "format_summary",
    "plan",
    "read_ledger",
    "run_report",
    "write_html_report",
    "young_interval",
]
