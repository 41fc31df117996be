"""Persist and commit as two steps, for a save whose ranks coordinate by other means.

:func:`~crashproof.checkpoint.save.persist` runs a whole save over crashproof's own
:class:`~crashproof.checkpoint.Group`: every rank writes, then reports to rank 0, which commits.
``torch.distributed.checkpoint`` has collectives of its own that call a storage writer's
``write_data`` on every rank and then ``finish`` on its coordinator with what each rank returned.
These two functions are those halves, built on the very functions ``persist`` runs, so a
checkpoint written this way is the same format, written and committed the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from crashproof.checkpoint.format import FileEntry
from crashproof.checkpoint.save._writer import Snapshot, _commit, _write_index, _write_shard
from crashproof.errors import CheckpointWriteError, NonFiniteStateError
from crashproof.storage import Storage

__all__ = ["commit_rank_files", "write_rank_files"]


def write_rank_files(
    storage: Storage, tmp_dir: str, snapshot: Snapshot, rank: int
) -> dict[str, FileEntry]:
    """Write rank ``rank``'s shard and index of ``snapshot`` into ``tmp_dir`` (made if missing),
    each checksummed as written and fsynced; returns their manifest entries, which the
    coordinator passes to :func:`commit_rank_files`.

    Only full checkpoints in which every rank writes all of its own tensors: replicated state
    written once (``owners``) needs the ranks to exchange entries mid-save, and a delta needs its
    base, neither of which a caller coordinating the ranks itself provides.
    """
    if snapshot.owners or snapshot.delta is not None:
        raise ValueError("write_rank_files writes full checkpoints without shared owners")
    if snapshot.ready is not None:
        snapshot.ready.synchronize()  # device-to-host copies of the snapshot are done
    storage.make_dirs(tmp_dir)
    shard = _write_shard(storage, tmp_dir, snapshot, rank)
    files, _ = _write_index(storage, tmp_dir, snapshot, rank, shard, [])
    return files


def commit_rank_files(
    storage: Storage,
    tmp_dir: str,
    final_dir: str,
    snapshot: Snapshot,
    files: Sequence[Mapping[str, FileEntry]],
) -> str:
    """On the coordinator, once every rank's :func:`write_rank_files` returned (``files[r]`` is
    rank ``r``'s): write the manifest last and publish ``tmp_dir`` as ``final_dir`` atomically
    and durably. ``snapshot`` gives the step, metadata and environment; its tensors are not read.

    Returns the checksum of the committed ``manifest.json``. Raises
    :class:`CheckpointWriteError` when the commit fails; ``tmp_dir`` is then removed, unless the
    publish itself was cut short (it may hold the only complete copy of a replaced checkpoint,
    which a root's start-up recovery puts back).
    """
    reports = [(dict(rank_files), None) for rank_files in files]
    failure = _commit(storage, tmp_dir, final_dir, snapshot, reports, len(reports))
    if failure is not None:
        text, code, nonfinite = failure
        message = f"checkpoint {storage.describe(final_dir)} was not committed ({text})"
        if nonfinite:
            raise NonFiniteStateError(message)
        raise CheckpointWriteError(code, message) if code else CheckpointWriteError(message)
    assert snapshot.committed_manifest is not None  # set by _commit once published
    return snapshot.committed_manifest
