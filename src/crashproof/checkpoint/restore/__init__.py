"""Reading checkpoints back: the manifest and the ranks' indexes, a rank's tensors and state
verified (the same path as ``crashproof verify``), sharded (DTensor) state through
``torch.distributed.checkpoint``, and which saved rank a new rank restores when the world
size changed.
"""

from __future__ import annotations

from crashproof.checkpoint.restore._dcp_reader import (
    CrashproofReader,
    load_sharded,
    restore_targets,
)
from crashproof.checkpoint.restore._rank_mapping import source_rank
from crashproof.checkpoint.restore._rank_read import RankRead, load_rank_state, verify_checkpoint
from crashproof.checkpoint.restore._read_manifest import (
    checkpoint_not_found,
    read_manifest,
    read_manifest_bytes,
    read_rank_index,
)

__all__ = [
    "CrashproofReader",
    "RankRead",
    "checkpoint_not_found",
    "load_rank_state",
    "load_sharded",
    "read_manifest",
    "read_manifest_bytes",
    "read_rank_index",
    "restore_targets",
    "source_rank",
    "verify_checkpoint",
]
