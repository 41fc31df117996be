"""Checkpoints: the format, the save pipeline, restore with fallback, retention, tiers, export.

``manager.CheckpointManager`` is the front door; its options are :class:`ManagerOptions`. The
manager's collaborators sit beside it (``_save_pipeline``, ``_restorer``, ``_retention_runner``,
``_agreement``, ``_tier_coordination``, sharing ``_manager_state``); the machinery they drive is in
subpackages by flow: ``format`` (on disk), ``save``, ``restore``, ``root`` (the lock and what is in
a root), ``tiers`` and ``export``. docs/architecture.md has the map.
"""

from __future__ import annotations

from crashproof.checkpoint._group import Group, default_group
from crashproof.checkpoint._options import ManagerOptions
from crashproof.checkpoint.export import check_target, export_dcp, export_safetensors
from crashproof.checkpoint.format import RankIndex, held_part, parse_step_dir
from crashproof.checkpoint.manager import CheckpointManager
from crashproof.checkpoint.restore import (
    held_files,
    load_rank_state,
    read_manifest,
    read_rank_index,
    verify_checkpoint,
)
from crashproof.checkpoint.root import (
    CheckpointInfo,
    committed_steps,
    describe_checkpoint,
    hold_root,
    list_checkpoints,
    located,
    lock_root,
    prune_plan,
    published_steps,
    unreadable,
)
from crashproof.checkpoint.save import CommitResult, Delta
from crashproof.checkpoint.tiers import ENV_AGENT_REPLICATION, ReplicationHost, Tier, TierStatus

__all__ = [
    "ENV_AGENT_REPLICATION",
    "CheckpointInfo",
    "CheckpointManager",
    "CommitResult",
    "Delta",
    "Group",
    "ManagerOptions",
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
    "held_files",
    "held_part",
    "hold_root",
    "list_checkpoints",
    "load_rank_state",
    "located",
    "lock_root",
    "parse_step_dir",
    "prune_plan",
    "published_steps",
    "read_manifest",
    "read_rank_index",
    "unreadable",
    "verify_checkpoint",
]
