"""The run's event log: ``RUN_DIR/events.jsonl``, one JSON object per line.

Every process of a supervised run appends to the same file: the supervisor (run, rank, hang and
restart events) and the trainers (restore, checkpoint, progress). Each line is written with one
``write`` on a file opened with ``O_APPEND``, so lines from different processes never interleave.
The schema is documented in ``docs/events.md``; the goodput report is computed from this file.

This module does not decide *what* is an event; the supervisor and the checkpoint manager do.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from crashproof._rundir import ENV_RUN_DIR, EVENTS_FILE, RunDir
from crashproof._runfiles import RunFileRefused, open_run_file

__all__ = [
    "ENV_RUN_DIR",
    "EVENTS_FILE",
    "EventLog",
    "EventTail",
    "LogFollower",
    "emit",
    "is_event_log",
    "read_events",
    "worker_event_log",
]

log = logging.getLogger(__name__)


class EventLog:
    """Appends events to one JSONL file; safe to share between threads and processes."""

    def __init__(self, path: str | os.PathLike[str], **common: Any) -> None:
        self.path = os.fspath(path)
        self.common = common
        """Fields added to every event of this writer (e.g. the trainer's rank)."""
        # Appended to, never truncated (a requeued run adds to it), never through a link, and
        # only when it is an event log: RunFileRefused otherwise.
        directory, name = os.path.split(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        self._fd = open_run_file(directory, name, "append", own=is_event_log)
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        """Append one event: ``{"ts": <unix seconds>, "event": event, **common, **fields}``."""
        record = {"ts": round(time.time(), 6), "event": event, **self.common, **fields}
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            if self._fd < 0:
                return
            try:
                os.write(self._fd, line)
            except OSError as exc:  # a full disk must not stop training over a log line
                log.warning("could not append to %s: %s", self.path, exc)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def is_event_log(head: bytes) -> bool:
    """Whether a file's first bytes are an event log's: every writer's line starts so."""
    return head.startswith(b'{"ts"')


_worker_log: EventLog | None = None
_worker_log_pid = 0


def worker_event_log() -> EventLog | None:
    """This trainer's writer into the supervisor's event log; None when not run by the supervisor.

    Opened once per process (a forked child opens its own).
    """
    global _worker_log, _worker_log_pid
    run_dir = RunDir.from_env()
    if run_dir is None:
        return None
    if _worker_log_pid != os.getpid():  # once per process (None: refused)
        _worker_log_pid = os.getpid()
        try:
            _worker_log = EventLog(
                run_dir.events,
                rank=int(os.environ.get("RANK", "0")),
                restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                pid=os.getpid(),
            )
        except (RunFileRefused, OSError) as exc:  # the agent refused to start on it already
            log.warning("no events from this trainer: %s", exc)
            _worker_log = None
    return _worker_log


def emit(event: str, **fields: Any) -> None:
    """Append an event to the run's log if this process runs under ``crashproof run``."""
    events = worker_event_log()
    if events is not None:
        events.emit(event, **fields)


MAX_TS = 253402300799.0
"""The latest event time a calendar holds (the end of year 9999, UTC): a report prints each."""


def read_events(
    path: str | os.PathLike[str], on_malformed: Callable[[int, str], None] | None = None
) -> Iterator[dict[str, Any]]:
    """The events of a log, oldest first; a torn last line (a writer killed mid-write) is skipped.
    So is a malformed line (not a JSON object, or a ``ts`` that is not a time from 0 to
    :data:`MAX_TS` seconds), reported to ``on_malformed(line_number, why)`` if given."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                record = None
            if not isinstance(record, dict):
                if on_malformed is not None:
                    on_malformed(number, "not a JSON object")
                continue
            ts = record.get("ts", 0.0)
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts <= MAX_TS:
                if on_malformed is not None:
                    on_malformed(
                        number, f"'ts' {ts!r} is not a time (seconds from 0 to {MAX_TS:.0f})"
                    )
                continue
            yield record


class EventTail:
    """Follows a growing event log: each :meth:`read_new` returns the events appended since the
    previous call. A line still being written is kept back until its newline arrives; a line
    torn by a writer killed mid-write (never completed) is skipped. A missing file has none."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def skip_to_end(self) -> None:
        """Follow from the log's end: what it holds now is not new."""
        try:
            self._offset = os.path.getsize(self.path)
        except FileNotFoundError:
            self._offset = 0
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        new: list[dict[str, Any]] = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                new.append(record)
        return new


class LogFollower:
    """Calls ``poll`` every ``interval_s`` on a daemon thread of its own (each call reads what an
    :class:`EventTail` has new), until :meth:`close`, which stops the thread and calls ``poll``
    once more for the last events. A failing call is logged, never raised: what follows a run's
    log (its metrics, its console story) must not take the run down."""

    def __init__(self, poll: Callable[[], None], *, interval_s: float, name: str) -> None:
        self._poll, self._name, self._interval_s = poll, name, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=name, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._call()

    def _call(self) -> None:
        try:
            self._poll()
        except Exception:
            log.exception("%s: reading the event log failed", self._name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._call()
