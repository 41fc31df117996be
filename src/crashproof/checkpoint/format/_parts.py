"""A checkpoint saved on node-local roots (its manifest's ``nodes``): each node's root holds the
manifest and the files of that node's ranks, its *part*. Which part a directory holds, and which
files make it up."""

from __future__ import annotations

from collections.abc import Collection

from crashproof.checkpoint.format._manifest import Manifest
from crashproof.checkpoint.format._names import index_name, shard_name
from crashproof.errors import CorruptCheckpointError

__all__ = ["held_part", "part_files"]


def part_files(ranks: Collection[int]) -> set[str]:
    """The files of ``ranks``: each one's index and shard."""
    return {name for rank in ranks for name in (index_name(rank), shard_name(rank))}


def held_part(manifest: Manifest, present: Collection[str], where: str) -> tuple[int, ...]:
    """The ranks whose files the directory ``where`` (listing ``present``) holds: every rank for
    a checkpoint in one root; one node's ranks, whole, for a checkpoint on node-local roots.

    Raises :class:`CorruptCheckpointError` for a directory holding no node's part whole, or
    parts of several nodes (sizes and checksums are checked by the caller)."""
    if manifest.nodes is None:
        return tuple(range(manifest.world_size))
    names = set(present) & set(manifest.files)
    held = [ranks for ranks in manifest.nodes if part_files(ranks) & names]
    if len(held) == 1 and part_files(held[0]) <= names:
        return held[0]
    if not held:
        raise CorruptCheckpointError(
            f"{where}: saved on {len(manifest.nodes)} nodes' own roots, it holds no node's files"
        )
    missing = sorted(part_files(held[0]) - names) if len(held) == 1 else []
    raise CorruptCheckpointError(
        f"{where}: saved on {len(manifest.nodes)} nodes' own roots, it holds "
        + (
            f"ranks {list(held[0])}'s part without {', '.join(missing[:3])}"
            if missing
            else f"files of {len(held)} nodes (ranks {[list(r) for r in held]}): one node's "
            "root holds its own ranks' files only"
        )
    )
