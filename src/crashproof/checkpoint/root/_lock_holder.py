"""Who holds a checkpoint root's writer lock, as its lock file says, and whether that process
still runs.

A holder is named by host, pid and the process's start time as the kernel counts it (with the
boot id), so a pid reused by another process is not taken for the holder. Whether a process runs
can only be told on its own host (Linux: ``/proc``); elsewhere a holder counts as running.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Holder", "is_alive", "proc_stat", "process_start"]


_MAX_PID = 2**31 - 1
"""The largest ``pid_t``: a larger "pid" is no process (and overflows ``kill``)."""
_MAX_UNIX = 2.0**37
"""About the year 6325: a lock taken later than that is no lock this process could see."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds (or held) a root's lock, as its lock file says."""

    host: str
    pid: int
    process_start: str
    """The process's start time as the kernel counts it (with the boot id): tells a reused pid
    from the holder. Empty where unknown."""
    since_unix: float

    def describe(self) -> str:
        try:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since_unix))
        except (ValueError, OverflowError, OSError):  # parse() refuses these: never in a message
            since = "an unknown time"
        host = self.host if self.host.isprintable() else ascii(self.host)
        return f"pid {self.pid} on host {host[:300]} (since {since})"

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "pid": self.pid,
            "process_start": self.process_start,
            "since_unix": self.since_unix,
        }

    @staticmethod
    def parse(data: bytes) -> Holder | None:
        """The holder a lock file names; None when it names no one: not JSON, a field missing,
        or fields no live process can have (a pid of 0 or -1, which ``kill`` takes for a process
        group, or beyond ``pid_t``; a time not finite or not in this era). Such a file is
        garbage: taken over by whoever gets the OS lock, never the name of a holder."""
        try:
            obj = json.loads(data)
            holder = Holder(
                str(obj["host"]),
                int(obj["pid"]),
                str(obj.get("process_start", "")),
                float(obj["since_unix"]),
            )
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            return None
        if not 0 < holder.pid <= _MAX_PID or not 0.0 <= holder.since_unix <= _MAX_UNIX:
            return None  # (NaN fails every comparison)
        if not holder.host or len(holder.host) > 255:
            return None
        return holder


def proc_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ")".
    return stat[stat.rindex(b")") + 2 :].split()


def process_start(pid: int) -> str:
    """``<boot id>:<start ticks>`` of ``pid`` (Linux), "" where the system does not say."""
    fields = proc_stat(pid)
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip().decode()
    except OSError:
        return ""
    return "" if fields is None else f"{boot}:{int(fields[19])}"


def is_alive(holder: Holder) -> bool:
    """Whether ``holder``, a process of this host, still runs (not a reused pid)."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = proc_stat(holder.pid)
    if fields is not None and fields[0] in (b"Z", b"X"):
        return False  # exited, not yet reaped by its parent: its locks are gone
    now = process_start(holder.pid)
    return not (holder.process_start and now and now != holder.process_start)
