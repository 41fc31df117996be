"""Checkpoints: the format, the save pipeline, restore with fallback, retention."""

from __future__ import annotations

from crashproof.checkpoint._catalog import (
    CheckpointInfo,
    committed_steps,
    describe_checkpoint,
    prune_plan,
)
from crashproof.checkpoint._delta import Delta
from crashproof.checkpoint._export import check_target, export_dcp, export_safetensors
from crashproof.checkpoint._format import RankIndex, parse_step_dir
from crashproof.checkpoint._group import Group, default_group
from crashproof.checkpoint._hosted import ENV_AGENT_REPLICATION, ReplicationHost
from crashproof.checkpoint._listing import list_checkpoints, located, unreadable
from crashproof.checkpoint._lock import lock_root
from crashproof.checkpoint._reader import (
    load_rank_state,
    read_manifest,
    read_rank_index,
    verify_checkpoint,
)
from crashproof.checkpoint._replication import Tier, TierStatus
from crashproof.checkpoint._writer import CommitResult
from crashproof.checkpoint.manager import CheckpointManager

__all__ = [
    "ENV_AGENT_REPLICATION",
    "CheckpointInfo",
    "CheckpointManager",
    "CommitResult",
    "Delta",
    "Group",
    "RankIndex",
    "ReplicationHost",
    "Tier",
    "TierStatus",
    "check_target",
    "committed_steps",
    "default_group",
    "describe_checkpoint",
    "export_dcp",
    "export_safetensors",
    "list_checkpoints",
    "load_rank_state",
    "located",
    "lock_root",
    "parse_step_dir",
    "prune_plan",
    "read_manifest",
    "read_rank_index",
    "unreadable",
    "verify_checkpoint",
]
