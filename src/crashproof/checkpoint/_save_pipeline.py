"""A manager's saves, from the training loop to the commit: :class:`SavePipeline`.

The training thread takes the snapshot (:func:`~crashproof.checkpoint.save._writer.take_snapshot`) and
hands it to one background writer thread, which persists it
(:func:`~crashproof.checkpoint.save._writer.persist`) and then runs retention; a synchronous save is
the same save, waited on. The pipeline owns the saves in flight and their staging buffers, collects
their outcomes (counted in :class:`~crashproof.checkpoint.save._stats.SaveStats`, raised at the next
call), and handles a full disk: what retention would remove after the save goes early, and the save
is tried once more.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
import uuid
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from crashproof.checkpoint._agreement import RankAgreement
from crashproof.checkpoint._group import Group
from crashproof.checkpoint._manager_state import ManagerState
from crashproof.checkpoint._options import ManagerOptions
from crashproof.checkpoint._retention_runner import RetentionRunner
from crashproof.checkpoint._tier_coordination import TierCoordinator
from crashproof.checkpoint.format import MAX_STEP, checked_metadata, digest
from crashproof.checkpoint.memory import MemorySnapshots
from crashproof.checkpoint.save import (
    ArenaUnavailable,
    CommitResult,
    SaveStats,
    SharedChecksums,
    Snapshot,
    StagingArea,
    assign_owners,
    keep_as_base,
    new_tmp_name,
    persist,
    take_snapshot,
)
from crashproof.errors import CheckpointWriteError, ConfigError, NonFiniteStateError
from crashproof.link import Notice, SupervisedReporter, Unsupervised
from crashproof.policy import SaveContext
from crashproof.state import TrainState

__all__ = ["SavePipeline", "check_step"]

log = logging.getLogger("crashproof.checkpoint")

_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A full disk, or a full quota (the usual "disk full" of a shared cluster file system)."""

Replicated = list[tuple[str, int, str, tuple[int, ...]]]
"""A rank's replicated tensors (DDP's model and optimizer): name, bytes, dtype, shape."""


def check_step(step: int) -> None:
    if not 0 <= step <= MAX_STEP:  # a manifest of a larger step would be unreadable
        raise ConfigError(f"step {step}: checkpoint steps are integers from 0 to 2**62")


class SavePipeline:
    """The saves of one manager: started on the training thread, written on the writer thread.

    Two groups: the training thread's collectives (``group``: decisions) and the writer's
    (``persist_group``: commit) must never interleave on one group, or ranks would pair them
    wrongly."""

    def __init__(
        self,
        shared: ManagerState,
        options: ManagerOptions,
        *,
        group: Group,
        persist_group: Group,
        stats: SaveStats,
        reporter: SupervisedReporter | Unsupervised,
        retention: RetentionRunner,
        tiers: TierCoordinator,
        memory: MemorySnapshots | None = None,
    ) -> None:
        self._shared = shared
        self._options = options
        self._group = group
        self._persist_group = persist_group
        self._stats = stats
        self._reporter = reporter
        self._retention = retention
        self._tiers = tiers
        n = options.staging_buffers
        # Under crashproof run the staging buffers live in the agent's memory (one slot each):
        # every asynchronous save is a memory snapshot too, at no extra copy.
        slots = memory.slots if memory is not None else [None] * n
        self._stagings = [StagingArea(slots[i]) for i in range(n)] if options.async_save else []
        self._memory = memory
        # Memory snapshots stage into the save's buffers; a synchronous manager (which writes
        # from the live tensors) has one area for them alone.
        self._memory_stagings = (
            [] if memory is None else self._stagings or [StagingArea(memory.slots[0])]
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="crashproof-persist")
        # One thread of its own, so a slow disk write never delays a memory commit.
        self._memory_executor = ThreadPoolExecutor(1, thread_name_prefix="crashproof-memory")
        # Saves not yet collected, oldest first, with the staging area each one reads from.
        self._inflight: deque[tuple[Future[CommitResult], int]] = deque()
        # Memory commits not yet collected: the future, its slot, its step, and whether the
        # snapshot is memory's alone (else a disk save of it reports its failures).
        self._memory_inflight: deque[tuple[Future[CommitResult], int, int, bool]] = deque()
        self._warned_sharded = False
        self.last_memory_step: int | None = None
        self.last_memory_s: float | None = None
        self._tmp_token: str | None = None  # in every save's temporary name, the same on all ranks
        self.last_commit: CommitResult | None = None
        self._sole_copy: int | None = None
        """A step restored from the agent's memory that no disk or tier holds: until a disk save
        commits, the staging slot holding it is written through, never overwritten."""

    def unfinished(self) -> str:
        """What became of the saves not yet collected (for a manager never closed): " (...)"."""
        outcomes = []
        for future, _ in self._inflight:
            if not future.done():
                outcomes.append("a save was still being written")
            elif (error := future.exception()) is not None:
                outcomes.append(f"the last save failed: {error}")
        return f" ({'; '.join(outcomes)})" if outcomes else ""

    def save_context(self, step: int) -> SaveContext:
        """What a save policy decides from, after ``step``."""
        return SaveContext(
            step,
            time.monotonic(),
            self._shared.last_save_step,
            self._shared.last_save_s,
            last_blocking_s=self._stats.last_blocking_s if self._stats.saves_started else None,
            last_persist_s=self._stats.last_persist_s if self._stats.saves_committed else None,
        )

    # -- the training thread -----------------------------------------------------------------

    def save(self, step: int, state: TrainState, metadata: dict[str, Any] | None) -> bool:
        """Snapshot ``state`` and hand it to the writer; returns whether a save started."""
        check_step(step)
        metadata = checked_metadata(metadata, step)  # refused here, naming the key
        self._shared.check_lock()  # still ours: not deleted, replaced or moved meanwhile
        self.raise_pending()
        started = time.perf_counter()
        self._group.arrive(f"the save of step {step}")
        free = self._free_staging(step, started)
        if free is None:
            return False
        staging = self._stagings[free] if self._stagings else None
        # Copying into the slot that holds the only copy of the state training resumed from
        # would leave, until this save commits, nothing newer than the disk's newest checkpoint
        # for a kill to fall back to: this one save writes from the live tensors and waits.
        write_through = staging is not None and self._holds_sole_copy(free)
        if write_through:
            staging = None
        self._wait_memory(free)
        try:
            snapshot = self._snapshot(step, state, staging, metadata)
        except ArenaUnavailable as exc:  # the disk checkpoint goes on, from buffers of its own
            self._memory_off(exc)
            staging = self._stagings[free]
            snapshot = self._snapshot(step, state, staging, metadata)
        if snapshot.sharded and self._shared.placement.node_local:
            raise ConfigError(
                f"checkpoint of step {step}: the model is sharded (DTensor, FSDP2) and "
                f"{self._shared.root} is node-local: restoring sharded state reads pieces from "
                "every rank's files, which no node holds. Put the root on shared storage "
                "(root_scope='shared')"
            )
        delta = self._options.delta
        # Every rank counts the same saves, so all agree on which may be deltas. Sharded state
        # is always saved whole: a delta's base must be the same rank's piece, which a restore
        # on another world size would not have.
        may_be_delta = (
            delta is not None
            and self._stats.saves_started % delta.full_every != 0
            and not snapshot.sharded
        )
        if delta is not None and snapshot.sharded and self._stats.saves_started == 0:
            log.warning(
                "CheckpointManager(delta=...): the model is sharded (DTensor, FSDP2), and sharded "
                "state is always saved in full, so every checkpoint of %s is a full one",
                self._shared.root,
            )
        replicated: Replicated | None = None
        if self._options.dedup_replicated and self._group.world_size > 1 and delta is None:
            replicated = _replicated_tensors(snapshot.tensors, state)
        if self._tmp_token is None:  # agreed once; each save's name adds its number
            self._tmp_token = str(self._group.broadcast(uuid.uuid4().hex[:8]))
        tmp_name = new_tmp_name(step, f"{self._tmp_token}-{self._stats.saves_started}")
        blocking_s = time.perf_counter() - started
        share = None
        if staging is not None and staging.arena is not None and not snapshot.sharded:
            # The memory snapshot of these same staged bytes hashes them (in place, it has
            # nothing else to do) while the disk save's writer writes them, and hands it the
            # checksums.
            idle = all(future.done() for future, _, _, _ in self._memory_inflight)
            share = snapshot.checksums_from = SharedChecksums(begins_at_once=idle)
        future = self._executor.submit(
            self._persist, snapshot, tmp_name, blocking_s, may_be_delta, replicated
        )
        self._inflight.append((future, free))
        if staging is not None and staging.arena is not None:
            self._commit_to_memory(snapshot, free, staging, alone=False, share=share)
        self._stats.saves_started += 1
        self._shared.last_save_step, self._shared.last_save_s = step, time.monotonic()
        if not self._options.async_save or write_through:
            self.wait_commit()
        if write_through and self.last_commit is not None and self.last_commit.step >= step:
            self._sole_copy = None
        self._stats.last_blocking_s = time.perf_counter() - started
        return True

    def protect(self, step: int | None) -> None:
        """After a restore: ``step`` when it came from the agent's memory alone (see
        ``_sole_copy``), else None."""
        self._sole_copy = step

    def _holds_sole_copy(self, slot: int) -> bool:
        return (
            self._sole_copy is not None
            and self._memory is not None
            and slot < len(self._memory.slots)
            and self._memory.slots[slot].step == self._sole_copy
        )

    def _snapshot(
        self,
        step: int,
        state: TrainState,
        staging: StagingArea | None,
        metadata: dict[str, Any] | None,
    ) -> Snapshot:
        """The state captured and copied into ``staging`` (the only pause training sees)."""
        tree = state.capture()
        return take_snapshot(
            step,
            tree,
            staging=staging,
            metadata=metadata,
            must_be_finite=(
                state.must_be_finite(tree, step=step) if self._options.check_finite else frozenset()
            ),
        )

    def save_before_stopping(
        self,
        notice: Notice,
        step: int,
        state: TrainState,
        metadata: dict[str, Any] | None,
        agreement: RankAgreement,
    ) -> bool:
        """The emergency checkpoint of ``step``, committed, if the ranks agree to save it;
        returns whether it was saved. A save in flight is finished first (never abandoned
        half-written)."""
        started = time.monotonic()
        with self._reporter.phase("save"):
            self.wait()
        saved = agreement.saves_before_stopping(
            notice, step, started, self._stats, self.last_commit, self._shared.newest_valid
        )
        if saved:
            with self._reporter.phase("save"):
                self.save(step, state, metadata)
                self.wait_commit()
            log.warning(
                "stop requested (%s): emergency checkpoint of step %d committed in %.2f s",
                notice.source,
                step,
                time.monotonic() - started,
            )
        return saved

    def _free_staging(self, step: int, started: float) -> int | None:
        """The staging slot the save of ``step`` may use, once a save in flight has freed one;
        None when the save is skipped instead (``on_busy="skip"``: on every rank, or none)."""
        capacity = max(1, len(self._stagings))
        busy = sum(not future.done() for future, _ in self._inflight) >= capacity
        skip = self._options.on_busy == "skip"
        if self._group.world_size > 1 and skip:
            busy = any(self._group.all_gather(busy))
        if busy and skip:
            self._stats.skipped_busy += 1
            log.warning(
                "skipping the checkpoint of step %d: the previous save is still being written (on_busy='skip')",
                step,
            )
            return None
        while len(self._inflight) >= capacity:  # wait for the oldest save, freeing its buffers
            self._collect(self._inflight.popleft()[0])
        if busy:
            self._stats.waited_busy += 1
            self._stats.waited_busy_s += time.perf_counter() - started
            log.info(
                "the checkpoint of step %d waited %.2f s for the previous save",
                step,
                time.perf_counter() - started,
            )
        return self._oldest(set(range(capacity)) - {slot for _, slot in self._inflight})

    def _oldest(self, free: set[int], pinned: set[int] | None = None) -> int:
        """Of the free staging slots, the one whose memory snapshot is oldest (or none): the
        newest snapshot in memory stays while the next one is copied. Slots the agent pins come
        last (``pinned``: asked already, else asked here)."""
        if self._memory is None:
            return min(free)
        slots = self._memory.slots
        if pinned is None:
            pinned = self._memory.pinned() if len(free) > 1 else set()
        # A slot whose memory snapshot is still being committed comes next to last: taking it
        # would wait for that commit (and for the agent's answer) on the training thread.
        committing = {slot for future, slot, _, _ in self._memory_inflight if not future.done()}
        return min(
            free,
            key=lambda i: (
                i in pinned,
                i in committing,
                -1 if slots[i].step is None else slots[i].step,
                i,
            ),
        )

    # -- memory snapshots (crashproof run's agent holds them) ---------------------------------

    def snapshot_to_memory(
        self, step: int, state: TrainState, metadata: dict[str, Any] | None
    ) -> bool:
        """Snapshot ``state`` into the agent's memory only; returns whether it did. Never waits:
        with every staging slot still being written, the snapshot is skipped (and counted).

        Every rank calls this at the same steps (``memory_every`` counts steps) and the ranks
        agree, in one small all-gather, to take it or skip it together: a restore takes a step
        from memory only when every rank holds it, so ranks that skipped different steps could
        hold none in common."""
        started = time.perf_counter()
        self.last_memory_step, self.last_memory_s = step, time.monotonic()  # (taken or not)
        self.raise_pending()
        free: set[int] = set()
        pinned: set[int] = set()
        if self._memory is not None and self._memory_stagings:
            busy = {slot for future, slot in self._inflight if not future.done()}
            busy |= {slot for future, slot, _, _ in self._memory_inflight if not future.done()}
            free = set(range(len(self._memory_stagings))) - busy
            held = {
                i
                for i in range(len(self._memory_stagings))
                if self._memory.slots[i].step is not None
            }
            if len(self._memory_stagings) > 1 and len(held) == 1:
                free -= held  # the one snapshot held stays until another is committed beside it
            if len(self._memory_stagings) > 1 and free:
                pinned = self._memory.pinned()
                free -= pinned  # (the step the other nodes cover stays too)
        can = bool(free)
        if self._group.world_size > 1:
            can = all(self._group.all_gather(can))
        if not can:
            if self._memory is not None and self._memory_stagings:
                self._stats.memory_skipped_busy += 1
                log.info(
                    "memory snapshot of step %d skipped: the staging buffers are busy (or hold "
                    "the snapshot the other nodes cover, until they cover a newer one)",
                    step,
                )
            return False
        assert self._memory is not None
        slot = self._oldest(free, pinned)  # (pinned slots are not free: no need to ask again)
        self._wait_memory(slot)  # (done already: collected)
        staging = self._memory_stagings[slot]
        try:
            snapshot = self._snapshot(step, state, staging, metadata)
        except ArenaUnavailable as exc:
            self._memory_off(exc)
            return False
        self._commit_to_memory(snapshot, slot, staging, alone=True)
        self._stats.memory_last_blocking_s = time.perf_counter() - started
        return True

    def _memory_off(self, refusal: ArenaUnavailable) -> None:
        """The agent refused the memory (or is gone): no more memory snapshots for this
        manager; its saves stage into buffers of their own, as without ``crashproof run``."""
        log.error(
            "%s; memory snapshots are off for %s from now on (checkpoints go on to disk)",
            refusal,
            self._shared.root,
        )
        self._stats.memory_failures += 1
        for staging in {*self._stagings, *self._memory_stagings}:
            staging.release()
        self._stagings = [StagingArea() for _ in self._stagings]
        self._memory_stagings = []

    def _commit_to_memory(
        self,
        snapshot: Snapshot,
        slot: int,
        staging: StagingArea,
        *,
        alone: bool,
        share: SharedChecksums | None = None,
    ) -> None:
        assert self._memory is not None
        if snapshot.sharded:  # a rank's piece alone does not restore (every rank's index does)
            if not self._warned_sharded:
                self._warned_sharded = True
                log.warning(
                    "memory snapshots do not cover sharded state (DTensor, FSDP2) yet: %s "
                    "restores from its checkpoints on disk",
                    self._shared.root,
                )
            return
        future = self._memory_executor.submit(
            self._memory_commit, self._memory, slot, snapshot, staging.data_at, share
        )
        if share is not None:  # a commit that failed before it began to hash hands over nothing
            future.add_done_callback(lambda _: share.give({}))
        self._memory_inflight.append((future, slot, snapshot.step, alone))
        self.last_memory_step, self.last_memory_s = snapshot.step, time.monotonic()

    def _memory_commit(
        self,
        memory: MemorySnapshots,
        slot: int,
        snapshot: Snapshot,
        data_at: int,
        share: SharedChecksums | None,
    ) -> CommitResult:
        started = time.perf_counter()
        result = memory.commit(slot, snapshot, data_at, share)
        self._stats.memory_last_commit_s = time.perf_counter() - started
        return result

    def _wait_memory(self, slot: int | None = None) -> None:
        """Collect the memory commits (of ``slot`` and those before them, or all)."""
        while self._memory_inflight and (
            slot is None or any(s == slot for _, s, _, _ in self._memory_inflight)
        ):
            self._collect_memory(*self._memory_inflight.popleft())

    def _collect_memory(
        self, future: Future[CommitResult], slot: int, step: int, alone: bool
    ) -> None:
        """The outcome of a memory commit: non-finite state in a memory-only snapshot is raised
        as a disk save's would be (a disk save's own snapshot: the save reports it); any other
        failure is logged and counted (the disk checkpoints do not depend on it)."""
        try:
            future.result()
        except NonFiniteStateError:
            self._stats.memory_failures += 1
            if alone:
                raise
            return
        except Exception as exc:
            self._stats.memory_failures += 1
            log.error(
                "the memory snapshot of step %d was not committed (%s: %s); restores use the "
                "disk checkpoints until the next one",
                step,
                type(exc).__name__,
                exc,
            )
            return
        self._stats.memory_snapshots += 1

    def wait(self) -> CommitResult | None:
        """Collect every save in flight (and memory snapshot), then let retention after it
        finish."""
        self._wait_memory()
        result = self.wait_commit()
        if not self._shared.closed:
            self._executor.submit(lambda: None).result()  # the queue is drained: retention done
        return result

    def wait_commit(self) -> CommitResult | None:
        """Collect every save in flight, oldest first; returns the newest commit."""
        result = None
        while self._inflight:
            result = self._collect(self._inflight.popleft()[0]) or result
        return result

    def _collect(self, future: Future[CommitResult]) -> CommitResult | None:
        """The outcome of one save: counted, logged, and raised unless the disk is merely full."""
        try:
            try:
                result = future.result()
            except (CheckpointWriteError, NonFiniteStateError):
                raise
            except Exception as exc:
                raise CheckpointWriteError(
                    f"saving a checkpoint in {self._shared.root} failed: {type(exc).__name__}: {exc}"
                ) from exc
        except NonFiniteStateError:
            self._stats.failures += 1
            raise
        except CheckpointWriteError as exc:
            self._stats.failures += 1
            if exc.errno in _DISK_FULL:
                self._stats.disk_full += 1
                if self._options.on_disk_full == "continue":
                    log.error(
                        "%s; training goes on (on_disk_full='continue'): free space on the disk",
                        exc,
                    )
                    return None
            raise
        self.last_commit = result
        self._stats.saves_committed += 1
        self._stats.bytes_written += result.bytes_written
        self._stats.last_persist_s = result.persist_s
        return result

    def raise_pending(self) -> None:
        """Surface a background failure on the next call into the manager."""
        while self._inflight and self._inflight[0][0].done():
            self._collect(self._inflight.popleft()[0])
        while self._memory_inflight and self._memory_inflight[0][0].done():
            self._collect_memory(*self._memory_inflight.popleft())
        message, self._shared.second_writer = self._shared.second_writer, None
        if message is not None:
            raise CheckpointWriteError(errno.EBUSY, message)

    def queue_retention(self) -> None:
        """A tier took a checkpoint: local retention may now remove what it spared for it."""
        newest = self._shared.newest_valid
        if newest is None:
            return
        with contextlib.suppress(RuntimeError):  # the writer thread is shut down: close() runs it
            self._executor.submit(self._retention.apply, keep_always=newest)

    def stop(self) -> None:
        """Let the writer threads finish what they were given, and end them."""
        self._executor.shutdown(wait=True)
        self._memory_executor.shutdown(wait=True)
        for staging in {*self._stagings, *self._memory_stagings}:
            if staging.arena is not None:
                staging.release()  # (the segments' views: the mappings can go now)
        if self._memory is not None:
            self._memory.close()

    # -- the writer thread -------------------------------------------------------------------

    def _persist(
        self,
        snapshot: Snapshot,
        tmp_name: str,
        blocking_s: float,
        may_be_delta: bool,
        replicated: Replicated | None,
    ) -> CommitResult:
        shared, delta = self._shared, self._options.delta
        if replicated is not None:  # the same on every rank: they all take part in agreeing
            snapshot.owners = self._replicated_owners(replicated)
        if may_be_delta and delta is not None and shared.delta_base is not None:
            snapshot.delta = (delta, shared.delta_base)
        try:
            try:
                result = persist(
                    shared.storage,
                    shared.root,
                    snapshot,
                    self._persist_group,
                    tmp_name,
                    shared.placement,
                )
            except CheckpointWriteError as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                # Every rank has this same outcome (rank 0 broadcast it): all retry, once.
                self._make_room(snapshot, exc)
                result = persist(
                    shared.storage,
                    shared.root,
                    snapshot,
                    self._persist_group,
                    f"{tmp_name}-retry",
                    shared.placement,
                )
        except BaseException:
            if snapshot.delta is None:
                shared.delta_base = None  # the full save failed: the next save is a full one
            raise
        shared.known.pop(snapshot.step, None)  # ours: its commit time is learnt at retention
        shared.corrupt.discard(snapshot.step)  # a good copy replaced the one found corrupt
        if delta is not None and result.kind == "full" and not snapshot.sharded:
            # (Sharded state is never delta-encoded: a copy kept as a base would only cost memory.)
            shared.delta_base = keep_as_base(snapshot, result.checksums, shared.delta_base)
        self._reporter.committed(
            snapshot.step,
            result.path,
            blocking_s,
            result.persist_s,
            result.checkpoint_bytes
            if result.checkpoint_bytes is not None
            else result.bytes_written,
        )
        shared.newest_valid = max(shared.newest_valid or 0, snapshot.step)
        log.info(
            "checkpoint step %d committed: %.1f MB in %.2f s",
            snapshot.step,
            result.bytes_written / 1e6,
            result.persist_s,
        )
        self._tiers.notify()
        if shared.placement.leads:  # (rank 0; on node-local roots each node's first rank)
            # Queued behind this save on the same thread, so a synchronous save returns as soon as
            # it is committed, and the next save starts only after the clean-up.
            self._executor.submit(self._retention.apply, keep_always=snapshot.step)
        return result

    def _replicated_owners(self, named: Replicated) -> dict[str, int]:
        """Which rank writes each replicated tensor: every rank must list the same names, shapes
        and dtypes, agreed in one small all-gather, or nothing is deduplicated. Whether the values
        agree is checked by the writer, by checksum. Runs on the writer thread, over its own
        group: an all-gather waits for the slowest rank, which the training loop must not."""
        signature = digest(json.dumps(named).encode())
        agreed = len(set(self._persist_group.all_gather(signature))) == 1
        if not named or not agreed:
            return {}
        # On node-local roots a rank reads only its node's root: each node's ranks write its
        # copy of the replicated tensors among themselves.
        node = self._shared.placement.my_node
        owners = assign_owners([(n, size) for n, size, _, _ in named], len(node))
        return {name: node[owner] for name, owner in owners.items()}

    def _make_room(self, snapshot: Snapshot, failure: CheckpointWriteError) -> None:
        """The disk is full: remove now what retention would remove once ``snapshot`` commits
        (never the newest valid checkpoint, nor a base a kept delta needs), on rank 0, while the
        other ranks wait; the caller then retries the save once. On node-local roots, each
        node's first rank in its node's root (rank 0 tells what it removed in its own)."""
        removed: list[int] = []
        if self._shared.placement.leads:
            try:
                removed = self._retention.remove_early(snapshot)
            except Exception as exc:
                log.warning("disk full: making room in %s failed: %s", self._shared.root, exc)
        if self._group.world_size > 1:
            removed = self._persist_group.broadcast(removed)
        self._stats.disk_full_retries += 1
        self._stats.removed_for_space += len(removed)
        log.warning(
            "disk full saving checkpoint step %d (%s); removed %s now, as retention would after "
            "this commit, and retrying the save once",
            snapshot.step,
            failure,
            f"checkpoint steps {sorted(removed)}" if removed else "nothing (retention keeps all)",
        )


def warn_if_never_closed(ref: weakref.ref[SavePipeline], owner_pid: int) -> None:
    """At interpreter exit, say so loudly when a writing manager was never closed: its last save
    may not have committed (a script that ends without ``close()``, or destroys the process
    group before it, loses the save in flight), and nothing else would tell. Only in the process
    that created it: a forked child (a DataLoader worker, a helper) inherits the manager but is
    not its owner, and closing it there is not the child's job."""
    pipeline = ref()
    if os.getpid() != owner_pid:
        return
    if pipeline is not None and not pipeline._shared.closed:
        log.error(
            "CheckpointManager(%s) was not closed before the process ended%s: call ckpt.close() "
            "at the end of training (before torch.distributed.destroy_process_group()), or use "
            "it as a context manager, so that the last checkpoint is committed",
            pipeline._shared.root,
            pipeline.unfinished(),
        )


def _replicated_tensors(tensors: list[tuple[str, Any]], state: TrainState) -> Replicated:
    """This rank's replicated tensors (DDP's model and optimizer): name, bytes, dtype, shape."""
    replicated = state.replicated_names(n for n, _ in tensors)
    return [
        (n, t.numel() * t.element_size(), str(t.dtype), tuple(t.shape))
        for n, t in tensors
        if n in replicated
    ]
