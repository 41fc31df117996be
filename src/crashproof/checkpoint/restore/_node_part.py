"""Restoring from node-local roots: each rank reads its node's root only, which holds the manifest
and the files of its node's ranks (:mod:`crashproof.checkpoint.format._parts`). No rank reads for
another, so each plans its own read; a step is a candidate only where every rank finds its part
in its own root, under the same manifest (:func:`part_here`, compared across ranks by the
restore)."""

from __future__ import annotations

import dataclasses

from crashproof.checkpoint.format import Manifest, digest, held_part, part_files
from crashproof.checkpoint.restore._fan_out import RankPlan
from crashproof.checkpoint.restore._rank_read import base_manifest
from crashproof.checkpoint.restore._read_manifest import read_manifest, read_manifest_bytes
from crashproof.errors import CorruptCheckpointError
from crashproof.storage import Storage

__all__ = [
    "Layout",
    "cut_to_node",
    "held_files",
    "part_here",
    "plan_node_part",
    "saved_layout",
]

Layout = tuple[int, tuple[tuple[int, ...], ...]]
"""A checkpoint's ranks as saved: the world size, and the ranks of each node's part."""


def part_here(storage: Storage, ckpt_dir: str, rank: int, world_size: int) -> str | None:
    """The checksum of the manifest in ``ckpt_dir`` when it holds ``rank``'s part of a checkpoint
    of ``world_size`` ranks (the manifest valid, its node's files present); else None. No
    checksum of the files is read: the restore verifies them."""
    try:
        data, manifest = read_manifest_bytes(storage, ckpt_dir)
        if manifest.world_size != world_size:
            return None
        names = set(storage.list(ckpt_dir))
        held = held_part(manifest, names, storage.describe(ckpt_dir))
    except (CorruptCheckpointError, OSError):
        return None
    if rank not in held or not part_files(held) <= names:
        return None
    return digest(data)


def saved_layout(storage: Storage, ckpt_dir: str) -> Layout | None:
    """The ranks of the checkpoint in ``ckpt_dir`` as saved: its world size and each node's
    ranks (one node holding every rank for a checkpoint saved in one root); None when its
    manifest is unreadable (the restore says why when it reads it)."""
    try:
        manifest = read_manifest_bytes(storage, ckpt_dir)[1]
    except (CorruptCheckpointError, OSError):
        return None
    return manifest.world_size, manifest.nodes or (tuple(range(manifest.world_size)),)


def held_files(storage: Storage, ckpt_dir: str, manifest: Manifest) -> set[str]:
    """The files of ``manifest`` that ``ckpt_dir`` holds: every one, or for a checkpoint saved on
    node-local roots, those of the node's part it holds (checked whole: raises
    :class:`CorruptCheckpointError` for no part, or parts of several nodes)."""
    if manifest.nodes is None:
        return set(manifest.files)
    return part_files(held_part(manifest, storage.list(ckpt_dir), storage.describe(ckpt_dir)))


def plan_node_part(storage: Storage, ckpt_dir: str, rank: int) -> RankPlan:
    """``rank``'s plan for the checkpoint in its node's root ``ckpt_dir``: the manifest (and a
    delta's base's) cut down to the files of the rank's node."""
    manifest = read_manifest(storage, ckpt_dir)
    base = base_manifest(storage, ckpt_dir, manifest)[1] if manifest.kind == "delta" else None
    return RankPlan(
        cut_to_node(manifest, rank), rank, None if base is None else cut_to_node(base, rank)
    )


def cut_to_node(manifest: Manifest, rank: int) -> Manifest:
    """``manifest`` cut down to the files of ``rank``'s node (all of them, saved in one root)."""
    node = next((ranks for ranks in manifest.nodes or () if rank in ranks), None)
    if node is None:  # one root held every rank's files: all stay readable
        return manifest
    names = part_files(node)
    files = {n: e for n, e in manifest.files.items() if n in names}
    return dataclasses.replace(manifest, files=files, complete=False)
