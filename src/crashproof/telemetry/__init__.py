"""Telemetry: the run's event log (``events.jsonl``), read by the goodput report."""

from __future__ import annotations

from crashproof.telemetry._events import EVENTS_FILE, EventLog, EventTail, read_events

__all__ = ["EVENTS_FILE", "EventLog", "EventTail", "read_events"]
