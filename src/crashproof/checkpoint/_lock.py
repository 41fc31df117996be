"""One writer per checkpoint root: the lock a writing :class:`CheckpointManager` holds.

On a local or network filesystem the writer (rank 0 of a job) holds an advisory ``flock`` on
``ROOT/.crashproof.lock`` for its whole life; the file says who holds it, as JSON (host, pid, the
process's start time, when it took the lock, the root). A second writer fails at once with a
message naming the holder; readers (``read_only=True``, the CLI but ``prune``, ``crashproof
run``'s agent) take no lock and change nothing. The file is deleted when the writer closes.

A lock file left by a process that died on this host (its pid is gone, or is another process
now) is taken over with a warning. One naming another host is never taken over: crashproof cannot
tell whether that process still runs. Delete the file once sure it does not.

Object stores have no lock this library can take portably: there, one writer per root is the
user's duty, and :class:`CheckpointManager` detects a second writer from checkpoints it did not
commit appearing under its root (docs/storage.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass
from typing import Any

from crashproof.errors import RootLockedError

__all__ = ["LOCK_NAME", "Holder", "RootLock", "lock_root"]

log = logging.getLogger("crashproof.checkpoint")

LOCK_NAME = ".crashproof.lock"
"""The lock file in a checkpoint root."""
_MAX_LOCK_BYTES = 64 * 1024
_EXITING_WAIT_S = 10.0
"""How long a lock held by a process of this host that is no longer running (killed, its
threads still exiting) is waited for."""

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


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
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since_unix))
        return f"pid {self.pid} on host {self.host} (since {since})"

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "pid": self.pid,
            "process_start": self.process_start,
            "since_unix": self.since_unix,
        }

    @staticmethod
    def parse(data: bytes) -> Holder | None:
        try:
            obj = json.loads(data)
            return Holder(
                str(obj["host"]),
                int(obj["pid"]),
                str(obj.get("process_start", "")),
                float(obj["since_unix"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def _proc_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ")".
    return stat[stat.rindex(b")") + 2 :].split()


def _process_start(pid: int) -> str:
    """``<boot id>:<start ticks>`` of ``pid`` (Linux), "" where the system does not say."""
    fields = _proc_stat(pid)
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip().decode()
    except OSError:
        return ""
    return "" if fields is None else f"{boot}:{int(fields[19])}"


def _alive(holder: Holder) -> bool:
    """Whether ``holder``, a process of this host, still runs (not a reused pid)."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = _proc_stat(holder.pid)
    if fields is not None and fields[0] in (b"Z", b"X"):
        return False  # exited, not yet reaped by its parent: its locks are gone
    now = _process_start(holder.pid)
    return not (holder.process_start and now and now != holder.process_start)


def _me() -> Holder:
    return Holder(socket.gethostname(), os.getpid(), _process_start(os.getpid()), time.time())


_held: weakref.WeakSet[RootLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    """A forked child (a data loader worker) must not keep the parent's lock alive: were the
    parent killed, the lock would outlive it for as long as the child runs."""
    for lock in list(_held):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class RootLock:
    """The held lock of one root; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, path: str, fd: int, holder: Holder) -> None:
        self.path, self.holder = path, holder
        self._fd: int | None = fd
        _held.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Delete the lock file and let go of the lock; safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if os.getpid() == self.holder.pid:  # not in a forked child, which merely shares it
            # Delete while still holding it, so no one takes a lock on a file about to vanish.
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(self.path)
        os.close(fd)  # closing the last descriptor of it lets go of the flock

    def __del__(self) -> None:  # a manager dropped without close(): do not keep the root locked
        with contextlib.suppress(Exception):
            self.release()


def read_holder(root: str) -> Holder | None:
    """Who the lock file of the local ``root`` names, if anyone."""
    try:
        fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return Holder.parse(os.read(fd, _MAX_LOCK_BYTES))
    finally:
        os.close(fd)


def lock_root(root: str) -> RootLock:
    """Take the writer's lock of the local ``root`` (which exists), or raise
    :class:`RootLockedError` naming who holds it."""
    path = os.path.join(root, LOCK_NAME)
    me = _me()
    exiting_until = time.monotonic() + _EXITING_WAIT_S
    for _ in range(1000):  # the holder may delete the file between our open and our flock
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = Holder.parse(os.read(fd, _MAX_LOCK_BYTES))
                    if (
                        holder is not None
                        and holder.host == me.host
                        and not _alive(holder)
                        and time.monotonic() < exiting_until
                    ):
                        # Killed, and still exiting (its other threads not yet gone): the
                        # lock goes with its last thread.
                        os.close(fd)
                        time.sleep(0.05)
                        continue
                    raise _locked(root, path, holder) from None
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                os.close(fd)  # deleted (and perhaps made again) meanwhile: lock the new one
                continue
            previous = Holder.parse(os.read(fd, _MAX_LOCK_BYTES))
            if previous is not None:
                _check_stale(root, path, previous, me)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me.to_json() | {"root": root}).encode(), 0)
            os.fsync(fd)
            return RootLock(path, fd, me)
        except FileNotFoundError:
            os.close(fd)  # deleted between our open and our stat: try again
            continue
        except BaseException:
            os.close(fd)
            raise
    raise RootLockedError(errno.EBUSY, f"{path}: could not take the lock (it keeps changing)")


def _check_stale(root: str, path: str, previous: Holder, me: Holder) -> None:
    """The lock is ours to take, but its file names ``previous``: take it over if that process
    is gone from this host; refuse if it may still run (another host, or alive here)."""
    if previous.host != me.host:
        raise RootLockedError(
            errno.EBUSY,
            f"{root} is locked by {previous.describe()}, another host (lock file {path}). Two "
            "writers on one root delete each other's checkpoints, and crashproof cannot tell "
            "whether that process still runs. If it does not, delete the lock file; to only "
            "read the checkpoints, use CheckpointManager(..., read_only=True)",
        )
    if previous.pid == me.pid and previous.process_start == me.process_start:
        return  # this process's own earlier manager, dropped without close()
    if _alive(previous):
        raise _locked(root, path, previous)
    log.warning(
        "taking over the lock of %s: it was held by %s, which is no longer running",
        root,
        previous.describe(),
    )


def _locked(root: str, path: str, holder: Holder | None) -> RootLockedError:
    who = holder.describe() if holder is not None else "another process (its lock file is empty)"
    return RootLockedError(
        errno.EBUSY,
        f"{root} is locked by {who}: it is the writer of this checkpoint root (lock file "
        f"{path}), and a second writer would delete its checkpoints and its saves in progress. "
        "Stop that run or give this one another root; to only read (evaluate, export), use "
        "CheckpointManager(..., read_only=True)",
    )
