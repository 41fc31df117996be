"""The agent's own check of a snapshot it holds: :func:`check_held`.

Once every process that could write a node's segments has stopped (the agent stopped its
trainers), the agent checks each committed snapshot as a restore would, while the next trainers
start. It then tells them so (``verified``), and they copy the bytes without hashing them again,
mapped read-only until they first write: a restore from memory at the speed of a memcpy, still
verified end to end.
"""

from __future__ import annotations

import os
import posixpath

from crashproof.checkpoint.memory._slot import Slot, SlotContents, malformed
from crashproof.checkpoint.memory._slot_storage import MEMORY_ROOT, SlotStorage, slot_place
from crashproof.checkpoint.memory._snapshots import slot_manifest
from crashproof.checkpoint.restore import RankRead
from crashproof.errors import CorruptCheckpointError
from crashproof.state import check_structure, value_tensor_names

__all__ = ["check_held"]


def check_held(
    fd: int,
    nbytes: int,
    slot: tuple[str, int, int],
    world_size: int,
    step: int,
    contents: SlotContents,
    origin: str = "local",
) -> None:
    """Check a snapshot the agent holds (its segment ``fd``, not taken over; ``slot``: its root
    key, rank and slot index) as a restore from memory checks it: its manifest and index, and
    every byte against its checksum; raises :class:`CorruptCheckpointError` naming what is
    wrong."""
    key, rank, index = slot
    held = Slot(None, key, rank, world_size, index)
    held.origin = origin
    why = malformed(contents, nbytes)
    if why is not None:
        raise CorruptCheckpointError(f"{slot_place(held)}: {why}")
    held.adopt(os.dup(fd), nbytes, step, contents, origin)
    try:
        storage, path = SlotStorage(held), posixpath.join(MEMORY_ROOT, held.contents["path"])
        reader = RankRead(storage, path, slot_manifest(held), rank, keep=value_tensor_names)
        try:
            reader.verify()
            check_structure(reader.check_tree(), storage.describe(path))
        finally:
            reader.close()
    finally:
        held.close()
