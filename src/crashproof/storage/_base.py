"""The storage interface every backend implements: a handful of methods over ``str`` paths.

Paths are strings, not ``pathlib.Path``, so object-store URIs survive. A backend knows nothing of
checkpoints; the checkpoint package decides what to write where. Two properties carry the format's
guarantees and every backend must provide them:

- ``WriteStream.commit()`` returns only once the bytes are durable (fsync on a filesystem);
- ``publish(tmp, final)`` makes a fully written directory visible under its final name in one
  step, durably, or not at all; where a store cannot (object stores: no rename), the directory
  counts as complete only once its ``commit_marker`` file, copied last, is there.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["ReadStream", "Storage", "WriteStream", "read_all", "write_all"]


class WriteStream(Protocol):
    """A file being written. Either ``commit()`` or ``abort()`` ends it."""

    def write(self, data: bytes | memoryview, /) -> None:
        """Append all of ``data``."""
        ...

    def commit(self) -> None:
        """Make the written bytes durable and close the file."""
        ...

    def abort(self) -> None:
        """Close and delete the partial file; never raises."""
        ...


class ReadStream(Protocol):
    """A file open for random-access reads."""

    def size(self) -> int:
        """The file's size in bytes, as it is now."""
        ...

    def readinto(self, offset: int, buf: memoryview, /) -> None:
        """Fill all of ``buf`` from ``offset``; raises ``EOFError`` if the file is shorter."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """Where checkpoint bytes go. Implementations: :class:`LocalStorage`, :class:`MemoryStorage`,
    :class:`FsspecStorage` (object stores and every other fsspec filesystem)."""

    def join(self, base: str, *names: str) -> str:
        """``base`` followed by the plain names ``names``."""
        ...

    def list(self, path: str) -> list[str]:
        """Names of the entries directly under ``path``; empty when it does not exist."""
        ...

    def make_dirs(self, path: str) -> None:
        """Create ``path`` and its parents; fine if it exists."""
        ...

    def create(self, path: str) -> WriteStream:
        """A new file at ``path``; fails if something is already there."""
        ...

    def open(self, path: str) -> ReadStream:
        """Open a regular file for reading; symbolic links are refused (``FileNotFoundError``)."""
        ...

    def put_file(self, local_path: str, path: str) -> None:
        """Copy the local file ``local_path`` to ``path`` (replacing it), durably, as fast as the
        store takes it: object stores upload large files in parallel parts (multipart)."""
        ...

    def publish(self, tmp_dir: str, final_dir: str, *, commit_marker: str | None = None) -> None:
        """Atomically and durably rename a finished ``tmp_dir`` to ``final_dir`` (replacing it).

        Stores that cannot rename (object stores) copy instead, and copy the file named
        ``commit_marker`` last: until it is there, ``final_dir`` is not a complete directory.
        """
        ...

    def remove(self, path: str) -> None:
        """Delete a file or a whole directory; nothing happens if it is missing."""
        ...

    def describe(self, path: str) -> str:
        """A human-readable location for messages (an absolute path, a URI)."""
        ...


def write_all(storage: Storage, path: str, data: bytes) -> None:
    """Write a small file durably in one call."""
    stream = storage.create(path)
    try:
        stream.write(data)
        stream.commit()
    except BaseException:
        stream.abort()
        raise


def read_all(storage: Storage, path: str, *, limit: int) -> bytes:
    """Read a small file whole; refuses files larger than ``limit`` bytes (``ValueError``)."""
    stream = storage.open(path)
    try:
        size = stream.size()
        if size > limit:
            raise ValueError(
                f"{storage.describe(path)} is {size} bytes, more than the {limit} allowed"
            )
        buf = bytearray(size)
        stream.readinto(0, memoryview(buf))
        return bytes(buf)
    finally:
        stream.close()
