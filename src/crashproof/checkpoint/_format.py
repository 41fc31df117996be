"""The on-disk format: names, the manifest and the per-rank index, and their validation.

A checkpoint is a directory ``step_<N>`` under the root holding, per rank ``r``:

- ``rank_<r>.safetensors``: the raw bytes of every tensor of that rank, laid out as a valid
  safetensors file (8-byte header length, JSON header, data), so standard tools can read it;
- ``rank_<r>.json``: the rank's index: each tensor's dtype, shape, byte range and checksum, and
  the state tree (JSON, with tensors referenced by index);

and, written last, ``manifest.json``: every file with its size and checksum, the step, world size,
kind, format, library and torch versions. A directory without a valid manifest is not a checkpoint.

Everything read from a file is validated here before it is used: names must be plain file names,
every byte range must lie inside its file, and sizes must agree with dtypes and shapes, so a
hostile or corrupt file can cause an error but never an out-of-bounds read or a huge allocation.
See ``docs/format.md`` for the user-facing description.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crashproof.checkpoint._dtypes import dtype_from_name
from crashproof.checkpoint._hashing import digest
from crashproof.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "ENCODINGS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_CHECKSUM",
    "MANIFEST_NAME",
    "MAX_INDEX_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_STEP",
    "DeltaEntry",
    "FileEntry",
    "Manifest",
    "Piece",
    "RankIndex",
    "TensorEntry",
    "checkpoint_dir_name",
    "dumps",
    "index_name",
    "parse_manifest",
    "parse_rank_index",
    "parse_step_dir",
    "seal_manifest",
    "shard_name",
    "sharded_pieces",
]

FORMAT_NAME = "crashproof-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_INDEX_BYTES = 512 * 1024 * 1024
MAX_WORLD_SIZE = 1 << 20
MAX_STEP = 1 << 62
"""The largest step a manifest may record (a save of a larger one is refused)."""
CHECKSUM_SCHEMES = ("bytes", "tensors")
MAX_NDIM = 64
MAX_ELEMENTS = 1 << 48  # even with zero-size dims, larger shapes overflow torch's stride maths
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
_STEP_DIR = re.compile(r"^step_(\d{1,19})$")
_KINDS = ("full", "delta")
ENCODINGS = ("same", "xor-zstd")
"""How a delta checkpoint stores a tensor against its base (see :mod:`._delta`)."""


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory's name, or None for any other name.

    Only the canonical spelling counts: exactly ``checkpoint_dir_name(step)``, ``step_`` and ten
    or more ASCII digits, zero-padded (no Unicode digits, no sign, no whitespace, no other padding
    of the same number), so that one step has one directory."""
    digits = name[5:]
    if not (name.startswith("step_") and digits.isascii() and digits.isdigit()):
        return None
    step = int(digits)
    return step if step < 1 << 63 and checkpoint_dir_name(step) == name else None


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def index_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def dumps(obj: Any) -> bytes:
    """Canonical JSON: sorted keys; ``allow_nan=False`` because non-finite floats are tagged."""
    return json.dumps(obj, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()


MANIFEST_CHECKSUM = "manifest_checksum"
"""The manifest's checksum of itself: of its canonical JSON without this field."""
_MANIFEST_FIELDS = frozenset(
    {"format", "format_version", "step", "world_size", "kind", "created_unix",
     "library_version", "torch_version", "hash_algorithm", "byte_order", "files", "metadata",
     "environment", "base_step", "base_manifest", MANIFEST_CHECKSUM}
)  # fmt: skip


def seal_manifest(obj: dict[str, Any]) -> bytes:
    """``manifest.json``'s bytes for ``obj`` (a manifest's JSON), with its checksum of itself, so
    that a damaged manifest is caught like any damaged file (its times, metadata and settings
    are no file's checksum)."""
    fields = {k: v for k, v in obj.items() if k != MANIFEST_CHECKSUM}
    return dumps(fields | {MANIFEST_CHECKSUM: digest(dumps(fields))})


def _check_seal(obj: dict[str, Any], where: str) -> None:
    unknown = sorted(set(obj) - _MANIFEST_FIELDS)
    if unknown:  # a damaged key name, or a newer format: either way not readable as it is
        raise CorruptCheckpointError(
            f"{where}: unknown field(s) {unknown}: the manifest is damaged, or was written by a "
            "newer crashproof (upgrade to read it)"
        )
    if MANIFEST_CHECKSUM not in obj:
        return  # written before manifests were sealed: its files' checksums still hold
    fields = {k: v for k, v in obj.items() if k != MANIFEST_CHECKSUM}
    try:
        actual = digest(dumps(fields))
    except ValueError:  # a NaN literal: never written by crashproof
        actual = ""
    if obj[MANIFEST_CHECKSUM] != actual:
        raise CorruptCheckpointError(
            f"{where}: the manifest does not match its own checksum: it is damaged"
        )


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    checksum: str
    scheme: str = "bytes"
    """What ``checksum`` covers: ``"bytes"``, the file's bytes; ``"tensors"`` (shard files), the
    header bytes followed by each tensor's checksum in file order (every tensor byte is covered by
    its own checksum, so each byte is hashed once)."""


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    world_size: int
    kind: str
    created_unix: float
    library_version: str
    torch_version: str
    hash_algorithm: str
    files: dict[str, FileEntry]
    metadata: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    """Settings that decide whether a resume can be bit-exact (deterministic algorithms, CUDA)."""
    base_step: int | None = None
    """``kind == "delta"``: the step of the full checkpoint the delta was taken against."""
    base_manifest: str | None = None
    """``kind == "delta"``: the checksum of that checkpoint's ``manifest.json`` bytes, which binds
    the delta to it: a checkpoint saved again under the same step has another manifest. None in
    deltas written before it was recorded (see docs/format.md)."""

    def to_json(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"base_step": self.base_step} if self.base_step is not None else {}
        if self.base_manifest is not None:
            extra["base_manifest"] = self.base_manifest
        return extra | {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "kind": self.kind,
            "created_unix": self.created_unix,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "hash_algorithm": self.hash_algorithm,
            "byte_order": "little",
            "files": {
                n: {"size": e.size, "checksum": e.checksum, "scheme": e.scheme}
                for n, e in self.files.items()
            },
            "metadata": self.metadata,
            "environment": self.environment,
        }


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


def _load_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (
        ValueError,
        RecursionError,
    ) as exc:  # ValueError covers UnicodeDecodeError and huge ints
        raise CorruptCheckpointError(f"{where}: not valid JSON ({str(exc)[:200]})") from None


def _require(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CorruptCheckpointError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (
        isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))
    ):
        raise CorruptCheckpointError(f"{where}: field {key!r} has type {type(value).__name__}")
    return value


def _count(obj: Any, key: str, where: str, *, upper: int = MAX_STEP) -> int:
    value: int = _require(obj, key, int, where)
    if not 0 <= value <= upper:
        raise CorruptCheckpointError(
            f"{where}: field {key!r} = {value} is out of range [0, {upper}]"
        )
    return value


def check_plain_name(name: Any, where: str) -> str:
    """A file name inside a checkpoint directory: no separators, no ``..``, no absolute paths."""
    if not isinstance(name, str) or not _PLAIN_NAME.match(name) or ".." in name:
        raise UnsafeCheckpointError(
            f"{where}: refers to {str(name)[:100]!r}, which is not a plain file name inside the "
            "checkpoint directory; the checkpoint was tampered with or is corrupt"
        )
    return name


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Validate and parse ``manifest.json``; raises :class:`CorruptCheckpointError`."""
    obj = _load_json(data, where)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a crashproof manifest")
    _check_seal(obj, where)
    version = _require(obj, "format_version", int, where)
    if version != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {version}, this crashproof reads version {FORMAT_VERSION}; "
            "upgrade crashproof to read it"
        )
    if obj.get("byte_order", "little") != "little":
        raise CorruptCheckpointError(
            f"{where}: byte order {obj.get('byte_order')!r} is not supported"
        )
    kind = _require(obj, "kind", str, where)
    if kind not in _KINDS:
        raise CorruptCheckpointError(f"{where}: unknown checkpoint kind {kind!r}")
    created = _require(obj, "created_unix", (int, float), where)
    try:
        created = float(created)
    except OverflowError:
        created = math.inf
    if not math.isfinite(created):
        raise CorruptCheckpointError(f"{where}: created_unix is not finite")
    files_obj = _require(obj, "files", dict, where)
    files: dict[str, FileEntry] = {}
    for name, entry in files_obj.items():
        check_plain_name(name, where)
        scheme = entry.get("scheme", "bytes") if isinstance(entry, dict) else None
        if scheme not in CHECKSUM_SCHEMES:
            raise CorruptCheckpointError(f"{where} [{name}]: unknown checksum scheme {scheme!r}")
        files[name] = FileEntry(
            size=_count(entry, "size", f"{where} [{name}]"),
            checksum=_require(entry, "checksum", str, f"{where} [{name}]"),
            scheme=scheme,
        )
    world_size = _count(obj, "world_size", where, upper=MAX_WORLD_SIZE)
    _check_file_set(files, world_size, where)
    metadata = obj.get("metadata", {})
    environment = obj.get("environment", {})
    if not isinstance(metadata, dict) or not isinstance(environment, dict):
        raise CorruptCheckpointError(f"{where}: field 'metadata' or 'environment' is not an object")
    base_step = base_manifest = None
    if kind == "delta":
        base_step = _count(obj, "base_step", where)
        if base_step >= _count(obj, "step", where):
            raise CorruptCheckpointError(f"{where}: delta on base step {base_step}, not earlier")
        if "base_manifest" in obj:
            base_manifest = _require(obj, "base_manifest", str, where)
    return Manifest(
        base_step=base_step,
        base_manifest=base_manifest,
        step=_count(obj, "step", where),
        world_size=world_size,
        kind=kind,
        created_unix=created,
        library_version=_require(obj, "library_version", str, where),
        torch_version=_require(obj, "torch_version", str, where),
        hash_algorithm=_require(obj, "hash_algorithm", str, where),
        files=files,
        metadata=metadata,
        environment=environment,
    )


def _check_file_set(files: Mapping[str, FileEntry], world_size: int, where: str) -> None:
    """A checkpoint is one index and one shard per rank, nothing else: a file that no rank's
    reader would check cannot be listed (restore and verify check the same files)."""
    ranks_listed = sum(1 for name in files if name.startswith("rank_") and name.endswith(".json"))
    foreign = sorted(n for n in files if not _is_rank_file(n, world_size))
    if world_size >= 1 and not foreign and len(files) == 2 * world_size:
        return  # 2W names, each one of the 2W a world of W has: exactly those
    raise CorruptCheckpointError(
        f"{where}: world size {world_size} does not match the {ranks_listed} rank indexes and "
        f"{len(files) - ranks_listed} other files listed"
        + (f" ({', '.join(foreign[:3])}: no rank's index or shard)" if foreign else "")
        + f"; a checkpoint lists exactly {index_name(0)} and {shard_name(0)} for each rank"
    )


def _is_rank_file(name: str, world_size: int) -> bool:
    digits = name.removeprefix("rank_").removesuffix(".json").removesuffix(".safetensors")
    if not digits.isdigit() or len(digits) > 7 or int(digits) >= world_size:
        return False
    return name in (index_name(int(digits)), shard_name(int(digits)))


def parse_rank_index(
    data: bytes, where: str, *, file_sizes: Mapping[str, int] | None = None
) -> RankIndex:
    """Validate and parse ``rank_<r>.json``.

    With ``file_sizes`` (the manifest's sizes by file name), the shard file must be listed and
    every tensor's byte range must lie inside it; sizes always have to match dtypes and shapes.
    """
    obj = _load_json(data, where)
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: not a rank index")
    if _require(obj, "format_version", int, where) != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: unsupported rank index version {obj['format_version']}"
        )
    shard_file = check_plain_name(obj.get("shard_file"), where)
    shard_size = None
    if file_sizes is not None:
        if shard_file not in file_sizes:
            raise CorruptCheckpointError(
                f"{where}: names shard {shard_file!r}, which the manifest does not list"
            )
        shard_size = file_sizes[shard_file]
    tensors_obj = _require(obj, "tensors", list, where)
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
        rank=_count(obj, "rank", where, upper=MAX_WORLD_SIZE),
        step=_count(obj, "step", where),
        shard_file=shard_file,
        tensors=tensors,
        state=obj.get("state"),
        deltas=deltas,
    )


def _parse_delta(obj: Any, where: str, tensors: list[TensorEntry]) -> DeltaEntry:
    index = _count(obj, "index", where)
    if index >= len(tensors):
        raise CorruptCheckpointError(f"{where}: tensor #{index}, the index lists {len(tensors)}")
    encoding = _require(obj, "encoding", str, where)
    if encoding not in ENCODINGS:
        raise CorruptCheckpointError(f"{where}: unknown encoding {encoding!r}")
    stored = tensors[index]
    if stored.dtype != "uint8" or len(stored.shape) != 1 or (encoding == "same" and stored.nbytes):
        raise CorruptCheckpointError(
            f"{where}: tensor #{index} is stored as {stored.dtype}{list(stored.shape)}, not as "
            f"the bytes of a {encoding!r} delta"
        )
    dtype = _require(obj, "dtype", str, where)
    dtype_from_name(dtype, where=where)
    shape = _shape(obj, where, stored.name)
    return DeltaEntry(index, encoding, dtype, shape, _require(obj, "checksum", str, where))


def _shape(obj: Any, where: str, name: str) -> tuple[int, ...]:
    shape_obj = _require(obj, "shape", list, where)
    if len(shape_obj) > MAX_NDIM:
        raise CorruptCheckpointError(f"{where} ({name}): {len(shape_obj)} dimensions")
    shape = tuple(_count({"dim": d}, "dim", f"{where} ({name})") for d in shape_obj)
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise UnsafeCheckpointError(
            f"{where} ({name}): shape {list(shape)[:8]} is beyond any real tensor"
        )
    return shape


def _parse_tensor(
    obj: Any, where: str, shard_size: int | None, file_sizes: Mapping[str, int] | None = None
) -> TensorEntry:
    name = _require(obj, "name", str, where)
    file = None
    if obj.get("file") is not None:  # another rank's shard: it must be one the manifest lists
        file = check_plain_name(obj.get("file"), where)
        if file_sizes is not None:
            if file not in file_sizes:
                raise CorruptCheckpointError(
                    f"{where} ({name}): in shard {file!r}, which the manifest does not list"
                )
            shard_size = file_sizes[file]
    dtype = _require(obj, "dtype", str, where)
    itemsize = dtype_from_name(dtype, where=where).itemsize
    shape = _shape(obj, where, name)
    offset = _count(obj, "offset", where)
    nbytes = _count(obj, "nbytes", where)
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
        name, dtype, shape, offset, nbytes, _require(obj, "checksum", str, where), file,
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


Piece = tuple[int, TensorEntry]
"""A saved piece of a tensor: the rank whose index lists it, and its entry there."""


def sharded_pieces(indexes: Sequence[RankIndex], where: str) -> dict[str, list[Piece]]:
    """Every sharded tensor's saved pieces by name, one per place in the whole tensor, checked
    across the ranks; with rank 0's whole tensors, each as the one piece of itself.

    The ranks must agree on each tensor's whole shape and dtype; a piece saved by several ranks
    (replicated over a mesh dimension) must be the same everywhere; and the pieces must tile the
    whole tensor: none overlaps another, and together they cover it, or part of a restored tensor
    would be left uninitialised. Metadata only: nothing is allocated beyond the indexes.
    """
    pieces: dict[str, dict[tuple[int, ...], Piece]] = {}
    wholes: dict[str, tuple[tuple[int, ...], str, int]] = {}
    for rank, index in enumerate(indexes):
        for entry in index.tensors:
            whole, offset = entry.global_shape, entry.global_offset
            if whole is None or offset is None:
                if rank != 0:
                    continue  # whole tensors: rank 0's (per-rank ones are no piece of anything)
                whole, offset = entry.shape, (0,) * len(entry.shape)
            first_whole = wholes.setdefault(entry.name, (whole, entry.dtype, rank))
            if first_whole[:2] != (whole, entry.dtype):
                raise CorruptCheckpointError(
                    f"{where}: the ranks disagree on the whole tensor {entry.name!r} "
                    f"({first_whole[1]}{list(first_whole[0])} by rank {first_whole[2]}, "
                    f"{entry.dtype}{list(whole)} by rank {rank})"
                )
            at = pieces.setdefault(entry.name, {})
            if offset in at:
                first_rank, first = at[offset]
                if (first.shape, first.checksum) != (entry.shape, entry.checksum):
                    raise CorruptCheckpointError(
                        f"{where}: ranks {first_rank} and {rank} saved different pieces "
                        f"of {entry.name!r} at {list(offset)} ({list(first.shape)} with "
                        f"checksum {first.checksum}, {list(entry.shape)} with {entry.checksum})"
                    )
                continue
            at[offset] = (rank, entry)
    for name, at in pieces.items():
        _check_tiling(name, wholes[name][0], at, where)
    return {name: list(at.values()) for name, at in pieces.items()}


def _check_tiling(
    name: str, whole: tuple[int, ...], at: Mapping[tuple[int, ...], Piece], where: str
) -> None:
    """The pieces (each inside ``whole``, checked as its index was parsed) overlap nowhere and
    cover every element: then their sizes add up to the whole's."""
    boxes = [(offset, entry.shape) for offset, (_, entry) in at.items() if math.prod(entry.shape)]
    if boxes:
        # Sweep along the dimension with the most distinct starts: for a grid of pieces only
        # one row of them is open at a time, so this stays near-linear in the number of pieces.
        dim = max(range(len(whole)), key=lambda d: len({o[d] for o, _ in boxes}), default=0)
        boxes.sort(key=lambda box: box[0][dim] if whole else 0)
        open_: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for offset, shape in boxes:
            if whole:
                open_ = [b for b in open_ if b[0][dim] + b[1][dim] > offset[dim]]
            for other, other_shape in open_:
                if all(
                    o < p + m and p < o + n
                    for o, n, p, m in zip(offset, shape, other, other_shape, strict=True)
                ):
                    raise CorruptCheckpointError(
                        f"{where}: the saved pieces of {name!r} overlap ({list(shape)} at "
                        f"{list(offset)} and {list(other_shape)} at {list(other)}); each element "
                        "of a sharded tensor is saved in one place"
                    )
            open_.append((offset, shape))
    covered = sum(math.prod(shape) for _, shape in boxes)
    if covered != math.prod(whole):
        raise CorruptCheckpointError(
            f"{where}: the saved pieces of {name!r} hold {covered} of its {math.prod(whole)} "
            f"elements ({list(whole)}): a rank's piece is missing"
        )
