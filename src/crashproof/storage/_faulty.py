"""``FaultyStorage``: a storage wrapper that fails or stalls writes when a chaos campaign says so.

:func:`crashproof.storage.storage_for` wraps every backend it returns in one when
``CRASHPROOF_CHAOS_STORAGE`` names a control file (:mod:`crashproof._seams`); without the
variable nothing is wrapped. Each armed fault ``{"id", "rank", "error", "files", "hang_s"}``
applies to the next ``files`` files this rank writes (``create`` and ``put_file``):

- ``enospc``: the first write raises ``OSError(ENOSPC)``, as a full disk does;
- ``eio``: the first write raises ``OSError(EIO)``, as a failing disk or a lost mount does;
- ``hang``: the first write blocks for ``hang_s`` seconds, then goes through.

The error messages name the fault (``crashproof chaos fault <id>``), so the campaign can find
where the library reported them. Every affected file is logged next to the control file, so a
fault's count holds across restarts. Reads, listings, publishing and removal pass through
untouched: what the checkpoint code does about a failed write is what is under test.
"""

from __future__ import annotations

import errno
import os
import time

from crashproof._seams import ENV_CHAOS_STORAGE, ControlWatcher, armed
from crashproof.storage._base import ReadStream, Storage, WriteStream

__all__ = ["FaultyStorage", "with_injected_faults"]

_ERRORS = {"enospc": errno.ENOSPC, "eio": errno.EIO}


def with_injected_faults(storage: Storage) -> Storage:
    """``storage``, wrapped in a :class:`FaultyStorage` when ``CRASHPROOF_CHAOS_STORAGE`` is set."""
    if isinstance(storage, FaultyStorage):
        return storage
    watcher = armed(ENV_CHAOS_STORAGE)
    return storage if watcher is None else FaultyStorage(storage, watcher)


class _Fault:
    """What to do to one file's first write."""

    def __init__(self, fault_id: str, error: str, hang_s: float) -> None:
        self.fault_id, self.error, self.hang_s = fault_id, error, hang_s

    def apply(self, path: str) -> None:
        if self.error == "hang":
            time.sleep(self.hang_s)
            return
        code = _ERRORS[self.error]
        raise OSError(code, f"{os.strerror(code)} (crashproof chaos fault {self.fault_id})", path)


class _FaultyWriteStream:
    def __init__(self, inner: WriteStream, path: str, fault: _Fault) -> None:
        self._inner, self._path = inner, path
        self._fault: _Fault | None = fault

    def write(self, data: bytes | memoryview, /) -> None:
        fault, self._fault = self._fault, None
        if fault is not None:
            fault.apply(self._path)
        self._inner.write(data)

    def commit(self) -> None:
        fault, self._fault = self._fault, None  # an empty file: the fault hits its commit
        if fault is not None:
            fault.apply(self._path)
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class FaultyStorage:
    """``inner`` with the writes of this process's rank failing as the control file ``watcher``
    reads says. Implements :class:`~crashproof.storage.Storage`."""

    def __init__(self, inner: Storage, watcher: ControlWatcher) -> None:
        self.inner = inner
        self._watcher = watcher

    def _next_fault(self, path: str) -> _Fault | None:
        """The armed fault that takes the file ``path``, if any (counted as fired)."""
        for fault in self._watcher.faults():
            fault_id = str(fault["id"])
            error = str(fault.get("error", "eio"))
            if error not in (*_ERRORS, "hang"):
                continue
            if self._watcher.claim(fault_id, int(fault.get("files", 1)), path=path, error=error):
                return _Fault(fault_id, error, float(fault.get("hang_s", 0.0)))
        return None

    def join(self, base: str, *names: str) -> str:
        return self.inner.join(base, *names)

    def list(self, path: str) -> list[str]:
        return self.inner.list(path)

    def make_dirs(self, path: str) -> None:
        self.inner.make_dirs(path)

    def create(self, path: str) -> WriteStream:
        stream = self.inner.create(path)
        fault = self._next_fault(path)
        return stream if fault is None else _FaultyWriteStream(stream, path, fault)

    def open(self, path: str) -> ReadStream:
        return self.inner.open(path)

    def put_file(self, local_path: str, path: str) -> None:
        fault = self._next_fault(path)
        if fault is not None:
            fault.apply(path)
        self.inner.put_file(local_path, path)

    def publish(self, tmp_dir: str, final_dir: str, *, commit_marker: str | None = None) -> None:
        self.inner.publish(tmp_dir, final_dir, commit_marker=commit_marker)

    def remove(self, path: str) -> None:
        self.inner.remove(path)

    def describe(self, path: str) -> str:
        return self.inner.describe(path)
