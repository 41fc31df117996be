"""Delta checkpoints: store only how each tensor differs from the newest full checkpoint.

Lossless, unlike the seeds' sketch that drops small changes: a restored delta equals the saved
state bit for bit. Per tensor, against the tensor of the same name in the base (the newest full
checkpoint, kept in host memory by the manager):

- ``same``: not one bit changed (frozen layers, untouched buffers): nothing stored;
- ``xor-zstd``: the bitwise XOR with the base, its bytes regrouped into planes (every element's
  first byte, then every second byte, ...), compressed with zstd. A training update leaves the
  sign, the exponent and the leading mantissa bits of most values as they were, so the XOR is
  mostly zero bits and the high-byte planes compress very well; rows an update never touched (an
  embedding's) are runs of zeros;
- stored as is (no entry) when it is new, has another shape or dtype, or would not shrink.

In the shard an encoded tensor is a ``uint8`` blob, so the shard stays a valid safetensors file
and the format's checksums, layout checks and commit cover it unchanged; the rank index describes
the logical tensor (``deltas``) with the checksum of its *decoded* bytes, checked after the
restore rebuilt it.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from crashproof.checkpoint.format import (
    DeltaEntry,
    copy_tensor_bytes,
    digest,
    dtype_name,
    tensor_bytes,
)
from crashproof.checkpoint.save._finite import FiniteCheck
from crashproof.errors import ConfigError, CorruptCheckpointError

__all__ = ["Delta", "DeltaBase", "apply_delta", "encode_delta", "keep_as_base"]

_EMPTY = torch.empty(0, dtype=torch.uint8)
_WORTH_IT = 0.95  # store as is unless the encoding saves at least 5%


@dataclass(frozen=True, slots=True)
class Delta:
    """``CheckpointManager(delta=Delta(full_every=N))``: one full checkpoint, then ``N - 1``
    deltas against it, then a full one again.

    Costs one more copy of the state in host memory (the base the deltas are taken against) and
    the encoding's CPU time on the background writer. After a restart the first save is full.
    """

    full_every: int = 10
    level: int = 1
    """zstd's level: 1 is fast enough to keep up with a disk; higher levels shrink little more."""
    threads: int = 2
    """Tensors encoded at the same time (zstd and NumPy release the GIL)."""

    def __post_init__(self) -> None:
        if self.full_every < 2 or not 1 <= self.level <= 19 or self.threads < 1:
            raise ConfigError(
                f"{self}: full_every must be >= 2 (1 would mean no deltas), level in 1..19, threads >= 1"
            )


@dataclass(frozen=True, slots=True)
class DeltaBase:
    """A committed full checkpoint's tensors, by name, held in host memory to encode against."""

    step: int
    tensors: Mapping[str, torch.Tensor]
    checksums: Mapping[str, str]
    manifest: str | None = None
    """The checksum of the checkpoint's ``manifest.json``, recorded in every delta taken against
    it (``base_manifest``): a later checkpoint of the same step (saved again after a restore fell
    back past this one) is another base. Known where the manifest was written: on the
    coordinator, the one rank that writes a delta's manifest too."""


def keep_as_base(
    snapshot: Any, checksums: Mapping[str, str], previous: DeltaBase | None
) -> DeltaBase:
    """A host copy of a committed full snapshot's tensors, reusing ``previous``'s buffers where
    names, shapes and dtypes match (a full save every few saves must not churn memory).

    ``snapshot`` is the :class:`~crashproof.checkpoint.save._writer.Snapshot` that was committed: its
    ``committed_manifest`` binds the deltas to be taken against it to this very checkpoint."""
    old = previous.tensors if previous is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in snapshot.tensors:
        buffer = old.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty_like(tensor, device="cpu")
        copy_tensor_bytes(buffer, tensor)
        tensors[name] = buffer
    return DeltaBase(
        snapshot.step, tensors, dict(checksums), getattr(snapshot, "committed_manifest", None)
    )


# The encoding runs on the background writer, beside the training loop, so it uses NumPy, which
# computes on the calling thread alone: a torch op would start its own OpenMP team and two teams
# spinning on the same cores slow training down (seen in an A/B run: a sum per tensor cost
# training ~15% of its speed; an observation, not a benchmark figure).


def _bytes(tensor: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes of a CPU, contiguous tensor as a NumPy array, without a copy."""
    if tensor.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return tensor.reshape(-1).view(torch.uint8).numpy()


# An encoded tensor is one record per byte plane (byte ``k`` of every element together, for
# ``k`` = 0, 1, ...: like bytes compress together): a mode byte (0: the plane as is, 1: zstd), the
# payload's length (8 bytes, little-endian), the payload. A plane of low mantissa bytes is close
# to random and zstd would spend time for nothing on it: a sample decides.
_RAW, _ZSTD = 0, 1
_RECORD = struct.Struct("<BQ")
_SAMPLE = 64 * 1024
_COMPRESSIBLE = 0.9


def _xor_planes(
    now: np.ndarray[Any, Any],
    then: np.ndarray[Any, Any],
    itemsize: int,
    compressor: zstandard.ZstdCompressor,
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The encoded XOR of ``now`` and ``then``, the bytes of ``itemsize``-byte elements.

    One pass: each plane's XOR is computed straight into its place in the blob (a strided read
    of both tensors, a contiguous write), and a compressible plane's zstd frame then overwrites
    it there; no XOR, plane or record is held anywhere else (computing the XOR, then the
    planes, then joining the records copied every byte three times: benchmarks/delta.py)."""
    count = now.size // itemsize
    # Every plane as is: the most it takes. Not zero-filled: every byte given is written first.
    blob = np.empty(itemsize * (_RECORD.size + count), dtype=np.uint8)
    now_columns, then_columns = now.reshape(-1, itemsize), then.reshape(-1, itemsize)
    pos = 0
    for k in range(itemsize):
        start = pos + _RECORD.size
        plane = blob[start : start + count]
        np.bitwise_xor(now_columns[:, k], then_columns[:, k], out=plane)
        mode, length = _RAW, count
        payload = _packed(plane, compressor)
        if payload is not None:
            mode, length = _ZSTD, len(payload)
            blob[start : start + length] = np.frombuffer(payload, dtype=np.uint8)
        _RECORD.pack_into(blob.data, pos, mode, length)
        pos = start + length
    return blob[:pos]


def _packed(plane: np.ndarray[Any, Any], compressor: zstandard.ZstdCompressor) -> bytes | None:
    """``plane`` as one zstd frame, or None where zstd would not make it smaller by a tenth.

    A plane of low mantissa bytes is close to random: the frame's first ``_SAMPLE`` bytes
    decide, and the rest of the plane goes on into the same frame only when they were
    compressible, so no byte is compressed twice (compressing a sample on its own first doubled
    zstd's work on every small tensor: benchmarks/delta.py)."""
    count = plane.size
    if count <= 4 * _SAMPLE:
        payload = compressor.compress(plane.data)
        return payload if len(payload) <= _COMPRESSIBLE * count else None
    stream = compressor.compressobj(size=count)
    head = stream.compress(plane[:_SAMPLE].data)
    head += stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    if len(head) > _COMPRESSIBLE * _SAMPLE:
        return None
    payload = head + stream.compress(plane[_SAMPLE:].data) + stream.flush()
    return payload if len(payload) < count else None


def _same_bytes(now: np.ndarray[Any, Any], then: np.ndarray[Any, Any]) -> bool:
    """Whether ``now`` and ``then`` (bytes) are equal, compared eight bytes at a time."""
    words = now.size // 8 * 8
    return np.array_equal(now[:words].view(np.uint64), then[:words].view(np.uint64)) and (
        np.array_equal(now[words:], then[words:])
    )


def _each_plane(
    blob: np.ndarray[Any, Any], count: int, itemsize: int, where: str
) -> Iterator[tuple[int, np.ndarray[Any, Any]]]:
    """Plane ``k`` of the ``itemsize`` planes of ``count`` bytes each that ``blob`` holds, in
    order, each validated before it is given; the blob's end is checked after the last."""
    data, pos = memoryview(blob.data).cast("B"), 0
    for k in range(itemsize):
        if pos + _RECORD.size > len(data):
            raise CorruptCheckpointError(f"{where}: the delta ends inside plane {k} of {itemsize}")
        mode, length = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        if mode not in (_RAW, _ZSTD) or length > len(data) - pos:
            raise CorruptCheckpointError(
                f"{where}: plane {k} of the delta has mode {mode} and {length} bytes, "
                f"{len(data) - pos} left"
            )
        payload = data[pos : pos + length]
        pos += length
        if mode == _ZSTD:
            payload = memoryview(_decompress(payload, count, f"{where}: plane {k}"))
        if len(payload) != count:
            raise CorruptCheckpointError(
                f"{where}: plane {k} holds {len(payload)} bytes, the tensor needs {count}"
            )
        yield k, np.frombuffer(payload, dtype=np.uint8)
    if pos != len(data):
        raise CorruptCheckpointError(f"{where}: {len(data) - pos} bytes after the last plane")


def _decompress(frame: memoryview, count: int, where: str) -> bytes:
    """The ``count`` bytes one zstd frame holds; nothing larger is ever allocated.

    python-zstandard ignores ``max_output_size`` when a frame's header states its content size
    and allocates what the header says (16 bytes on disk could ask for a TiB). So the stated
    size must be ``count`` (the writer always states it) before anything is decompressed, and
    zstd itself refuses a frame that holds more than it states; bytes after the frame (a second
    frame, garbage) are refused too, so one blob has one decoding."""
    try:
        stated = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"{where} is not a zstd frame ({exc})") from None
    if stated != count:
        said = "does not state its size" if stated < 0 else f"states {stated} bytes"
        raise CorruptCheckpointError(f"{where}: its zstd frame {said}, the tensor needs {count}")
    stream = zstandard.ZstdDecompressor().decompressobj()
    try:
        data = stream.decompress(frame)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"{where} cannot be decoded ({exc})") from None
    if not stream.eof or stream.unused_data:
        raise CorruptCheckpointError(
            f"{where}: the zstd frame is cut short or followed by {len(stream.unused_data)} "
            "more bytes"
        )
    return data


_LOCAL = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """One per thread: a zstd context must not be used by two threads at once."""
    cached: dict[int, zstandard.ZstdCompressor] | None = getattr(_LOCAL, "compressors", None)
    if cached is None:
        cached = _LOCAL.compressors = {}
    if level not in cached:
        cached[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cached[level]


def encode_delta(
    tensors: Sequence[tuple[str, torch.Tensor]],
    base: DeltaBase,
    config: Delta,
    check: FiniteCheck | None = None,
) -> tuple[list[tuple[str, torch.Tensor]], list[DeltaEntry]]:
    """The tensors to store in place of ``tensors`` (CPU, contiguous), and how to decode them.

    ``check`` is told of each tensor stored encoded (its bytes are not written as they are)."""

    def encode(i: int) -> tuple[torch.Tensor, DeltaEntry | None]:
        name, tensor = tensors[i]
        previous = base.tensors.get(name)
        if (
            previous is None
            or previous.dtype != tensor.dtype
            or previous.shape != tensor.shape
            or tensor.numel() == 0
        ):
            return tensor, None
        dtype = dtype_name(tensor.dtype, where=name)
        now, then = _bytes(tensor), _bytes(previous)
        # The checksum is needed anyway and runs at ~30 GB/s: only a tensor whose checksum is
        # its base's can be unchanged, and is then compared byte for byte (bitwise: NaN
        # payloads and -0.0 count as they are), so "same" never rests on the hash alone.
        checksum = digest(tensor_bytes(tensor))
        if checksum == base.checksums[name] and _same_bytes(now, then):
            return _EMPTY, DeltaEntry(i, "same", dtype, tuple(tensor.shape), checksum)
        if check is not None:
            check.tensor(i)
        blob = _xor_planes(now, then, tensor.element_size(), _compressor(config.level))
        if blob.size > _WORTH_IT * now.size:
            return tensor, None
        stored = torch.from_numpy(blob)
        return stored, DeltaEntry(i, "xor-zstd", dtype, tuple(tensor.shape), checksum)

    with ThreadPoolExecutor(config.threads, thread_name_prefix="crashproof-delta") as pool:
        results = list(pool.map(encode, range(len(tensors))))
    stored = [(name, out) for (name, _), (out, _) in zip(tensors, results, strict=True)]
    return stored, [entry for _, entry in results if entry is not None]


def apply_delta(entry: DeltaEntry, blob: torch.Tensor, target: torch.Tensor, where: str) -> None:
    """Turn ``target``, holding the base's tensor, into the saved one; verify its checksum.

    ``target`` is changed before the checksum can be checked: a restore first rebuilds every
    tensor into scratch memory (``RankRead.verify``) and only then into the live tensors."""
    if entry.encoding == "xor-zstd":
        # each plane XORed straight into its byte of every element: no transposed copy
        size = target.element_size()
        columns = _bytes(target).reshape(-1, size)
        for k, plane in _each_plane(_bytes(blob), target.numel(), size, where):
            np.bitwise_xor(columns[:, k], plane, out=columns[:, k])
    found = digest(tensor_bytes(target))
    if found != entry.checksum:
        raise CorruptCheckpointError(
            f"{where}: rebuilt from its base it has checksum {found}, the index lists "
            f"{entry.checksum}; the base checkpoint does not match the one the delta was taken against"
        )
