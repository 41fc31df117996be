"""Telemetry: what happened in a run, and what it cost.

Every process of a run records what it does in the event log (``_events``: ``events.jsonl`` in
the run directory); the goodput ledger (``_ledger``, ``_attempts``, ``_records``) reads the log
back and accounts every second of wall time, each failure classified by ``_failures`` (the one
classifier: the metrics and ``crashproof chaos`` use it too); ``crashproof report`` renders the
ledger as text, JSON and a self-contained HTML page (``_report``, ``_report_html``,
``_report_timeline``); ``crashproof plan`` and the adaptive save policy use the same economics
(``_economics``, ``_planner``); ``metrics`` serves the log as Prometheus metrics (a public module
of its own: only the agent loads prometheus_client).

Telemetry is a sink: every other part writes events into it, and it imports none of them.
"""

from __future__ import annotations

from crashproof.telemetry._economics import daly_interval, young_interval
from crashproof.telemetry._events import (
    ENV_RUN_DIR,
    EVENTS_FILE,
    EventLog,
    EventTail,
    LogFollower,
    emit,
    is_event_log,
    read_events,
    worker_event_log,
)
from crashproof.telemetry._failures import GROUP_FAILURES, failure_kind
from crashproof.telemetry._fields import Event, int_field, number_field
from crashproof.telemetry._ledger import (
    Breakdown,
    FailureRecord,
    Ledger,
    Marker,
    TimelinePoint,
    compute_ledger,
    read_ledger,
)
from crashproof.telemetry._planner import Plan, plan
from crashproof.telemetry._report import (
    format_summary,
    is_report_page,
    write_html_report,
)

__all__ = [
    "ENV_RUN_DIR",
    "EVENTS_FILE",
    "GROUP_FAILURES",
    "Breakdown",
    "Event",
    "EventLog",
    "EventTail",
    "FailureRecord",
    "Ledger",
    "LogFollower",
    "Marker",
    "Plan",
    "TimelinePoint",
    "compute_ledger",
    "daly_interval",
    "emit",
    "failure_kind",
    "format_summary",
    "int_field",
    "is_event_log",
    "is_report_page",
    "number_field",
    "plan",
    "read_events",
    "read_ledger",
    "worker_event_log",
    "write_html_report",
    "young_interval",
]
