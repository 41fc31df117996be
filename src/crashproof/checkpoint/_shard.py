"""Write a rank's tensors into one shard file, and read them back verified.

The shard is a valid safetensors file (a JSON header, then the tensors' bytes back to back), so
``safetensors.safe_open`` can read a crashproof shard; crashproof itself reads through the rank index
(see :mod:`crashproof.checkpoint._format`), which also holds each tensor's checksum.

Writing hashes each chunk on a helper thread while the previous chunk is being written: xxHash and
``os.write`` both release the GIL, so the checksums cost no wall time next to the disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from crashproof.checkpoint._dtypes import dtype_from_name, dtype_name, safetensors_code
from crashproof.checkpoint._format import FileEntry, TensorEntry
from crashproof.checkpoint._hashing import Hasher, new_hasher
from crashproof.errors import CorruptCheckpointError
from crashproof.storage import ReadStream, Storage

__all__ = ["read_shard", "tensor_bytes", "write_shard"]

_CHUNK = 16 * 1024 * 1024


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU, contiguous tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


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


def _chunks(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), _CHUNK):
        yield view[start : start + _CHUNK]


def write_shard(
    storage: Storage,
    path: str,
    tensors: Sequence[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> tuple[list[TensorEntry], FileEntry]:
    """Write CPU contiguous ``tensors`` to ``path`` durably; returns their entries and the file's.

    ``metadata`` goes into the safetensors header's ``__metadata__`` (string values only).
    """
    header, ranges = _header(
        tensors, metadata if metadata is not None else {"format": "crashproof"}
    )
    file_hasher = new_hasher()
    file_hasher.update(header)
    entries: list[TensorEntry] = []
    stream = storage.create(path)
    try:
        stream.write(header)
        with ThreadPoolExecutor(1, thread_name_prefix="crashproof-hash") as hash_pool:
            for (name, tensor), (pos, nbytes) in zip(tensors, ranges, strict=True):
                tensor_hasher = new_hasher()
                for chunk in _chunks(tensor_bytes(tensor)):
                    hashed = hash_pool.submit(_update_both, tensor_hasher, file_hasher, chunk)
                    stream.write(chunk)
                    hashed.result()
                entries.append(
                    TensorEntry(
                        name=name,
                        dtype=dtype_name(tensor.dtype, where=name),
                        shape=tuple(tensor.shape),
                        offset=len(header) + pos,
                        nbytes=nbytes,
                        checksum=tensor_hasher.hexdigest(),
                    )
                )
        stream.commit()
    except BaseException:
        stream.abort()
        raise
    size = len(header) + (ranges[-1][0] + ranges[-1][1] if ranges else 0)
    return entries, FileEntry(size=size, checksum=file_hasher.hexdigest())


def _update_both(a: Hasher, b: Hasher, chunk: memoryview) -> None:
    a.update(chunk)
    b.update(chunk)


def read_shard(
    stream: ReadStream,
    entries: Sequence[TensorEntry],
    expected: FileEntry,
    where: str,
    *,
    keep: bool = True,
    on_bytes: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """Read every tensor of a shard, verifying each tensor's and the whole file's checksum.

    ``entries`` were validated against ``expected.size`` by the format parser, so every range lies
    inside the file; the actual file size is checked here against the manifest before any read.
    With ``keep=False`` the tensors are verified and dropped one by one (memory: the largest one).
    """
    actual_size = stream.size()
    if actual_size != expected.size:
        raise CorruptCheckpointError(
            f"{where}: {actual_size} bytes on storage, the manifest says {expected.size} (truncated or appended)"
        )
    tensors: list[torch.Tensor] = [torch.empty(0)] * len(entries)
    file_hasher = new_hasher()
    pos = 0  # bytes of the file already fed to file_hasher, in order
    for i in sorted(range(len(entries)), key=lambda i: entries[i].offset):
        entry = entries[i]
        if entry.offset < pos:
            raise CorruptCheckpointError(
                f"{where}: tensor {entry.name!r} overlaps the one before it"
            )
        _hash_range(stream, pos, entry.offset, file_hasher)
        tensor = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype, where=where))
        view = tensor_bytes(tensor)
        stream.readinto(entry.offset, view)
        tensor_hasher = new_hasher()
        _update_both(tensor_hasher, file_hasher, view)
        if tensor_hasher.hexdigest() != entry.checksum:
            raise CorruptCheckpointError(
                f"{where}: tensor {entry.name!r} (bytes {entry.offset}..{entry.offset + entry.nbytes}) "
                f"has checksum {tensor_hasher.hexdigest()}, expected {entry.checksum}"
            )
        if keep:
            tensors[i] = tensor
        if on_bytes:
            on_bytes(entry.offset + entry.nbytes - pos)
        pos = entry.offset + entry.nbytes
    _hash_range(stream, pos, actual_size, file_hasher)
    if on_bytes:
        on_bytes(actual_size - pos)
    if file_hasher.hexdigest() != expected.checksum:
        raise CorruptCheckpointError(
            f"{where}: file checksum {file_hasher.hexdigest()}, expected {expected.checksum}"
        )
    return tensors


def _hash_range(stream: ReadStream, start: int, end: int, hasher: Hasher) -> None:
    """Feed bytes [start, end) of the file to ``hasher`` (the header, or any gap)."""
    buf = np.empty(min(max(end - start, 0), _CHUNK), dtype=np.uint8)
    while start < end:
        view = buf.data[: min(_CHUNK, end - start)]
        stream.readinto(start, view)
        hasher.update(view)
        start += len(view)
