"""``CheckpointManager``: the front door for saving and restoring a training run.

It owns one checkpoint root and decides *when* (the save policy), *what survives* (the retention
policy) and *which checkpoint to trust* on restore (the newest one that verifies). Its
collaborators do the work: :mod:`._save_pipeline` (saves, over :mod:`crashproof.checkpoint.save._writer`),
:mod:`._retention_runner`, :mod:`._agreement` (between ranks), :mod:`._restorer` (restore,
rollback) and :mod:`._tier_coordination` (durable tiers); they share :mod:`._manager_state`.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import dataclasses
import functools
import logging
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any, Literal, NoReturn

from crashproof.checkpoint._agreement import RankAgreement
from crashproof.checkpoint._group import Group, default_group
from crashproof.checkpoint._manager_state import (
    ManagerState,
    open_for_reading,
    open_for_writing,
)
from crashproof.checkpoint._options import DEFAULT_EVERY, DEFAULT_KEEP, ManagerOptions
from crashproof.checkpoint._placement import Placement
from crashproof.checkpoint._restorer import Restorer
from crashproof.checkpoint._retention_runner import RetentionRunner
from crashproof.checkpoint._save_pipeline import SavePipeline, check_step, warn_if_never_closed
from crashproof.checkpoint._tier_coordination import TierCoordinator
from crashproof.checkpoint.format import checked_metadata
from crashproof.checkpoint.memory import MemorySnapshots
from crashproof.checkpoint.root import CheckpointInfo, committed_steps, describe_checkpoint
from crashproof.checkpoint.save import CommitResult, Delta, SaveStats
from crashproof.checkpoint.tiers import Tier, TierStatus
from crashproof.errors import ConfigError
from crashproof.link import Notice, PreemptedExit, PreemptionListener, trainer_reporter
from crashproof.policy import RetentionPolicy, SavePolicy
from crashproof.state import TrainState
from crashproof.storage import Storage, storage_for

__all__ = ["CheckpointManager"]

log = logging.getLogger("crashproof.checkpoint")


class CheckpointManager:
    """Save, retain and restore the checkpoints of one run under ``root``.

    ``root`` holds one ``step_<N>`` directory per checkpoint. Each keyword option is documented
    on the field of the same name of :class:`~crashproof.checkpoint.ManagerOptions`:
    ``every`` and ``keep`` are the save and retention policies (default ``EverySteps(1000)``,
    keep the newest 5), ``async_save`` writes in the background, ``remote`` names durable tiers every
    checkpoint is copied to, ``handle_signals`` turns SIGTERM, SIGUSR1 and a first SIGINT
    (``on_interrupt``) into an emergency save and :class:`PreemptedExit`, ``read_only`` only restores and lists.

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
        on_interrupt: Literal["checkpoint", "raise"] = "checkpoint",
        check_finite: bool = True,
        delta: Delta | None = None,
        dedup_replicated: bool = True,
        remote: str | Tier | Sequence[str | Tier] | None = None,
        remote_timeout_s: float = 600.0,
        replicate: bool = True,
        read_only: bool = False,
        restore_memory_bytes: int | None = None,
        memory_every: SavePolicy | None = None,
        memory: bool = True,
        root_scope: Literal["auto", "shared", "node"] = "shared",
    ) -> None:
        options = ManagerOptions(
            every=every, keep=keep, async_save=async_save, on_busy=on_busy,
            on_disk_full=on_disk_full, staging_buffers=staging_buffers, storage=storage,
            timeout_s=timeout_s, handle_signals=handle_signals, on_interrupt=on_interrupt,
            check_finite=check_finite,
            delta=delta, dedup_replicated=dedup_replicated, remote=remote,
            remote_timeout_s=remote_timeout_s, replicate=replicate, read_only=read_only,
            restore_memory_bytes=restore_memory_bytes, memory_every=memory_every, memory=memory,
            root_scope=root_scope,
        )  # fmt: skip
        root = os.fspath(root)
        self.root, self.storage = storage_for(root) if storage is None else (root, storage)
        self.every: SavePolicy = every if every is not None else DEFAULT_EVERY
        self.keep: RetentionPolicy = keep if keep is not None else DEFAULT_KEEP
        self.async_save, self.on_busy, self.on_disk_full = async_save, on_busy, on_disk_full
        self.check_finite, self.delta, self.dedup_replicated = check_finite, delta, dedup_replicated
        self.read_only, self.remote_timeout_s = read_only, remote_timeout_s
        self.stats = SaveStats()
        """What this manager did: saves, skips, waits, failures, bytes, timings."""
        self._discard_save_of: int | None = None  # the step a NumericsGuard rollback abandoned
        self._group = default_group(timeout_s)  # the training thread's collectives
        self._shared = ManagerState(
            self.root,
            self.storage,
            read_only=read_only,
            placement=Placement.shared(self._group.world_size, self._group.rank),
        )
        # Under `crashproof run`: heartbeats, phases and events for the supervisor; else no-ops.
        self._reporter = trainer_reporter(self._group.rank)
        self._preemption = PreemptionListener(options.preemption_signals())
        self._agreement = RankAgreement(self._group, handle_signals=handle_signals)
        self._tiers = TierCoordinator(self._shared, self.keep, remote_timeout_s)
        self._retention = RetentionRunner(self._shared, self.keep, self._tiers)
        self.memory_every = memory_every
        snapshots = _memory_snapshots(options, self.storage.describe(self.root), self._group)
        self._pipeline = SavePipeline(
            self._shared, options, group=self._group, persist_group=default_group(timeout_s),
            stats=self.stats, reporter=self._reporter, retention=self._retention,
            tiers=self._tiers, memory=snapshots,
        )  # fmt: skip
        self._restorer = Restorer(
            self._shared, self._group, self._agreement, self._tiers,
            read_only=read_only, memory_bytes=restore_memory_bytes, memory=snapshots,
        )  # fmt: skip
        if not read_only:
            open_for_writing(
                self._shared,
                self._group,
                options.describe(self.storage.describe(root)),
                root_scope,
            )
            atexit.register(warn_if_never_closed, weakref.ref(self._pipeline), os.getpid())
        else:
            open_for_reading(self._shared, self._group, root_scope)
        try:
            # (Rank 0 copies a shared root; each node's first rank its node's own part.)
            replicate = self._shared.placement.leads and replicate and not read_only
            self._tiers.open(remote, replicate=replicate, on_durable=self._pipeline.queue_retention)
        except BaseException:  # (a tier's root locked by another run, a tier that cannot open)
            self._shared.closed = True  # nothing was saved: no "never closed" error at exit
            self._pipeline.stop()
            self._shared.release_lock()
            raise
        # Last, so a constructor that fails leaves no handler behind: SIGTERM, SIGUSR1 and
        # SIGINT become a request to stop at the next maybe_save.
        if handle_signals:
            self._preemption.install()

    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def last_commit(self) -> CommitResult | None:
        """The most recent committed save of this manager."""
        return self._pipeline.last_commit

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

    def maybe_save(
        self, step: int, state: TrainState, *, metadata: dict[str, Any] | None = None
    ) -> bool:
        """Save if the policy says so for the step just finished; returns whether it saved.

        Also the trainer's heartbeat under ``crashproof run``: call it every step.
        """
        self._shared.check_writer("maybe_save")
        check_step(step)  # at every call, not only at a save
        metadata = checked_metadata(metadata, step)
        self._reporter.step_done(step)
        self._pipeline.raise_pending()
        decision, notice = self._agreement.after_step(  # (a step saved already is not again)
            self.every.should_save(self._pipeline.save_context(step))
            and step != self._shared.last_save_step,
            self._preemption.pending(),
            same_everywhere=getattr(self.every, "same_on_every_rank", False),
        )
        if self._discard_save_of is not None:
            if step == self._discard_save_of:  # the state was rolled back: it is not this step's
                step, decision = self._shared.last_save_step, False
            self._discard_save_of = None
        if notice is not None:
            self._stop_for(notice, step, state, metadata)
        if decision:
            self.save(step, state, metadata=metadata)
        elif self._memory_due(step):
            with self._reporter.phase("save"):
                self._pipeline.snapshot_to_memory(step, state, metadata)
        return decision

    def _memory_due(self, step: int) -> bool:
        """Whether ``memory_every`` asks for a memory snapshot after ``step`` (the same on every
        rank: only step-counting policies are accepted with several ranks)."""
        pipeline = self._pipeline
        if self.memory_every is None or step == pipeline.last_memory_step:
            return False
        context = pipeline.save_context(step)
        if pipeline.last_memory_step is not None and pipeline.last_memory_s is not None:
            context = dataclasses.replace(
                context,
                last_save_step=pipeline.last_memory_step,
                last_save_s=pipeline.last_memory_s,
            )
        return self.memory_every.should_save(context)

    def _stop_for(
        self, notice: Notice, step: int, state: TrainState, metadata: dict[str, Any] | None
    ) -> NoReturn:
        """The emergency checkpoint of ``step``, then :class:`PreemptedExit` (exit code 75)."""
        started = time.monotonic()
        saved = self._pipeline.save_before_stopping(notice, step, state, metadata, self._agreement)
        self._reporter.preempted(notice.source, step, time.monotonic() - started, saved=saved)
        self._close(self._tiers.durable_wait_when_stopping(notice))
        raise PreemptedExit(notice, step)

    def save(self, step: int, state: TrainState, *, metadata: dict[str, Any] | None = None) -> bool:
        """Checkpoint ``state`` as the state after ``step`` steps; returns whether a save started.

        With a save of an earlier step still being written, ``on_busy`` decides: wait for it, or
        skip this one (returns False). Synchronous managers return once the checkpoint is
        committed; asynchronous ones once the state is copied.
        """
        self._shared.check_writer("save")
        with self._reporter.phase("save"):
            return self._pipeline.save(step, state, metadata)

    @property
    def last_blocking_s(self) -> float:
        """How long the last :meth:`save` paused the training loop."""
        return self.stats.last_blocking_s

    def wait(self) -> CommitResult | None:
        """Block until the save in flight (if any) is committed and retention has run after it
        (what it removed is out of the root; deleting the files finishes in the background).

        Raises :class:`CheckpointWriteError` if the save failed (a full disk only with
        ``on_disk_full="raise"``).
        """
        return self._pipeline.wait()

    def prune(self, keep: RetentionPolicy, *, dry_run: bool = False) -> list[int]:
        """Apply ``keep`` now; returns the steps removed (or that would be, with ``dry_run``).

        The newest checkpoint that verifies is never removed.
        """
        self._shared.check_writer("prune")
        self.wait()
        return self._retention.prune(keep, dry_run=dry_run)

    def restore(self, state: TrainState, step: int | None = None) -> int:
        """Load the newest valid checkpoint (or ``step``) into ``state``; returns its step, 0 if none.

        A checkpoint that fails verification is logged and skipped for the next newest. One that
        verifies but does not fit ``state`` raises :class:`StateMismatchError`: an older checkpoint
        would not fit either, and silently starting over would discard the run.
        """
        self._shared.check_open()
        started = time.perf_counter()
        with self._reporter.phase("restore"):
            self.wait()
            restored = self._restorer.restore(state, step)
        if restored is not None:
            self._report_restore(restored, started)
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
        self._shared.check_writer("rollback")
        started = time.perf_counter()
        with self._reporter.phase("restore"):
            self.wait()
            restored = self._restorer.rollback(state, before)
        if restored is None:
            return None
        self._report_restore(restored, started)
        self._discard_save_of = anomaly_step
        return restored[0]

    def _report_restore(self, restored: tuple[int, str], started: float) -> None:
        self._pipeline.protect(self._restorer.held_in_memory_only)
        self._reporter.restored(
            restored[0], restored[1], time.perf_counter() - started,
            kind=self._restorer.last_kind, nbytes=self._restorer.last_bytes,
            verified_by=self._restorer.last_verified_by,
        )  # fmt: skip

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint directory under the root, newest first, with a quick validity check."""
        self.wait()
        return [
            describe_checkpoint(self.storage, s, p)
            for s, p in committed_steps(self.storage, self.root)
        ]

    def replication_status(self) -> builtins.list[TierStatus]:
        """Where each durable tier stands (rank 0; other ranks copy nothing: empty)."""
        return self._tiers.status()

    def close(self) -> None:
        """Wait for the save in flight and for the newest checkpoint to be durable in every tier
        (at most ``remote_timeout_s``), then release the threads. Safe to call twice."""
        self._close(self.remote_timeout_s)

    def _close(self, durable_wait_s: float) -> None:
        if self._shared.closed:
            return
        try:
            with self._reporter.phase("save"):  # the last commit may take long: not a hang
                self.wait()
                self._tiers.wait_durable(
                    durable_wait_s,
                    on_rank0=functools.partial(
                        self._agreement.on_leaders, self._shared.placement.leads
                    ),
                )
        finally:
            self._shared.closed = True
            self._pipeline.stop()
            self._tiers.stop()
            self._retention.after_tiers_stopped()
            self._reporter.closed()
            self._preemption.uninstall()
            self._shared.release_lock()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _memory_snapshots(options: ManagerOptions, root: str, group: Group) -> MemorySnapshots | None:
    """This rank's snapshots in the agent's memory, when under ``crashproof run`` and wanted."""
    every = options.memory_every
    if (
        every is not None
        and group.world_size > 1
        and not getattr(every, "same_on_every_rank", False)
    ):
        raise ConfigError(
            f"CheckpointManager(memory_every={every!r}) with {group.world_size} ranks: a restore "
            "takes a step from memory only when every rank holds it, so every rank must snapshot "
            "the same steps; use a policy that counts steps (EverySteps)"
        )
    if options.read_only or not options.memory:
        return None
    if group.world_size > 1:
        # Named by rank 0's root: on node-local roots each node's path may differ, and a node
        # that takes a lost one's place must find its snapshots under the name its peers kept.
        root = str(group.broadcast(root))
    snapshots = MemorySnapshots.open(root, group.rank, group.world_size, options.staging_buffers)
    # Memory snapshots are agreed on at every one of them: all ranks take part, or none.
    if (
        every is not None
        and group.world_size > 1
        and not all(group.all_gather(snapshots is not None))
    ):
        if snapshots is not None:
            snapshots.close()
        snapshots = None
        if group.rank == 0:
            log.warning(
                "CheckpointManager(memory_every=%r): some ranks cannot reach crashproof "
                "run's agent; memory snapshots are off for every rank",
                every,
            )
        return None
    if snapshots is None and every is not None and group.rank == 0:
        log.info(
            "CheckpointManager(memory_every=%r): memory snapshots are kept by crashproof run's "
            "agent; not under it, only the disk checkpoints are taken",
            every,
        )
    return snapshots
