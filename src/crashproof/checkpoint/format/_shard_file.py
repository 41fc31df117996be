"""Write a rank's tensors into one shard file, and read them back verified.

The shard is a valid safetensors file (a JSON header, then the tensors' bytes back to back), so
``safetensors.safe_open`` can read a crashproof shard; crashproof itself reads through the rank index
(see :mod:`crashproof.checkpoint.format._rank_index`), which also holds each tensor's checksum.

Every tensor's bytes are hashed once; the shard's own checksum is derived from its header and the
tensors' checksums (scheme ``"tensors"`` in the manifest), so it covers every byte of the file.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from crashproof.checkpoint.format._dtypes import dtype_from_name, dtype_name, safetensors_code
from crashproof.checkpoint.format._hashing import digest, new_hasher
from crashproof.checkpoint.format._manifest import FileEntry
from crashproof.checkpoint.format._rank_index import TensorEntry
from crashproof.errors import CorruptCheckpointError, UnsupportedStateError
from crashproof.storage import ReadStream, Storage

__all__ = [
    "ReadBuffer",
    "ShardRead",
    "copy_tensor_bytes",
    "hash_range",
    "read_shard",
    "shard_checksum",
    "shard_layout",
    "tensor_bytes",
    "write_shard",
]

_CHUNK = 16 * 1024 * 1024
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on its JSON header
_READ_THREADS = 4
_EMPTY = torch.empty(0)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU, contiguous tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def copy_tensor_bytes(into: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the bytes of ``source`` into ``into`` (CPU, contiguous, as many bytes): one memcpy
    on the calling thread, exact for every dtype (NumPy has no bfloat16 or float8: bytes). NumPy
    lets the GIL go for a large copy, so several threads copy at once; a torch ``copy_`` would
    start a team of intra-op threads for each tensor instead."""
    if source.numel():
        np.copyto(_byte_array(into), _byte_array(source))


def _byte_array(tensor: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _header(
    names_and_tensors: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]
) -> tuple[bytes, list[tuple[int, int]]]:
    """The safetensors header, and each tensor's (offset within data, nbytes)."""
    entries: dict[str, object] = {"__metadata__": metadata}
    ranges, pos = [], 0
    for name, tensor in names_and_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        stored = dtype_name(tensor.dtype, where=name)
        code = safetensors_code(stored)
        shape = list(tensor.shape) if code else [nbytes]
        entries[name] = {"dtype": code or "U8", "shape": shape, "data_offsets": [pos, pos + nbytes]}
        ranges.append((pos, nbytes))
        pos += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    return len(raw).to_bytes(8, "little") + raw, ranges


_DEFAULT_METADATA = {"format": "crashproof"}


def shard_layout(
    names_and_tensors: Sequence[tuple[str, torch.Tensor]],
) -> tuple[bytes, list[tuple[int, int]]]:
    """The header :func:`write_shard` writes for these tensors (no metadata given), and each
    tensor's (offset after the header, nbytes): where a staging area places the tensors so that
    the shard's bytes are its buffers (see :mod:`crashproof.checkpoint.memory`)."""
    return _header(names_and_tensors, _DEFAULT_METADATA)


def _chunks(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), _CHUNK):
        yield view[start : start + _CHUNK]


def shard_checksum(header: bytes, tensor_checksums: Sequence[str]) -> str:
    """The ``"tensors"`` checksum of a shard: its header, then each tensor's checksum in order."""
    hasher = new_hasher()
    hasher.update(header)
    for checksum in tensor_checksums:
        hasher.update(checksum.encode("ascii"))
    return hasher.hexdigest()


def write_shard(
    storage: Storage,
    path: str,
    tensors: Sequence[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
    inspect: Callable[[int, memoryview], None] | None = None,
    known: Callable[[], Mapping[str, str]] | None = None,
) -> tuple[list[TensorEntry], FileEntry]:
    """Write CPU contiguous ``tensors`` to ``path`` durably; returns their entries and the file's.

    ``metadata`` goes into the safetensors header's ``__metadata__`` (string values only). Each
    byte is hashed once, on a helper thread that trails the writes: xxHash and ``os.write`` both
    release the GIL, so on two cores the checksums cost almost no wall time. ``inspect(i, chunk)``
    is called on that thread too, with every chunk of tensor ``i``, after it is hashed.

    ``known``: the bytes are another writer's too, which hashes (and inspects) them; called once
    every byte is written, it gives the checksums that writer worked out, by name, and only the
    tensors it does not name are hashed and inspected then.
    """
    header, ranges = _header(tensors, metadata if metadata is not None else _DEFAULT_METADATA)
    hashers = [new_hasher() for _ in tensors]
    given: Mapping[str, str] = {}
    stream = storage.create(path)
    try:
        stream.write(header)
        with ThreadPoolExecutor(1, thread_name_prefix="crashproof-hash") as hash_pool:
            # One worker runs the updates in submission order, so each hasher sees its chunks in
            # order; the tensors cannot change during the save, so nothing waits per chunk.
            pending = []
            for i, ((_, tensor), hasher) in enumerate(zip(tensors, hashers, strict=True)):
                for chunk in _chunks(tensor_bytes(tensor)):
                    if known is None:
                        pending.append(hash_pool.submit(_hash_chunk, hasher, chunk, i, inspect))
                    stream.write(chunk)
            for future in pending:
                future.result()
        if known is not None:
            given = known()
            for i, ((name, tensor), hasher) in enumerate(zip(tensors, hashers, strict=True)):
                if name not in given:
                    for chunk in _chunks(tensor_bytes(tensor)):
                        _hash_chunk(hasher, chunk, i, inspect)
        stream.commit()
    except BaseException:
        stream.abort()
        raise
    entries = [
        TensorEntry(
            name=name,
            dtype=dtype_name(tensor.dtype, where=name),
            shape=tuple(tensor.shape),
            offset=len(header) + pos,
            nbytes=nbytes,
            checksum=given[name] if name in given else hasher.hexdigest(),
        )
        for (name, tensor), (pos, nbytes), hasher in zip(tensors, ranges, hashers, strict=True)
    ]
    size = len(header) + sum(nbytes for _, nbytes in ranges)
    checksum = shard_checksum(header, [e.checksum for e in entries])
    return entries, FileEntry(size=size, checksum=checksum, scheme="tensors")


def _hash_chunk(
    hasher: Any, chunk: memoryview, index: int, inspect: Callable[[int, memoryview], None] | None
) -> None:
    hasher.update(chunk)
    if inspect is not None:
        inspect(index, chunk)


class ReadBuffer:
    """How many bytes of host memory a restore may hold for tensors bound for live ones, shared
    by the shards it reads (thread-safe): each tensor that fits is read once, verified in that
    memory, then copied into its live tensor; the others are read twice (see :class:`ShardRead`)."""

    def __init__(self, nbytes: int) -> None:
        self._left = nbytes
        self._lock = threading.Lock()

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` the restore holds in memory anyway (tensors with no live destination)
        against the allowance, whether or not they fit."""
        with self._lock:
            self._left -= nbytes

    def take(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit in what is left; returns whether they did."""
        with self._lock:
            if nbytes > self._left:
                return False
            self._left -= nbytes
            return True


class ShardRead:
    """Read one shard in two phases, so live tensors are written only once every byte verified.

    :meth:`verify` checks the layout and reads every tensor into new host memory as it hashes
    it: those without a live destination (when kept) and, as far as ``buffer`` allows, those
    with one. The rest of the latter are only hashed, through a small per-thread buffer (which
    also warms the page cache). :meth:`fill` then copies the buffered tensors into the live
    tensors named in ``into`` (by tensor name) and reads the others' verified bytes straight into
    theirs, a second read that needs no second copy of the model in memory. Reads and hashes
    release the GIL: a few threads keep the disk's queue full.
    """

    def __init__(
        self,
        stream: ReadStream,
        entries: Sequence[TensorEntry],
        expected: FileEntry,
        where: str,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        keep: bool | Callable[[str], bool] = True,
        on_bytes: Callable[[int], None] | None = None,
        partial: bool = False,
        buffer: ReadBuffer | None = None,
    ) -> None:
        self._stream, self._entries, self._expected, self._where = stream, entries, expected, where
        self._buffer = buffer
        self._buffered: dict[int, torch.Tensor] = {}  # read once, verified: copied by fill()
        # Some tensors of another rank's shard (replicated state it wrote for everyone): each is
        # checked against its own checksum; the file as a whole is its writer's to verify.
        self._partial = partial
        # Which tensors without a live destination are read into memory (by name): all, none
        # (verify only hashes), or some (verify keeps the RNG states it checks by value).
        self._keep: Callable[[str], bool] = keep if callable(keep) else (lambda _: keep)
        self._on_bytes = on_bytes
        self._targets = {
            i: t
            for i, e in enumerate(entries)
            if (t := (into or {}).get(e.name)) is not None and _fits(t, e)
        }
        self._tensors: list[torch.Tensor] = [_EMPTY] * len(entries)
        self._verified = False
        # A stream over memory no one else writes (a snapshot in the agent's memory): tensors
        # bound for live ones are hashed where they lie and copied once, by fill().
        self._view: Callable[[int, int], memoryview] | None = getattr(stream, "view", None)
        # A snapshot the agent checked byte for byte after every process that could write it
        # had stopped, mapped read-only here since: its layout is checked, its bytes copied
        # without a second hash (see crashproof.checkpoint.memory's Slot.verified).
        self._hashed_already = self._view is not None and bool(getattr(stream, "verified", False))
        if buffer is not None:  # read into new memory whatever the buffer: counted first
            buffer.charge(sum(e.nbytes for i, e in enumerate(entries) if self.has_value(i)))

    def verify(self) -> None:
        """Check every byte against its checksum; raises :class:`CorruptCheckpointError`."""
        where, entries = self._where, self._entries
        actual_size = self._stream.size()
        if actual_size != self._expected.size:
            raise CorruptCheckpointError(
                f"{where}: {actual_size} bytes on storage, the manifest says {self._expected.size} (truncated or appended)"
            )
        if self._expected.scheme != "tensors":
            raise CorruptCheckpointError(
                f"{where}: listed with checksum scheme {self._expected.scheme!r}, expected 'tensors'"
            )
        order = sorted(range(len(entries)), key=lambda i: entries[i].offset)
        if self._partial:
            # No byte read twice: what is kept is bounded by the file, however many entries.
            end, previous = 0, None
            for i in sorted(order, key=lambda i: (entries[i].offset, entries[i].nbytes)):
                e = entries[i]
                if e.offset + e.nbytes > actual_size:
                    raise CorruptCheckpointError(
                        f"{where}: tensor {e.name!r} (bytes {e.offset}..{e.offset + e.nbytes}) "
                        f"lies outside the file's {actual_size} bytes"
                    )
                if e.offset < end and e.nbytes:
                    assert previous is not None
                    raise CorruptCheckpointError(
                        f"{where}: tensors {previous.name!r} (bytes {previous.offset}.."
                        f"{previous.offset + previous.nbytes}) and {e.name!r} (bytes {e.offset}.."
                        f"{e.offset + e.nbytes}) overlap; a tensor of another rank's shard is "
                        "listed once, at its own bytes"
                    )
                if e.offset + e.nbytes >= end:
                    end, previous = e.offset + e.nbytes, e
            with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="crashproof-read") as pool:
                list(pool.map(self._verify_one, order))
            self._verified = True
            return
        header_end = entries[order[0]].offset if entries else actual_size
        if header_end > _MAX_HEADER:
            raise CorruptCheckpointError(
                f"{where}: a {header_end}-byte header is beyond the {_MAX_HEADER}-byte limit"
            )
        pos = header_end
        for i in order:  # the layout, from metadata alone, before reading any tensor
            if entries[i].offset != pos:
                raise CorruptCheckpointError(
                    f"{where}: tensor {entries[i].name!r} starts at byte {entries[i].offset}, expected {pos} "
                    "(tensors must follow each other without gaps or overlaps)"
                )
            pos += entries[i].nbytes
        if pos != actual_size:
            raise CorruptCheckpointError(
                f"{where}: {actual_size - pos} bytes after the last tensor"
            )
        header = bytearray(header_end)
        self._stream.readinto(0, memoryview(header))
        with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="crashproof-read") as pool:
            list(pool.map(self._verify_one, order))
        found = shard_checksum(bytes(header), [entries[i].checksum for i in order])
        if found != self._expected.checksum:
            raise CorruptCheckpointError(
                f"{where}: shard checksum {found}, expected {self._expected.checksum}"
            )
        self._verified = True

    def _verify_one(self, i: int) -> None:
        entry = self._entries[i]
        if self.has_value(i):
            self._tensors[i] = self.read(i)
        elif self._hashed_already:
            pass
        elif self._view is not None:  # (hashed where it lies: no copy into a bounce buffer)
            self._check(entry, digest(self._view(entry.offset, entry.nbytes)))
        elif i in self._targets and self._buffer is not None and self._buffer.take(entry.nbytes):
            self._buffered[i] = self.read(i)
        else:
            self._check(entry, hash_range(self._stream, entry.offset, entry.nbytes))
        if self._on_bytes:
            self._on_bytes(entry.nbytes)

    def read(self, i: int) -> torch.Tensor:
        """Entry ``i``'s tensor, read into new memory and checked against its checksum."""
        entry = self._entries[i]
        tensor = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype, where=self._where))
        view = tensor_bytes(tensor)
        self._stream.readinto(entry.offset, view)
        if not self._hashed_already:
            self._check(entry, digest(view))
        return tensor

    def _check(self, entry: TensorEntry, found: str, when: str = "") -> None:
        if found != entry.checksum:
            raise CorruptCheckpointError(
                f"{self._where}: tensor {entry.name!r} (bytes {entry.offset}..{entry.offset + entry.nbytes}) "
                f"has checksum {found}, expected {entry.checksum}{when}"
            )

    def has_destination(self, i: int) -> bool:
        """Whether entry ``i`` is read into a live tensor by :meth:`fill` (else :meth:`verify`
        read it into new memory, when ``keep``)."""
        return i in self._targets

    def has_value(self, i: int) -> bool:
        """Whether :meth:`verify` reads entry ``i`` into new memory (it has no live destination
        and is kept), so :meth:`kept` holds its value."""
        return i not in self._targets and self._keep(self._entries[i].name)

    def kept(self) -> list[torch.Tensor]:
        """After :meth:`verify`: the tensors read into new memory (``keep``), in entry order; an
        empty tensor for those with a live destination (not written yet) or not kept."""
        assert self._verified, "kept() before verify()"
        return self._tensors

    def fill(self) -> list[torch.Tensor]:
        """Read the verified bytes into the live tensors; returns every tensor, in entry order."""
        assert self._verified, "fill() before verify()"

        def fill_one(i: int) -> None:
            entry, target = self._entries[i], self._targets[i]
            if self._view is not None:  # verified where it lies, which nothing else writes
                if entry.nbytes:
                    source = np.frombuffer(self._view(entry.offset, entry.nbytes), np.uint8)
                    np.copyto(_byte_array(target), source)
                self._tensors[i] = target
                return
            buffered = self._buffered.pop(i, None)
            if buffered is not None:  # verified in memory no one else can change: copied
                copy_tensor_bytes(target, buffered)
                self._tensors[i] = target
                return
            view = tensor_bytes(target)
            self._stream.readinto(entry.offset, view)
            # Cheap insurance (it hashes from memory): the file must not have changed since verify.
            self._check(
                entry, digest(view), " after it verified: the file changed during the restore"
            )
            self._tensors[i] = target

        with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="crashproof-read") as pool:
            list(pool.map(fill_one, sorted(self._targets)))
        return self._tensors


def _fits(target: torch.Tensor, entry: TensorEntry) -> bool:
    """Whether the entry's bytes can be read straight into ``target``'s memory."""
    return (
        target.device.type == "cpu"
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and tuple(target.shape) == entry.shape
        and _stored_name(target.dtype) == entry.dtype
    )


def _stored_name(dtype: torch.dtype) -> str | None:
    """``dtype``'s name in the format; None for one it cannot hold (a live tensor of such a
    dtype fits no entry: the state check that follows names what was expected and found)."""
    try:
        return dtype_name(dtype, where="")
    except UnsupportedStateError:
        return None


_LOCAL = threading.local()


def _bounce_buffer() -> memoryview:
    """A reusable per-thread read buffer for hashing bytes without keeping them."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None:
        buf = _LOCAL.buf = memoryview(bytearray(_CHUNK))
    return buf


def hash_range(
    stream: ReadStream, offset: int, nbytes: int, on_bytes: Callable[[int], None] | None = None
) -> str:
    """The checksum of ``nbytes`` bytes from ``offset``, read through a per-thread buffer."""
    hasher = new_hasher()
    bounce = _bounce_buffer()
    for start in range(0, nbytes, len(bounce)):
        view = bounce[: min(len(bounce), nbytes - start)]
        stream.readinto(offset + start, view)
        hasher.update(view)
        if on_bytes:
            on_bytes(len(view))
    return hasher.hexdigest()


def read_shard(
    stream: ReadStream,
    entries: Sequence[TensorEntry],
    expected: FileEntry,
    where: str,
    *,
    keep: bool = True,
    on_bytes: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """Read (``keep``) or only verify every tensor of a shard; see :class:`ShardRead`."""
    reader = ShardRead(stream, entries, expected, where, keep=keep, on_bytes=on_bytes)
    reader.verify()
    return reader.fill()
