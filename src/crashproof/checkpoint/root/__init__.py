"""A checkpoint root: its one writer's lock, what is in it (the committed checkpoints, what
``crashproof ls`` lists, the retention and prune plans) and its rollback marks.
"""

from __future__ import annotations

from crashproof.checkpoint.root._catalog import (
    CheckpointInfo,
    checkpoint_facts,
    committed_steps,
    describe_checkpoint,
    leftover_dirs,
    newest_verified,
    prune_plan,
    published_steps,
    recover_interrupted,
    retention_plan,
)
from crashproof.checkpoint.root._listing import list_checkpoints, located, unreadable
from crashproof.checkpoint.root._lock import RootLock, hold_root, lock_root, read_holder
from crashproof.checkpoint.root._rollbacks import (
    RollbackMark,
    abandoned,
    abandoned_steps,
    read_marks,
    record_rollback,
)

__all__ = [
    "CheckpointInfo",
    "RollbackMark",
    "RootLock",
    "abandoned",
    "abandoned_steps",
    "checkpoint_facts",
    "committed_steps",
    "describe_checkpoint",
    "hold_root",
    "leftover_dirs",
    "list_checkpoints",
    "located",
    "lock_root",
    "newest_verified",
    "prune_plan",
    "published_steps",
    "read_holder",
    "read_marks",
    "record_rollback",
    "recover_interrupted",
    "retention_plan",
    "unreadable",
]
