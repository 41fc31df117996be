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
from typing import Any, Literal

from crashproof._console import announce
from crashproof.checkpoint._group import Group
from crashproof.checkpoint._placement import NODE_ENV, Placement, node_key
from crashproof.checkpoint.restore import read_manifest
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

__all__ = ["ManagerState", "RootScope", "open_for_reading", "open_for_writing"]

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
    """The root's lock while writing, held by the rank that leads it (rank 0; each node's first
    rank on node-local roots); None on other ranks, object stores, readers."""
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
    stranded: set[int] = field(default_factory=set)
    """On node-local roots, steps this node's root holds that a restore of this run found not
    whole on every node (a node lost its disk, the ranks moved between nodes): no rank of this
    run can restore them, so retention does not count them among what it keeps (they would
    crowd out the steps this run saves), and removes them only when the disk is full."""
    second_writer: str | None = None
    """Why the next call into the manager fails: a second writer was seen."""
    retention_off: bool = False
    """Set for good once a second writer was seen."""
    placement: Placement = field(default_factory=lambda: Placement.shared(1, 0))
    """Which ranks share this root (node-local roots: each node's ranks, see
    :mod:`crashproof.checkpoint._placement`)."""

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
"""How long a rank looks for its root's lock before it says the root is not the one its node's
leader locked (a network filesystem's client may cache the directory's old listing for a
moment; each look lists the directory, which makes it fetch the listing again)."""

RootScope = Literal["auto", "shared", "node"]


def _blind(root: str, held: list[Any]) -> bool:
    """Whether this rank does not see, in ``root``, the lock whose holder (host, pid) is ``held``."""
    deadline = time.monotonic() + _SHARED_WAIT_S
    while True:
        with contextlib.suppress(OSError):
            os.listdir(root)  # (refreshes a network filesystem's cached listing)
        holder = read_holder(root)
        if holder is not None and [holder.host, holder.pid] == held:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.5)


def _apart(group: Group, blind: bool) -> list[str]:
    """Every rank that is ``blind`` (a collective), as "rank (on host)"."""
    verdicts = group.all_gather((blind, socket.gethostname()))
    return [f"{rank} (on {host})" for rank, (no, host) in enumerate(verdicts) if no]


def _not_shared(root: str, apart: list[str], host: str) -> CheckpointWriteError:
    return CheckpointWriteError(
        errno.ENOTSUP,
        f"{root}: rank(s) {', '.join(apart)} do not see the lock rank 0 (on {host}) holds in "
        "this directory: it is not one directory shared by every rank (a local disk on each "
        "node, or another path on some ranks). crashproof commits a checkpoint in one root that "
        "every rank writes into: put the root on a shared filesystem (NFS, Lustre, GPFS) or in "
        "an object store (s3://, gs://), and give every rank the same path; or, for a disk of "
        "each node's own, CheckpointManager(..., root_scope='node') (docs/storage.md)",
    )


def _take_root(state: ManagerState) -> Exception | None:
    """Take the root's lock, finish an interrupted publish and remove what failed saves left;
    the error, if that failed. By each root's leader: rank 0, or each node's first rank."""
    root = state.root
    try:
        # From here on every change this rank makes in the root checks first that it still
        # holds it: the background writes, publishes, removals and downloads alike.
        state.storage.make_dirs(root)
        storage, state.lock = hold_root(state.storage, root)
        state.storage = storage
        recover_interrupted(storage, root)
        for leftover in leftover_dirs(storage, root):
            log.info("removing %s, left by a save that never committed", storage.describe(leftover))
            storage.remove(leftover)
        state.known = {s: None for s, _ in committed_steps(storage, root)}
    except Exception as exc:
        return exc
    return None


def _gather_placement(group: Group) -> Placement:
    """Every rank's node, as each tells it (a collective)."""
    return Placement.from_keys(group.all_gather(node_key()), group.rank)


def _holder(state: ManagerState) -> list[Any] | None:
    lock = state.lock
    return None if lock is None else [lock.holder.host, lock.holder.pid]


def _open_node_local(state: ManagerState, group: Group, not_shared: Exception) -> Exception | None:
    """Some ranks do not see rank 0's root (``not_shared`` says which): where they are on other
    nodes, each node's first rank takes the root as its node's own, and every rank checks that
    it sees its node's root (a collective). Sets ``state.placement``; returns the error every
    rank raises, or None."""
    placement = _gather_placement(group)
    root = state.root
    if not placement.node_local:  # one node, and its ranks see different directories
        return not_shared
    error = _take_root(state) if placement.leads and group.rank != 0 else None
    said = group.all_gather(
        (None if error is None else f"{type(error).__name__}: {error}", _holder(state))
    )
    failed = [f"rank {r}: {why}" for r, (why, _) in enumerate(said) if why is not None]
    if failed:
        return error or CheckpointWriteError(
            errno.EBUSY,
            f"{root}: the nodes' first ranks could not each take their node's root "
            f"({'; '.join(failed)}). With root_scope='node' every node needs a directory of its "
            "own: nodes that see one directory are not node-local",
        )
    leader = placement.leader_of(group.rank)
    held = said[leader][1]
    apart = _apart(group, held is not None and group.rank != leader and _blind(root, held))
    if apart:
        return CheckpointWriteError(
            errno.ENOTSUP,
            f"{root}: rank(s) {', '.join(apart)} do not see the lock their node's first rank "
            "holds in this directory: the ranks of one node must see one directory (give every "
            f"rank of a node the same path; {NODE_ENV} names a rank's node where the host name "
            "does not tell)",
        )
    state.placement = placement
    if group.rank == 0:  # (said loudly: with 'auto', a node missing a shared mount lands here)
        announce(
            log,
            f"{root} is not shared: each of the {len(placement.nodes)} nodes writes its ranks' "
            "files into a root of its own (ranks "
            + " | ".join(",".join(map(str, ranks)) for ranks in placement.nodes)
            + "); if it should be shared storage, a node is missing its mount: "
            "root_scope='shared' refuses that",
        )
    return None


def open_for_reading(state: ManagerState, group: Group, scope: RootScope) -> None:
    """A read-only manager takes no lock, so nothing tells it whether each node has a root of
    its own; where the ranks are on several nodes it reads node-local parts when told
    (``scope='node'``) or, with ``'auto'``, when the newest checkpoint rank 0 sees was saved
    on node-local roots (a collective)."""
    if group.world_size == 1 or scope == "shared":
        return
    placement = _gather_placement(group)
    if not placement.node_local:
        return
    node_local = scope == "node"
    if group.rank == 0 and not node_local:
        with contextlib.suppress(Exception):
            newest = committed_steps(state.storage, state.root)[:1]
            node_local = (
                bool(newest) and read_manifest(state.storage, newest[0][1]).nodes is not None
            )
    if group.broadcast(node_local):
        state.placement = placement


def open_for_writing(
    state: ManagerState, group: Group, policies: str, scope: RootScope = "shared"
) -> None:
    """Rank 0 takes the root's lock, finishes an interrupted publish and removes what failed saves
    left; every other rank checks it sees that root, or, where the root is a directory of each
    node's own (``scope`` allowing), each node's first rank does the same for its node's root.
    Then rank 0 announces the ``policies`` in force. Every rank fails if any cannot (no
    collective left waiting)."""
    root = state.root
    error = _take_root(state) if group.rank == 0 else None
    if group.world_size > 1:
        said = group.broadcast(
            {
                "error": None if error is None else f"{type(error).__name__}: {error}",
                "lock": _holder(state),
            }
        )
        if said["error"] is not None and error is None:
            error = CheckpointWriteError(
                errno.EBUSY, f"rank 0 cannot write to {root}: {said['error']}"
            )
        if said["error"] is None:
            held = said["lock"]  # (None: an object store, one namespace for all)
            apart = _apart(group, held is not None and group.rank != 0 and _blind(root, held))
            if apart:
                not_shared = _not_shared(root, apart, held[0])
                if scope != "shared" and error is None:
                    error = _open_node_local(state, group, not_shared)
                else:
                    error = error or not_shared
            elif scope == "node" and _gather_placement(group).node_local:
                error = error or CheckpointWriteError(
                    errno.ENOTSUP,
                    f"{root}: root_scope='node', but the ranks of every node see the one "
                    "directory rank 0 locked: it is shared, not a disk of each node's own. "
                    "Leave root_scope at 'auto' (or 'shared') for a shared root",
                )
    if error is not None:
        state.release_lock()
        raise error
    if group.rank == 0:
        announce(log, policies)
