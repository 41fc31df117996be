"""An in-memory storage backend: fast, isolated, and the reference the shared storage tests run on."""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import threading

__all__ = ["MemoryStorage"]


class _MemoryWriteStream:
    def __init__(self, owner: MemoryStorage, path: str) -> None:
        self._owner, self._path, self._buf = owner, path, bytearray()
        self._open = True

    def write(self, data: bytes | memoryview, /) -> None:
        assert self._open, "write after commit/abort"
        self._buf += memoryview(data).cast("B")

    def commit(self) -> None:
        assert self._open, "commit after commit/abort"
        self._open = False
        with self._owner._lock:
            self._owner._files[self._path] = bytes(self._buf)

    def abort(self) -> None:
        self._open = False
        with self._owner._lock:
            self._owner._files.pop(self._path, None)


class _MemoryReadStream:
    def __init__(self, data: bytes, path: str) -> None:
        self._data, self._path = data, path

    def size(self) -> int:
        return len(self._data)

    def readinto(self, offset: int, buf: memoryview, /) -> None:
        view = buf.cast("B")
        if not view:
            return
        if offset < 0 or offset + len(view) > len(self._data):
            raise EOFError(f"{self._path}: file ends before offset {offset} + {len(view)}")
        view[:] = self._data[offset : offset + len(view)]

    def close(self) -> None:
        pass


class MemoryStorage:
    """Files held in a dict. Directories exist implicitly while they hold files, or once made."""

    def __init__(self) -> None:
        self._files: dict[str, bytes] = {}
        self._dirs: set[str] = set()
        self._lock = threading.Lock()

    def join(self, base: str, *names: str) -> str:
        return posixpath.join(base, *names)

    def list(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        with self._lock:
            names = {
                p[len(prefix) :].split("/", 1)[0]
                for p in (*self._files, *self._dirs)
                if p.startswith(prefix)
            }
        return sorted(names)

    def make_dirs(self, path: str) -> None:
        with self._lock:
            parts = path.rstrip("/").split("/")
            self._dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))

    def create(self, path: str) -> _MemoryWriteStream:
        with self._lock:
            if path in self._files:
                raise FileExistsError(path)
            self._files[path] = b""  # visible as a partial file while written, like a real disk
        return _MemoryWriteStream(self, path)

    def open(self, path: str) -> _MemoryReadStream:
        with self._lock:
            try:
                return _MemoryReadStream(self._files[path], path)
            except KeyError:
                raise FileNotFoundError(path) from None

    def put_file(self, local_path: str, path: str) -> None:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(local_path, flags)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FileNotFoundError(errno.ENOENT, "not a regular file", local_path)
            data = f.read()
        with self._lock:
            self._files[path] = data

    def publish(self, tmp_dir: str, final_dir: str, *, commit_marker: str | None = None) -> None:
        # A rename is atomic here: the marker needs no special order.
        src, dst = tmp_dir.rstrip("/") + "/", final_dir.rstrip("/") + "/"
        with self._lock:
            for p in [p for p in self._files if p.startswith(dst)]:
                del self._files[p]
            for p in [p for p in self._files if p.startswith(src)]:
                self._files[dst + p[len(src) :]] = self._files.pop(p)
            moved = {dst + d[len(src) :] for d in self._dirs if d.startswith(src)}
            self._dirs = {d for d in self._dirs if not (d + "/").startswith((src, dst))}
            self._dirs |= moved | {final_dir.rstrip("/")}

    def remove(self, path: str) -> None:
        prefix = path.rstrip("/") + "/"
        with self._lock:
            self._files.pop(path, None)
            for p in [p for p in self._files if p.startswith(prefix)]:
                del self._files[p]
            self._dirs = {
                d for d in self._dirs if d != path.rstrip("/") and not d.startswith(prefix)
            }

    def describe(self, path: str) -> str:
        return f"memory://{path}"

    # Test helpers: direct access to the bytes, e.g. to corrupt a checkpoint on purpose.
    def get_bytes(self, path: str) -> bytes:
        with self._lock:
            return self._files[path]

    def put_bytes(self, path: str, data: bytes) -> None:
        with self._lock:
            self._files[path] = data
