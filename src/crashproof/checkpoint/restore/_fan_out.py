"""Restore's fan-out: rank 0 reads the manifest once and hands each rank only what it reads.

The manifest lists every rank's files, so it grows with the number of ranks W; every rank
reading and parsing all of it costs W times its size in aggregate (220 GB across 32,768 ranks,
``benchmarks/coordination.py``), and on another world size every rank read every saved rank's
index as well. Instead rank 0 reads the manifest; its own index, for the shards that hold
replicated tensors written once (every rank reads those); and, on another world size, every
saved rank's index, to check once that the state is replicated. Each rank then receives a
:class:`RankPlan`: the manifest with only the entries of its own files and of those shards,
whose size does not grow with W, so the aggregate grows linearly. A rank checks each file it
reads against its entry as before: nothing is trusted that was not checked. A rank whose own
index needs more than its plan holds (a shard only it points into, which crashproof never
writes but a valid checkpoint may hold, or sharded pieces) reads the whole manifest itself
(:class:`~crashproof.checkpoint.restore._read_manifest.PartialManifest`): the plan is an
economy, never a narrower judgement than ``crashproof verify``'s.

Sharded (DTensor) state is the exception: every rank describes every saved piece to
``torch.distributed.checkpoint``'s planner and so reads every rank's index; those ranks get the
whole manifest (still read from storage once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from crashproof.checkpoint.format import Manifest, RankIndex, index_name, shard_name
from crashproof.checkpoint.restore._rank_mapping import source_ranks
from crashproof.checkpoint.restore._rank_read import base_manifest, unusable_base
from crashproof.checkpoint.restore._read_manifest import read_manifest, read_rank_index
from crashproof.errors import CorruptCheckpointError
from crashproof.storage import Storage

__all__ = ["RankPlan", "plan_restore"]


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank needs to restore its part of a checkpoint."""

    manifest: Manifest
    """The checkpoint's manifest, with only the files this rank reads (every other field whole)."""
    source: int
    """The saved rank whose part this rank restores: itself, unless the world size changed."""
    base: Manifest | None = None
    """A delta's base checkpoint's manifest, checked against the delta, likewise cut down."""


def plan_restore(
    storage: Storage, ckpt_dir: str, world_size: int, *, per_rank: Collection[str] = ()
) -> list[RankPlan]:
    """Every rank's :class:`RankPlan` for the checkpoint in ``ckpt_dir``, in rank order (run by
    rank 0). Raises what reading the manifest, an index or a delta's base raises, and
    :class:`~crashproof.StateMismatchError` for state that cannot be restored on ``world_size``
    ranks."""
    manifest = read_manifest(storage, ckpt_dir)
    sources, indexes = source_ranks(storage, ckpt_dir, manifest, world_size, per_rank=per_rank)
    base_dir, base = (
        base_manifest(storage, ckpt_dir, manifest) if manifest.kind == "delta" else ("", None)
    )
    if world_size == 1:  # one reader: nothing to save by cutting the manifest down
        return [RankPlan(manifest, sources[0], base)]
    if not indexes:
        indexes = [read_rank_index(storage, ckpt_dir, manifest, 0)]
    if any(t.global_shape is not None for index in indexes for t in index.tensors):
        return [RankPlan(manifest, source, base) for source in sources]
    shared = _shared_shards(indexes)
    base_shared: set[str] = set()
    if base is not None:  # (its owners of replicated tensors may differ from the delta's)
        try:
            base_shared = _shared_shards([read_rank_index(storage, base_dir, base, 0)])
        except CorruptCheckpointError as exc:
            raise unusable_base(storage, ckpt_dir, manifest, exc) from None
    return [
        RankPlan(
            _cut(manifest, source, shared),
            source,
            None if base is None else _cut(base, source, base_shared),
        )
        for source in sources
    ]


def _shared_shards(indexes: Sequence[RankIndex]) -> set[str]:
    """The shards that hold replicated tensors, each written once by one rank for all: the rank
    that writes a tensor is the same in every rank's index, so every index but the writer's own
    points into its shard; one index (the first) misses only the shard of its own rank, added."""
    return {indexes[0].shard_file} | {
        t.file for index in indexes for t in index.tensors if t.file is not None
    }


def _cut(manifest: Manifest, rank: int, shared: set[str]) -> Manifest:
    """``manifest`` with only the files of ``rank`` and the ``shared`` shards; found by name,
    not by going through every rank's files (which would make rank 0's work quadratic)."""
    names = {index_name(rank), shard_name(rank), *shared}
    files = {n: manifest.files[n] for n in sorted(names) if n in manifest.files}
    return dataclasses.replace(manifest, files=files, complete=False)
