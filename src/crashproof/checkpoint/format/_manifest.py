"""The manifest, ``manifest.json``: the file that makes a directory a checkpoint.

A checkpoint is a directory ``step_<N>`` under the root holding, per rank ``r``:

- ``rank_<r>.safetensors``: the raw bytes of every tensor of that rank, laid out as a valid
  safetensors file (8-byte header length, JSON header, data), so standard tools can read it;
- ``rank_<r>.json``: the rank's index: each tensor's dtype, shape, byte range and checksum, and
  the state tree (JSON, with tensors referenced by index; :mod:`crashproof.checkpoint.format._rank_index`);

and, written last, ``manifest.json``: every file with its size and checksum, the step, world size,
kind, format, library and torch versions, sealed by its own checksum. A directory without a valid
manifest is not a checkpoint. This module owns the manifest: its fields, its seal, its parsing.
The names are in :mod:`crashproof.checkpoint.format._names`, the checks every field read goes through and
the format's limits in :mod:`crashproof.checkpoint.format._fields`, the sharded tensors' pieces in
:mod:`crashproof.checkpoint.format._pieces`. See ``docs/format.md`` for the user-facing description.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from crashproof.checkpoint.format._fields import (
    MAX_WORLD_SIZE,
    check_plain_name,
    count_field,
    dumps,
    load_json,
    require_field,
)
from crashproof.checkpoint.format._hashing import digest
from crashproof.checkpoint.format._names import (
    FORMAT_NAME,
    FORMAT_VERSION,
    index_name,
    shard_name,
)
from crashproof.errors import CorruptCheckpointError

__all__ = [
    "MANIFEST_CHECKSUM",
    "FileEntry",
    "Manifest",
    "parse_manifest",
    "seal_manifest",
]

CHECKSUM_SCHEMES = ("bytes", "tensors")
_KINDS = ("full", "delta")


MANIFEST_CHECKSUM = "manifest_checksum"
"""The manifest's checksum of itself: of its canonical JSON without this field."""
_MANIFEST_FIELDS = frozenset(
    {"format", "format_version", "step", "world_size", "kind", "created_unix",
     "library_version", "torch_version", "hash_algorithm", "byte_order", "files", "metadata",
     "environment", "base_step", "base_manifest", "nodes", MANIFEST_CHECKSUM}
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
    nodes: tuple[tuple[int, ...], ...] | None = None
    """Saved on node-local roots: the ranks of each node, whose root holds their files and this
    manifest (every node's copy is the same). None: one root holds every file."""
    complete: bool = field(default=True, compare=False)
    """False for a rank's part of a manifest, cut down to that rank's files by a restore's plan
    (:mod:`crashproof.checkpoint.restore._fan_out`); never written."""

    def to_json(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"base_step": self.base_step} if self.base_step is not None else {}
        if self.base_manifest is not None:
            extra["base_manifest"] = self.base_manifest
        if self.nodes is not None:
            extra["nodes"] = [list(ranks) for ranks in self.nodes]
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


def parse_manifest(data: bytes, where: str, *, partial: bool = False) -> Manifest:
    """Validate and parse ``manifest.json``; raises :class:`CorruptCheckpointError`.

    ``partial``: a manifest cut down to one rank's index and shard (a rank's snapshot held in
    memory, :mod:`crashproof.checkpoint.memory`); parsed as ``complete=False``."""
    obj = load_json(data, where)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a crashproof manifest")
    _check_seal(obj, where)
    version = require_field(obj, "format_version", int, where)
    if version != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {version}, this crashproof reads version {FORMAT_VERSION}; "
            "upgrade crashproof to read it"
        )
    if obj.get("byte_order", "little") != "little":
        raise CorruptCheckpointError(
            f"{where}: byte order {obj.get('byte_order')!r} is not supported"
        )
    kind = require_field(obj, "kind", str, where)
    if kind not in _KINDS:
        raise CorruptCheckpointError(f"{where}: unknown checkpoint kind {kind!r}")
    created = require_field(obj, "created_unix", (int, float), where)
    try:
        created = float(created)
    except OverflowError:
        created = math.inf
    if not math.isfinite(created):
        raise CorruptCheckpointError(f"{where}: created_unix is not finite")
    files_obj = require_field(obj, "files", dict, where)
    files: dict[str, FileEntry] = {}
    for name, entry in files_obj.items():
        check_plain_name(name, where)
        scheme = entry.get("scheme", "bytes") if isinstance(entry, dict) else None
        if scheme not in CHECKSUM_SCHEMES:
            raise CorruptCheckpointError(f"{where} [{name}]: unknown checksum scheme {scheme!r}")
        files[name] = FileEntry(
            size=count_field(entry, "size", f"{where} [{name}]"),
            checksum=require_field(entry, "checksum", str, f"{where} [{name}]"),
            scheme=scheme,
        )
    world_size = count_field(obj, "world_size", where, upper=MAX_WORLD_SIZE)
    if partial:
        _check_one_rank(files, world_size, where)
    else:
        _check_file_set(files, world_size, where)
    metadata = obj.get("metadata", {})
    environment = obj.get("environment", {})
    if not isinstance(metadata, dict) or not isinstance(environment, dict):
        raise CorruptCheckpointError(f"{where}: field 'metadata' or 'environment' is not an object")
    base_step = base_manifest = None
    if kind == "delta":
        base_step = count_field(obj, "base_step", where)
        if base_step >= count_field(obj, "step", where):
            raise CorruptCheckpointError(f"{where}: delta on base step {base_step}, not earlier")
        if "base_manifest" in obj:
            base_manifest = require_field(obj, "base_manifest", str, where)
    return Manifest(
        base_step=base_step,
        base_manifest=base_manifest,
        nodes=_nodes(obj, world_size, where) if "nodes" in obj else None,
        step=count_field(obj, "step", where),
        world_size=world_size,
        kind=kind,
        created_unix=created,
        library_version=require_field(obj, "library_version", str, where),
        torch_version=require_field(obj, "torch_version", str, where),
        hash_algorithm=require_field(obj, "hash_algorithm", str, where),
        files=files,
        metadata=metadata,
        environment=environment,
        complete=not partial,
    )


def _nodes(obj: dict[str, Any], world_size: int, where: str) -> tuple[tuple[int, ...], ...]:
    """The ``nodes`` field: every rank once, each node's ranks ascending, nodes by first rank."""
    nodes = obj["nodes"]
    shaped = isinstance(nodes, list) and all(isinstance(node, list) and node for node in nodes)
    ranks = [r for node in nodes for r in node] if shaped else None
    if (
        ranks is None
        or not all(type(r) is int for r in ranks)
        or sorted(ranks) != list(range(world_size))
        or any(node != sorted(node) for node in nodes)
        or [node[0] for node in nodes] != sorted(node[0] for node in nodes)
    ):
        raise CorruptCheckpointError(
            f"{where}: field 'nodes' is not a partition of the {world_size} ranks into nodes"
        )
    return tuple(tuple(node) for node in nodes)


def _check_one_rank(files: Mapping[str, FileEntry], world_size: int, where: str) -> None:
    """A partial manifest lists one rank's index and shard, nothing else."""
    indexes = [n for n in files if n.startswith("rank_") and n.endswith(".json")]
    if len(files) == 2 and len(indexes) == 1 and all(_is_rank_file(n, world_size) for n in files):
        rank = indexes[0].removeprefix("rank_").removesuffix(".json")
        if shard_name(int(rank)) in files:
            return
    raise CorruptCheckpointError(
        f"{where}: a rank's part lists its index and its shard, not {sorted(files)[:4]}"
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
