"""Durable tiers: committed checkpoints replicated to remote storage, in the trainer's
process or by the agent of ``crashproof run``; whole checkpoints copied between storages.
"""

from __future__ import annotations

from crashproof.checkpoint.tiers._agent_replication import (
    ENV_AGENT_REPLICATION,
    ReplicationHost,
    agent_tiers,
)
from crashproof.checkpoint.tiers._backlog import LocalCheckpoints
from crashproof.checkpoint.tiers._replicator import TierReplicator
from crashproof.checkpoint.tiers._tier import Replica, Tier, TierStatus, open_tiers
from crashproof.checkpoint.tiers._transfer import download_checkpoint

__all__ = [
    "ENV_AGENT_REPLICATION",
    "LocalCheckpoints",
    "Replica",
    "ReplicationHost",
    "Tier",
    "TierReplicator",
    "TierStatus",
    "agent_tiers",
    "download_checkpoint",
    "open_tiers",
]
