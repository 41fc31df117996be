"""Read and verify committed checkpoints. Nothing here unpickles or follows a path out of the directory.

Every read is bounded by what the manifest promises and the manifest is bounded by a size limit,
so corrupt or hostile input ends in :class:`CorruptCheckpointError`, never in a huge allocation,
an out-of-bounds read or code execution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from crashproof.checkpoint._format import (
    MANIFEST_NAME,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    RankIndex,
    index_name,
    parse_manifest,
    parse_rank_index,
)
from crashproof.checkpoint._hashing import HASH_ALGORITHM, digest, new_hasher
from crashproof.checkpoint._shard import read_shard
from crashproof.checkpoint._tree import decode_tree
from crashproof.errors import CheckpointNotFoundError, CorruptCheckpointError
from crashproof.storage import Storage, read_all

__all__ = ["load_rank_state", "read_manifest", "read_rank_index", "verify_checkpoint"]

_VERIFY_CHUNK = 16 * 1024 * 1024


def read_manifest(storage: Storage, ckpt_dir: str) -> Manifest:
    """The parsed manifest; :class:`CorruptCheckpointError` when it is missing or invalid."""
    path = storage.join(ckpt_dir, MANIFEST_NAME)
    where = storage.describe(path)
    try:
        data = read_all(storage, path, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{where}: missing; the checkpoint was never committed"
        ) from None
    except (OSError, EOFError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: cannot be read: {exc}") from None
    manifest = parse_manifest(data, where)
    if manifest.hash_algorithm != HASH_ALGORITHM:
        raise CorruptCheckpointError(
            f"{where}: checksums use {manifest.hash_algorithm!r}, expected {HASH_ALGORITHM!r}"
        )
    return manifest


def _file_entry(manifest: Manifest, name: str, where: str) -> FileEntry:
    try:
        return manifest.files[name]
    except KeyError:
        raise CorruptCheckpointError(f"{where}: the manifest does not list {name}") from None


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
    except (OSError, EOFError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: cannot be read ({exc})") from None
    if len(data) != entry.size or digest(data) != entry.checksum:
        raise CorruptCheckpointError(
            f"{where}: {len(data)} bytes with checksum {digest(data)}, the manifest lists "
            f"{entry.size} bytes with checksum {entry.checksum}"
        )
    sizes = {n: e.size for n, e in manifest.files.items()}
    index = parse_rank_index(data, where, file_sizes=sizes)
    if index.rank != rank or index.step != manifest.step:
        raise CorruptCheckpointError(
            f"{where}: holds rank {index.rank} step {index.step}, expected rank {rank} step {manifest.step}"
        )
    return index


def load_rank_state(storage: Storage, ckpt_dir: str, manifest: Manifest, rank: int) -> Any:
    """Rank ``rank``'s state tree with its tensors, every byte verified against its checksum."""
    tree, _ = _read_rank(storage, ckpt_dir, manifest, rank, keep=True, on_bytes=None)
    return tree


def _read_rank(
    storage: Storage,
    ckpt_dir: str,
    manifest: Manifest,
    rank: int,
    *,
    keep: bool,
    on_bytes: Callable[[int], None] | None,
) -> tuple[Any, str]:
    """Read and verify one rank's index and shard; returns the decoded state tree and shard name.

    With ``keep=False`` tensors are verified but not kept: the tree holds empty placeholders.
    """
    index = read_rank_index(storage, ckpt_dir, manifest, rank)
    shard_path = storage.join(ckpt_dir, index.shard_file)
    where = storage.describe(shard_path)
    try:
        stream = storage.open(shard_path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    try:
        entry = manifest.files[index.shard_file]
        tensors = read_shard(stream, index.tensors, entry, where, keep=keep, on_bytes=on_bytes)
    except (OSError, EOFError) as exc:
        raise CorruptCheckpointError(f"{where}: cannot be read ({exc})") from None
    finally:
        stream.close()
    index_where = storage.describe(storage.join(ckpt_dir, index_name(rank)))

    def load_tensor(i: int) -> Any:
        if i >= len(tensors):
            raise CorruptCheckpointError(
                f"{index_where}: the state refers to tensor #{i}, the index lists {len(tensors)}"
            )
        return tensors[i]

    return decode_tree(index.state, load_tensor, index_where), index.shard_file


def verify_checkpoint(
    storage: Storage, ckpt_dir: str, *, on_bytes: Callable[[int], None] | None = None
) -> Manifest:
    """Check everything a restore checks, without keeping the tensors; returns the manifest.

    Every file's size and checksum, every tensor's checksum and byte range, and every reference
    in the state trees. ``on_bytes(n)`` is called as bytes are hashed (for progress bars).
    """
    manifest = read_manifest(storage, ckpt_dir)
    checked: set[str] = set()
    for rank in range(manifest.world_size):
        _, shard_file = _read_rank(storage, ckpt_dir, manifest, rank, keep=False, on_bytes=on_bytes)
        checked |= {index_name(rank), shard_file}
    for name, entry in sorted(manifest.files.items()):
        if name not in checked:
            _verify_file(storage, storage.join(ckpt_dir, name), entry, on_bytes)
    return manifest


def _verify_file(
    storage: Storage, path: str, entry: FileEntry, on_bytes: Callable[[int], None] | None
) -> None:
    where = storage.describe(path)
    try:
        stream = storage.open(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    try:
        if entry.scheme != "bytes":
            raise CorruptCheckpointError(
                f"{where}: checksum scheme {entry.scheme!r} belongs to a rank's shard file"
            )
        if stream.size() != entry.size:
            raise CorruptCheckpointError(
                f"{where}: {stream.size()} bytes, the manifest lists {entry.size}"
            )
        hasher = new_hasher()
        buf = np.empty(min(entry.size, _VERIFY_CHUNK), dtype=np.uint8)
        pos = 0
        while pos < entry.size:
            view = buf.data[: min(_VERIFY_CHUNK, entry.size - pos)]
            stream.readinto(pos, view)
            hasher.update(view)
            pos += len(view)
            if on_bytes:
                on_bytes(len(view))
        if hasher.hexdigest() != entry.checksum:
            raise CorruptCheckpointError(
                f"{where}: checksum {hasher.hexdigest()}, the manifest lists {entry.checksum}"
            )
    except (OSError, EOFError) as exc:
        raise CorruptCheckpointError(f"{where}: cannot be read ({exc})") from None
    finally:
        stream.close()


def checkpoint_not_found(root: str, step: int | None) -> CheckpointNotFoundError:
    what = f"no checkpoint of step {step}" if step is not None else "no committed checkpoint"
    return CheckpointNotFoundError(f"{what} in {root}; `crashproof ls {root}` lists what there is")
