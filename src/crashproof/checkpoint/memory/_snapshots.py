"""This rank's snapshots held in the memory of ``crashproof run``'s agent: :class:`MemorySnapshots`.

A snapshot in memory is this rank's part of a checkpoint, written by the disk save's own writer
into a slot (see :mod:`._slot_storage`) and committed by this rank alone: its shard, its index,
and a manifest listing those two, all checksummed as on disk. A restore verifies it with the
same code as a checkpoint on disk, and takes a step from memory only when every rank holds it.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath

from crashproof.checkpoint._group import Group, RankAlone
from crashproof.checkpoint.format import MANIFEST_NAME, Manifest, digest, parse_manifest
from crashproof.checkpoint.memory._slot import Slot
from crashproof.checkpoint.memory._slot_storage import MEMORY_ROOT, SlotStorage, slot_place
from crashproof.checkpoint.save import (
    CommitResult,
    SharedChecksums,
    Snapshot,
    new_tmp_name,
    persist,
)
from crashproof.errors import CorruptCheckpointError
from crashproof.link import MemoryClient

__all__ = ["MemorySnapshots"]

log = logging.getLogger("crashproof.checkpoint")


class MemorySnapshots:
    """The slots of one manager's root on this rank: one per staging buffer (and any more the
    agent held from an earlier manager, offered to a restore only)."""

    def __init__(
        self, client: MemoryClient, root: str, rank: int, world_size: int, slots: int
    ) -> None:
        self._client = client
        self.rank, self.world_size = rank, world_size
        key = digest(root.encode())[:16]  # two managers in one trainer (model, EMA) never mix
        self._key = key
        self.slots = [Slot(client, key, rank, world_size, i, buffers=slots) for i in range(slots)]
        reply, fds = client.request(
            {"op": "hello", "key": key, "rank": rank, "world_size": world_size}
        )
        # Every segment the agent holds for this rank is adopted, even beyond ``slots`` (a
        # manager restarted with fewer staging buffers): a restore may take any of them.
        for info, fd in zip(reply.get("slots", []), fds, strict=False):
            index = int(info["slot"])
            while len(self.slots) <= index:
                self.slots.append(
                    Slot(client, key, rank, world_size, len(self.slots), buffers=slots)
                )
            origin, verified = str(info.get("origin", "local")), info.get("verified") is True
            self.slots[index].adopt(
                fd, int(info["nbytes"]), info["step"], info["files"], origin, verified=verified
            )

    @classmethod
    def open(cls, root: str, rank: int, world_size: int, slots: int) -> MemorySnapshots | None:
        """This rank's snapshots under ``crashproof run`` (None when not supervised, or run with
        ``--no-memory``, or the agent cannot be reached: saves go on, to disk only)."""
        try:
            client = MemoryClient.from_environment()
        except OSError as exc:
            log.warning("memory snapshots are off: cannot reach crashproof run's agent (%s)", exc)
            return None
        if client is None:
            return None
        try:
            return cls(client, root, rank, world_size, slots)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            client.close()
            log.warning("memory snapshots are off: crashproof run's agent did not answer (%s)", exc)
            return None

    def commit(
        self, index: int, snapshot: Snapshot, data_at: int, share: SharedChecksums | None = None
    ) -> CommitResult:
        """Write ``snapshot``, staged in slot ``index``, as this rank's part, and commit it:
        checksummed and checked for non-finite values as on disk (the writer thread's work;
        replicated tensors are not deduplicated and deltas are not taken: a slot holds its
        rank's whole part). ``share``: where to hand the checksums to the disk save of the
        same staged bytes, once hashed (before the agent is told of the commit)."""
        mine = dataclasses.replace(
            snapshot, owners={}, delta=None, checksums_from=None, checksums_to=share
        )
        storage = SlotStorage(self.slots[index], data_at)
        group = RankAlone(self.rank, self.world_size)
        return persist(storage, MEMORY_ROOT, mine, group, new_tmp_name(snapshot.step))

    def pinned(self) -> set[int]:
        """The slots to leave alone: they hold the newest snapshot every other node covers
        (copies or parity), the step a lost node would be rebuilt at, until a newer one is; or
        the agent is sending them to its peers (a memory snapshot skips rather than wait)."""
        try:
            reply, _ = self._client.request(
                {"op": "pinned", "key": self._key, "rank": self.rank, "world_size": self.world_size}
            )
        except (OSError, ValueError):
            return set()  # (the agent is gone: the next save says so)
        step, sending = reply.get("step"), set(reply.get("sending", []))
        return {
            s.index
            for s in self.slots
            if (step is not None and s.step == step) or s.index in sending
        }

    def steps(self) -> dict[int, int]:
        """The committed steps this rank holds, and the slot of each."""
        return {s.step: s.index for s in self.slots if s.step is not None}

    def common_steps(self, group: Group) -> set[int]:
        """The steps every rank holds (a collective)."""
        held = group.all_gather(sorted(self.steps()))
        return set.intersection(*(set(steps) for steps in held)) if held else set()

    def storage(self, step: int) -> tuple[SlotStorage, str]:
        """The storage and directory of the snapshot of ``step``."""
        slot = self.slots[self.steps()[step]]
        return SlotStorage(slot), posixpath.join(MEMORY_ROOT, slot.contents["path"])

    def verified(self, step: int) -> bool:
        """Whether the agent checked the snapshot of ``step`` after its writers stopped (see
        :attr:`Slot.verified`): a restore copies it without hashing it again."""
        return self.slots[self.steps()[step]].verified

    def origin(self, step: int) -> str:
        """``local``, or ``peer:<node>``: where the agent got the snapshot of ``step``."""
        return self.slots[self.steps()[step]].origin

    def manifest(self, step: int) -> Manifest:
        """The manifest of this rank's part of ``step`` (partial: its own files only)."""
        return slot_manifest(self.slots[self.steps()[step]])

    def drop(self, step: int | None = None, *, newer_than: int | None = None) -> None:
        """Stop offering the snapshot of ``step`` (found corrupt), or every one newer than
        ``newer_than`` (a restore or rollback went back past them: resuming into them later
        would bring back what was abandoned)."""
        for slot in self.slots:
            if slot.step is None:
                continue
            if slot.step == step or (newer_than is not None and slot.step > newer_than):
                slot.overwriting()

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self._client.close()


def slot_manifest(slot: Slot) -> Manifest:
    """The manifest of the part of its rank the slot holds (partial: its own files only)."""
    assert slot.step is not None
    where = (
        f"{slot_place(slot)}: {posixpath.join(MEMORY_ROOT, slot.contents['path'], MANIFEST_NAME)}"
    )
    data = slot.files().get(MANIFEST_NAME)  # (held as bytes)
    if data is None:
        raise CorruptCheckpointError(f"{where}: missing; the snapshot was never committed")
    manifest = parse_manifest(data, where, partial=True)
    if manifest.step != slot.step or manifest.world_size != slot.world_size:
        raise CorruptCheckpointError(f"{where}: not rank {slot.rank}'s part of step {slot.step}")
    return manifest
