"""Read a checkpoint's manifest, and a rank's index checked against the manifest.

The manifest is read within a size limit and parsed by :mod:`crashproof.checkpoint.format._manifest`; a
rank's index only as the manifest lists it (its size, its checksum) before it is parsed, and it
must name its own rank, step and shard.
"""

from __future__ import annotations

import posixpath

from crashproof.checkpoint.format import (
    HASH_ALGORITHM,
    MANIFEST_NAME,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    RankIndex,
    UnlistedShardError,
    digest,
    index_name,
    parse_manifest,
    parse_rank_index,
    parse_step_dir,
    shard_name,
)
from crashproof.errors import CheckpointNotFoundError, CorruptCheckpointError, CrashproofError
from crashproof.storage import Storage, read_all

__all__ = [
    "PartialManifest",
    "checkpoint_not_found",
    "read_error",
    "read_manifest",
    "read_manifest_bytes",
    "read_rank_index",
    "refused",
    "unreadable",
]


def read_manifest(storage: Storage, ckpt_dir: str) -> Manifest:
    """The parsed manifest; :class:`CorruptCheckpointError` when it is missing or invalid."""
    return read_manifest_bytes(storage, ckpt_dir)[1]


def read_manifest_bytes(storage: Storage, ckpt_dir: str) -> tuple[bytes, Manifest]:
    """The manifest's bytes as stored (to copy it unchanged) and parsed."""
    path = storage.join(ckpt_dir, MANIFEST_NAME)
    where = storage.describe(path)
    try:
        data = read_all(storage, path, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{where}: missing; the checkpoint was never committed"
        ) from None
    except OSError as exc:
        raise refused(exc, where) from None
    except (EOFError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: cannot be read: {exc}") from None
    manifest = parse_manifest(data, where)
    if manifest.hash_algorithm != HASH_ALGORITHM:
        raise CorruptCheckpointError(
            f"{where}: checksums use {manifest.hash_algorithm!r}, expected {HASH_ALGORITHM!r}"
        )
    # A step directory holds its own step: one renamed or copied under another step's name
    # would otherwise pass for that step (in restore, verify, ls and export alike).
    named = parse_step_dir(posixpath.basename(ckpt_dir.rstrip("/")))
    if named is not None and named != manifest.step:
        raise CorruptCheckpointError(
            f"{storage.describe(ckpt_dir)}: the manifest is for step {manifest.step}, not "
            f"{named}; the directory was renamed or copied"
        )
    return data, manifest


def refused(exc: OSError, where: str) -> OSError:
    """The storage's refusal to read ``where`` (permissions, an I/O error, a dead connection),
    raised as what it is, with the file named in full: it says nothing against the checkpoint,
    so it must never be worded as corruption (which makes a restore fall back past it and lets
    retention remove it). A missing file, a link or a non-regular file is the checkpoint's fault
    (the storage raises :class:`FileNotFoundError` for those): see :func:`read_error`."""
    if isinstance(exc, CrashproofError):
        return exc
    name = exc.filename if isinstance(exc.filename, str) and "/" in exc.filename else where
    if exc.errno is None:
        return OSError(f"{name}: {exc}")
    return OSError(exc.errno, exc.strerror or str(exc), name)


def unreadable(exc: BaseException) -> bool:
    """``exc`` is the storage refusing a read (permissions, an I/O error, a stale handle), not a
    fault of the checkpoint: an OSError other than crashproof's own, and other than a missing
    file or a file where a directory belongs (a file its manifest lists that is absent, a
    ``step_*`` that is a file, a link or FIFO refused: the checkpoint's fault,
    :class:`~crashproof.errors.CorruptCheckpointError` where the reader words it)."""
    return isinstance(exc, OSError) and not isinstance(
        exc, (CrashproofError, FileNotFoundError, NotADirectoryError)
    )


def read_error(exc: OSError | EOFError, where: str) -> Exception:
    """What a failed read of a checkpoint's file at ``where`` is: the storage's refusal
    (:func:`refused`), or corruption (a file shorter than listed, missing, or not a regular
    file)."""
    if isinstance(exc, OSError) and unreadable(exc):
        return refused(exc, where)
    return CorruptCheckpointError(f"{where}: cannot be read ({exc})")


def _file_entry(manifest: Manifest, name: str, where: str) -> FileEntry:
    try:
        return manifest.files[name]
    except KeyError:
        raise CorruptCheckpointError(f"{where}: the manifest does not list {name}") from None


class PartialManifest(Exception):
    """A rank's index needs more of the manifest than its restore plan holds: a shard only that
    rank points into (a checkpoint crashproof does not write, but that is valid), or sharded
    pieces (whose reader reads every rank's index). The rank reads the whole manifest itself."""


def read_rank_index(storage: Storage, ckpt_dir: str, manifest: Manifest, rank: int) -> RankIndex:
    """The verified, parsed index of ``rank``."""
    name = index_name(rank)
    where = storage.describe(storage.join(ckpt_dir, name))
    entry = _file_entry(manifest, name, storage.describe(ckpt_dir))
    if entry.size > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(
            f"{where}: listed as {entry.size} bytes, above the {MAX_INDEX_BYTES} limit"
        )
    try:
        data = read_all(storage, storage.join(ckpt_dir, name), limit=entry.size)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    except OSError as exc:
        raise refused(exc, where) from None
    except (EOFError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: cannot be read ({exc})") from None
    if len(data) != entry.size or digest(data) != entry.checksum:
        raise CorruptCheckpointError(
            f"{where}: {len(data)} bytes with checksum {digest(data)}, the manifest lists "
            f"{entry.size} bytes with checksum {entry.checksum}"
        )
    sizes = {n: e.size for n, e in manifest.files.items()}
    try:
        index = parse_rank_index(data, where, file_sizes=sizes)
    except UnlistedShardError:
        if manifest.complete:
            raise
        raise PartialManifest(where) from None
    if not manifest.complete and any(t.global_shape is not None for t in index.tensors):
        raise PartialManifest(where)  # sharded pieces: every rank's index is read
    if index.rank != rank or index.step != manifest.step:
        raise CorruptCheckpointError(
            f"{where}: holds rank {index.rank} step {index.step}, expected rank {rank} step {manifest.step}"
        )
    if index.shard_file != shard_name(rank):
        raise CorruptCheckpointError(
            f"{where}: names shard {index.shard_file!r}, expected {shard_name(rank)!r} (each "
            "rank's tensors are in its own shard)"
        )
    for tensor in index.tensors:
        if tensor.file is not None and _shard_rank(tensor.file) is None:
            raise CorruptCheckpointError(
                f"{where}: tensor {tensor.name!r} is in {tensor.file!r}, which is no rank's shard "
                "(a tensor is in its rank's shard, or in the shard of the rank that wrote it for all)"
            )
    return index


def _shard_rank(name: str) -> int | None:
    """The rank whose shard file ``name`` is, or None (the manifest lists only ranks' files)."""
    digits = name.removeprefix("rank_").removesuffix(".safetensors")
    if not digits.isdigit() or shard_name(int(digits)) != name:
        return None
    return int(digits)


def checkpoint_not_found(root: str, step: int | None) -> CheckpointNotFoundError:
    what = f"no checkpoint of step {step}" if step is not None else "no committed checkpoint"
    return CheckpointNotFoundError(f"{what} in {root}; `crashproof ls {root}` lists what there is")
