"""What the collaborators of one :class:`~crashproof.CheckpointManager` share about its root:
:class:`ManagerState` (the lock, the newest valid checkpoint, the delta base, the checkpoints
known to be this run's), and :func:`open_for_writing`, which a writing manager runs first."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from crashproof._console import announce
from crashproof.checkpoint._group import Group
from crashproof.checkpoint.root import (
    RootLock,
    committed_steps,
    hold_root,
    leftover_dirs,
    read_holder,
    recover_interrupted,
)
from crashproof.checkpoint.save import DeltaBase
from crashproof.errors import CheckpointWriteError, ConfigError
from crashproof.storage import Storage

__all__ = ["ManagerState", "open_for_writing"]

log = logging.getLogger("crashproof.checkpoint")


@dataclass
class ManagerState:
    """One manager's mutable state, read and written by the save pipeline (training and writer
    threads), retention, the restorer and tier coordination."""

    root: str
    storage: Storage
    read_only: bool = False
    closed: bool = False
    lock: RootLock | None = None
    """Rank 0's lock on a local root while writing; None on other ranks, object stores, readers."""
    newest_valid: int | None = None
    """The newest checkpoint known to verify: committed or restored by this manager."""
    delta_base: DeltaBase | None = None
    """The newest committed full checkpoint's tensors, to take deltas against. Only the writer
    thread touches it, in save order, so every rank sees the same base for the same save."""
    last_save_step: int = 0
    last_save_s: float = field(default_factory=time.monotonic)
    known: dict[int, float | None] = field(default_factory=dict)
    """Where no lock can be held (object stores): the commit time of every checkpoint this manager
    knows of (None: not looked at yet), to tell a second writer's checkpoints (docs/storage.md)."""
    corrupt: set[int] = field(default_factory=set)
    """Steps whose local copy a restore of this run found corrupt (and skipped): retention does
    not count them among what it keeps and removes them first when the disk is full. A step
    leaves the set when this run commits or downloads a good copy of it."""
    second_writer: str | None = None
    """Why the next call into the manager fails: a second writer was seen."""
    retention_off: bool = False
    """Set for good once a second writer was seen."""

    def check_open(self) -> None:
        if self.closed:
            raise ConfigError("this CheckpointManager is closed; create a new one")

    def check_writer(self, what: str) -> None:
        """Fail when the manager is closed, or may only read."""
        self.check_open()
        if self.read_only:
            raise ConfigError(
                f"CheckpointManager({self.root!r}, read_only=True) cannot {what}: it only restores "
                "and lists; the run that writes the root saves, prunes and rolls back"
            )

    def check_lock(self) -> None:
        """Fail when the lock is no longer ours (deleted, replaced or moved meanwhile)."""
        if self.lock is not None:
            self.lock.check()

    def release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()


_SHARED_WAIT_S = 3.0
"""How long a rank looks for rank 0's lock file before it says the root is not shared (a
network filesystem's client may cache the directory's old listing for a moment; each look
lists the directory, which makes it fetch the listing again)."""


def _not_shared(root: str, group: Group, held: list[Any] | None) -> CheckpointWriteError | None:
    """Every rank must see the one root rank 0 locked (``held``: its host and pid; None: an
    object store, one namespace for all): a root that is a local directory on each node would
    commit checkpoints that hold only rank 0's node's shards. Returns the error every rank
    raises, or None (a collective)."""
    blind = False
    if held is not None and group.rank != 0:
        deadline = time.monotonic() + _SHARED_WAIT_S
        while True:
            with contextlib.suppress(OSError):
                os.listdir(root)  # (refreshes a network filesystem's cached listing)
            holder = read_holder(root)
            blind = holder is None or [holder.host, holder.pid] != held
            if not blind or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    verdicts = group.all_gather((blind, socket.gethostname()))
    apart = [f"{rank} (on {host})" for rank, (no, host) in enumerate(verdicts) if no]
    if not apart:
        return None
    host, _ = held if held is not None else ("?", 0)
    return CheckpointWriteError(
        errno.ENOTSUP,
        f"{root}: rank(s) {', '.join(apart)} do not see the lock rank 0 (on {host}) holds in "
        "this directory: it is not one directory shared by every rank (a local disk on each "
        "node, or another path on some ranks). crashproof commits a checkpoint in one root that "
        "every rank writes into: put the root on a shared filesystem (NFS, Lustre, GPFS) or in "
        "an object store (s3://, gs://), and give every rank the same path",
    )


def open_for_writing(state: ManagerState, group: Group, policies: str) -> None:
    """Rank 0 takes the root's lock, finishes an interrupted publish and removes what failed saves
    left, then announces the ``policies`` in force; every rank fails if it cannot (no collective
    left waiting)."""
    root = state.root
    error: Exception | None = None
    if group.rank == 0:
        try:
            # From here on every change rank 0 makes in the root checks first that it still
            # holds it: the background writes, publishes, removals and downloads alike.
            state.storage.make_dirs(root)
            storage, state.lock = hold_root(state.storage, root)
            state.storage = storage
            recover_interrupted(storage, root)
            for leftover in leftover_dirs(storage, root):
                log.info(
                    "removing %s, left by a save that never committed", storage.describe(leftover)
                )
                storage.remove(leftover)
            state.known = {s: None for s, _ in committed_steps(storage, root)}
        except Exception as exc:
            error = exc
    if group.world_size > 1:
        lock = state.lock
        held = None if lock is None else [lock.holder.host, lock.holder.pid]
        said = group.broadcast(
            {"error": None if error is None else f"{type(error).__name__}: {error}", "lock": held}
        )
        if said["error"] is not None and error is None:
            error = CheckpointWriteError(
                errno.EBUSY, f"rank 0 cannot write to {root}: {said['error']}"
            )
        if said["error"] is None:
            error = error or _not_shared(root, group, said["lock"])
    if error is not None:
        state.release_lock()
        raise error
    if group.rank == 0:
        announce(log, policies)
