"""The lock file, ``ROOT/.crashproof.lock``, handled without trusting what is at its name.

Nothing but a regular file is ever opened, read or written there: a FIFO (which would block), a
socket, a device (which might act on being opened), a directory or a symbolic link is refused
without being opened, and every open refuses to follow a link. The file holds its holder as JSON
(:class:`~crashproof.checkpoint.root._lock_holder.Holder`, and the root).
"""

from __future__ import annotations

import errno
import json
import os
import stat

from crashproof.checkpoint.root._lock_holder import Holder
from crashproof.errors import CheckpointWriteError, RootLockedError

__all__ = [
    "LOCK_NAME",
    "MAX_LOCK_BYTES",
    "OPEN_FLAGS",
    "describe_found",
    "identity",
    "lstat_lock_file",
    "not_a_lock_file",
    "open_lock_file",
    "read_holder_at",
    "write_holder",
]

LOCK_NAME = ".crashproof.lock"
"""The lock file in a checkpoint root."""
MAX_LOCK_BYTES = 64 * 1024
OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
"""How the lock file is opened: never through a link, and nothing at that name may block us."""


def open_lock_file(path: str, dir_fd: int) -> int:
    """Open (or create) the lock file, refusing anything but a regular file at its name before
    opening it, so that no FIFO, device or socket is opened, read or waited on."""
    found = lstat_lock_file(dir_fd)
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise not_a_lock_file(path, found.st_mode)
    try:
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | OPEN_FLAGS, 0o644, dir_fd=dir_fd)
    except OSError as exc:  # replaced meanwhile by a link (ELOOP), a directory (EISDIR), ...
        found = lstat_lock_file(dir_fd)
        if found is not None and not stat.S_ISREG(found.st_mode):
            raise not_a_lock_file(path, found.st_mode) from exc
        if exc.errno in (errno.EACCES, errno.EPERM) and found is not None:
            # Another user's lock file (a shared root): this process may not take it over
            # itself, whoever it names. Say whose it is and what to do, not a bare errno.
            holder = read_holder_at(dir_fd)
            named = f"it names {holder.describe()}" if holder is not None else "it names no one"
            raise RootLockedError(
                exc.errno,
                f"{path}: the root's lock file belongs to user {found.st_uid} and this process "
                f"may not write it ({named}); if that process is gone, remove {path}, or give "
                "this run a root of its own",
            ) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_a_lock_file(path, mode)
    return fd


def write_holder(fd: int, holder: Holder, root: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder.to_json() | {"root": root}).encode(), 0)
    os.fsync(fd)


def identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def lstat_lock_file(dir_fd: int) -> os.stat_result | None:
    """What is at the lock file's name in the locked directory (links not followed), if any."""
    try:
        return os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def read_holder_at(dir_fd: int) -> Holder | None:
    """Who the lock file names; None when it is missing, unreadable or not a regular file (which
    is never opened: a FIFO would block, a device might act on being opened)."""
    found = lstat_lock_file(dir_fd)
    if found is None or not stat.S_ISREG(found.st_mode):
        return None
    try:
        fd = os.open(LOCK_NAME, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return Holder.parse(os.pread(fd, MAX_LOCK_BYTES, 0))
    except OSError:
        return None
    finally:
        os.close(fd)


_KINDS = (
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISLNK, "symbolic link"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def not_a_lock_file(path: str, mode: int) -> CheckpointWriteError:
    return CheckpointWriteError(
        errno.EEXIST,
        f"{path} is a {_kind(mode)}, not a lock file (crashproof writes a regular file there): "
        "it was not opened, read or changed, and this root cannot be locked for writing. Remove "
        f"it (rm {path}) if nothing of yours needs it, or give this run another root",
    )


def describe_found(dir_fd: int, found: os.stat_result | None) -> str:
    if found is None:
        return "is missing"
    if not stat.S_ISREG(found.st_mode):
        return f"is a {_kind(found.st_mode)}"
    holder = read_holder_at(dir_fd)
    return "names no one" if holder is None else f"names {holder.describe()}"
