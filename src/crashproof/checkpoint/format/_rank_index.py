"""A rank's index, ``rank_<r>.json``: every tensor of the rank (its dtype, shape, byte range,
checksum; the file holding it; for a piece of a sharded tensor, its place in the whole), the
tensors stored as deltas against a base, and the state tree that refers to the tensors.

:func:`parse_rank_index` validates all of it: names must be plain file names, every byte range
must lie inside its file and sizes must agree with dtypes and shapes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from crashproof.checkpoint.format._dtypes import dtype_from_name
from crashproof.checkpoint.format._fields import (
    MAX_ELEMENTS,
    MAX_NDIM,
    MAX_WORLD_SIZE,
    check_plain_name,
    count_field,
    load_json,
    require_field,
)
from crashproof.checkpoint.format._names import FORMAT_VERSION
from crashproof.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "ENCODINGS",
    "DeltaEntry",
    "RankIndex",
    "TensorEntry",
    "UnlistedShardError",
    "parse_rank_index",
]

ENCODINGS = ("same", "xor-zstd")
"""How a delta checkpoint stores a tensor against its base (see :mod:`crashproof.checkpoint.save._delta`)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: str
    file: str | None = None
    """The shard file holding the bytes when it is another rank's (state replicated on every
    rank is written once, spread over the ranks); None: this rank's own shard."""
    global_shape: tuple[int, ...] | None = None
    """For one rank's piece of a sharded tensor (a DTensor, e.g. under FSDP2): the whole tensor's
    shape; ``shape`` is the piece's. None: the tensor is whole."""
    global_offset: tuple[int, ...] | None = None
    """Where the piece starts in the whole tensor, one index per dimension."""

    def to_json(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"file": self.file} if self.file is not None else {}
        if self.global_shape is not None and self.global_offset is not None:
            extra["global"] = {"shape": list(self.global_shape), "offset": list(self.global_offset)}
        return extra | {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                        "offset": self.offset, "nbytes": self.nbytes, "checksum": self.checksum}  # fmt: skip


@dataclass(frozen=True, slots=True)
class DeltaEntry:
    """In a delta checkpoint: tensor ``index`` of the shard is stored encoded against the base.

    The shard entry is then a ``uint8`` blob; this is the logical tensor it decodes to."""

    index: int
    encoding: str
    dtype: str
    shape: tuple[int, ...]
    checksum: str
    """Of the decoded tensor's bytes."""

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "encoding": self.encoding, "dtype": self.dtype,
                "shape": list(self.shape), "checksum": self.checksum}  # fmt: skip


@dataclass(frozen=True, slots=True)
class RankIndex:
    rank: int
    step: int
    shard_file: str
    tensors: list[TensorEntry]
    state: Any
    deltas: list[DeltaEntry] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        extra = {"deltas": [d.to_json() for d in self.deltas]} if self.deltas else {}
        return extra | {
            "format_version": FORMAT_VERSION,
            "rank": self.rank,
            "step": self.step,
            "shard_file": self.shard_file,
            "tensors": [t.to_json() for t in self.tensors],
            "state": self.state,
        }  # fmt: skip


class UnlistedShardError(CorruptCheckpointError):
    """An index names a shard its manifest does not list."""


def parse_rank_index(
    data: bytes, where: str, *, file_sizes: Mapping[str, int] | None = None
) -> RankIndex:
    """Validate and parse ``rank_<r>.json``.

    With ``file_sizes`` (the manifest's sizes by file name), the shard file must be listed and
    every tensor's byte range must lie inside it; sizes always have to match dtypes and shapes.
    """
    obj = load_json(data, where)
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: not a rank index")
    if require_field(obj, "format_version", int, where) != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: unsupported rank index version {obj['format_version']}"
        )
    shard_file = check_plain_name(obj.get("shard_file"), where)
    shard_size = None
    if file_sizes is not None:
        if shard_file not in file_sizes:
            raise UnlistedShardError(
                f"{where}: names shard {shard_file!r}, which the manifest does not list"
            )
        shard_size = file_sizes[shard_file]
    tensors_obj = require_field(obj, "tensors", list, where)
    tensors = [
        _parse_tensor(t, f"{where} tensor #{i}", shard_size, file_sizes)
        for i, t in enumerate(tensors_obj)
    ]
    names: set[str] = set()
    for t in tensors:
        if t.name in names:  # a name is where a tensor goes in the state: one place, one tensor
            raise CorruptCheckpointError(f"{where}: two tensors are named {t.name[:100]!r}")
        names.add(t.name)
    deltas_obj = obj.get("deltas", [])
    if not isinstance(deltas_obj, list):
        raise CorruptCheckpointError(f"{where}: field 'deltas' is not a list")
    deltas = [_parse_delta(d, f"{where} delta #{i}", tensors) for i, d in enumerate(deltas_obj)]
    if len({d.index for d in deltas}) != len(deltas):
        raise CorruptCheckpointError(f"{where}: a tensor has two delta entries")
    return RankIndex(
        rank=count_field(obj, "rank", where, upper=MAX_WORLD_SIZE),
        step=count_field(obj, "step", where),
        shard_file=shard_file,
        tensors=tensors,
        state=obj.get("state"),
        deltas=deltas,
    )


def _parse_delta(obj: Any, where: str, tensors: list[TensorEntry]) -> DeltaEntry:
    index = count_field(obj, "index", where)
    if index >= len(tensors):
        raise CorruptCheckpointError(f"{where}: tensor #{index}, the index lists {len(tensors)}")
    encoding = require_field(obj, "encoding", str, where)
    if encoding not in ENCODINGS:
        raise CorruptCheckpointError(f"{where}: unknown encoding {encoding!r}")
    stored = tensors[index]
    if stored.dtype != "uint8" or len(stored.shape) != 1 or (encoding == "same" and stored.nbytes):
        raise CorruptCheckpointError(
            f"{where}: tensor #{index} is stored as {stored.dtype}{list(stored.shape)}, not as "
            f"the bytes of a {encoding!r} delta"
        )
    dtype = require_field(obj, "dtype", str, where)
    dtype_from_name(dtype, where=where)
    shape = _shape(obj, where, stored.name)
    return DeltaEntry(index, encoding, dtype, shape, require_field(obj, "checksum", str, where))


def _shape(obj: Any, where: str, name: str) -> tuple[int, ...]:
    shape_obj = require_field(obj, "shape", list, where)
    if len(shape_obj) > MAX_NDIM:
        raise CorruptCheckpointError(f"{where} ({name}): {len(shape_obj)} dimensions")
    shape = tuple(count_field({"dim": d}, "dim", f"{where} ({name})") for d in shape_obj)
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise UnsafeCheckpointError(
            f"{where} ({name}): shape {list(shape)[:8]} is beyond any real tensor"
        )
    return shape


def _parse_tensor(
    obj: Any, where: str, shard_size: int | None, file_sizes: Mapping[str, int] | None = None
) -> TensorEntry:
    name = require_field(obj, "name", str, where)
    file = None
    if obj.get("file") is not None:  # another rank's shard: it must be one the manifest lists
        file = check_plain_name(obj.get("file"), where)
        if file_sizes is not None:
            if file not in file_sizes:
                raise UnlistedShardError(
                    f"{where} ({name}): in shard {file!r}, which the manifest does not list"
                )
            shard_size = file_sizes[file]
    dtype = require_field(obj, "dtype", str, where)
    itemsize = dtype_from_name(dtype, where=where).itemsize
    shape = _shape(obj, where, name)
    offset = count_field(obj, "offset", where)
    nbytes = count_field(obj, "nbytes", where)
    expected = math.prod(shape) * itemsize
    if nbytes != expected:
        raise CorruptCheckpointError(
            f"{where} ({name}): {nbytes} bytes recorded, but {dtype}{list(shape)} needs {expected}"
        )
    if shard_size is not None and offset + nbytes > shard_size:
        raise UnsafeCheckpointError(
            f"{where} ({name}): bytes {offset}..{offset + nbytes} lie outside the shard file "
            f"of {shard_size} bytes"
        )
    global_shape, global_offset = _global_placement(obj, where, name, shape)
    return TensorEntry(
        name, dtype, shape, offset, nbytes, require_field(obj, "checksum", str, where), file,
        global_shape, global_offset,
    )  # fmt: skip


def _global_placement(
    obj: dict[str, Any], where: str, name: str, shape: tuple[int, ...]
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """A sharded piece's whole shape and offset; the piece must lie inside the whole."""
    placement = obj.get("global")
    if placement is None:
        return None, None
    if not isinstance(placement, dict):
        raise CorruptCheckpointError(f"{where} ({name}): 'global' is not an object")
    whole = _shape(placement, where, name)
    offsets = _shape({"shape": placement.get("offset")}, where, name)
    if len(whole) != len(shape) or len(offsets) != len(shape):
        raise CorruptCheckpointError(
            f"{where} ({name}): a {len(shape)}-d piece of a {len(whole)}-d tensor at {list(offsets)}"
        )
    if any(o + n > w for o, n, w in zip(offsets, shape, whole, strict=True)):
        raise CorruptCheckpointError(
            f"{where} ({name}): the piece {list(shape)} at {list(offsets)} does not fit in {list(whole)}"
        )
    return whole, offsets
