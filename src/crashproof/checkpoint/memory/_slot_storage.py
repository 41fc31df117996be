"""A slot seen as a :class:`~crashproof.storage.Storage` holding one checkpoint directory: this
rank's part of one step (its shard, its index, a manifest cut down to those two).

Writing a memory snapshot is the disk save's own writer (:func:`~crashproof.checkpoint.save.persist`)
pointed at this storage, so its bytes, checksums, index and manifest are made by the same code and
verified by the same restore. Two differences, both here:

- the shard's tensor bytes are already in the segment (the staging buffers are views into it):
  each chunk the writer hands over must *be* the segment's bytes at the place the file puts them,
  checked by address, and nothing is copied; a chunk anywhere else fails the snapshot (it would
  otherwise overwrite a staged tensor not yet hashed). The header goes just before the tensors.
- ``publish`` is the commit: the agent is told, and offers the snapshot from then on.
"""

from __future__ import annotations

import posixpath

import numpy as np

from crashproof.checkpoint.format import checkpoint_dir_name, parse_step_dir, shard_name
from crashproof.checkpoint.memory._slot import Slot

__all__ = ["MEMORY_ROOT", "SlotStorage", "slot_place"]

MEMORY_ROOT = "memory"
"""The root a slot's checkpoint directory is under (a name in messages, not a path)."""


class _InPlaceShard:
    """The shard file, written over bytes already in place."""

    def __init__(self, slot: Slot, data_at: int) -> None:
        self._slot, self._data_at = slot, data_at
        self._view = slot.view()
        self._base = _address(self._view)
        self.start: int | None = None  # where the file begins (its header's first byte)
        self._pos = data_at

    def write(self, data: bytes | memoryview, /) -> None:
        data = memoryview(data).cast("B")
        if self.start is None:  # the header: placed to end where the tensors begin
            if len(data) > self._data_at:
                raise RuntimeError("the shard header does not fit before the staged tensors")
            self.start = self._data_at - len(data)
            self._view[self.start : self._data_at] = data
            return
        if len(data) and _address(data) != self._base + self._pos:
            raise RuntimeError(
                "a tensor of the memory snapshot is not where its staging buffer put it in the "
                "segment (the state's tensors changed between staging and writing)"
            )
        self._pos += len(data)
        if self._pos > len(self._view):
            raise RuntimeError("the memory snapshot overran its segment")

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass

    @property
    def span(self) -> tuple[int, int]:
        assert self.start is not None
        return self.start, self._pos - self.start


class _SmallFile:
    def __init__(self, files: dict[str, bytes], name: str) -> None:
        self._files, self._name, self._buf = files, name, bytearray()

    def write(self, data: bytes | memoryview, /) -> None:
        self._buf += memoryview(data).cast("B")

    def commit(self) -> None:
        self._files[self._name] = bytes(self._buf)

    def abort(self) -> None:
        self._files.pop(self._name, None)


class _ViewStream:
    """A file in memory. ``view`` lets a restore hash and copy the bytes where they lie: a
    segment is written only by its trainer, and a trainer that restores is not snapshotting.
    ``verified``: the agent has checked its tensors' bytes against their checksums already (see
    :attr:`Slot.verified`), and a restore copies them without hashing them again."""

    def __init__(self, data: memoryview, where: str, *, verified: bool = False) -> None:
        self._data, self._where = data, where
        self.verified = verified

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or offset + nbytes > len(self._data):
            raise EOFError(f"{self._where}: ends before offset {offset} + {nbytes}")
        return self._data[offset : offset + nbytes]

    def size(self) -> int:
        return len(self._data)

    def readinto(self, offset: int, buf: memoryview, /) -> None:
        view = buf.cast("B")
        if offset < 0 or offset + len(view) > len(self._data):
            raise EOFError(f"{self._where}: ends before offset {offset} + {len(view)}")
        view[:] = self._data[offset : offset + len(view)]

    def close(self) -> None:
        self._data = memoryview(b"")


class SlotStorage:
    """The checkpoint directory a slot holds (reading), or is being written (``data_at``: where
    the staged tensors begin in the segment)."""

    def __init__(self, slot: Slot, data_at: int | None = None) -> None:
        self._slot = slot
        self._data_at = data_at
        self._shard: _InPlaceShard | None = None
        self._pending: dict[str, bytes] = {}
        self._files = slot.files() if data_at is None else {}

    def join(self, base: str, *names: str) -> str:
        return posixpath.join(base, *names)

    def describe(self, path: str) -> str:
        where = slot_place(self._slot)
        return where if path.rstrip("/") == MEMORY_ROOT else f"{where}: {path}"

    def list(self, path: str) -> list[str]:
        committed = self._slot.contents.get("path")
        if path.rstrip("/") == MEMORY_ROOT:
            return [committed] if committed else []
        if committed and posixpath.basename(path.rstrip("/")) == committed:
            return sorted([*self._files, shard_name(self._slot.rank)])
        return []

    def make_dirs(self, path: str) -> None:
        pass

    def create(self, path: str) -> _InPlaceShard | _SmallFile:
        name = posixpath.basename(path)
        if name == shard_name(self._slot.rank):
            assert self._data_at is not None, "a slot read from is not written to"
            self._shard = _InPlaceShard(self._slot, self._data_at)
            return self._shard
        return _SmallFile(self._pending, name)

    def open(self, path: str) -> _ViewStream:
        name, where = posixpath.basename(path), self.describe(path)
        parent = posixpath.basename(posixpath.dirname(path))
        if parent != self._slot.contents.get("path"):
            raise FileNotFoundError(where)
        if name == shard_name(self._slot.rank):
            start, size = self._slot.contents["shard"]
            view = self._slot.view()[start : start + size]
            return _ViewStream(view, where, verified=self._slot.verified)
        if name not in self._files:
            raise FileNotFoundError(where)
        return _ViewStream(memoryview(self._files[name]), where)

    def put_file(self, local_path: str, path: str) -> None:
        raise OSError(f"{self.describe(path)}: only the checkpoint writer writes here")

    def publish(self, tmp_dir: str, final_dir: str, *, commit_marker: str | None = None) -> None:
        name = posixpath.basename(final_dir.rstrip("/"))
        step = parse_step_dir(name)
        if self._shard is None or step is None or name != checkpoint_dir_name(step):
            raise RuntimeError(f"{self.describe(final_dir)}: not a complete snapshot")
        self._slot.commit(step, dict(self._pending), self._shard.span, name)

    def remove(self, path: str) -> None:
        self._pending.clear()


def slot_place(slot: Slot) -> str:
    """Where a slot is, in messages: the agent's memory, the rank's snapshot, where it came from."""
    origin = slot.origin
    copied = "" if origin == "local" else f", copied from {origin.removeprefix('peer:')}"
    return (
        f"the memory of crashproof run's agent (rank {slot.rank}'s snapshot {slot.index}{copied})"
    )


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
