"""Durable tiers: committed checkpoints copied from the local root to remote storage, in the
background, one thread per tier.

Each :class:`TierReplicator` keeps its tier in step with the local root by repeated rounds, each
doing one thing, most urgent first: remove what a rollback abandoned (its marks are kept in the
local root: :mod:`crashproof.checkpoint.root._rollbacks`), upload the newest checkpoint the tier lacks,
upload older ones the tier's retention would keep (at most ``max_backlog`` pending); the tier's
retention runs after every upload. Rounds start when a save commits (:meth:`notify`) and every
few seconds anyway, so work left by an earlier process is picked up too.

A round that fails (the store is down, hangs past its timeout, refuses) is retried after an
exponential backoff with full jitter, as cloud SDKs recommend; training never waits for any of it.
While a tier is failing its backlog is bounded: only the newest ``max_backlog`` pending
checkpoints are kept for it (the manager spares them locally), older ones are dropped and
reported. Every upload, failure, recovery and drop is logged and, under ``crashproof run``,
recorded as an event.

What a tier is (:class:`Tier`) lives in :mod:`crashproof.checkpoint.tiers._tier`; the plan of what to
upload next, in :mod:`crashproof.checkpoint.tiers._backlog`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from crashproof.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    checkpoint_dir_name,
    digest,
    parse_manifest,
)
from crashproof.checkpoint.restore import verify_checkpoint
from crashproof.checkpoint.root import abandoned_steps, committed_steps, hold_root, read_marks
from crashproof.checkpoint.tiers._backlog import LocalCheckpoint, LocalCheckpoints, plan_backlog
from crashproof.checkpoint.tiers._tier import Tier, TierStatus
from crashproof.checkpoint.tiers._transfer import remove_checkpoint, upload_checkpoint
from crashproof.errors import CorruptCheckpointError
from crashproof.policy import CheckpointFacts, RetentionPolicy, retained
from crashproof.storage import Storage, read_all

__all__ = [
    "TierReplicator",
]

log = logging.getLogger("crashproof.replication")

Emit = Callable[..., None]
"""``emit(event, **fields)``: where replication events go (the run's event log, or nowhere)."""

POLL_S = 5.0
"""A round at least this often even without a commit: picks up checkpoints of earlier runs."""
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class TierReplicator:
    """Keeps one tier in step with a local checkpoint root, on its own daemon thread."""

    def __init__(
        self,
        local: Storage,
        local_root: str,
        tier: Tier,
        *,
        keep: RetentionPolicy,
        emit: Emit,
        on_durable: Callable[[], None] = lambda: None,
    ) -> None:
        self.tier = tier
        self._local, self._local_root = local, local_root
        self._keep = tier.keep if tier.keep is not None else keep
        self._emit = emit
        self._on_durable = on_durable  # local retention may now remove what it had to spare
        self._remote_root, remote = tier.open()
        # A tier on a local or network filesystem is a root like any other: its replicator is
        # its writer, holds its lock (a run writing there refuses this one, with
        # RootLockedError naming it) and checks the hold before every change it makes there.
        self._remote, self._hold = hold_root(remote, self._remote_root)
        self._warned_foreign = False
        self._cond = threading.Condition()
        self._wake = False
        self._stopping = False
        # The tier as this replicator knows it: step -> digest of its manifest (None: unknown
        # until the first successful listing), with each step's facts and delta base.
        self._durable: dict[int, str] | None = None
        self._remote_facts: dict[int, CheckpointFacts] = {}
        self._remote_bases: dict[int, int | None] = {}
        self._relist = False
        self._local_checkpoints = LocalCheckpoints(local, local_root)
        self._given_up: set[int] = set()  # corrupt here: never copied
        self._dropped: list[int] = []
        self._failing_since: float | None = None
        self._uploading: tuple[int, float] | None = None
        self._failures = 0
        self._jitter = random.Random()  # never the global RNG: that one is the training's
        self._last_error = ""
        self._uploaded = 0
        self._bytes = 0
        self._thread = threading.Thread(
            target=self._run, name=f"crashproof-replicate-{tier.uri}", daemon=True
        )
        self._thread.start()

    # -- what the manager calls -------------------------------------------------------------

    def notify(self) -> None:
        """A checkpoint was committed, removed or rolled back locally: start a round now."""
        with self._cond:
            self._wake = True
            self._cond.notify_all()

    def pending(self) -> list[int]:
        """Local checkpoints the tier still waits for, most urgent first. Computed afresh (not
        from the last round, which may be stuck in a transfer to a store that hangs), so a
        checkpoint committed a moment ago is covered before any round has run."""
        return self._backlog(self._local_checkpoints.scan())[0]

    def protected(self) -> set[int]:
        """What local retention must spare: :meth:`pending`."""
        return set(self.pending())

    def status(self) -> TierStatus:
        pending = sorted(self.pending(), reverse=True)
        with self._cond:
            durable = self._durable or {}
            return TierStatus(
                uri=self.tier.uri,
                newest_durable=max(durable) if durable else None,
                pending=pending,
                uploading=self._uploading,
                failing_since=self._failing_since,
                last_error=self._last_error,
                uploaded=self._uploaded,
                bytes_uploaded=self._bytes,
                dropped=list(self._dropped),
            )

    def known(self) -> dict[str, Any]:
        """What the tier holds, for the agent's status file: ``durable`` (step -> manifest
        digest) and ``facts`` (step -> [commit time, metadata]); steps as strings (JSON)."""
        with self._cond:
            return {
                "durable": {str(s): d for s, d in (self._durable or {}).items()},
                "facts": {
                    str(s): [f.created_unix, dict(f.metadata)]
                    for s, f in self._remote_facts.items()
                },
            }

    def wait_durable(self, timeout_s: float) -> bool:
        """Wait until every local checkpoint the tier wants (the newest included) is durable
        there and nothing a rollback abandoned is left; False on timeout or when the thread is
        gone."""
        deadline = time.monotonic() + timeout_s
        self.notify()
        while self.pending() or self._durable is None or self._abandoned_here():
            left = deadline - time.monotonic()
            if left <= 0 or not self._thread.is_alive():
                return False
            with self._cond:
                self._cond.wait(min(left, 0.5))
        return True

    def _abandoned_here(self) -> bool:
        """Whether the tier still holds a checkpoint a rollback abandoned."""
        marks = read_marks(self._local, self._local_root)
        with self._cond:
            return bool(abandoned_steps(marks, self._durable or {}, self._remote_facts))

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread after the transfer in progress (waiting at most ``timeout_s``: a hung
        store cannot hold up the process; the daemon thread dies with it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._hold is not None and not self._thread.is_alive():
            self._hold.release()  # (a thread stuck in a transfer keeps it: the process's end frees it)

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
            try:
                busy = self._round()
            except Exception as exc:  # anything the store throws: back off and try again
                self._failed(exc)
                delay = self._jitter.uniform(
                    0, min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**self._failures)
                )
                self._sleep(delay, wake_early=False)
                continue
            self._recovered()
            if not busy:
                self._sleep(POLL_S, wake_early=True)

    def _sleep(self, seconds: float, *, wake_early: bool) -> None:
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self._stopping:
                if wake_early and self._wake:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._wake = False

    def _round(self) -> bool:
        """One unit of work; True when there may be more to do at once."""
        if self._durable is None or self._relist:
            self._list_remote()
            self._relist = False
            self._apply_retention()
        if self._forget_abandoned():
            return True
        local = self._local_checkpoints.scan()
        todo = self._plan(local)
        if todo:
            self._upload(todo[0], local)
            self._apply_retention()  # after every upload: saves faster than uploads must not
            return True  # let the tier grow without bound
        return False

    def _list_remote(self) -> None:
        """Learn what the tier holds; remove uploads that never committed (no manifest)."""
        self._remote.make_dirs(self._remote_root)
        durable: dict[int, str] = {}
        facts: dict[int, CheckpointFacts] = {}
        bases: dict[int, int | None] = {}
        for step, path in committed_steps(self._remote, self._remote_root):
            if MANIFEST_NAME not in self._remote.list(path):
                log.info("%s: removing an upload that never committed", self._remote.describe(path))
                remove_checkpoint(self._remote, path)
                continue
            manifest_path = self._remote.join(path, MANIFEST_NAME)
            try:  # an I/O error propagates: the round fails and is retried
                data = read_all(self._remote, manifest_path, limit=MAX_MANIFEST_BYTES)
                manifest = parse_manifest(data, self._remote.describe(manifest_path))
            except (CorruptCheckpointError, ValueError, EOFError) as exc:
                log.warning("%s; it will be replaced", exc)
                continue
            durable[step] = digest(data)
            facts[step] = CheckpointFacts(step, manifest.created_unix, manifest.metadata)
            bases[step] = manifest.base_step
        with self._cond:
            self._durable, self._remote_facts, self._remote_bases = durable, facts, bases
            self._cond.notify_all()

    def _forget_abandoned(self) -> bool:
        """Remove from the tier what a rollback abandoned (marks in the local root); True if
        anything was removed. A failure raises: the round is retried, the marks stay."""
        marks = read_marks(self._local, self._local_root)
        if not marks:
            return False
        with self._cond:
            doomed = abandoned_steps(marks, self._durable or {}, self._remote_facts)
        for step in sorted(doomed, reverse=True):
            log.warning("rollback: removing checkpoint step %d from %s", step, self.tier.uri)
            remove_checkpoint(
                self._remote, self._remote.join(self._remote_root, checkpoint_dir_name(step))
            )
            self._forgot(step)
        return bool(doomed)

    def _forgot(self, step: int) -> None:
        with self._cond:
            (self._durable or {}).pop(step, None)
            self._remote_facts.pop(step, None)
            self._remote_bases.pop(step, None)

    def _plan(self, local: dict[int, LocalCheckpoint]) -> list[int]:
        """What to upload now, most urgent first (see :func:`plan_backlog`); reports drops."""
        todo, dropped = self._backlog(local)
        newly_dropped = [s for s in dropped if s not in self._dropped]
        if newly_dropped:
            log.warning(
                "%s is behind by %d checkpoints; giving up on steps %s for it (max_backlog=%d)",
                self.tier.uri,
                len(todo) + len(dropped),
                newly_dropped,
                self.tier.max_backlog,
            )
            self._emit("replication_dropped", tier=self.tier.uri, steps=newly_dropped)
            self._dropped = sorted(set(self._dropped) | set(newly_dropped))[-100:]
        return todo

    def _backlog(self, local: dict[int, LocalCheckpoint]) -> tuple[list[int], list[int]]:
        with self._cond:
            durable = dict(self._durable or {})
            remote_facts = dict(self._remote_facts)
            given_up = set(self._given_up)
        return plan_backlog(
            local, durable, remote_facts, self._keep, self.tier.max_backlog, given_up
        )

    def _upload(self, step: int, local: dict[int, LocalCheckpoint]) -> None:
        entry = local[step]
        remote_dir = self._remote.join(self._remote_root, checkpoint_dir_name(step))
        started = time.perf_counter()
        with self._cond:
            self._uploading = (step, time.time())
        try:
            nbytes = upload_checkpoint(
                self._local,
                entry.path,
                entry.manifest,
                self._remote,
                remote_dir,
                parallel=self.tier.parallel,
                verify=self.tier.verify,
            )
        except FileNotFoundError:
            if not self._local.list(entry.path):  # retention removed it meanwhile: superseded
                log.info("checkpoint step %d was removed before it reached %s", step, self.tier.uri)
                return
            # A file missing, or a link, FIFO or device in place of one: the local checkpoint's
            # fault, which no retry mends (a FIFO would be retried for as long as the run).
            self._give_up_if_corrupt_here(step, entry)
            raise
        except CorruptCheckpointError:
            self._give_up_if_corrupt_here(step, entry)
            raise
        finally:
            with self._cond:
                self._uploading = None
        seconds = time.perf_counter() - started
        with self._cond:
            assert self._durable is not None
            self._durable[step] = digest(entry.manifest)
            self._remote_facts[step] = entry.facts
            self._remote_bases[step] = entry.base_step
            self._uploaded += 1
            self._bytes += nbytes
            self._cond.notify_all()
        log.info(
            "checkpoint step %d is durable in %s: %.1f MB in %.2f s",
            step,
            self.tier.uri,
            nbytes / 1e6,
            seconds,
        )
        try:
            waiting = len(self.pending())
        except Exception:  # a listing that fails now is the next upload's failure to report
            waiting = None
        self._emit(
            "replicated",
            tier=self.tier.uri,
            step=step,
            bytes=nbytes,
            seconds=round(seconds, 4),
            pending=waiting,
        )
        self._on_durable()

    def _give_up_if_corrupt_here(self, step: int, entry: LocalCheckpoint) -> None:
        """The copy did not verify: if the local checkpoint itself does not, no retry can help."""
        try:
            verify_checkpoint(self._local, entry.path)
            return  # damaged in transit: retried
        except (CorruptCheckpointError, FileNotFoundError) as exc:
            why = str(exc)
        except OSError:  # the disk refused a read (permissions, EIO): retried, it may pass
            return
        with self._cond:
            self._given_up.add(step)
        log.error(
            "checkpoint step %d is corrupt on the local disk (%s); it will not be copied to %s",
            step,
            why,
            self.tier.uri,
        )
        self._emit("replication_dropped", tier=self.tier.uri, steps=[step], reason=why[:500])

    def _apply_retention(self) -> None:
        """The tier's retention: never its newest checkpoint, nor a kept delta's base. Judged
        from what the replicator knows (no reads from the store); a kept delta whose base is
        unknown stops the pass rather than risk removing that base."""
        with self._cond:
            durable = dict(self._durable or {})
            facts = dict(self._remote_facts)
            bases = dict(self._remote_bases)
        if not durable:
            return
        kept = retained(self._keep, [facts.get(s, CheckpointFacts(s)) for s in durable])
        kept.add(max(durable))
        ours = self._newest_ours(durable)
        if ours is not None:
            kept.add(ours)
        if any(s not in bases for s in kept):
            return
        kept |= {b for s in kept if (b := bases[s]) is not None}
        for step in sorted(set(durable) - kept):
            log.info("retention: removing checkpoint step %d from %s", step, self.tier.uri)
            remove_checkpoint(
                self._remote, self._remote.join(self._remote_root, checkpoint_dir_name(step))
            )
            self._forgot(step)

    def _newest_ours(self, durable: dict[int, str]) -> int | None:
        """The newest local checkpoint the tier holds as it is here. Tier retention keeps it
        even when the tier holds newer steps (another run's, written there before): else
        retention would remove each upload right after it, and the run would never be durable."""
        local = self._local_checkpoints.scan()
        same = [s for s, e in local.items() if durable.get(s) == digest(e.manifest)]
        if not same:
            return None
        newer = sorted(s for s in durable if s > max(same) and s not in local)
        if newer and not self._warned_foreign:
            self._warned_foreign = True
            log.warning(
                "%s holds checkpoints of steps %s, newer than this run's newest (%d) and not in "
                "%s: another run's? Its retention keeps this run's newest checkpoint as well; give "
                "each run its own tier",
                self.tier.uri,
                newer[:10],
                max(same),
                self._local.describe(self._local_root),
            )
        return max(same)

    # -- failures ----------------------------------------------------------------------------

    def _failed(self, exc: Exception) -> None:
        self._failures += 1
        why = f"{type(exc).__name__}: {exc}"
        with self._cond:
            first = self._failing_since is None
            if first:
                self._failing_since = time.time()
            self._last_error = why
        try:
            pending = self.pending()
        except Exception:
            pending = []
        log.log(
            logging.ERROR if first else logging.WARNING,
            "replication to %s failed (attempt %d, %d checkpoints pending): %s; training goes on, "
            "retrying",
            self.tier.uri,
            self._failures,
            len(pending),
            why,
        )
        self._emit(
            "replication_failed",
            tier=self.tier.uri,
            attempt=self._failures,
            pending=pending,
            error=why[:500],
        )
        self._relist = True  # a failed upload may have left anything behind: look again

    def _recovered(self) -> None:
        if self._failing_since is None:
            return
        down_s = time.time() - self._failing_since
        log.warning("replication to %s works again after %.1f s", self.tier.uri, down_s)
        self._emit("replication_recovered", tier=self.tier.uri, down_s=round(down_s, 3))
        with self._cond:
            self._failing_since = None
            self._last_error = ""
        self._failures = 0
