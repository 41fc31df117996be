"""Fault-injection seams: the one place the chaos environment variables are read.

Two seams in production code inject faults from inside a trainer: the NumericsGuard's loss
(:mod:`crashproof.guard._injection`, ``CRASHPROOF_CHAOS_NAN``) and the storage wrapper
(:mod:`crashproof.storage._faulty`, ``CRASHPROOF_CHAOS_STORAGE``); both ask :func:`armed` here.
Each environment variable names
a JSON file the campaign rewrites atomically (``{"faults": [{"id": ..., "rank": ..., ...}]}``);
the trainer side stats it at most once per use and re-reads it only when it changed. A fault that
fires is appended, one JSON line, to ``<file>.fired``, so it fires once across restarts (a new
process reads the log before acting) and the campaign learns exactly when and where it fired.

This module only moves the facts and stays light (the standard library and the event-log
reader: it is imported by the guard and the storage package). What each fault means is the seam's business; when to arm one is the
campaign's (:mod:`crashproof.chaos._campaign`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from typing import Any

from crashproof._files import read_json_object, write_json_atomically
from crashproof.telemetry import read_events

__all__ = [
    "ENV_CHAOS_NAN",
    "ENV_CHAOS_STORAGE",
    "FIRED_SUFFIX",
    "ControlWatcher",
    "armed",
    "read_fired",
    "watcher_for",
    "write_control",
]

ENV_CHAOS_NAN = "CRASHPROOF_CHAOS_NAN"
"""Path of the control file arming NaN losses (set by ``crashproof chaos``)."""
ENV_CHAOS_STORAGE = "CRASHPROOF_CHAOS_STORAGE"
"""Path of the control file arming storage faults (set by ``crashproof chaos``)."""

FIRED_SUFFIX = ".fired"
"""``<control file><FIRED_SUFFIX>``: one JSON line per fault fired by a trainer."""


def write_control(path: str, faults: list[dict[str, Any]]) -> None:
    """Replace the control file at ``path`` in one step (readers never see half a file)."""
    write_json_atomically(path, {"faults": faults})


def read_fired(path: str) -> list[dict[str, Any]]:
    """What fired, in order, from ``<path>.fired`` (a torn last line is skipped)."""
    try:
        return list(read_events(path + FIRED_SUFFIX))
    except FileNotFoundError:
        return []


_watchers: dict[tuple[str, int | None, int], ControlWatcher] = {}
_watchers_lock = threading.Lock()


def armed(variable: str, *, default_rank: int | None = None) -> ControlWatcher | None:
    """The watcher of the control file the environment ``variable`` names, for this process's
    rank (``RANK``, else ``default_rank``); None, at the cost of one lookup, when it is unset."""
    path = os.environ.get(variable)
    if not path:
        return None
    rank = os.environ.get("RANK")
    return watcher_for(path, int(rank) if rank is not None else default_rank)


def watcher_for(path: str, rank: int | None) -> ControlWatcher:
    """This process's one watcher of ``path`` for ``rank``: every seam and every storage object
    of a process shares it, so a fault that fired in one is not fired again by another."""
    key = (path, rank, os.getpid())  # a forked child starts over, from the fired log
    with _watchers_lock:
        watcher = _watchers.get(key)
        if watcher is None:
            watcher = _watchers[key] = ControlWatcher(path, rank)
        return watcher


class ControlWatcher:
    """A trainer's view of one control file: the faults armed for this process's rank, and how
    often each has fired (in this process and, read once per change, in earlier ones).
    Thread-safe: a storage seam is called from background writer threads."""

    def __init__(self, path: str, rank: int | None) -> None:
        self.path = path
        self.rank = rank
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._faults: list[dict[str, Any]] = []
        self._fired: Counter[str] = Counter()

    def faults(self) -> list[dict[str, Any]]:
        """The faults armed for this rank, re-read when the file changed (one ``stat`` a call).

        A missing or unreadable file arms nothing: a campaign that has not written it yet, or
        has removed it, must never stop training."""
        with self._lock:
            return self._refresh()

    def claim(self, fault_id: str, times: int = 1, **details: Any) -> bool:
        """Fire ``fault_id`` here if it fired fewer than ``times`` times on this rank: True, and
        the firing is counted and logged (with ``details``); False: it is spent."""
        with self._lock:
            if self._fired[fault_id] >= times:
                return False
            self._fired[fault_id] += 1
            self._log(fault_id, details)
            return True

    def fired(self, fault_id: str) -> int:
        """How many times the fault ``fault_id`` fired on this rank."""
        with self._lock:
            return self._fired[fault_id]

    def _refresh(self) -> list[dict[str, Any]]:
        try:
            st = os.stat(self.path)
        except OSError:
            self._stamp, self._faults = None, []
            return self._faults
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._stamp = stamp
            self._faults = self._load()
            # Other processes of this rank (before a restart) may have fired some already.
            self._fired = Counter(
                str(r.get("id")) for r in read_fired(self.path) if r.get("rank") == self.rank
            )
        return self._faults

    def _log(self, fault_id: str, details: dict[str, Any]) -> None:
        line = json.dumps(
            {"id": fault_id, "rank": self.rank, "pid": os.getpid(), "ts": time.time(), **details}
        )
        # appended to, never through a link or into a FIFO (the campaign's own folder)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(self.path + FIRED_SUFFIX, flags, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def _load(self) -> list[dict[str, Any]]:
        data = read_json_object(self.path)
        faults = data.get("faults") if data is not None else None
        if not isinstance(faults, list):
            return []
        return [
            f
            for f in faults
            if isinstance(f, dict) and "id" in f and f.get("rank", self.rank) == self.rank
        ]
