"""Local (POSIX) filesystem storage: plain ``os`` calls, fsync for durability, rename to commit.

Nothing below a root is followed through a symbolic link: listings leave links out (with one
warning each), and a file is opened without following a link, neither its own name nor its
directory's, and without blocking (a FIFO or a device in place of a file would otherwise hang the
open or the first read), then checked to be a regular file before a byte is read.

:meth:`LocalStorage.publish` replaces a directory so that a complete copy of it is under its final
name at every instant: on Linux the new directory and the old one swap names in one
``renameat2(RENAME_EXCHANGE)``; where the filesystem cannot, the old one is first renamed to
``.replaced-<name>-<random>``, which start-up recovery (:mod:`crashproof.checkpoint.root._catalog`)
puts back if a crash came before the new one took its place.

Chaos seam: ``CRASHPROOF_CHAOS_PUBLISH_KILL=<point>`` makes the process SIGKILL itself at that
point of the publish sequence (one of :data:`PUBLISH_POINTS`); read in :func:`_chaos_point` only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import re
import shutil
import signal
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "ENV_PUBLISH_KILL",
    "PUBLISH_POINTS",
    "REPLACED_PREFIX",
    "TRASH_PREFIX",
    "LocalStorage",
    "deferring_removals",
]

log = logging.getLogger("crashproof.storage")

# Big writes are split so a single os.write never has to pin gigabytes at once.
_WRITE_CHUNK = 64 * 1024 * 1024
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NOCTTY = getattr(os, "O_NOCTTY", 0)

TRASH_PREFIX = ".trash-"
"""A directory being deleted: renamed first, so a crash never leaves half of a checkpoint."""
REPLACED_PREFIX = ".replaced-"
"""The previous copy of a directory being replaced, where names cannot be swapped atomically."""

ENV_PUBLISH_KILL = "CRASHPROOF_CHAOS_PUBLISH_KILL"
"""Chaos seam: the publish point at which this process SIGKILLs itself (tests, docs/chaos.md)."""
PUBLISH_POINTS = (
    "publish:start",  # nothing done yet
    "publish:synced",  # the new directory's entries are durable
    "publish:exchanged",  # new and old swapped names (the old one is under the temporary name)
    "publish:set-aside",  # without an exchange: the old one renamed to .replaced-*
    "publish:renamed",  # without an exchange: the new one under the final name
    "publish:durable",  # the parent fsynced: the new one is there for good
    "remove:renamed",  # the old one renamed to .trash-*, not yet deleted
)
"""Every point of :meth:`LocalStorage.publish` (and the removal of the old copy it ends with)."""

_warned_links: set[str] = set()
_warned_lock = threading.Lock()


def _chaos_point(point: str) -> None:
    """SIGKILL this process here if ``CRASHPROOF_CHAOS_PUBLISH_KILL`` names ``point``."""
    if os.environ.get(ENV_PUBLISH_KILL) == point:
        os.kill(os.getpid(), signal.SIGKILL)


class _LocalWriteStream:
    def __init__(self, path: str) -> None:
        self._path = path
        self._fd: int | None = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644
        )

    def write(self, data: bytes | memoryview, /) -> None:
        assert self._fd is not None, "write after commit/abort"
        view = memoryview(data).cast("B")
        while view:
            written = os.write(self._fd, view[:_WRITE_CHUNK])
            view = view[written:]

    def commit(self) -> None:
        assert self._fd is not None, "commit after commit/abort"
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self._path)


def _refuse(path: str, why: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, why, path)


def _open_regular(path: str, *, parent_too: bool) -> int:
    """A read-only descriptor of the regular file ``path``, opened without following a link
    (nor, with ``parent_too``, a link in place of its directory) and without blocking.

    Anything but a regular file is refused before it is opened (``lstat``): opening a device
    can act (a watchdog arms, a tape rewinds, a terminal becomes the controlling one); then the
    descriptor is checked again (``fstat``), since the name may have changed in between."""
    flags = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _NOCTTY | _CLOEXEC
    parent, name = os.path.split(path)
    try:
        if parent_too:
            dir_fd = os.open(parent or ".", os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
            try:
                _refuse_unless_regular(path, os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
                fd = os.open(name, flags, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        else:
            _refuse_unless_regular(path, os.lstat(path))
            fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW met a link (or a non-dir)
            raise _refuse(path, "refusing to follow a symbolic link") from None
        if exc.errno in (errno.ENXIO, errno.EWOULDBLOCK):  # a socket, a FIFO without writer...
            raise _refuse(path, "not a regular file") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse(path, f"not a regular file ({stat.filemode(mode)})")
    return fd


def _refuse_unless_regular(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "refusing to follow a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, f"not a regular file ({stat.filemode(st.st_mode)}); not opened")


class _LocalReadStream:
    def __init__(self, path: str) -> None:
        self._fd = _open_regular(path, parent_too=True)
        self._path = path

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def readinto(self, offset: int, buf: memoryview, /) -> None:
        view = buf.cast("B")
        while view:
            try:
                got = os.preadv(self._fd, [view], offset)
            except OSError as exc:  # (EIO on a failing disk): name the file, as open does
                raise OSError(exc.errno, exc.strerror, self._path) from None
            if got == 0:
                raise EOFError(f"{self._path}: file ends before offset {offset} + {len(view)}")
            view = view[got:]
            offset += got

    def close(self) -> None:
        os.close(self._fd)


class LocalStorage:
    """Files and directories on a local or network (POSIX) filesystem."""

    def join(self, base: str, *names: str) -> str:
        return os.path.join(base, *names)

    def list(self, path: str) -> list[str]:
        try:
            with os.scandir(path) as entries:
                names: list[str] = []
                links: list[str] = []
                for entry in entries:
                    (links if entry.is_symlink() else names).append(entry.name)
        except (FileNotFoundError, NotADirectoryError):
            return []
        for name in links:
            _warn_link(os.path.join(path, name))
        return sorted(names)

    def make_dirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def create(self, path: str) -> _LocalWriteStream:
        return _LocalWriteStream(path)

    def open(self, path: str) -> _LocalReadStream:
        return _LocalReadStream(path)

    def put_file(self, local_path: str, path: str) -> None:
        # Copy under a temporary name and rename, so a reader never sees half a file.
        tmp = f"{path}.put-{uuid.uuid4().hex[:8]}"
        try:
            with (
                os.fdopen(_open_regular(local_path, parent_too=False), "rb") as src,
                open(tmp, "xb") as dst,
            ):
                shutil.copyfileobj(src, dst, _WRITE_CHUNK)  # kernel-side copy where it can
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(os.path.dirname(os.path.abspath(path)))

    def publish(self, tmp_dir: str, final_dir: str, *, commit_marker: str | None = None) -> None:
        # A rename is atomic here: the marker needs no special order.
        # The files were fsynced when written; their directory entries are durable only once the
        # directory itself is, and the rename only once the parent is.
        _chaos_point("publish:start")
        _fsync_dir(tmp_dir, follow=False)
        _chaos_point("publish:synced")
        parent = os.path.dirname(os.path.abspath(final_dir))
        old = None
        if not os.path.lexists(final_dir):
            os.rename(tmp_dir, final_dir)
            _chaos_point("publish:renamed")
        elif _exchange(tmp_dir, final_dir):
            # One step: the final name holds the new copy, the temporary name the old one.
            old = tmp_dir
            _chaos_point("publish:exchanged")
        else:
            # rename(2) cannot replace a non-empty directory: move the old one aside first,
            # under a name start-up recovery puts back if the next rename never happens.
            old = os.path.join(
                parent, f"{REPLACED_PREFIX}{os.path.basename(final_dir)}-{uuid.uuid4().hex[:8]}"
            )
            os.rename(final_dir, old)
            _chaos_point("publish:set-aside")
            try:
                os.rename(tmp_dir, final_dir)
            except BaseException:
                os.rename(old, final_dir)  # failed, not crashed: the old one goes back at once
                raise
            _chaos_point("publish:renamed")
        _fsync_dir(parent)
        _chaos_point("publish:durable")
        if old is not None:
            self.remove(old)

    def remove(self, path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a file, or a link itself (never what it points to)
            return
        # Rename first so the directory disappears in one step: a crash during the deletion
        # leaves a ".trash-" leftover that readers ignore, never a half-deleted checkpoint.
        path = path.rstrip("/")
        parent = os.path.dirname(os.path.abspath(path))
        if _other_filesystem(path, os.lstat(parent).st_dev):
            return
        name = os.path.basename(path)
        if not name.startswith(TRASH_PREFIX):
            trash = os.path.join(parent, f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(path, trash)
            except FileNotFoundError:
                return
            except OSError as exc:
                # (EBUSY: a mount point; EACCES, EROFS: ...) Deleting in place could stop
                # half-way through a checkpoint, or reach what is mounted there: leave it.
                log.warning(
                    "not removing %s: it cannot be renamed aside (%s); remove it by hand",
                    os.path.abspath(path),
                    exc.strerror or exc,
                )
                return
            path = trash
            _chaos_point("remove:renamed")
        delete = functools.partial(shutil.rmtree, path, ignore_errors=True)  # never follows links
        reap = getattr(_DEFERRED, "reap", None)
        if reap is not None:  # gone from the root already; the deletion itself can wait
            reap(delete)
            return
        delete()

    def describe(self, path: str) -> str:
        return os.path.abspath(path)


_DEFERRED = threading.local()


@contextlib.contextmanager
def deferring_removals(reap: Callable[[Callable[[], None]], None]) -> Iterator[None]:
    """Within the block, on this thread, :meth:`LocalStorage.remove` of a directory renames it
    aside as always (it leaves the root at once, atomically) and hands the deletion of what it
    renamed (a callable) to ``reap``, which may run it later on another thread. Deleting a checkpoint of
    gigabytes takes the file system a fraction of a second per gigabyte: retention need not
    make the training run's next ``wait()`` wait for it. Other storages delete as always."""
    previous = getattr(_DEFERRED, "reap", None)
    _DEFERRED.reap = reap
    try:
        yield
    finally:
        _DEFERRED.reap = previous


def _other_filesystem(path: str, dev: int) -> bool:
    """Whether the directory ``path`` is, or holds, a mount point (a bind mount of a directory
    outside the root, another filesystem): logged, and nothing there is removed, since deleting
    would reach files that are not the root's. A bind mount of the same filesystem has the same
    ``st_dev``: the kernel's mount table (Linux) tells those."""
    found = path if os.lstat(path).st_dev != dev else _mount_under(path)
    if found is None:
        for top, dirs, _ in os.walk(path):  # (never into a link)
            for name in dirs:
                with contextlib.suppress(FileNotFoundError):
                    if os.lstat(os.path.join(top, name)).st_dev != dev:
                        found = os.path.join(top, name)
                        break
            if found is not None:
                break
    if found is None:
        return False
    log.warning(
        "not removing %s: %s is a mount point (another filesystem, or a bind mount); crashproof "
        "never removes across one. Unmount it, then remove the directory by hand",
        os.path.abspath(path),
        os.path.abspath(found),
    )
    return True


def _mount_under(path: str) -> str | None:
    """A mount point at or under ``path``, from ``/proc/self/mountinfo``; None if none (or
    where the table cannot be read)."""
    top = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = f.read().decode("utf-8", "surrogateescape")
    except OSError:
        return None
    for line in table.splitlines():
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        # Spaces, tabs, newlines and backslashes in the mount point are octal escapes.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point == top or point.startswith(top.rstrip("/") + "/"):
            return point
    return None


def _warn_link(path: str) -> None:
    with _warned_lock:
        if path in _warned_links:
            return
        _warned_links.add(path)
    log.warning(
        "ignoring %s: it is a symbolic link, and crashproof never follows a link inside a "
        "checkpoint root; move the real directory or file here if it is meant to be read",
        os.path.abspath(path),
    )


def _fsync_dir(path: str, *, follow: bool = True) -> None:
    fd = os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC | (0 if follow else _NOFOLLOW))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2: Any = False  # False: not looked up yet; None: not available


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the platform or the filesystem cannot (then nothing changed)."""
    global _renameat2
    if _renameat2 is False:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
            fn.argtypes += [ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):
            _renameat2 = None
    if _renameat2 is None:
        return False
    ret = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if ret == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False  # not here (a filesystem without the flag, an old kernel): rename twice
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")
