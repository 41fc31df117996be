"""Counters of what a CheckpointManager did: read them for logs, metrics and tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["SaveStats"]


@dataclass(slots=True)
class SaveStats:
    saves_started: int = 0
    """Saves that took a snapshot."""
    saves_committed: int = 0
    """Saves that reached their commit."""
    skipped_busy: int = 0
    """Saves skipped because the previous one was still being written (``on_busy="skip"``)."""
    waited_busy: int = 0
    """Saves that first waited for the previous one (``on_busy="wait"``)."""
    waited_busy_s: float = 0.0
    """Total time the training loop waited for a previous save."""
    failures: int = 0
    """Saves that failed (reported through :class:`CheckpointWriteError` or, for a full disk, logged)."""
    disk_full: int = 0
    """Of the failures, those caused by a full disk."""
    disk_full_retries: int = 0
    """Saves that failed for a full disk, removed early what retention would remove after them
    and were tried once more (a retry that fails counts in ``failures`` too)."""
    removed_for_space: int = 0
    """Checkpoints removed early, before the save that made them superfluous committed, to make
    room on a full disk."""
    bytes_written: int = 0
    """Bytes of committed checkpoints written by this rank."""
    last_blocking_s: float = 0.0
    """How long the last save paused the training loop (snapshot, and any wait)."""
    last_persist_s: float = 0.0
    """How long the last committed save took to write and commit, in the background or not."""
    memory_snapshots: int = 0
    """Snapshots committed to the memory of ``crashproof run``'s agent (an asynchronous save's
    own snapshot, and those of ``memory_every``)."""
    memory_skipped_busy: int = 0
    """Memory snapshots skipped because every staging buffer was still being written to disk
    (a memory snapshot never waits)."""
    memory_failures: int = 0
    """Memory snapshots that failed to commit (logged; the disk checkpoints are unaffected)."""
    memory_last_blocking_s: float = 0.0
    """How long the last memory-only snapshot paused the training loop."""
    memory_last_commit_s: float = 0.0
    """How long the last memory snapshot took to checksum and commit, in the background."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
