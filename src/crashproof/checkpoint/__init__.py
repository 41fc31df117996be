"""Checkpoints: the format, the save pipeline, restore with fallback, retention."""

from __future__ import annotations

from crashproof.checkpoint._catalog import CheckpointInfo, committed_steps, describe_checkpoint
from crashproof.checkpoint._delta import Delta
from crashproof.checkpoint._reader import load_rank_state, read_manifest, verify_checkpoint
from crashproof.checkpoint._replication import Tier, TierStatus
from crashproof.checkpoint._writer import CommitResult
from crashproof.checkpoint.manager import CheckpointManager

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "CommitResult",
    "Delta",
    "Tier",
    "TierStatus",
    "committed_steps",
    "describe_checkpoint",
    "load_rank_state",
    "read_manifest",
    "verify_checkpoint",
]
