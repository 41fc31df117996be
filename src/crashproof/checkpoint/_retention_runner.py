"""Retention as a writing manager runs it, on rank 0 (on node-local roots, on each node's first
rank, in its node's root): :class:`RetentionRunner`.

The plan itself is :func:`~crashproof.checkpoint.root._catalog.retention_plan`'s; this module decides
what is kept anyway (the checkpoint just saved, the newest valid one, the base of the next deltas,
what a tier has not taken yet), stops for good when a second writer's checkpoints appear in a root
no lock protects, and removes early what retention would remove after a save that found the disk
full.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from crashproof.checkpoint._manager_state import ManagerState
from crashproof.checkpoint._tier_coordination import TierCoordinator
from crashproof.checkpoint.root import (
    checkpoint_facts,
    committed_steps,
    leftover_dirs,
    newest_verified,
    prune_plan,
    retention_plan,
)
from crashproof.checkpoint.save import Snapshot
from crashproof.policy import CheckpointFacts, RetentionPolicy
from crashproof.storage import deferring_removals

__all__ = ["RetentionRunner"]

from crashproof.errors import ConfigError

log = logging.getLogger("crashproof.checkpoint")


class _Reaper:
    """Deletes, on a thread of its own, the checkpoints retention renamed aside: out of the
    root at once, their deletion (a fraction of a second per gigabyte) off the save's path."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []

    def submit(self, delete: Callable[[], None]) -> None:
        if os.getpid() != self._pid:  # a forked child has no thread of its parent's
            delete()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="crashproof-reaper")
        # (the finished ones are dropped: a run of weeks makes thousands of removals)
        self._pending = [future for future in self._pending if not future.done()]
        self._pending.append(self._pool.submit(delete))

    def drain(self) -> None:
        """Wait until every deletion handed over is done (the disk is full; the manager closes)."""
        if os.getpid() != self._pid:
            return
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.drain()
        if self._pool is not None and os.getpid() == self._pid:
            self._pool.shutdown(wait=True)
            self._pool = None


class RetentionRunner:
    """Applies ``keep`` to the root of ``shared`` without ever removing what must stay."""

    def __init__(self, shared: ManagerState, keep: RetentionPolicy, tiers: TierCoordinator) -> None:
        self._shared = shared
        self._keep = keep
        self._tiers = tiers
        self._reaper = _Reaper()

    def kept_anyway(self, keep_always: int) -> set[int]:
        """What retention never removes now: ``keep_always``, the newest valid checkpoint, the
        base of the next deltas, and what a tier has not taken yet."""
        keep = {keep_always}
        if self._shared.newest_valid is not None:
            keep.add(self._shared.newest_valid)
        if self._shared.delta_base is not None:  # the next deltas are taken against it
            keep.add(self._shared.delta_base.step)
        return keep | self._tiers.protected()  # not yet copied to a durable tier

    def unusable(self) -> frozenset[int]:
        """The steps whose local copy this run found corrupt, or not whole on every node: never
        counted as kept, removed first when the disk is full (never the newest valid
        checkpoint, which verified)."""
        shared = self._shared
        return frozenset((shared.corrupt | shared.stranded) - {shared.newest_valid})

    def apply(self, *, keep_always: int) -> None:
        """Remove what the retention policy does not keep (never the newest valid checkpoint).

        Temporary directories are not touched here: another rank may already be writing the next
        save's. Abandoned ones are removed when a manager starts.
        """
        shared = self._shared
        try:
            if shared.retention_off:
                return
            shared.check_lock()  # never remove from a root this writer no longer holds
            keep = self.kept_anyway(keep_always)
            found = committed_steps(shared.storage, shared.root)
            facts = checkpoint_facts(shared.storage, found)
            if shared.lock is None and self._second_writer_in(facts, keep_always):
                return
            unusable = self.unusable()
            plan = retention_plan(
                shared.storage, found, self._keep, keep_always=keep, facts=facts, unusable=unusable
            )
            # A copy this run found corrupt (or not whole on every node) is not counted among
            # the kept, but only a full disk removes it (remove_early): until then it stays, for
            # whoever looks into why (or for the node that holds the rest of it).
            plan = [(step, path) for step, path in plan if step not in unusable]
            with deferring_removals(self._reaper.submit):
                for step, path in plan:
                    log.info("retention: removing checkpoint step %d", step)
                    shared.storage.remove(path)
                    shared.corrupt.discard(step)
                    shared.stranded.discard(step)
        except Exception as exc:  # a failed clean-up must not fail the save that just committed
            log.warning(
                "retention in %s failed: %s; will retry after the next save", shared.root, exc
            )

    def prune(self, keep: RetentionPolicy, *, dry_run: bool) -> list[int]:
        """Apply ``keep`` now (never to the newest checkpoint that verifies); returns the steps
        removed, or that would be with ``dry_run``. Only the rank that leads the root removes
        (rank 0; on node-local roots, each node's first rank in its node's)."""
        shared = self._shared
        shared.check_lock()
        if shared.placement.node_local and shared.newest_valid is None:
            # Each node sees its own root only: the newest step whose part verifies there may be
            # one no other node holds, and keeping it would remove the last step all hold.
            raise ConfigError(
                f"prune on the node-local root {shared.storage.describe(shared.root)}: restore "
                "or save first, so the manager knows the newest checkpoint every node holds "
                "(prune keeps it)"
            )
        doomed = prune_plan(shared.storage, shared.root, keep, keep_always=shared.newest_valid)
        if not dry_run and shared.placement.leads:
            for _, path in doomed:
                self._shared.storage.remove(path)
        return sorted(step for step, _ in doomed)

    def after_tiers_stopped(self) -> None:
        """At close: the tiers are stopped, what they spared may go now; every deletion handed
        over is done when this returns."""
        try:
            if self._tiers.replicating and self._shared.newest_valid is not None:
                self.apply(keep_always=self._shared.newest_valid)
        finally:
            self._reaper.close()

    def _second_writer_in(self, facts: list[CheckpointFacts], ours: int) -> bool:
        """Whether ``facts`` show checkpoints this manager did not commit and did not find when
        it started (where no lock keeps a second writer out: object stores). Then retention
        stops for good (it would delete the other writer's checkpoints, or they ours) and the
        next call into the manager raises."""
        shared = self._shared
        foreign = []
        for fact in facts:
            if fact.step == ours or shared.known.get(fact.step, 0.0) is None:
                shared.known[fact.step] = fact.created_unix  # ours, or found at start: first look
            elif fact.step not in shared.known or shared.known[fact.step] != fact.created_unix:
                foreign.append(fact)  # new and not ours, or committed again, not by us
        if not foreign:
            return False
        shared.retention_off = True
        steps = ", ".join(str(f.step) for f in foreign)
        shared.second_writer = (
            f"checkpoints of steps {steps} in {shared.storage.describe(shared.root)} were committed "
            "by another writer while this manager writes the root: two writers on one root "
            "delete each other's checkpoints and restore mixes their runs. Retention is off for "
            "this manager. Give each run its own root; a job that only reads uses "
            "CheckpointManager(..., read_only=True) (docs/storage.md)"
        )
        log.error("%s", shared.second_writer)
        return True

    def remove_early(self, snapshot: Snapshot) -> list[int]:
        """Rank 0, the disk being full: remove now what retention would once ``snapshot``
        commits; returns the steps."""
        shared = self._shared
        self._reaper.drain()  # the space of what retention removed before is free first
        if shared.retention_off:
            return []
        keep = self.kept_anyway(snapshot.step)
        if shared.newest_valid is None and shared.placement.node_local:
            log.warning(
                "disk full in %s before any checkpoint was restored or saved: retention removes "
                "nothing early (on a node-local root only each node's own part is seen, which "
                "cannot tell the newest checkpoint every node holds)",
                shared.storage.describe(shared.root),
            )
            return []
        if shared.newest_valid is None:  # nothing restored nor saved yet: find it, by checksums
            newest = newest_verified(shared.storage, shared.root)
            if newest is not None:
                keep.add(newest)
        if snapshot.delta is not None:
            keep.add(snapshot.delta[1].step)
        found = committed_steps(shared.storage, shared.root)
        unusable = self.unusable()
        facts = [
            f
            for f in checkpoint_facts(shared.storage, found)
            if f.step != snapshot.step and f.step not in unusable
        ]
        facts.append(CheckpointFacts(snapshot.step, time.time(), snapshot.metadata))
        plan = retention_plan(
            shared.storage, found, self._keep, keep_always=keep, facts=facts, unusable=unusable
        )
        for step, path in plan:
            log.warning(
                "disk full: retention removes checkpoint step %d%s before step %d commits",
                step,
                _why_unusable(shared, step),
                snapshot.step,
            )
            shared.storage.remove(path)
            shared.corrupt.discard(step)
            shared.stranded.discard(step)
        if shared.lock is not None:  # the lock holder's own leftovers: trash of removals
            for leftover in leftover_dirs(shared.storage, shared.root):
                if os.path.basename(leftover).startswith(".trash-"):
                    shared.storage.remove(leftover)
        return [step for step, _ in plan]


def _why_unusable(shared: ManagerState, step: int) -> str:
    """What the log says of a step removed early that this run could not restore."""
    if step in shared.corrupt:
        return " (found corrupt by this run's restore)"
    if step in shared.stranded:
        return " (not whole on every node's root)"
    return ""
