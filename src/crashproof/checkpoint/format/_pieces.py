"""The saved pieces of sharded tensors (DTensors: FSDP2, tensor parallel), checked across ranks.

Each rank's index lists its own piece of every sharded tensor with the piece's place in the whole
tensor (:class:`~crashproof.checkpoint.format._rank_index.TensorEntry`); :func:`sharded_pieces` puts the
ranks' lists together and checks that the pieces tile each whole tensor. Metadata only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from crashproof.checkpoint.format._rank_index import RankIndex, TensorEntry
from crashproof.errors import CorruptCheckpointError

__all__ = ["Piece", "sharded_pieces"]


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
