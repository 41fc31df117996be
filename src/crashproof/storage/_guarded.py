"""``GuardedStorage``: a storage whose every change is preceded by a check that its writer still
holds the root, and :func:`local_backend`, which tells a lockable (local, POSIX) storage.

A writer holds a local root's lock for its whole life, but a hold can be lost meanwhile (the lock
file replaced by another writer's, the root moved or deleted). Checking only before a save or a
retention pass leaves everything that runs later unchecked: the background write, its publish, a
removal to make room on a full disk, a download published into the root. Wrapping the storage
puts the check in front of every ``create``, ``put_file``, ``publish``, ``remove`` and
``make_dirs``, whoever calls them; reads and listings pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable

from crashproof.storage._base import ReadStream, Storage, WriteStream
from crashproof.storage._local import LocalStorage

__all__ = ["GuardedStorage", "local_backend"]


def local_backend(storage: Storage) -> LocalStorage | None:
    """The :class:`LocalStorage` under ``storage`` and its wrappers (``.inner``), if it is one:
    a root there can and must be locked by its writer."""
    seen = 0
    while not isinstance(storage, LocalStorage) and seen < 8:  # wrappers do not nest deeper
        inner = getattr(storage, "inner", None)
        if inner is None:
            return None
        storage, seen = inner, seen + 1
    return storage if isinstance(storage, LocalStorage) else None


class GuardedStorage:
    """``inner``, with ``check()`` (which raises when the hold is lost) before every change."""

    def __init__(self, inner: Storage, check: Callable[[], None]) -> None:
        self.inner = inner
        self._check = check

    def join(self, base: str, *names: str) -> str:
        return self.inner.join(base, *names)

    def list(self, path: str) -> list[str]:
        return self.inner.list(path)

    def open(self, path: str) -> ReadStream:
        return self.inner.open(path)

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    def make_dirs(self, path: str) -> None:
        self._check()
        self.inner.make_dirs(path)

    def create(self, path: str) -> WriteStream:
        self._check()
        return self.inner.create(path)

    def put_file(self, local_path: str, path: str) -> None:
        self._check()
        self.inner.put_file(local_path, path)

    def publish(self, tmp_dir: str, final_dir: str, *, commit_marker: str | None = None) -> None:
        self._check()
        self.inner.publish(tmp_dir, final_dir, commit_marker=commit_marker)

    def remove(self, path: str) -> None:
        self._check()
        self.inner.remove(path)
