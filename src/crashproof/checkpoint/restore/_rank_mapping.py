"""Restoring a checkpoint on another number of ranks than saved it.

Replicated state (DDP, or any job whose ranks hold the same tensors) restores on any world size:
every saved rank has all of it, so new rank ``r`` reads saved rank ``r % W``. Whether the state
*is* replicated is not assumed: the ranks' indexes list every tensor's checksum, and they must
agree for every tensor but the RNG states (which differ per rank by design) and the pieces of
sharded tensors (DTensors: FSDP2, tensor parallel), which :mod:`crashproof.checkpoint.restore._dcp_reader` redistributes from
their recorded placements. Other state that differs between ranks (sharded by hand, e.g. a
``ZeroRedundancyOptimizer``) is refused with a clear error: nothing says how it is split.

A DDP model's buffers may differ too (BatchNorm's running statistics follow each rank's own batch
after DDP hands out rank 0's): the caller names them in ``per_rank``, and they come, like other
per-rank values (RNG states, ``extra``), from the saved rank ``r % W``,
so two new ranks may start with the same RNG state. A run resumed on another world size is not
bit-exact anyway (the gradient reduction order changes); the data position is global and carries
over exactly (see :class:`~crashproof.ResumableSampler`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from crashproof.checkpoint.format import Manifest, RankIndex
from crashproof.checkpoint.restore._read_manifest import read_rank_index
from crashproof.errors import StateMismatchError
from crashproof.storage import Storage

__all__ = ["source_rank", "source_ranks"]

_PER_RANK_PREFIXES = ("rng/",)


def source_rank(
    storage: Storage,
    ckpt_dir: str,
    manifest: Manifest,
    rank: int,
    world_size: int,
    *,
    per_rank: Collection[str] = (),
) -> int:
    """The saved rank whose part ``rank`` (of ``world_size``) restores; see the module docstring.

    Raises :class:`StateMismatchError` when the world size differs and the saved ranks' tensors
    are not the same; :class:`~crashproof.CorruptCheckpointError` for an unreadable index.
    """
    sources, _ = source_ranks(storage, ckpt_dir, manifest, world_size, per_rank=per_rank)
    return sources[rank]


def source_ranks(
    storage: Storage,
    ckpt_dir: str,
    manifest: Manifest,
    world_size: int,
    *,
    per_rank: Collection[str] = (),
    among: Sequence[int] | None = None,
) -> tuple[list[int], list[RankIndex]]:
    """The saved rank each of ``world_size`` ranks restores, and the saved ranks' indexes read
    to check that the state is replicated (none when the world size is the one saved).
    ``among``: the saved ranks to compare, and to restore from (one node's part of a
    checkpoint saved on node-local roots: the others are on their own nodes' disks)."""
    saved = manifest.world_size
    if saved == world_size and among is None:
        return list(range(world_size)), []
    ranks = list(range(saved)) if among is None else list(among)
    indexes = [read_rank_index(storage, ckpt_dir, manifest, r) for r in ranks]
    # A save that wrote replicated tensors once (they point into another rank's file) wrote the
    # rest of the model per rank on purpose: its buffers (see TrainState.replicated_names).
    shared = {t.name for index in indexes for t in index.tensors if t.file is not None}
    if any(name.startswith("model/") for name in shared):
        per_rank = {*per_rank, *(t.name for t in indexes[0].tensors
                                 if t.name.startswith("model/") and t.name not in shared)}  # fmt: skip
    reference: dict[str, str] | None = None
    for r, index in zip(ranks, indexes, strict=True):
        tensors = {
            t.name: t.checksum
            for t in index.tensors
            if not t.name.startswith(_PER_RANK_PREFIXES)
            and t.global_shape is None
            and t.name not in per_rank
        }
        if reference is None:
            reference = tensors
        elif tensors != reference:
            differing = sorted(
                n for n in reference.keys() | tensors.keys() if reference.get(n) != tensors.get(n)
            )
            raise StateMismatchError(
                f"{storage.describe(ckpt_dir)} was saved by {saved} ranks whose tensors differ "
                f"(rank {ranks[0]} and rank {r}: {', '.join(differing[:5])}"
                f"{', ...' if len(differing) > 5 else ''}): the state is split between the ranks "
                f"by hand (not as DTensors, whose placements say how), so it cannot be "
                f"redistributed over {world_size} ranks. Restore with {saved} ranks, or shard "
                f"with FSDP2 / DTensor."
            )
    return [ranks[rank % len(ranks)] for rank in range(world_size)], indexes
