"""One writer per checkpoint root: the lock a writing :class:`CheckpointManager` holds.

On a local or network filesystem the writer (rank 0 of a job) holds, for its whole life, an
advisory ``flock`` on the root directory itself and one on ``ROOT/.crashproof.lock``; the file
says who holds it, as JSON (host, pid, the process's start time, when it took the lock, the root).
The directory's lock is the one nobody can delete: an open directory cannot be unlinked, so a
lock file removed by a clean-up script or a user does not let a second writer in. The file's lock
is for filesystems that cannot lock a directory (NFS: there ``flock`` becomes a POSIX lock, which
needs a file open for writing) and for older crashproof versions. A second writer fails at once
with a message naming the holder; readers (``read_only=True``, the CLI but ``prune``, ``crashproof
run``'s agent) take no lock and change nothing. The file is deleted when the writer closes.

The writer checks its hold (:meth:`RootLock.check`) before each save and each retention pass: a
lock file deleted meanwhile is re-created (with an error logged); a lock file replaced by another,
or a root directory moved, replaced or deleted, fails that save. Nothing but a regular file with
one link is ever read or written at the lock's name: a FIFO, a socket, a device, a directory or a
symbolic link there is refused without waiting on it, and a hard link is replaced by a new file
(never written through to the other names of the linked file).

A lock file left by a process that died on this host (its pid is gone, or is another process
now) is taken over with a warning. One naming another host is never taken over: crashproof cannot
tell whether that process still runs. Delete the file once sure it does not.

Object stores have no lock this library can take portably: there, one writer per root is the
user's duty, and :class:`CheckpointManager` detects a second writer from checkpoints it did not
commit appearing under its root (docs/storage.md).

This module takes, checks and releases the lock; who a holder is and whether it still runs is
:mod:`crashproof.checkpoint.root._lock_holder`'s, and the lock file's handling
:mod:`crashproof.checkpoint.root._lock_file`'s.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
import weakref

from crashproof.checkpoint.root._lock_file import (
    LOCK_NAME,
    MAX_LOCK_BYTES,
    OPEN_FLAGS,
    describe_found,
    identity,
    lstat_lock_file,
    open_lock_file,
    read_holder_at,
    write_holder,
)
from crashproof.checkpoint.root._lock_holder import Holder, is_alive, process_start
from crashproof.errors import CheckpointWriteError, RootLockedError
from crashproof.storage import GuardedStorage, Storage, local_backend

__all__ = [
    "RootLock",
    "hold_root",
    "lock_root",
    "read_holder",
]

log = logging.getLogger("crashproof.checkpoint")

_EXITING_WAIT_S = 10.0
"""How long a lock held by a process of this host that is no longer running (killed, its
threads still exiting) is waited for."""

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


def _me() -> Holder:
    return Holder(socket.gethostname(), os.getpid(), process_start(os.getpid()), time.time())


_held: weakref.WeakSet[RootLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    """A forked child (a data loader worker) must not keep the parent's lock alive: were the
    parent killed, the lock would outlive it for as long as the child runs."""
    for lock in list(_held):
        fds = (lock._fd, lock._dir_fd)
        lock._fd = lock._dir_fd = None
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class RootLock:
    """The held lock of one root: :meth:`check` before writing; :meth:`release` (or the
    process's end) lets it go."""

    def __init__(
        self, root: str, dir_fd: int, fd: int, holder: Holder, *, dir_locked: bool
    ) -> None:
        self.root, self.holder = root, holder
        self.path = os.path.join(root, LOCK_NAME)
        self.dir_locked = dir_locked
        """Whether the root directory itself is locked (not on NFS: there only the file is)."""
        self._dir_fd: int | None = dir_fd
        self._fd: int | None = fd
        # The training thread (before a save) and the writer thread (before retention) both
        # check; a check may replace the lock file's descriptor, so one check at a time.
        self._guard = threading.Lock()
        _held.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def check(self) -> None:
        """Raise :class:`CheckpointWriteError` unless this writer still holds its root as it
        locked it; re-create the lock file if it was deleted meanwhile (logged as an error).

        Saves and retention write and remove by path: a root moved, replaced or deleted since
        the lock was taken would send them to a directory this writer does not hold, where
        another writer may be. A few system calls, no reads of file contents."""
        with self._guard:
            self._check()

    def _check(self) -> None:
        fd, dir_fd = self._fd, self._dir_fd
        if fd is None or dir_fd is None:
            raise CheckpointWriteError(
                errno.EBADF, f"{self.root}: this process no longer holds the root's writer lock"
            )
        locked = os.fstat(dir_fd)
        try:
            now: os.stat_result | None = os.stat(self.root)
        except OSError:
            now = None
        if now is None or identity(now) != identity(locked):
            raise _root_moved(self.root, dir_fd, gone=now is None)
        found = lstat_lock_file(dir_fd)
        if found is not None and identity(found) == identity(os.fstat(fd)):
            return
        if found is None:
            log.error(
                "%s was deleted while this process held it; re-creating it. %s Do not delete it "
                "while a run writes to this root",
                self.path,
                "The root directory's lock kept a second writer out meanwhile."
                if self.dir_locked
                else "This filesystem cannot lock the directory: a second writer started "
                "meanwhile would have made its own lock file, and none is there.",
            )
            try:
                new = _recreate(dir_fd, self.holder, self.root)
            except FileExistsError:  # made by someone else between our look and our create
                found = lstat_lock_file(dir_fd)
            else:
                self._fd = new
                os.close(fd)
                return
        raise RootLockedError(
            errno.EBUSY,
            f"{self.path} was replaced while this process held the lock of {self.root}: it now "
            f"{describe_found(dir_fd, found)}. Another writer may be using this root, and two "
            "writers delete each other's checkpoints: this one stops saving and removing there. "
            "Stop the other writer (or remove that file if it is no one's) and restart this run",
        )

    def release(self) -> None:
        """Delete the lock file and let go of the lock; safe to call twice."""
        if os.getpid() != self.holder.pid:  # a forked child: the guard may be copied held
            self._release()
            return
        with self._guard:
            self._release()

    def _release(self) -> None:
        fd, self._fd = self._fd, None
        dir_fd, self._dir_fd = self._dir_fd, None
        if fd is None or dir_fd is None:
            return
        if os.getpid() == self.holder.pid:  # not in a forked child, which merely shares it
            # Delete while still holding it, so no one takes a lock on a file about to vanish;
            # through the directory locked, which may have been moved since.
            with contextlib.suppress(OSError):
                found = lstat_lock_file(dir_fd)
                if found is not None and identity(found) == identity(os.fstat(fd)):
                    os.unlink(LOCK_NAME, dir_fd=dir_fd)
        os.close(fd)  # closing the last descriptor of each lets go of its flock
        os.close(dir_fd)

    def __del__(self) -> None:  # a manager dropped without close(): do not keep the root locked
        with contextlib.suppress(Exception):
            self.release()


def read_holder(root: str) -> Holder | None:
    """Who the lock file of the local ``root`` names, if anyone."""
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return read_holder_at(dir_fd)
    finally:
        os.close(dir_fd)


def hold_root(storage: Storage, root: str) -> tuple[Storage, RootLock | None]:
    """Where ``storage`` can lock ``root`` (a local or network filesystem), make it and take its
    writer's lock: the storage to write through (every change checks the hold first:
    :class:`~crashproof.storage.GuardedStorage`) and the lock, to release when done. Object
    stores cannot be locked: ``storage`` itself and None. Every writer into a root comes through
    here: a manager, a tier's replicator, ``crashproof prune``."""
    if local_backend(storage) is None:
        return storage, None
    storage.make_dirs(root)
    lock = lock_root(root)
    return GuardedStorage(storage, lock.check), lock


def lock_root(root: str) -> RootLock:
    """Take the writer's lock of the local ``root`` (which exists), or raise
    :class:`RootLockedError` naming who holds it (:class:`CheckpointWriteError` when what is at
    the lock file's name is not a lock file)."""
    path = os.path.join(root, LOCK_NAME)
    me = _me()
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        dir_locked = _lock_dir(root, path, dir_fd, me)
        fd = _lock_file(root, path, dir_fd, me)
    except BaseException:
        os.close(dir_fd)  # lets go of the directory's lock, if taken
        raise
    return RootLock(root, dir_fd, fd, me, dir_locked=dir_locked)


def _lock_dir(root: str, path: str, dir_fd: int, me: Holder) -> bool:
    """Lock the root directory itself; False where its filesystem cannot (NFS)."""
    if fcntl is None:  # pragma: no cover - not POSIX
        return False
    exiting_until = time.monotonic() + _EXITING_WAIT_S
    while True:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = read_holder_at(dir_fd)
            if not _exiting(holder, me, exiting_until):
                raise _locked(root, path, holder) from None
            time.sleep(0.05)
        except OSError as exc:  # NFS: flock becomes a POSIX lock, which needs a writable file
            log.debug("cannot lock the directory %s (%s): the lock file alone holds it", root, exc)
            return False


def _lock_file(root: str, path: str, dir_fd: int, me: Holder) -> int:
    """Take the lock file's flock and write ``me`` into it; its descriptor."""
    exiting_until = time.monotonic() + _EXITING_WAIT_S
    for _ in range(1000):  # the holder may delete the file between our open and our flock
        fd = open_lock_file(path, dir_fd)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = Holder.parse(os.pread(fd, MAX_LOCK_BYTES, 0))
                    if _exiting(holder, me, exiting_until):
                        os.close(fd)
                        time.sleep(0.05)
                        continue
                    raise _locked(root, path, holder) from None
            mine = os.fstat(fd)
            found = lstat_lock_file(dir_fd)
            if found is None or identity(found) != identity(mine):
                os.close(fd)  # deleted (and perhaps made again) meanwhile: lock the new one
                continue
            raw = os.pread(fd, MAX_LOCK_BYTES, 0)
            previous = Holder.parse(raw)
            if previous is not None:
                _check_stale(root, path, previous, me)
            elif raw.strip():  # no one holds its lock, and it names no process that could
                log.warning(
                    "taking over the lock of %s: its lock file names no process that could run "
                    "(%d bytes that are not a holder: a pid of 0, a time that is not finite, ...)",
                    root,
                    len(raw),
                )
            if mine.st_nlink != 1:
                # A hard link: writing would change the file under its other names too (outside
                # the root, perhaps). Drop this name only and make a file of our own.
                log.warning(
                    "%s is a hard link to a file with %d names: replacing it with a new lock "
                    "file; the file under its other names is left as it was",
                    path,
                    mine.st_nlink,
                )
                os.unlink(LOCK_NAME, dir_fd=dir_fd)
                os.close(fd)
                continue
            write_holder(fd, me, root)
            return fd
        except BaseException:
            os.close(fd)
            raise
    raise RootLockedError(errno.EBUSY, f"{path}: could not take the lock (it keeps changing)")


def _recreate(dir_fd: int, holder: Holder, root: str) -> int:
    """A new lock file for ``holder``, who holds the root; FileExistsError if one is there."""
    fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o644, dir_fd=dir_fd)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        write_holder(fd, holder, root)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _exiting(holder: Holder | None, me: Holder, until: float) -> bool:
    """Whether ``holder`` was killed on this host and its lock goes with its last thread, which
    is still exiting: worth waiting for (until ``until``)."""
    return (
        holder is not None
        and holder.host == me.host
        and not is_alive(holder)
        and time.monotonic() < until
    )


def _root_moved(root: str, dir_fd: int, *, gone: bool) -> CheckpointWriteError:
    where = ""
    with contextlib.suppress(OSError):  # Linux: where the locked directory is now
        where = os.readlink(f"/proc/self/fd/{dir_fd}")
    now = f"; the directory this writer locked is now {where}" if where and where != root else ""
    return CheckpointWriteError(
        errno.ENOENT if gone else errno.ESTALE,
        f"{root} {'is gone' if gone else 'is another directory now'}: the checkpoint root was "
        f"moved, replaced or deleted while this process held its writer lock{now}. Saving or "
        "removing there would act on a directory this writer does not hold (another writer may "
        "hold it). Put the directory back, or stop this run and restart it on the root you mean",
    )


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
    if is_alive(previous):
        raise _locked(root, path, previous)
    log.warning(
        "taking over the lock of %s: it was held by %s, which is no longer running",
        root,
        previous.describe(),
    )


def _locked(root: str, path: str, holder: Holder | None) -> RootLockedError:
    who = (
        holder.describe()
        if holder is not None
        else "another process (its lock file names no one: deleted or emptied while it runs)"
    )
    return RootLockedError(
        errno.EBUSY,
        f"{root} is locked by {who}: it is the writer of this checkpoint root (lock file "
        f"{path}), and a second writer would delete its checkpoints and its saves in progress. "
        "Stop that run or give this one another root; to only read (evaluate, export), use "
        "CheckpointManager(..., read_only=True)",
    )
