"""``CheckpointManager``: the front door for saving and restoring a training run.

It owns one checkpoint root and decides *when* (the save policy), *what survives* (the retention
policy) and *which checkpoint to trust* on restore (the newest one that verifies). The bytes go
through the pipeline in :mod:`crashproof.checkpoint._writer`, on one background thread: a
synchronous save is the same save, waited on.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import errno
import functools
import json
import logging
import os
import posixpath
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from types import TracebackType
from typing import Any, Literal, NoReturn, TypeVar, cast

from crashproof.checkpoint._catalog import (
    CheckpointInfo,
    checkpoint_facts,
    committed_steps,
    describe_checkpoint,
    leftover_dirs,
    newest_verified,
    prune_plan,
    recover_interrupted,
    retention_plan,
)
from crashproof.checkpoint._delta import Delta, DeltaBase, keep_as_base
from crashproof.checkpoint._format import MAX_STEP, checkpoint_dir_name
from crashproof.checkpoint._group import Group, default_group
from crashproof.checkpoint._hashing import digest
from crashproof.checkpoint._hosted import agent_tiers
from crashproof.checkpoint._lock import RootLock, lock_root
from crashproof.checkpoint._metadata import checked_metadata
from crashproof.checkpoint._reader import RankRead, checkpoint_not_found, read_manifest
from crashproof.checkpoint._replication import (
    LocalCheckpoints,
    Replica,
    Tier,
    TierReplicator,
    TierStatus,
    open_tiers,
)
from crashproof.checkpoint._reshard import source_rank
from crashproof.checkpoint._rollbacks import abandoned, read_marks, record_rollback
from crashproof.checkpoint._sharded import CrashproofReader, load_sharded, restore_targets
from crashproof.checkpoint._staging import StagingArea
from crashproof.checkpoint._stats import SaveStats
from crashproof.checkpoint._transfer import download_checkpoint
from crashproof.checkpoint._writer import (
    CommitResult,
    Snapshot,
    assign_owners,
    exactness_environment,
    named_tensors,
    new_tmp_name,
    persist,
    take_snapshot,
)
from crashproof.errors import (
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    NonFiniteStateError,
    StateMismatchError,
)
from crashproof.link import Notice, PreemptedExit, PreemptionListener, trainer_reporter
from crashproof.policy import (
    CheckpointFacts,
    EverySteps,
    KeepAll,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
)
from crashproof.state import TrainState
from crashproof.storage import LocalStorage, Storage, storage_for
from crashproof.telemetry import emit

__all__ = ["CheckpointManager"]

log = logging.getLogger("crashproof.checkpoint")

_T = TypeVar("_T")
PREEMPTION_DURABLE_WAIT_S = 10.0
_KEEPALIVE_S = 5.0
_RELISTS = 3
"""How many times a restore lists the checkpoints again after one vanished while it was read
(a writer's retention removed it after committing a newer one)."""
AGREE_EVERY_S = 0.25
"""How often the ranks agree on stopping (a preemption notice) and on time-based saves."""
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A full disk, or a full quota (the usual "disk full" of a shared cluster file system)."""
_AGREE_MAX_CALLS = 10_000
"""While rank 0 works alone (a download from a tier), the others hear from it this often."""


def _created_unix(storage: Storage, ckpt_dir: str) -> float | None:
    try:
        return read_manifest(storage, ckpt_dir).created_unix
    except (CorruptCheckpointError, OSError):
        return None


def _unclosed_at_exit(ref: weakref.ref[CheckpointManager]) -> None:
    """At interpreter exit, say so loudly when a writing manager was never closed: its last save
    may not have committed (a script that ends without ``close()``, or destroys the process
    group before it, loses the save in flight), and nothing else would tell."""
    manager = ref()
    if manager is None or manager._closed:
        return
    outcomes = []
    for future, _ in manager._inflight:
        if not future.done():
            outcomes.append("a save was still being written")
        elif (error := future.exception()) is not None:
            outcomes.append(f"the last save failed: {error}")
    log.error(
        "CheckpointManager(%s) was not closed before the process ended%s: call ckpt.close() at "
        "the end of training (before torch.distributed.destroy_process_group()), or use it as a "
        "context manager, so that the last checkpoint is committed",
        manager.root,
        f" ({'; '.join(outcomes)})" if outcomes else "",
    )


def _check_step(step: int) -> None:
    if not 0 <= step <= MAX_STEP:  # a manifest of a larger step would be unreadable
        raise ConfigError(f"step {step}: checkpoint steps are integers from 0 to 2**62")


def _still_there(storage: Storage, ckpt_dir: str) -> bool:
    """Whether the checkpoint directory ``ckpt_dir`` is still in its root (a directory left
    without its manifest is there: a corrupt checkpoint, not a removed one)."""
    parent, name = posixpath.split(ckpt_dir.rstrip("/"))
    try:
        return name in storage.list(parent)
    except Exception:  # cannot tell: list again, a bounded number of times
        return False


class CheckpointManager:
    """Save, retain and restore the checkpoints of one run under ``root``.

    Args:
        root: the directory holding one ``step_<N>`` directory per checkpoint.
        every: when :meth:`maybe_save` saves; default ``EverySteps(1000)``.
        keep: which checkpoints retention keeps; default all. The newest valid checkpoint and
            one being written are always kept.
        async_save: return from :meth:`save` once the state is copied into host buffers (reused
            across saves) and write it in the background; with False, :meth:`save` writes straight
            from the live tensors and returns once the checkpoint is committed.
        on_busy: when a save is due while the previous one is still being written: ``"wait"``
            for it, or ``"skip"`` the new one. Either is logged and counted in :attr:`stats`.
        on_disk_full: when a save fails because the disk is full: ``"continue"`` training (the
            failure is logged and counted; earlier checkpoints stay) or ``"raise"``.
        staging_buffers: 1 (host staging costs one copy of the state) or 2 (double buffering:
            the next save can be snapshotted while the previous one is still being written, at the
            cost of a second copy; two saves are then in flight, written one after the other).
        storage: the storage backend; default chosen from ``root``.
        timeout_s: how long ranks wait for each other during a save before giving up.
        delta: save deltas between full checkpoints (:class:`~crashproof.Delta`): only how each
            tensor changed since the newest full one, losslessly. Costs one more host copy of the
            state (the base). None: every checkpoint is full.
        check_finite: refuse to commit a checkpoint whose parameters or optimizer state hold NaN
            or inf (checked by the background writer: it costs training nothing); the refusal is
            raised as :class:`NonFiniteStateError` at the next call, like any failed save.
        dedup_replicated: in a DDP job, write the replicated model and optimizer state once,
            spread over the ranks (each writes about 1/W of it), instead of once per rank;
            every rank's copy is still checksummed and a rank whose copy differs fails the save.
            Not with ``delta``.
        remote: durable tiers behind the local root: a URI (``"s3://bucket/run"``), a
            :class:`~crashproof.Tier` (its own retention, options, backlog), or a list of them
            (e.g. two regions). Each committed checkpoint is copied to every tier in the
            background, verified there, and :meth:`restore` takes the newest valid checkpoint of
            any tier. Rank 0 copies (the root must be one directory all ranks write into).
        replicate: copy checkpoints to the tiers (rank 0, or the agent). False for a process that
            only restores from them (an evaluation job): it then never writes to a tier.
        remote_timeout_s: how long :meth:`close` waits for the newest checkpoint to be durable in
            every tier before it gives up, logging what is still pending (it stays on the local
            disk and the next manager with the same tiers uploads it).
        handle_signals: treat SIGTERM, SIGUSR1 (SLURM's ``--signal``) and a first SIGINT as a
            request to stop: at the next :meth:`maybe_save` all ranks agree, save that step and
            raise :class:`PreemptedExit` (exit code 75, "resumable"). Handlers installed before
            are still called. Needs the main thread; restored by :meth:`close`.
        read_only: only restore and look (an evaluation job, a tool): the manager takes no lock,
            never saves, prunes or rolls back, never removes or renames anything in the root
            (not even a save in progress of the run that writes it), never writes to a tier,
            and restores a tier's checkpoint straight from the tier.

    One writer per root: a writing manager (rank 0 of the job) holds a lock on a local root for
    its whole life (``ROOT/.crashproof.lock`` names the holder); a second writer fails here with
    :class:`CheckpointWriteError` naming it. A lock left by a process that died on this host is
    taken over with a warning. On an object store one writer per root is the user's duty; a
    second writer's checkpoints appearing under the root fail the next save (docs/storage.md).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        every: SavePolicy | None = None,
        keep: RetentionPolicy | None = None,
        async_save: bool = True,
        on_busy: Literal["wait", "skip"] = "wait",
        on_disk_full: Literal["continue", "raise"] = "continue",
        staging_buffers: int = 1,
        storage: Storage | None = None,
        timeout_s: float = 600.0,
        handle_signals: bool = True,
        check_finite: bool = True,
        delta: Delta | None = None,
        dedup_replicated: bool = True,
        remote: str | Tier | Sequence[str | Tier] | None = None,
        remote_timeout_s: float = 600.0,
        replicate: bool = True,
        read_only: bool = False,
    ) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"CheckpointManager(timeout_s={timeout_s}): must be positive")
        if on_busy not in ("wait", "skip"):
            raise ConfigError(f"CheckpointManager(on_busy={on_busy!r}): use 'wait' or 'skip'")
        if on_disk_full not in ("continue", "raise"):
            raise ConfigError(
                f"CheckpointManager(on_disk_full={on_disk_full!r}): use 'continue' or 'raise'"
            )
        root = os.fspath(root)
        self.root, self.storage = storage_for(root) if storage is None else (root, storage)
        self.every: SavePolicy = every if every is not None else EverySteps(1000)
        self.keep: RetentionPolicy = keep if keep is not None else KeepAll()
        self.async_save = async_save
        self.on_busy = on_busy
        self.on_disk_full = on_disk_full
        self.check_finite = check_finite
        self.delta = delta
        self.dedup_replicated = dedup_replicated
        # The newest committed full checkpoint's tensors, to take deltas against. Only the writer
        # thread touches it, in save order, so every rank sees the same base for the same save.
        self._delta_base: DeltaBase | None = None
        self.stats = SaveStats()
        """What this manager did: saves, skips, waits, failures, bytes, timings."""
        if staging_buffers not in (1, 2) or (staging_buffers == 2 and not async_save):
            raise ConfigError(
                f"CheckpointManager(staging_buffers={staging_buffers}): use 1, or 2 with async_save=True"
            )
        self._stagings = [StagingArea() for _ in range(staging_buffers)] if async_save else []
        # Two groups: the training thread's collectives (decisions, restore) and the background
        # writer's (commit) must never interleave on one group, or ranks would pair them wrongly.
        self._group: Group = default_group(timeout_s)
        self._persist_group: Group = default_group(timeout_s)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="crashproof-persist")
        # Saves not yet collected, oldest first, with the staging area each one reads from.
        self._inflight: deque[tuple[Future[CommitResult], int]] = deque()
        self._closed = False
        self._last_save_step = 0
        self._last_save_s = time.monotonic()
        self._newest_valid: int | None = None
        self._discard_save_of: int | None = None  # the step a NumericsGuard rollback abandoned
        self._calls_to_agreement = 0  # maybe_save calls before the ranks next agree (see _agree)
        self._tmp_token: str | None = None  # in every save's temporary name, the same on all ranks
        self._last_call_s: float | None = None
        self._step_s: float | None = None
        self._restored_environment: dict[str, Any] = {}
        self.last_commit: CommitResult | None = None
        """The most recent committed save of this manager."""
        # Under `crashproof run`: heartbeats, phases and events for the supervisor; else no-ops.
        self._reporter = trainer_reporter(self._group.rank)
        self._preemption = PreemptionListener()
        self._handle_signals = handle_signals
        self.read_only = read_only
        self._lock: RootLock | None = None
        # Where no lock can be held (object stores): the commit time of every checkpoint this
        # manager knows of, to tell a second writer's checkpoints (docs/storage.md).
        self._known: dict[int, float | None] = {}
        self._second_writer: str | None = None
        self._retention_off = False
        if not read_only:
            self._open_for_writing()
            atexit.register(_unclosed_at_exit, weakref.ref(self))
        try:
            self._tiers = open_tiers(remote)
            self.remote_timeout_s = remote_timeout_s
            self._by_agent = False
            self._replicators = (
                self._start_replication()
                if self._group.rank == 0 and replicate and not read_only
                else []
            )
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        # Last, so a constructor that fails leaves no handler behind: SIGTERM, SIGUSR1 and
        # SIGINT become a request to stop at the next maybe_save.
        if handle_signals:
            self._preemption.install()

    def _open_for_writing(self) -> None:
        """Rank 0 takes the root's lock, finishes an interrupted publish and removes what
        failed saves left; every rank fails if it cannot (no collective left waiting)."""
        error: Exception | None = None
        if self._group.rank == 0:
            try:
                self.storage.make_dirs(self.root)
                inner = getattr(self.storage, "inner", self.storage)  # a wrapper (chaos faults)
                if isinstance(inner, LocalStorage):
                    self._lock = lock_root(self.root)
                recover_interrupted(self.storage, self.root)
                for leftover in leftover_dirs(self.storage, self.root):
                    log.info(
                        "removing %s, left by a save that never committed",
                        self.storage.describe(leftover),
                    )
                    self.storage.remove(leftover)
                self._known = {s: None for s, _ in committed_steps(self.storage, self.root)}
            except Exception as exc:
                error = exc
        if self._group.world_size > 1:
            message = self._group.broadcast(
                None if error is None else f"{type(error).__name__}: {error}"
            )
            if message is not None and error is None:
                error = CheckpointWriteError(
                    errno.EBUSY, f"rank 0 cannot write to {self.root}: {message}"
                )
        if error is not None:
            if self._lock is not None:
                self._lock.release()
            raise error

    @property
    def rank(self) -> int:
        return self._group.rank

    def compute_section(self) -> contextlib.AbstractContextManager[None]:
        """Mark this rank's own work in a step, the part with no collective in it (usually the
        forward pass)::

            with ckpt.compute_section():
                loss = loss_fn(model(batch), target)

        Under ``crashproof run`` its time is reported to the supervisor, which flags a rank whose
        work takes longer than its peers' (a straggler: a slow device, a throttled host). Ranks
        that wait for each other in every step all take the same time per step, so only the
        marked work tells the slow one apart. Costs one clock read on each side; a no-op when
        not supervised."""
        return self._reporter.compute_section()

    # -- saving ------------------------------------------------------------------------------

    def maybe_save(
        self, step: int, state: TrainState, *, metadata: dict[str, Any] | None = None
    ) -> bool:
        """Save if the policy says so for the step just finished; returns whether it saved.

        Also the trainer's heartbeat under ``crashproof run``: call it every step.
        """
        self._check_writer("maybe_save")
        _check_step(step)  # at every call, not only at a save
        metadata = checked_metadata(metadata, step)
        self._reporter.step_done(step)
        self._raise_pending()
        ctx = SaveContext(
            step,
            time.monotonic(),
            self._last_save_step,
            self._last_save_s,
            last_blocking_s=self.stats.last_blocking_s if self.stats.saves_started else None,
            last_persist_s=self.stats.last_persist_s if self.stats.saves_committed else None,
        )
        decision = self.every.should_save(ctx)
        notice = self._preemption.pending()
        same_everywhere = getattr(self.every, "same_on_every_rank", False)
        if self._group.world_size > 1 and (self._handle_signals or not same_everywhere):
            decision, stop = self._agree(decision, notice is not None, same_everywhere)
            # A notice acts only once the ranks agree on it: signals reach the ranks at
            # different steps, and a rank stopping alone would pair its emergency save's
            # collectives with its peers' training. Until then it stays pending.
            notice = (notice or Notice("another rank", time.monotonic())) if stop else None
        if self._discard_save_of is not None:
            if step == self._discard_save_of:  # the state was rolled back: it is not this step's
                step, decision = self._last_save_step, False
            self._discard_save_of = None
        if notice is not None:
            self._stop_for(notice, step, state, metadata)
        if decision:
            self.save(step, state, metadata=metadata)
        return decision

    def _agree(self, decision: bool, noticed: bool, same_everywhere: bool) -> tuple[bool, bool]:
        """What every rank does after this step: save (rank 0's decision binds, for policies
        whose ranks may disagree: clocks) and stop (any rank told to). Returns both.

        Agreeing is one small all-reduce, made every few steps rather than every step: it also
        waits for the slowest rank, which costs a fast step more than the all-reduce itself. Rank
        0 sets the next agreement ``AGREE_EVERY_S`` ahead from its step time, so a notice or a
        time-based save waits at most that long; all ranks count the same calls to know when.
        """
        now = time.monotonic()
        if self._last_call_s is not None:
            gap = now - self._last_call_s
            self._step_s = gap if self._step_s is None else 0.8 * self._step_s + 0.2 * gap
        self._last_call_s = now
        if self._calls_to_agreement > 0:
            self._calls_to_agreement -= 1
            return (decision if same_everywhere else False), False
        rank0 = self._group.rank == 0
        ahead = 0
        if rank0 and self._step_s:
            ahead = max(0, min(_AGREE_MAX_CALLS, int(AGREE_EVERY_S / self._step_s) - 1))
        stop, rank0_decision, calls = self._group.max(
            [int(noticed), int(decision and rank0), ahead if rank0 else 0]
        )
        self._calls_to_agreement = calls
        return (decision if same_everywhere else bool(rank0_decision)), bool(stop)

    def _stop_for(
        self, notice: Notice, step: int, state: TrainState, metadata: dict[str, Any] | None
    ) -> NoReturn:
        """The emergency checkpoint of ``step``, then :class:`PreemptedExit` (exit code 75).

        A save in flight is finished first (never abandoned half-written). When the notice has a
        deadline the last save's timings say cannot be met, the newest committed checkpoint
        stays the one to resume from, and the log says so.
        """
        started = time.monotonic()
        with self._reporter.phase("save"):
            self.wait()
        needed_s = self.stats.last_blocking_s + self.stats.last_persist_s
        late = notice.deadline_s is not None and started + needed_s > notice.deadline_s
        missing = self.last_commit is None or self.last_commit.step != step
        # Every rank saves, or none: a deadline or a missing commit seen by any rank decides.
        late, missing = (bool(v) for v in self._group.max([int(late), int(missing)]))
        already = not missing
        saved = not (already or late)
        if not saved:
            log.error(
                "stop requested (%s) after step %d: %s; resuming from checkpoint step %s",
                notice.source,
                step,
                "its checkpoint is committed"
                if already
                else f"an emergency checkpoint needs ~{needed_s:.1f} s, more than the notice leaves",
                self._newest_valid,
            )
        else:
            with self._reporter.phase("save"):
                self._save(step, state, metadata)
                self._wait_commit()
            log.warning(
                "stop requested (%s): emergency checkpoint of step %d committed in %.2f s",
                notice.source,
                step,
                time.monotonic() - started,
            )
        self._reporter.preempted(notice.source, step, time.monotonic() - started, saved=saved)
        self._close(self._durable_wait_when_stopping(notice))
        raise PreemptedExit(notice, step)

    def _durable_wait_when_stopping(self, notice: Notice) -> float:
        """How long a preempted run waits for its tiers: not at all when the agent uploads (it
        outlives the trainers), else what the notice leaves (a few seconds kept for the exit),
        at most ``PREEMPTION_DURABLE_WAIT_S`` without a deadline; the checkpoint itself is
        already committed locally, and the next run uploads what is left."""
        if self._by_agent:
            return 0.0
        if notice.deadline_s is None:
            return min(self.remote_timeout_s, PREEMPTION_DURABLE_WAIT_S)
        return max(0.0, min(self.remote_timeout_s, notice.deadline_s - time.monotonic() - 5.0))

    def save(self, step: int, state: TrainState, *, metadata: dict[str, Any] | None = None) -> bool:
        """Checkpoint ``state`` as the state after ``step`` steps; returns whether a save started.

        With a save of an earlier step still being written, ``on_busy`` decides: wait for it, or
        skip this one (returns False). Synchronous managers return once the checkpoint is
        committed; asynchronous ones once the state is copied.
        """
        self._check_writer("save")
        with self._reporter.phase("save"):
            return self._save(step, state, metadata)

    def _save(self, step: int, state: TrainState, metadata: dict[str, Any] | None) -> bool:
        _check_step(step)
        metadata = checked_metadata(metadata, step)  # refused here, naming the key
        if self._lock is not None:  # still ours: not deleted, replaced or moved meanwhile
            self._lock.check()
        self._raise_pending()
        started = time.perf_counter()
        capacity = max(1, len(self._stagings))
        busy = sum(not future.done() for future, _ in self._inflight) >= capacity
        if self._group.world_size > 1 and self.on_busy == "skip":
            busy = any(self._group.all_gather(busy))  # every rank must skip, or none
        if busy and self.on_busy == "skip":
            self.stats.skipped_busy += 1
            log.warning(
                "skipping the checkpoint of step %d: the previous save is still being written (on_busy='skip')",
                step,
            )
            return False
        while len(self._inflight) >= capacity:  # wait for the oldest save, freeing its buffers
            self._collect(self._inflight.popleft()[0])
        if busy:
            self.stats.waited_busy += 1
            self.stats.waited_busy_s += time.perf_counter() - started
            log.info(
                "the checkpoint of step %d waited %.2f s for the previous save",
                step,
                time.perf_counter() - started,
            )
        free = min(set(range(capacity)) - {slot for _, slot in self._inflight})
        staging = self._stagings[free] if self._stagings else None
        tree = state.capture()
        snapshot = take_snapshot(
            step,
            tree,
            staging=staging,
            metadata=metadata,
            must_be_finite=(
                state.must_be_finite(tree, step=step) if self.check_finite else frozenset()
            ),
        )
        # Every rank counts the same saves, so all agree on which may be deltas. Sharded state
        # is always saved whole: a delta's base must be the same rank's piece, which a restore
        # on another world size would not have.
        may_be_delta = (
            self.delta is not None
            and self.stats.saves_started % self.delta.full_every != 0
            and not snapshot.sharded
        )
        if self.delta is not None and snapshot.sharded and self.stats.saves_started == 0:
            log.warning(
                "CheckpointManager(delta=...): the model is sharded (DTensor, FSDP2), and sharded "
                "state is always saved in full, so every checkpoint of %s is a full one",
                self.root,
            )
        replicated: builtins.list[tuple[str, int, str, tuple[int, ...]]] | None = None
        if self.dedup_replicated and self._group.world_size > 1 and self.delta is None:
            replicated = self._replicated_tensors(snapshot.tensors, state)
        if self._tmp_token is None:  # agreed once; each save's name adds its number
            self._tmp_token = str(self._group.broadcast(uuid.uuid4().hex[:8]))
        tmp_name = new_tmp_name(step, f"{self._tmp_token}-{self.stats.saves_started}")
        blocking_s = time.perf_counter() - started
        self._inflight.append(
            (
                self._executor.submit(
                    self._persist, snapshot, tmp_name, blocking_s, may_be_delta, replicated
                ),
                free,
            )
        )
        self.stats.saves_started += 1
        self._last_save_step, self._last_save_s = step, time.monotonic()
        if not self.async_save:
            self._wait_commit()
        self.stats.last_blocking_s = time.perf_counter() - started
        return True

    @staticmethod
    def _replicated_tensors(
        tensors: builtins.list[tuple[str, Any]], state: TrainState
    ) -> builtins.list[tuple[str, int, str, tuple[int, ...]]]:
        """This rank's replicated tensors (DDP's model and optimizer): name, bytes, dtype, shape."""
        replicated = state.replicated_names(n for n, _ in tensors)
        return [
            (n, t.numel() * t.element_size(), str(t.dtype), tuple(t.shape))
            for n, t in tensors
            if n in replicated
        ]

    def _replicated_owners(
        self, named: builtins.list[tuple[str, int, str, tuple[int, ...]]]
    ) -> dict[str, int]:
        """Which rank writes each replicated tensor: every rank must list the same names, shapes
        and dtypes, agreed in one small all-gather, or nothing is deduplicated. Whether the values
        agree is checked by the writer, by checksum. Runs on the writer thread, over its own
        group: an all-gather waits for the slowest rank, which the training loop must not."""
        signature = digest(json.dumps(named).encode())
        agreed = len(set(self._persist_group.all_gather(signature))) == 1
        if not named or not agreed:
            return {}
        return assign_owners([(n, size) for n, size, _, _ in named], self._group.world_size)

    @property
    def last_blocking_s(self) -> float:
        """How long the last :meth:`save` paused the training loop."""
        return self.stats.last_blocking_s

    def _persist(
        self,
        snapshot: Snapshot,
        tmp_name: str,
        blocking_s: float,
        may_be_delta: bool,
        replicated: builtins.list[tuple[str, int, str, tuple[int, ...]]] | None,
    ) -> CommitResult:
        if replicated is not None:  # the same on every rank: they all take part in agreeing
            snapshot.owners = self._replicated_owners(replicated)
        if may_be_delta and self.delta is not None and self._delta_base is not None:
            snapshot.delta = (self.delta, self._delta_base)
        try:
            try:
                result = persist(self.storage, self.root, snapshot, self._persist_group, tmp_name)
            except CheckpointWriteError as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                # Every rank has this same outcome (rank 0 broadcast it): all retry, once.
                self._make_room(snapshot, exc)
                result = persist(
                    self.storage, self.root, snapshot, self._persist_group, f"{tmp_name}-retry"
                )
        except BaseException:
            if snapshot.delta is None:
                self._delta_base = None  # the full save failed: the next save is a full one
            raise
        self._known.pop(snapshot.step, None)  # ours: its commit time is learnt at retention
        if self.delta is not None and result.kind == "full" and not snapshot.sharded:
            # (Sharded state is never delta-encoded: a copy kept as a base would only cost memory.)
            self._delta_base = keep_as_base(snapshot, result.checksums, self._delta_base)
        self._reporter.committed(
            snapshot.step,
            result.path,
            blocking_s,
            result.persist_s,
            result.checkpoint_bytes
            if result.checkpoint_bytes is not None
            else result.bytes_written,
        )
        self._newest_valid = max(self._newest_valid or 0, snapshot.step)
        log.info(
            "checkpoint step %d committed: %.1f MB in %.2f s",
            snapshot.step,
            result.bytes_written / 1e6,
            result.persist_s,
        )
        for replicator in self._replicators:
            replicator.notify()
        if self._group.rank == 0:
            # Queued behind this save on the same thread, so a synchronous save returns as soon as
            # it is committed, and the next save starts only after the clean-up.
            self._executor.submit(self._apply_retention, keep_always=snapshot.step)
        return result

    def wait(self) -> CommitResult | None:
        """Block until the save in flight (if any) is committed and retention has run after it.

        Raises :class:`CheckpointWriteError` if the save failed (a full disk only with
        ``on_disk_full="raise"``).
        """
        result = self._wait_commit()
        if not self._closed:
            self._executor.submit(lambda: None).result()  # the queue is drained: retention done
        return result

    def _wait_commit(self) -> CommitResult | None:
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
                    f"saving a checkpoint in {self.root} failed: {type(exc).__name__}: {exc}"
                ) from exc
        except NonFiniteStateError:
            self.stats.failures += 1
            raise
        except CheckpointWriteError as exc:
            self.stats.failures += 1
            if exc.errno in _DISK_FULL:
                self.stats.disk_full += 1
                if self.on_disk_full == "continue":
                    log.error(
                        "%s; training goes on (on_disk_full='continue'): free space on the disk",
                        exc,
                    )
                    return None
            raise
        self.last_commit = result
        self.stats.saves_committed += 1
        self.stats.bytes_written += result.bytes_written
        self.stats.last_persist_s = result.persist_s
        return result

    def _raise_pending(self) -> None:
        """Surface a background failure on the next call into the manager."""
        while self._inflight and self._inflight[0][0].done():
            self._collect(self._inflight.popleft()[0])
        message, self._second_writer = self._second_writer, None
        if message is not None:
            raise CheckpointWriteError(errno.EBUSY, message)

    # -- retention ---------------------------------------------------------------------------

    def _kept_anyway(self, keep_always: int) -> set[int]:
        """What retention never removes now: ``keep_always``, the newest valid checkpoint, the
        base of the next deltas, and what a tier has not taken yet."""
        keep = {keep_always}
        if self._newest_valid is not None:
            keep.add(self._newest_valid)
        if self._delta_base is not None:  # the next deltas are taken against it
            keep.add(self._delta_base.step)
        for replicator in self._replicators:  # not yet copied to a durable tier
            keep |= replicator.protected()
        return keep

    def _apply_retention(self, *, keep_always: int) -> None:
        """Remove what the retention policy does not keep (never the newest valid checkpoint).

        Temporary directories are not touched here: another rank may already be writing the next
        save's. Abandoned ones are removed when a manager starts.
        """
        try:
            if self._retention_off:
                return
            if self._lock is not None:  # never remove from a root this writer no longer holds
                self._lock.check()
            keep = self._kept_anyway(keep_always)
            found = committed_steps(self.storage, self.root)
            facts = checkpoint_facts(self.storage, found)
            if self._lock is None and self._second_writer_in(facts, keep_always):
                return
            plan = retention_plan(self.storage, found, self.keep, keep_always=keep, facts=facts)
            for step, path in plan:
                log.info("retention: removing checkpoint step %d", step)
                self.storage.remove(path)
        except Exception as exc:  # a failed clean-up must not fail the save that just committed
            log.warning(
                "retention in %s failed: %s; will retry after the next save", self.root, exc
            )

    def _second_writer_in(self, facts: builtins.list[CheckpointFacts], ours: int) -> bool:
        """Whether ``facts`` show checkpoints this manager did not commit and did not find when
        it started (where no lock keeps a second writer out: object stores). Then retention
        stops for good (it would delete the other writer's checkpoints, or they ours) and the
        next call into the manager raises."""
        foreign = []
        for fact in facts:
            if fact.step == ours or self._known.get(fact.step, 0.0) is None:
                self._known[fact.step] = fact.created_unix  # ours, or found at start: first look
            elif fact.step not in self._known or self._known[fact.step] != fact.created_unix:
                foreign.append(fact)  # new and not ours, or committed again, not by us
        if not foreign:
            return False
        self._retention_off = True
        steps = ", ".join(str(f.step) for f in foreign)
        self._second_writer = (
            f"checkpoints of steps {steps} in {self.storage.describe(self.root)} were committed "
            "by another writer while this manager writes the root: two writers on one root "
            "delete each other's checkpoints and restore mixes their runs. Retention is off for "
            "this manager. Give each run its own root; a job that only reads uses "
            "CheckpointManager(..., read_only=True) (docs/storage.md)"
        )
        log.error("%s", self._second_writer)
        return True

    def _make_room(self, snapshot: Snapshot, failure: CheckpointWriteError) -> None:
        """The disk is full: remove now what retention would remove once ``snapshot`` commits
        (never the newest valid checkpoint, nor a base a kept delta needs), on rank 0, while the
        other ranks wait; the caller then retries the save once."""
        removed: builtins.list[int] = []
        if self._group.rank == 0:
            try:
                removed = self._remove_early(snapshot)
            except Exception as exc:
                log.warning("disk full: making room in %s failed: %s", self.root, exc)
        if self._group.world_size > 1:
            removed = self._persist_group.broadcast(removed)
        self.stats.disk_full_retries += 1
        self.stats.removed_for_space += len(removed)
        log.warning(
            "disk full saving checkpoint step %d (%s); removed %s now, as retention would after "
            "this commit, and retrying the save once",
            snapshot.step,
            failure,
            f"checkpoint steps {sorted(removed)}" if removed else "nothing (retention keeps all)",
        )

    def _remove_early(self, snapshot: Snapshot) -> builtins.list[int]:
        """Rank 0: what :meth:`_make_room` removes; returns the steps."""
        if self._retention_off:
            return []
        keep = self._kept_anyway(snapshot.step)
        if self._newest_valid is None:  # nothing restored nor saved yet: find it, by checksums
            newest = newest_verified(self.storage, self.root)
            if newest is not None:
                keep.add(newest)
        if snapshot.delta is not None:
            keep.add(snapshot.delta[1].step)
        found = committed_steps(self.storage, self.root)
        facts = [f for f in checkpoint_facts(self.storage, found) if f.step != snapshot.step]
        facts.append(CheckpointFacts(snapshot.step, time.time(), snapshot.metadata))
        plan = retention_plan(self.storage, found, self.keep, keep_always=keep, facts=facts)
        for step, path in plan:
            log.warning(
                "disk full: retention removes checkpoint step %d before step %d commits",
                step,
                snapshot.step,
            )
            self.storage.remove(path)
        if self._lock is not None:  # the lock holder's own leftovers: trash of removals
            for leftover in leftover_dirs(self.storage, self.root):
                if os.path.basename(leftover).startswith(".trash-"):
                    self.storage.remove(leftover)
        return [step for step, _ in plan]

    def _start_replication(self) -> builtins.list[Replica]:
        """Rank 0's replication to the tiers: by the agent of ``crashproof run`` when there is
        one (uploads then outlive this process), else on threads of this process."""
        if not self._tiers:
            return []
        local = LocalCheckpoints(self.storage, self.root)
        by_agent = agent_tiers(self.root, self._tiers, self.keep, local)
        if by_agent is not None:
            self._by_agent = True
            return list(by_agent)
        return [
            TierReplicator(
                self.storage,
                self.root,
                tier,
                keep=self.keep,
                emit=emit,
                on_durable=self._retention_after_upload,
            )
            for tier in self._tiers
        ]

    def _retention_after_upload(self) -> None:
        """A tier took a checkpoint: local retention may now remove what it spared for it."""
        if self._newest_valid is None:
            return
        with contextlib.suppress(RuntimeError):  # the writer thread is shut down: close() runs it
            self._executor.submit(self._apply_retention, keep_always=self._newest_valid)

    def prune(self, keep: RetentionPolicy, *, dry_run: bool = False) -> list[int]:
        """Apply ``keep`` now; returns the steps removed (or that would be, with ``dry_run``).

        The newest checkpoint that verifies is never removed.
        """
        self._check_writer("prune")
        self.wait()
        if self._lock is not None:
            self._lock.check()
        doomed = prune_plan(self.storage, self.root, keep)
        if not dry_run:
            for _, path in doomed:
                self.storage.remove(path)
        return sorted(step for step, _ in doomed)

    # -- restoring ---------------------------------------------------------------------------

    def restore(self, state: TrainState, step: int | None = None) -> int:
        """Load the newest valid checkpoint (or ``step``) into ``state``; returns its step, 0 if none.

        A checkpoint that fails verification is logged and skipped for the next newest. One that
        verifies but does not fit ``state`` raises :class:`StateMismatchError`: an older checkpoint
        would not fit either, and silently starting over would discard the run.
        """
        self._check_open()
        started = time.perf_counter()
        with self._reporter.phase("restore"):
            restored = self._restore(state, step)
        if restored is not None:
            self._reporter.restored(restored[0], restored[1], time.perf_counter() - started)
            return restored[0]
        return 0

    def rollback(self, state: TrainState, *, before: int, anomaly_step: int) -> int | None:
        """Go back to the newest valid checkpoint of a step before ``before``; returns its step,
        or None (and changes nothing) when there is none.

        For :class:`~crashproof.NumericsGuard`: training went wrong at ``anomaly_step`` (the
        trouble began at ``before``). Every checkpoint after the one restored belongs to the
        abandoned stretch and is removed, so a later restart cannot resume into it either. The
        training loop's :meth:`maybe_save` of ``anomaly_step``, which comes after the rollback,
        is ignored (the state is no longer that step's).
        """
        self._check_writer("rollback")
        started = time.perf_counter()
        with self._reporter.phase("restore"):
            restored = self._restore(state, None, below=before)
            if restored is None:
                return None
            step, path = restored
            if self._group.rank == 0:
                if self._lock is not None:
                    self._lock.check()
                if self._tiers:  # first, so the tiers' copies count as abandoned whatever happens
                    record_rollback(self.storage, self.root, step)
                for later, later_path in committed_steps(self.storage, self.root):
                    if later > step:
                        log.warning(
                            "rollback: removing checkpoint step %d (after the anomaly)", later
                        )
                        self.storage.remove(later_path)
                for replicator in self._replicators:
                    replicator.notify()
        self._reporter.restored(step, path, time.perf_counter() - started)
        self._discard_save_of = anomaly_step
        return step

    def _restore(
        self, state: TrainState, step: int | None, *, below: int | None = None
    ) -> tuple[int, str] | None:
        """The step and path restored, or None when there was nothing valid to restore.

        Candidates are the checkpoints of every tier, newest first; of one step, the local copy is
        tried first and each remote copy after it (downloaded into the local root by rank 0,
        verified, then loaded like a local one).

        A candidate that vanished while it was read (another process's retention removed it
        after committing a newer one) makes the restore list the checkpoints again, up to
        ``_RELISTS`` times: a reader must not fall back past a newer checkpoint, or to step 0.
        """
        self.wait()
        skipped: list[str] = []
        tried: set[tuple[int, str | None]] = set()
        for listing in range(_RELISTS + 1):
            candidates = self._on_rank0(self._candidates)
            if below is not None:
                candidates = [c for c in candidates if c[0] < below]
            if step is not None:
                candidates = [c for c in candidates if c[0] == step]
                if not candidates and listing == 0:
                    raise checkpoint_not_found(self.storage.describe(self.root), step)
            vanished: list[int] = []
            for candidate, path, sources in candidates:
                for source in sources:
                    if (candidate, source) in tried:
                        continue
                    tried.add((candidate, source))
                    restored = self._try_source(state, candidate, path, source, skipped, vanished)
                    if restored is not None:
                        return restored
                    if vanished:  # the listing is out of date: newer ones may be there now
                        tried.discard((candidate, source))  # (and this one back, re-saved)
                        break
                if vanished:
                    break
            if not vanished:
                break
            log.warning(
                "checkpoint step %d vanished while it was read; listing %s again",
                vanished[0],
                self.root,
            )
        if step is not None:
            raise CorruptCheckpointError(
                f"checkpoint step {step} in {self.root} is not valid: {skipped[0]}"
            )
        if skipped:
            log.error(
                "no valid checkpoint in %s (%d skipped); starting from step 0",
                self.root,
                len(skipped),
            )
        return None

    def _try_source(
        self,
        state: TrainState,
        candidate: int,
        path: str,
        source: str | None,
        skipped: list[str],
        vanished: list[int],
    ) -> tuple[int, str] | None:
        """Restore ``candidate`` from its local copy (``source`` None) or a tier's copy."""
        storage, where = self.storage, path
        if source is not None and self.read_only:  # read in place: the root stays as is
            try:
                root, storage = next(t for t in self._tiers if t.uri == source).open()
            except Exception as exc:
                skipped.append(f"step {candidate} in {source}: {exc}")
                return None
            where = storage.join(root, checkpoint_dir_name(candidate))
        elif source is not None:  # a remote copy: bring it here first
            fetched = self._on_rank0(functools.partial(self._fetch, candidate, source))
            if fetched:
                skipped.append(f"step {candidate} in {source}: {fetched}")
                return None
        return self._try_restore(state, candidate, where, skipped, storage, vanished)

    def _candidates(self) -> list[tuple[int, str, list[str | None]]]:
        """``(step, local path, sources)`` newest first; a source is None for the local copy or
        a tier's URI. A tier that cannot be listed is logged and left out; a tier's copy that a
        rollback abandoned (see :mod:`crashproof.checkpoint._rollbacks`) is never a candidate."""
        local = dict(committed_steps(self.storage, self.root))
        sources: dict[int, list[str | None]] = {s: [None] for s in local}
        marks = read_marks(self.storage, self.root) if self._tiers else []
        for tier in self._tiers:
            try:
                root, storage = tier.open()
                remote = committed_steps(storage, root)
                for remote_step, remote_path in remote:
                    if any(remote_step > m.after for m in marks):
                        created = _created_unix(storage, remote_path)
                        if abandoned(marks, remote_step, created):
                            continue
                    sources.setdefault(remote_step, []).append(tier.uri)
            except Exception as exc:  # a dead tier must not stop a restore from the others
                log.error("cannot list %s to restore from it: %s", tier.uri, exc)
        return [
            (s, local.get(s) or self.storage.join(self.root, checkpoint_dir_name(s)), sources[s])
            for s in sorted(sources, reverse=True)
        ]

    def _on_rank0(self, work: Callable[[], _T]) -> _T:
        """``work()`` on rank 0, its result on every rank, however long it takes: the other
        ranks wait in a broadcast every few seconds, never in one collective that could time out
        (a download from a tier can take longer than the collective timeout)."""
        if self._group.world_size == 1:
            return work()
        if self._group.rank != 0:
            while True:
                kind, value = self._group.broadcast(None)
                if kind == "done":
                    return cast(_T, value)
                if kind == "error":
                    raise CheckpointWriteError(f"rank 0 failed: {value}")
        with ThreadPoolExecutor(1, thread_name_prefix="crashproof-rank0") as pool:
            future = pool.submit(work)
            while True:
                try:
                    value = future.result(timeout=_KEEPALIVE_S)
                except FutureTimeout:
                    self._group.broadcast(("wait", None))
                    continue
                except Exception as exc:
                    self._group.broadcast(("error", f"{type(exc).__name__}: {exc}"))
                    raise
                self._group.broadcast(("done", value))
                return value

    def _fetch(self, step: int, uri: str) -> str:
        """Download checkpoint ``step`` (and the full checkpoint it needs, if a delta) from the tier
        ``uri`` into the local root; returns "" on success, else why not."""
        tier = next(t for t in self._tiers if t.uri == uri)
        started = time.perf_counter()
        self._known[step] = None  # ours to bring in: not a second writer's
        try:
            root, storage = tier.open()
            manifest = download_checkpoint(
                storage,
                storage.join(root, checkpoint_dir_name(step)),
                self.storage,
                self.root,
                checkpoint_dir_name(step),
            )
            base = manifest.base_step
            if base is not None and checkpoint_dir_name(base) not in self.storage.list(self.root):
                self._known[base] = None
                download_checkpoint(
                    storage,
                    storage.join(root, checkpoint_dir_name(base)),
                    self.storage,
                    self.root,
                    checkpoint_dir_name(base),
                )
        except Exception as exc:
            log.warning("cannot restore checkpoint step %d from %s: %s", step, uri, exc)
            return f"{type(exc).__name__}: {exc}"
        log.info(
            "downloaded checkpoint step %d from %s in %.2f s",
            step,
            uri,
            time.perf_counter() - started,
        )
        return ""

    def _try_restore(
        self,
        state: TrainState,
        candidate: int,
        path: str,
        skipped: list[str],
        storage: Storage | None = None,
        vanished: list[int] | None = None,
    ) -> tuple[int, str] | None:
        """Restore ``candidate`` if every rank verifies it; None (and a line in ``skipped``) if
        not, and ``candidate`` in ``vanished`` when it is no longer there on some rank.

        Two phases: every rank verifies its part and checks (and trial-loads) everything with
        real values, the live tensors' values aside, before any rank writes anything live; the
        loading that follows has nothing left to refuse."""
        started = time.perf_counter()
        storage = self.storage if storage is None else storage
        status, reader, reason = self._load_candidate(state, candidate, path, storage)
        where = storage.describe(path)
        try:
            statuses = self._group.all_gather((status, reason))
            mismatch = next((r for s, r in statuses if s == "mismatch"), None)
            if mismatch is not None:
                raise StateMismatchError(mismatch)
            problems = [r for s, r in statuses if s != "ok"]
            if problems:
                log.warning("skipping checkpoint step %d: %s", candidate, "; ".join(problems))
                skipped.append(f"step {candidate}: {problems[0]}")
                if vanished is not None and any(s == "gone" for s, _ in statuses):
                    vanished.append(candidate)
                return None
            assert reader is not None
            tree = reader.finish(reader.sharded_values)
        finally:
            if reader is not None:
                reader.close()
        try:
            state.restore(tree, where=where, checked=True)
        except Exception as exc:
            # Checked and trial-loaded before, so only an object that cannot be copied for a trial
            # (or that loads differently the second time) gets here, with the live state partly
            # written: never a bare error, and never a silent fallback over a half-loaded state.
            raise CorruptCheckpointError(
                f"{where}: loading step {candidate} failed after the live tensors were written "
                f"({type(exc).__name__}: {exc}); the model, optimizer and other components may "
                "now hold a mix of this checkpoint and their earlier state. Create them anew and "
                "restore again, or restore an earlier step"
            ) from exc
        self._warn_if_inexact(candidate)
        self._last_save_step, self._last_save_s = candidate, time.monotonic()
        self._newest_valid = candidate
        # Deltas are taken against what this manager committed; after a restore (or a rollback)
        # the next save is full, or it could name a base that is later than it or gone.
        self._delta_base = None
        log.info("restored checkpoint step %d in %.2f s", candidate, time.perf_counter() - started)
        return int(candidate), storage.describe(path)

    def _warn_if_inexact(self, step: int) -> None:
        """Say so when the run that saved (or this one) uses kernels that may not be bit-exact."""
        env = self._restored_environment
        now = exactness_environment()
        if (env.get("cuda") or now["cuda"]) and not (
            env.get("deterministic_algorithms") and now["deterministic_algorithms"]
        ):
            log.warning(
                "resuming from step %d on CUDA without torch.use_deterministic_algorithms(True) in both "
                "runs: the resumed run can match the uninterrupted one only statistically, not bit for "
                "bit (see docs/exactness.md)",
                step,
            )
        # Checkpoints from before this was recorded say nothing: only a recorded False counts.
        saved_mkl = env.get("mkl_reproducible", True)
        if now["mkl"] and not (saved_mkl and now["mkl_reproducible"]):
            log.warning(
                "resuming from step %d with MKL not set up for reproducible results in %s: set "
                "MKL_CBWR=AUTO,STRICT and MKL_DYNAMIC=FALSE before Python starts (crashproof run "
                "does) or runs may differ in the last bits (see docs/exactness.md)",
                step,
                "this run" if saved_mkl else "the run that saved it",
            )

    def _load_candidate(
        self, state: TrainState, step: int, path: str, storage: Storage
    ) -> tuple[str, RankRead | None, str]:
        """Check and verify one candidate without touching the live state.

        Returns ``("ok", reader, "")`` (the caller finishes the read into the live tensors),
        ``("corrupt", None, why)``, ``("gone", None, why)`` (it vanished while it was read) or
        ``("mismatch", None, why)``.
        """
        reader: RankRead | None = None
        try:
            manifest = read_manifest(storage, path)
            if manifest.step != step:
                raise CorruptCheckpointError(
                    f"{storage.describe(path)}: the manifest is for step {manifest.step}, not {step}; "
                    "the directory was renamed or copied"
                )
            # Another world size: replicated state only, each rank reading a saved rank's part.
            source = source_rank(
                storage, path, manifest, self._group.rank, self._group.world_size,
                per_rank=state.per_rank_names(),
            )  # fmt: skip
            if source != self._group.rank or manifest.world_size != self._group.world_size:
                log.info(
                    "checkpoint step %d was saved by %d ranks: rank %d restores saved rank %d's state",
                    step,
                    manifest.world_size,
                    self._group.rank,
                    source,
                )
                if state.data is not None and state.sampler is None and self._group.rank == 0:
                    log.warning(
                        "checkpoint step %d was saved by %d ranks and is restored on %d: the "
                        "data loader's own state_dict() is per rank, so each rank resumes from a "
                        "saved rank's position and samples may be repeated or skipped; a "
                        "DataLoader over crashproof.ResumableSampler carries the global position",
                        step,
                        manifest.world_size,
                        self._group.world_size,
                    )
            reader = RankRead(storage, path, manifest, source, into=state.live_tensors())
            # Verify first, so a corrupt file is skipped rather than reported as a mismatch.
            # Nothing here writes into the live state: only finish() does, after all ranks agree.
            reader.verify()
            # Real values for every check that needs them (RNG states, optimizer state, trial
            # loads of extras); only tensors read straight into live memory are stand-ins.
            values = reader.check_tree()
            if not isinstance(values, dict):
                raise CorruptCheckpointError(
                    f"{storage.describe(path)}: the state is not a mapping"
                )
            pieces = reader.sharded_entries()
            # Every rank's pieces tile their tensors (metadata only) before anything is sized.
            saved = CrashproofReader(path, storage=storage, manifest=manifest) if pieces else None
            state.check(values, where=storage.describe(path))
            if saved is not None:  # cut this rank's pieces out of the saved ones, into new memory
                with state.restore_layout() as layout:
                    _, live = named_tensors(layout)
                    targets = restore_targets(pieces, dict(live), saved)
                load_sharded(storage, path, manifest, targets, reader=saved)
                reader.sharded_values = targets
            self._restored_environment = manifest.environment
            return "ok", reader, ""
        except StateMismatchError as exc:
            status, why = "mismatch", str(exc)
        except (CorruptCheckpointError, OSError) as exc:
            status, why = "corrupt", str(exc)
            if not _still_there(storage, path):
                status = "gone"  # removed while it was read: the listing is out of date
        if reader is not None:
            reader.close()
        return status, None, why

    # -- inspection and lifecycle ------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint directory under the root, newest first, with a quick validity check."""
        self.wait()
        return [
            describe_checkpoint(self.storage, s, p)
            for s, p in committed_steps(self.storage, self.root)
        ]

    def replication_status(self) -> builtins.list[TierStatus]:
        """Where each durable tier stands (rank 0; other ranks copy nothing: empty)."""
        return [r.status() for r in self._replicators]

    def close(self) -> None:
        """Wait for the save in flight and for the newest checkpoint to be durable in every tier
        (at most ``remote_timeout_s``), then release the threads. Safe to call twice."""
        self._close(self.remote_timeout_s)

    def _close(self, durable_wait_s: float) -> None:
        if self._closed:
            return
        try:
            with self._reporter.phase("save"):  # the last commit may take long: not a hang
                self.wait()
                if self._tiers:  # every rank waits with rank 0, in short collectives
                    self._on_rank0(functools.partial(self._wait_durable, durable_wait_s))
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            for replicator in self._replicators:
                replicator.stop()
            if self._replicators and self._newest_valid is not None:
                self._apply_retention(keep_always=self._newest_valid)
            self._reporter.closed()
            self._preemption.uninstall()
            if self._lock is not None:
                self._lock.release()

    def _wait_durable(self, limit_s: float) -> None:
        """Rank 0: wait (at most ``limit_s``) until every tier has what it wants; else say what
        is pending, and where it stays."""
        if not self._replicators or self._newest_valid is None:
            return
        if limit_s <= 0:
            log.info(
                "not waiting for the durable tiers (stopping); what is pending is uploaded %s",
                "by the agent"
                if self._by_agent
                else "when a manager with these tiers starts again",
            )
            return
        deadline = time.monotonic() + limit_s
        for replicator in self._replicators:
            left = max(0.0, deadline - time.monotonic())
            if not replicator.wait_durable(left):
                status = replicator.status()
                log.error(
                    "checkpoint step %d is not durable in %s after %.0f s (pending: steps %s; "
                    "last error: %s); it stays in %s and is uploaded %s",
                    self._newest_valid,
                    status.uri,
                    limit_s,
                    status.pending,
                    status.last_error or "none",
                    self.storage.describe(self.root),
                    "by the agent"
                    if self._by_agent
                    else "when a manager with this remote starts again",
                )

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this CheckpointManager is closed; create a new one")

    def _check_writer(self, what: str) -> None:
        self._check_open()
        if self.read_only:
            raise ConfigError(
                f"CheckpointManager({self.root!r}, read_only=True) cannot {what}: it only restores "
                "and lists; the run that writes the root saves, prunes and rolls back"
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
