"""Local (POSIX) filesystem storage: plain ``os`` calls, fsync for durability, rename to commit."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid

__all__ = ["LocalStorage"]

# Big writes are split so a single os.write never has to pin gigabytes at once.
_WRITE_CHUNK = 64 * 1024 * 1024


class _LocalWriteStream:
    def __init__(self, path: str) -> None:
        self._path = path
        self._fd: int | None = os.open(
            path,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
            0o644,
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


class _LocalReadStream:
    def __init__(self, path: str) -> None:
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW on a symlink
                raise FileNotFoundError(
                    errno.ENOENT, "refusing to follow a symbolic link", path
                ) from None
            raise
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            raise FileNotFoundError(errno.ENOENT, "not a regular file", path)
        self._path = path

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def readinto(self, offset: int, buf: memoryview, /) -> None:
        view = buf.cast("B")
        while view:
            got = os.preadv(self._fd, [view], offset)
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
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

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
            with open(local_path, "rb") as src, open(tmp, "xb") as dst:
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
        _fsync_dir(tmp_dir)
        parent = os.path.dirname(os.path.abspath(final_dir))
        trash = None
        if os.path.lexists(final_dir):
            # rename(2) cannot replace a non-empty directory: move the old one aside first.
            trash = os.path.join(
                parent, f".trash-{os.path.basename(final_dir)}-{uuid.uuid4().hex[:8]}"
            )
            os.rename(final_dir, trash)
        os.rename(tmp_dir, final_dir)
        _fsync_dir(parent)
        if trash is not None:
            self.remove(trash)

    def remove(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            # Rename first so the directory disappears in one step: a crash during the deletion
            # leaves a ".trash-" leftover that readers ignore, never a half-deleted checkpoint.
            name = os.path.basename(path.rstrip("/"))
            if not name.startswith(".trash-"):
                trash = os.path.join(
                    os.path.dirname(path.rstrip("/")), f".trash-{name}-{uuid.uuid4().hex[:8]}"
                )
                try:
                    os.rename(path, trash)
                    path = trash
                except OSError:
                    pass  # e.g. a read-only parent: fall back to deleting in place
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def describe(self, path: str) -> str:
        return os.path.abspath(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
