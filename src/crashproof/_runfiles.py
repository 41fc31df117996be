"""Writing into a run directory: never through a link, never over what crashproof did not write.

A run directory (``crashproof run --run-dir``) is reused by a requeued job and may hold what its
user put there. Every file the supervisor, its trainers and a chaos campaign write in it comes
through here:

* folders are made and opened one level at a time, relative to the one above, without following
  a link (``O_NOFOLLOW | O_DIRECTORY``): a link where a folder should be is refused. The run
  directory itself may be a link: it is resolved once, as a checkpoint root is;
* files are opened relative to their folder with ``O_NOFOLLOW`` (a link is refused) and
  ``O_NONBLOCK`` (a FIFO cannot block), and must be regular files with one link (a hard link to
  a file elsewhere is refused);
* a file is created new, or appended to (never truncated) when it already is crashproof's own,
  told by its first bytes (``own``); a file is replaced whole (renamed over) or removed only when
  it is crashproof's own.

A refusal is :class:`RunFileRefused`, naming the path and why.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable

from crashproof._files import write_atomically

__all__ = [
    "Own",
    "RunFileRefused",
    "make_dirs",
    "make_new_dir",
    "open_run_file",
    "remove_own",
    "replace_own",
]

Own = Callable[[bytes], bool]
"""Whether a file's first bytes (up to 4 KiB) show it is crashproof's own."""

_HEAD = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class RunFileRefused(OSError):
    """A path in a run directory crashproof must not write: a link, not a regular file, a hard
    link, or a file it did not write."""


def _parts(root: str, rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise RunFileRefused(f"{os.path.join(root, rel)}: leads out of {root}")
    return parts


def _open_dirs(root: str, parts: list[str], create: bool) -> int:
    """An fd of ``root/parts...``, each folder made (``create``) and opened without following."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for n, name in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                path = os.path.join(root, *parts[: n + 1])
                raise RunFileRefused(
                    f"{path}: not a folder crashproof can use ({exc.strerror})"
                ) from None
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dirs(root: str, rel: str) -> str:
    """Make the folder ``root/rel`` (and those above it) without following a link; its path."""
    os.close(_open_dirs(root, _parts(root, rel), create=True))
    return os.path.join(root, rel)


def make_new_dir(root: str, rel: str, name: str) -> str:
    """Make a folder under ``root/rel`` that did not exist: ``name``, or ``name-2``, ``name-3``
    ... if taken (a requeued job's agent may have the same pid); returns the name made."""
    fd = _open_dirs(root, _parts(root, rel), create=True)
    try:
        for n in range(1, 10_000):
            candidate = name if n == 1 else f"{name}-{n}"
            try:
                os.mkdir(candidate, 0o755, dir_fd=fd)
                return candidate
            except FileExistsError:
                continue
        raise RunFileRefused(f"{os.path.join(root, rel, name)}: no free name")
    finally:
        os.close(fd)


def _checked(fd: int, path: str, own: Own | None) -> int:
    """``fd`` if it is a regular file with one link (and, not empty, crashproof's own)."""
    info = os.fstat(fd)
    why = None
    if not stat.S_ISREG(info.st_mode):
        why = "not a regular file"
    elif info.st_nlink != 1:
        why = "a hard link to a file elsewhere"
    elif own is not None and info.st_size and not own(os.pread(fd, _HEAD, 0)):
        why = "a file crashproof did not write"
    if why is not None:
        os.close(fd)
        raise RunFileRefused(f"{path}: {why}; crashproof writes only its own files")
    return fd


def open_run_file(root: str, rel: str, how: str, own: Own | None = None) -> int:
    """An fd of the file ``root/rel`` for writing, its folders made (see the module docstring).

    ``how``: ``"new"`` (created, must not exist), ``"append"`` (created, or appended to when
    ``own`` says it is crashproof's), ``"rewrite"`` (created, or emptied when it is a regular
    file with one link: for files in a folder crashproof made new, such as its heartbeats)."""
    *dirs, name = _parts(root, rel)
    path = os.path.join(root, rel)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= {"new": os.O_EXCL, "append": os.O_APPEND, "rewrite": 0}[how]
    dir_fd = _open_dirs(root, dirs, create=True)
    try:
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        except OSError as exc:  # ELOOP: a link; ENXIO: a FIFO without a reader; EEXIST
            raise RunFileRefused(f"{path}: crashproof will not write it ({exc.strerror})") from None
    finally:
        os.close(dir_fd)
    fd = _checked(fd, path, own if how == "append" else None)
    os.set_blocking(fd, True)
    if how == "rewrite":
        os.ftruncate(fd, 0)
    return fd


def _own_file(path: str, own: Own) -> bool | None:
    """None: nothing at ``path``; True: crashproof's own regular file; False: anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None if not os.path.lexists(path) else False
    except OSError:
        return False
    try:
        _checked(os.dup(fd), path, own)
        return True
    except RunFileRefused:
        return False
    finally:
        os.close(fd)


def replace_own(root: str, rel: str, data: bytes, own: Own) -> None:
    """``data`` as the file ``root/rel``, renamed into place whole, unless something that is not
    crashproof's own is there (:class:`RunFileRefused`)."""
    make_dirs(root, os.path.dirname(rel))
    path = os.path.join(root, rel)
    if _own_file(path, own) is False:
        raise RunFileRefused(f"{path}: a file crashproof did not write; it is left as it is")
    write_atomically(path, data, durable=False)


def remove_own(path: str, own: Own) -> bool:
    """Remove ``path`` if it is crashproof's own regular file; whether it did."""
    if _own_file(path, own):
        os.remove(path)
        return True
    return False
