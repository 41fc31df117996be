"""Reading checkpoints back: the manifest and the ranks' indexes, a rank's tensors and state
verified (the same path as ``crashproof verify``), sharded (DTensor) state through
``torch.distributed.checkpoint``, which saved rank a new rank restores when the world size
changed, and each rank's part of the manifest, read once by rank 0 (``_fan_out``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from crashproof.checkpoint.restore._fan_out import RankPlan, plan_restore
from crashproof.checkpoint.restore._node_part import (
    Layout,
    cut_to_node,
    held_files,
    part_here,
    plan_node_part,
    saved_layout,
)
from crashproof.checkpoint.restore._rank_mapping import source_rank, source_ranks
from crashproof.checkpoint.restore._rank_read import RankRead, load_rank_state, verify_checkpoint
from crashproof.checkpoint.restore._read_manifest import (
    PartialManifest,
    checkpoint_not_found,
    read_manifest,
    read_manifest_bytes,
    read_rank_index,
    unreadable,
)

if TYPE_CHECKING:
    from crashproof.checkpoint.restore._dcp_reader import (
        CrashproofReader,
        dcp_failures,
        load_sharded,
        restore_targets,
    )

__all__ = [
    "CrashproofReader",
    "Layout",
    "PartialManifest",
    "RankPlan",
    "RankRead",
    "checkpoint_not_found",
    "cut_to_node",
    "dcp_failures",
    "held_files",
    "load_rank_state",
    "load_sharded",
    "part_here",
    "plan_node_part",
    "plan_restore",
    "read_manifest",
    "read_manifest_bytes",
    "read_rank_index",
    "restore_targets",
    "saved_layout",
    "source_rank",
    "source_ranks",
    "unreadable",
    "verify_checkpoint",
]

_SHARDED = frozenset({"CrashproofReader", "dcp_failures", "load_sharded", "restore_targets"})


def __getattr__(name: str) -> Any:
    """The sharded readers, imported when first asked for: ``torch.distributed.checkpoint`` (and
    with it DTensor's operator tables) takes a second to import, and only sharded state needs it."""
    if name in _SHARDED:
        from crashproof.checkpoint.restore import _dcp_reader

        return getattr(_dcp_reader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
