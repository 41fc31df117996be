"""Snapshots held in the memory of ``crashproof run``'s agent, so that a trainer that crashes
resumes from RAM instead of storage.

The agent (:mod:`crashproof.supervisor._memory_host`) creates shared-memory segments and keeps
them alive across its trainers' crashes; each trainer maps its own and uses them as the staging
buffers of its asynchronous saves (:class:`~crashproof.checkpoint.save.StagingArea` with an
arena), so a snapshot costs no copy beyond the one a save makes anyway. A snapshot is committed
as this rank's part of a checkpoint, by the disk writer's own code, and restored through the same
verification as a checkpoint on disk (see docs/recovery.md).
"""

from __future__ import annotations

from crashproof.checkpoint.memory._check_held import check_held
from crashproof.checkpoint.memory._slot import Slot
from crashproof.checkpoint.memory._slot_storage import MEMORY_ROOT, SlotStorage
from crashproof.checkpoint.memory._snapshots import MemorySnapshots

__all__ = ["MEMORY_ROOT", "MemorySnapshots", "Slot", "SlotStorage", "check_held"]
