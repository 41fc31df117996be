"""The save pipeline: the snapshot (into reusable staging buffers), delta encoding, the
check that what is saved is finite, persist and commit; and the counters of saves.
"""

from __future__ import annotations

from crashproof.checkpoint.save._delta import Delta, DeltaBase, apply_delta, keep_as_base
from crashproof.checkpoint.save._rank_files import commit_rank_files, write_rank_files
from crashproof.checkpoint.save._shared_checksums import SharedChecksums
from crashproof.checkpoint.save._staging import Arena, ArenaUnavailable, StagingArea
from crashproof.checkpoint.save._stats import SaveStats
from crashproof.checkpoint.save._writer import (
    TMP_PREFIX,
    CommitResult,
    Snapshot,
    assign_owners,
    exactness_environment,
    named_tensors,
    new_tmp_name,
    persist,
    take_snapshot,
)

__all__ = [
    "TMP_PREFIX",
    "Arena",
    "ArenaUnavailable",
    "CommitResult",
    "Delta",
    "DeltaBase",
    "SaveStats",
    "SharedChecksums",
    "Snapshot",
    "StagingArea",
    "apply_delta",
    "assign_owners",
    "commit_rank_files",
    "exactness_environment",
    "keep_as_base",
    "named_tensors",
    "new_tmp_name",
    "persist",
    "take_snapshot",
    "write_rank_files",
]
