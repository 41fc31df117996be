"""Storage on any fsspec filesystem: object stores (``s3://``, ``gs://``, ``az://``) and others.

Paths are URIs (``s3://bucket/runs/exp1/step_0000000200``). Object stores have no directories and
no atomic rename, so:

- a directory made by :meth:`FsspecStorage.make_dirs` is an empty marker object ``<dir>/`` (what
  the S3 console does), so empty directories exist and list like directories;
- :meth:`FsspecStorage.publish` copies the finished temporary directory to its final name on the
  server side, the file named ``commit_marker`` (the checkpoint's manifest) *last*, then deletes
  the temporary one. Until the marker is there, readers see no checkpoint (a directory without a
  valid manifest is not one); a crash midway leaves a final directory without a manifest, which
  restore skips and the next manager removes;
- re-publishing a directory removes the old copy's marker first, then the old copy, then
  copies the new one (marker last), then deletes the temporary directory: at every instant one
  complete copy exists, under the final name or the temporary one, and start-up recovery
  (:func:`crashproof.checkpoint.root._catalog.recover_interrupted`) finishes an interrupted publish;
- a file is durable once ``commit`` returns: the object store has acknowledged the upload
  (multipart for large files: fsspec's buffered writer).

Reads are ranged requests (``cat_file(start, end)``): stateless, so the parallel reads of a
restore need no shared file position.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import inspect
import os
import posixpath
import stat
import threading
from typing import Any

from crashproof.errors import ConfigError
from crashproof.storage._s3transfer import s3_uploader

__all__ = ["LOCAL_PROTOCOLS", "PUT_CONCURRENCY", "FsspecStorage"]

LOCAL_PROTOCOLS = ("file", "local", "asynclocal")
"""fsspec's names for this machine's filesystem: a root there is a :class:`LocalStorage` root."""

PUT_CONCURRENCY = 8
"""Parts of one file uploaded at once, where the store uploads in parts (multipart)."""


class _FsspecWriteStream:
    def __init__(self, owner: FsspecStorage, path: str) -> None:
        self._owner, self._path = owner, path
        self._file: Any = owner.fs.open(owner._key(path), "wb")

    def write(self, data: bytes | memoryview, /) -> None:
        assert self._file is not None, "write after commit/abort"
        self._file.write(memoryview(data).cast("B"))

    def commit(self) -> None:
        assert self._file is not None, "commit after commit/abort"
        file, self._file = self._file, None
        try:
            file.close()  # the upload completes here: acknowledged, so durable
        finally:
            self._owner._done(self._path)

    def abort(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(Exception):
                discard = getattr(file, "discard", None)
                if discard is not None:
                    discard()  # drop the buffer and any multipart upload begun
                    file.closed = True  # or its finaliser would try to upload what is gone
                else:
                    file.close()
        with contextlib.suppress(Exception):
            self._owner.fs.rm(self._owner._key(self._path))
        self._owner._done(self._path)


class _FsspecReadStream:
    def __init__(self, owner: FsspecStorage, path: str, size: int) -> None:
        self._owner, self._path, self._size = owner, path, size

    def size(self) -> int:
        return self._size

    def readinto(self, offset: int, buf: memoryview, /) -> None:
        view = buf.cast("B")
        if not view:
            return
        if offset + len(view) > self._size:
            raise EOFError(f"{self._path}: file ends before offset {offset} + {len(view)}")
        data = self._owner.fs.cat_file(
            self._owner._key(self._path), start=offset, end=offset + len(view)
        )
        if len(data) != len(view):
            raise EOFError(
                f"{self._path}: {len(data)} bytes at offset {offset}, wanted {len(view)}"
            )
        view[:] = data

    def close(self) -> None:
        pass


_ROUTERS = ("generic",)
"""fsspec filesystems that reach any other one by the URI given, local files included."""


def _reaches_local_files(fs: Any) -> bool:
    """Whether the fsspec filesystem ``fs``, or one it wraps (``dir::``, a cache), is the local
    filesystem."""
    for _ in range(8):
        protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        if any(p in LOCAL_PROTOCOLS or p in _ROUTERS for p in protocols):
            return True
        fs = getattr(fs, "fs", None)
        if fs is None or not hasattr(fs, "protocol"):
            return False
    return True  # wrappers this deep: refuse rather than guess


class FsspecStorage:
    """Files under URIs of one fsspec filesystem (``fsspec.filesystem(protocol, **options)``)."""

    def __init__(self, fs: Any, protocol: str) -> None:
        if _reaches_local_files(fs):
            # No lock could hold such a root, and fsspec follows links: the promises of a
            # local root (one writer, nothing leads elsewhere) would silently not hold.
            raise ConfigError(
                f"{protocol}:// reaches this machine's files through fsspec, without the lock "
                "and the no-link rules of a local root; give the path itself (or file:///path)"
            )
        self.fs, self.protocol = fs, protocol
        self._writing: set[str] = set()
        self._lock = threading.Lock()
        # S3: boto3's threaded multipart transfer where installed (see _s3transfer), made here
        # because importing boto3 must happen where storage_for guards the global RNG.
        self._s3 = s3_uploader(fs) if protocol in ("s3", "s3a") else None
        # Stores whose upload takes parts in parallel (s3fs) are told how many at once.
        put = getattr(fs, "_put_file", None) or fs.put_file
        self._put_options: dict[str, Any] = (
            {"max_concurrency": PUT_CONCURRENCY}
            if "max_concurrency" in inspect.signature(put).parameters
            else {}
        )

    def _key(self, path: str) -> str:
        """The filesystem's own path for a URI (``bucket/key`` for ``s3://bucket/key``)."""
        return str(self.fs._strip_protocol(path)).rstrip("/")

    def _done(self, path: str) -> None:
        with self._lock:
            self._writing.discard(path)

    def join(self, base: str, *names: str) -> str:
        return posixpath.join(base, *names)

    def list(self, path: str) -> list[str]:
        key = self._key(path)
        self.fs.invalidate_cache(key)
        try:
            entries = self.fs.ls(key, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = set()
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            if name == key:  # the directory's own marker, or the path is a file
                continue
            names.add(posixpath.basename(name))
        return sorted(names)

    def make_dirs(self, path: str) -> None:
        key = self._key(path)
        self.fs.makedirs(key, exist_ok=True)  # buckets; real directories where the store has them
        self.fs.invalidate_cache(key)
        if not self.fs.isdir(key):
            self.fs.pipe_file(key + "/", b"")  # an object store: a directory marker

    def create(self, path: str) -> _FsspecWriteStream:
        with self._lock:
            if path in self._writing:
                raise FileExistsError(f"{path}: already being written")
            self.fs.invalidate_cache(posixpath.dirname(self._key(path)))
            if self.fs.exists(self._key(path)):
                raise FileExistsError(f"{path}: exists")
            self._writing.add(path)
        try:
            return _FsspecWriteStream(self, path)
        except BaseException:
            self._done(path)
            raise

    def open(self, path: str) -> _FsspecReadStream:
        key = self._key(path)
        self.fs.invalidate_cache(posixpath.dirname(key))
        try:
            info = self.fs.info(key)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(path) from None
        if info.get("type") != "file":
            raise FileNotFoundError(f"{path}: not a file")
        return _FsspecReadStream(self, path, int(info["size"]))

    def put_file(self, local_path: str, path: str) -> None:
        key = self._key(path)
        mode = os.lstat(local_path).st_mode
        if not stat.S_ISREG(mode):  # not a link, a FIFO, a device: the upload would follow or hang
            raise FileNotFoundError(
                errno.ENOENT, f"not a regular file ({stat.filemode(mode)})", local_path
            )
        if self._s3 is not None:
            self._s3.upload(local_path, key)
        else:
            self.fs.put_file(local_path, key, **self._put_options)
        self.fs.invalidate_cache(posixpath.dirname(key))

    def publish(self, tmp_dir: str, final_dir: str, *, commit_marker: str | None = None) -> None:
        """Copy ``tmp_dir`` to ``final_dir`` (replacing it), ``commit_marker`` last; see above."""
        src, dst = self._key(tmp_dir), self._key(final_dir)
        # A replaced checkpoint stops being one before anything of it changes: its marker goes
        # first. From here until the new marker is copied the complete copy is ``tmp_dir``, which
        # is removed last; start-up recovery publishes it again if a crash comes in between.
        if commit_marker is not None:
            self.remove(posixpath.join(final_dir, commit_marker))
        self.remove(final_dir)
        files: builtins.list[str] = []
        dirs: builtins.list[str] = []
        for name in self._walk(src):
            (dirs if name.endswith("/") else files).append(name)
        files.sort(key=lambda name: name == commit_marker)  # the marker last
        for name in dirs:
            self.fs.pipe_file(f"{dst}/{name}", b"")
        for name in files:
            self.fs.copy(f"{src}/{name}", f"{dst}/{name}")
        self.remove(tmp_dir)

    def _walk(self, key: str) -> builtins.list[str]:
        """Every file (and directory, with a trailing ``/``) under ``key``, relative to it."""
        out: builtins.list[str] = []
        for name in self.list(key):
            child = f"{key}/{name}"
            if self.fs.isdir(child):
                out.append(name + "/")
                out += [f"{name}/{inner}" for inner in self._walk(child)]
            else:
                out.append(name)
        return out

    def remove(self, path: str) -> None:
        key = self._key(path)
        self.fs.invalidate_cache(key)
        with contextlib.suppress(FileNotFoundError):
            if self.fs.exists(key):
                self.fs.rm(key, recursive=True)
        with contextlib.suppress(FileNotFoundError, OSError):
            if self.fs.exists(key + "/"):
                self.fs.rm(key + "/")
        self.fs.invalidate_cache(key)

    def describe(self, path: str) -> str:
        return path
