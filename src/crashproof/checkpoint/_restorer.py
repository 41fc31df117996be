"""A manager's restore and rollback: :class:`Restorer`.

Candidates are the checkpoints of the local root and of every tier, newest first. Each is tried
from each source (the local copy, then each tier's: downloaded into the local root by rank 0, or
read in place by a read-only manager) until one verifies on every rank and fits the state; only
then is anything written into the live tensors. A candidate that vanished while it was read makes
the restore list the checkpoints again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from crashproof import _host_memory
from crashproof._console import announce
from crashproof._host_memory import HEADROOM_BYTES
from crashproof.checkpoint._agreement import RankAgreement
from crashproof.checkpoint._group import Group
from crashproof.checkpoint._manager_state import ManagerState
from crashproof.checkpoint._tier_coordination import TierCoordinator
from crashproof.checkpoint.format import Manifest, ReadBuffer, checkpoint_dir_name
from crashproof.checkpoint.memory import MemorySnapshots
from crashproof.checkpoint.restore import (
    Layout,
    PartialManifest,
    RankPlan,
    RankRead,
    checkpoint_not_found,
    part_here,
    plan_node_part,
    plan_restore,
    read_manifest,
    saved_layout,
)
from crashproof.checkpoint.root import (
    RollbackMark,
    abandoned,
    committed_steps,
    read_marks,
    record_rollback,
    unreadable,
)
from crashproof.checkpoint.save import exactness_environment, named_tensors
from crashproof.checkpoint.tiers import download_checkpoint
from crashproof.errors import (
    CheckpointReadError,
    ConfigError,
    CorruptCheckpointError,
    CrashproofError,
    StateMismatchError,
)
from crashproof.state import TrainState
from crashproof.storage import Storage, local_backend

__all__ = ["Restorer"]

log = logging.getLogger("crashproof.checkpoint")

_RELISTS = 3
"""How many times a restore lists the checkpoints again after one vanished while it was read
(a writer's retention removed it after committing a newer one)."""

Candidate = tuple[int, str, list[str | None]]
"""A checkpoint to try: its step, its local path, and its sources (None: the local copy,
:data:`MEMORY`: the agent's memory, else a tier's URI)."""

NODE_TIERS = "node tiers"
"""On node-local roots, the source of a step some node holds only in its prefix of a tier:
each node's first rank downloads what its root lacks, then every rank reads its node's root."""

MEMORY = "memory"
"""The source of a step every rank holds in the memory of ``crashproof run``'s agent: tried
before any copy in storage."""


class Restorer:
    """Finds the newest checkpoint that verifies, across the root and its tiers, and loads it."""

    def __init__(
        self,
        shared: ManagerState,
        group: Group,
        agreement: RankAgreement,
        tiers: TierCoordinator,
        *,
        read_only: bool,
        memory_bytes: int | None = None,
        memory: MemorySnapshots | None = None,
    ) -> None:
        self._shared = shared
        self._memory = memory
        self.last_kind = "local"
        """Where the last restore read from: ``memory`` (this node's agent), ``peer`` (some
        rank's part copied from another node's agent), ``local`` or ``tier``."""
        self.last_bytes = 0
        """How many bytes this rank read and verified in the last restore."""
        self.last_verified_by = "restore"
        """``agent``: the last restore copied a snapshot the agent had checked already (see
        :func:`crashproof.checkpoint.memory.check_held`); ``restore``: it hashed what it read."""
        self.held_in_memory_only: int | None = None
        """The step last restored from the agent's memory when no disk or tier held it (else
        None): its staging slot is then the only copy of the state training resumed from."""
        self._memory_bytes = memory_bytes  # ManagerOptions.restore_memory_bytes
        self._group = group
        self._agreement = agreement
        self._tiers = tiers
        self._read_only = read_only
        self._restored_environment: dict[str, Any] = {}
        self._node_tier_digests: dict[int, str] = {}
        """On node-local roots: the manifest checksum of each step offered from the tiers."""
        self._node_disk_steps: set[int] = set()
        """On node-local roots: the steps every node holds on its disk (last listed)."""

    def restore(
        self, state: TrainState, step: int | None, *, below: int | None = None
    ) -> tuple[int, str] | None:
        """The step and path restored, or None when there was nothing valid to restore.

        Of one step, the local copy is tried first and each remote copy after it. A candidate that
        vanished while it was read (another process's retention removed it after committing a
        newer one) makes the restore list the checkpoints again, up to ``_RELISTS`` times: a
        reader must not fall back past a newer checkpoint, or to step 0.
        """
        root, storage = self._shared.root, self._shared.storage
        skipped: list[str] = []
        tried: set[tuple[int, str | None]] = set()
        in_memory = set() if self._memory is None else self._memory.common_steps(self._group)
        for listing in range(_RELISTS + 1):
            if self._shared.placement.node_local:  # (each rank lists its node's root)
                candidates = self._candidates_on_nodes(in_memory)
            else:
                candidates = self._agreement.on_rank0(
                    functools.partial(self._candidates, in_memory)
                )
            if below is not None:
                candidates = [c for c in candidates if c[0] < below]
            if step is not None:
                candidates = [c for c in candidates if c[0] == step]
                if not candidates and listing == 0:
                    raise checkpoint_not_found(storage.describe(root), step)
            vanished: list[int] = []
            for candidate, path, sources in candidates:
                refused: list[str] = []
                for source in sources:
                    if (candidate, source) in tried:
                        continue
                    tried.add((candidate, source))
                    restored = self._try_source(
                        state, candidate, path, source, skipped, vanished, refused
                    )
                    if restored is not None:
                        if self._memory is not None:  # (those after it were abandoned)
                            self._memory.drop(newer_than=restored[0])
                        only_memory = source == MEMORY and set(sources) == {MEMORY}
                        self.held_in_memory_only = candidate if only_memory else None
                        return restored
                    if vanished:  # the listing is out of date: newer ones may be there now
                        tried.discard((candidate, source))  # (and this one back, re-saved)
                        break
                if vanished:
                    break
                if refused:
                    raise _read_refused(candidate, refused[0])
            if not vanished:
                break
            log.warning(
                "checkpoint step %d vanished while it was read; listing %s again", vanished[0], root
            )
        else:  # the newest kept vanishing: falling back past them, or to step 0, would lose them
            raise CheckpointReadError(
                f"checkpoint step {vanished[0]} in {storage.describe(root)} vanished while it was "
                f"read, {_RELISTS + 1} times (a writer's retention removing checkpoints faster "
                "than this restore reads them?). Nothing was changed: restore again"
            )
        if step is not None:
            raise CorruptCheckpointError(
                f"checkpoint step {step} in {root} is not valid: {skipped[0]}"
            )
        if skipped:
            log.error(
                "no valid checkpoint in %s (%d skipped); starting from step 0", root, len(skipped)
            )
        return None

    def rollback(self, state: TrainState, before: int) -> tuple[int, str] | None:
        """Restore the newest valid checkpoint of a step before ``before`` and, on rank 0, remove
        every checkpoint after it (the tiers' copies are marked abandoned first)."""
        restored = self.restore(state, None, below=before)
        if restored is None or not self._shared.placement.leads:
            return restored
        step, storage, root = restored[0], self._shared.storage, self._shared.root
        self._shared.check_lock()
        if self._tiers.tiers:  # first, so the tiers' copies count as abandoned whatever happens
            record_rollback(storage, root, step)
        for later, later_path in committed_steps(storage, root):
            if later > step:
                log.warning("rollback: removing checkpoint step %d (after the anomaly)", later)
                storage.remove(later_path)
        self._tiers.notify()
        return restored

    def _candidates(self, in_memory: set[int]) -> list[Candidate]:
        """Every checkpoint, newest first, and ``in_memory`` (the steps every rank holds in the
        agent's memory) first among the sources of each. A tier that cannot be listed is logged
        and left out; a tier's copy that a rollback abandoned (see
        :mod:`crashproof.checkpoint.root._rollbacks`) is never a candidate."""
        local_storage, local_root = self._shared.storage, self._shared.root
        local = dict(committed_steps(local_storage, local_root))
        sources: dict[int, list[str | None]] = {s: [None] for s in local}
        marks = read_marks(local_storage, local_root) if self._tiers.tiers else []
        for tier in self._tiers.tiers:
            try:
                root, storage = tier.open()
                for remote_step, remote_path in committed_steps(storage, root):
                    if not _abandoned_copy(marks, storage, remote_step, remote_path):
                        sources.setdefault(remote_step, []).append(tier.uri)
            except Exception as exc:  # a dead tier must not stop a restore from the others
                log.error("cannot list %s to restore from it: %s", tier.uri, exc)
        for step in in_memory:
            sources.setdefault(step, []).insert(0, MEMORY)
        self._refuse_node_parts(local, sources)
        return [
            (s, local.get(s) or local_storage.join(local_root, checkpoint_dir_name(s)), sources[s])
            for s in sorted(sources, reverse=True)
        ]

    def _candidates_on_nodes(self, in_memory: set[int]) -> list[Candidate]:
        """On node-local roots (every rank calls this): the steps whose part every rank finds
        under one manifest, in its node's own root or its node's prefix of a tier, and
        ``in_memory``, newest first. A step some node lacks everywhere (lost with its disk and
        never copied, not yet published there, or held for other ranks now that the ranks moved
        between nodes) is no candidate: no rank could read the missing part."""
        storage, root = self._shared.storage, self._shared.root
        rank, world_size = self._group.rank, self._group.world_size
        local: dict[int, str] = {}
        mine: dict[int, str | None] = {}
        newest: tuple[int, str, Layout | None] | None = None
        failure = ""
        try:
            local = dict(committed_steps(storage, root))
            mine = {
                step: part_here(storage, path, rank, world_size) for step, path in local.items()
            }
            if local:
                step = max(local)
                newest = (step, storage.describe(local[step]), saved_layout(storage, local[step]))
        except Exception as exc:  # (said to every rank, which would otherwise wait for this one)
            failure = (
                f"rank {rank} cannot list {storage.describe(root)}: {type(exc).__name__}: {exc}"
            )
        remote = self._tier_parts(rank, world_size)
        said = self._group.all_gather((mine, remote, newest, failure))
        failures = [why for _, _, _, why in said if why]
        if failures:
            raise CheckpointReadError(
                f"{failures[0]}. Nothing was changed: restore again once the storage reads it"
            )
        listings = [(theirs, tiers) for theirs, tiers, _, _ in said]
        on_disk = {
            step
            for step, found in mine.items()
            if found is not None and all(theirs.get(step) == found for theirs, _ in listings)
        }
        # Rank 0's copy of a step (its node's disk first) names the manifest every rank needs.
        wanted = {s: d for s, d in {**listings[0][1], **listings[0][0]}.items() if d is not None}
        # Offered from the tiers: a step each node has on its disk or in its tier prefix, and a
        # step on every disk where every node's tier prefix holds its part too (a part found
        # damaged on one disk is then downloaded again).
        in_tiers = {
            step
            for step, found in wanted.items()
            if all(
                tiers.get(step) == found or (step not in on_disk and theirs.get(step) == found)
                for theirs, tiers in listings
            )
        }
        lacking = sorted(
            {s for theirs, tiers in listings for s in (*theirs, *tiers)} - on_disk - in_tiers,
            reverse=True,
        )
        if lacking and rank == 0:
            log.warning(
                "checkpoint steps %s are not whole on every node's own root or its tiers (a node "
                "lost its disk or has not published them, or the ranks moved between nodes): "
                "they are not candidates",
                lacking[:5],
            )
        # Held here but restorable by no rank of this run: not counted by retention (see
        # ManagerState.stranded).
        self._shared.stranded = set(local) - on_disk - in_tiers
        if self._read_only:  # (it never writes into the root: a part stays where it is)
            in_tiers = set()
        self._node_tier_digests = {s: wanted[s] for s in in_tiers}
        self._node_disk_steps = on_disk
        if not (on_disk | in_tiers | in_memory):
            self._refuse_another_layout([n for _, _, n, _ in said if n is not None])
        candidates: list[Candidate] = []
        for step in sorted(on_disk | in_tiers | in_memory, reverse=True):
            sources: list[str | None] = [MEMORY] if step in in_memory else []
            sources += [None] if step in on_disk else []
            sources += [NODE_TIERS] if step in in_tiers else []
            path = local.get(step) or storage.join(root, checkpoint_dir_name(step))
            candidates.append((step, path, sources))
        return candidates

    def _refuse_node_parts(
        self, local: dict[int, str], sources: dict[int, list[str | None]]
    ) -> None:
        """In one root (on rank 0): when its newest checkpoint is one node's part, saved on
        node-local roots, and no checkpoint but such parts is anywhere (an older one saved in
        one root, the agent's memory, a tier), refused as :meth:`_refuse_another_layout` says."""
        storage = self._shared.storage
        if not local:
            return
        newest = saved_layout(storage, local[max(local)])
        if newest is None or len(newest[1]) == 1:
            return
        for step, where in sources.items():
            if where != [None] or (layout := saved_layout(storage, local[step])) is None:
                return  # (from memory or a tier; or unreadable: the restore says why)
            if len(layout[1]) == 1:
                return
        self._refuse_another_layout([(max(local), storage.describe(local[max(local)]), newest)])

    def _refuse_another_layout(self, newest: list[tuple[int, str, Layout | None]]) -> None:
        """Nothing to restore on node-local roots, where the nodes' disks hold checkpoints saved
        by another layout of ranks (another world size, or ranks per node): each node's disk
        holds its own ranks' part only, which no rank of this layout can read. Starting from
        step 0 would lose them without a word; raised on every rank alike (``newest``: every
        rank's newest checkpoint, gathered), with nothing changed."""
        now = (self._group.world_size, self._shared.placement.nodes)
        other = [(step, where, saved) for step, where, saved in newest if saved not in (None, now)]
        if not other:
            return
        step, where, saved = max(other)
        assert saved is not None
        world_size, nodes = saved
        per_node = sorted({len(ranks) for ranks in nodes})
        layout = (
            f"--nnodes {len(nodes)} --nproc-per-node {per_node[0]}" if len(per_node) == 1 else ""
        )
        by = (
            f"{_count(world_size, 'rank')} on {_count(len(nodes), 'node')} (ranks {_ranges(nodes)})"
        )
        held = (
            f"saved on node-local roots by {by}, and each node's disk holds only its own "
            "ranks' part"
            if len(nodes) > 1
            else f"saved in one root by {by}, which only one node's disk holds here"
        )
        raise ConfigError(
            f"checkpoint step {step} ({where}) was {held}; this run has "
            f"{_count(now[0], 'rank')} on {_count(len(now[1]), 'node')} (ranks "
            f"{_ranges(now[1])}), so no rank could read the part it needs. Nothing was "
            "changed. Resume with the layout it was saved with"
            + (f" (crashproof run {layout})" if layout else "")
            + ", or start afresh with another root; only a shared root (root_scope='shared') "
            "restores on another world size"
        )

    def _tier_parts(self, rank: int, world_size: int) -> dict[int, str]:
        """The steps whose part for ``rank`` its node's prefix of a tier holds (the first tier
        that holds one), by manifest checksum; a tier that cannot be listed is logged and left
        out, and a copy a rollback abandoned is none."""
        found: dict[int, str] = {}
        marks = read_marks(self._shared.storage, self._shared.root) if self._tiers.tiers else []
        for tier in self._tiers.tiers:
            try:
                root, storage = tier.open()
                for step, path in committed_steps(storage, root):
                    if step in found or _abandoned_copy(marks, storage, step, path):
                        continue
                    digest_here = part_here(storage, path, rank, world_size)
                    if digest_here is not None:
                        found[step] = digest_here
            except Exception as exc:  # a dead tier must not stop a restore from the others
                log.error("cannot list %s to restore from it: %s", tier.uri, exc)
        return found

    def _fetch_node_part(self, step: int) -> tuple[str, bool]:
        """On node-local roots, on every rank: each node's first rank downloads its part of
        ``step`` (under the manifest every node agreed on) from its node's prefix of the first
        tier holding it, into its root, replacing what is there (missing, of another manifest,
        or found damaged on this disk), while the other ranks wait in short collectives (a
        download may take longer than one collective's timeout). Returns ("", False) when every
        node has its part now, else why not and whether a tier refused a read (the same on
        every rank)."""
        placement, rank = self._shared.placement, self._group.rank
        wanted = self._node_tier_digests.get(step)
        outcome: list[tuple[str, bool]] = [("", False)]

        storage, root = self._shared.storage, self._shared.root
        here = storage.join(root, checkpoint_dir_name(step))

        def download() -> None:
            outcome[0] = ("no tier holds this node's part", False)
            try:
                # A part already here is kept, unless the step was on every disk: then one of
                # them was found wanting, and no node can tell it was not its own.
                if step not in self._node_disk_steps and (
                    part_here(storage, here, rank, self._group.world_size) == wanted
                ):
                    outcome[0] = ("", False)
                    return
                for tier in self._tiers.tiers:
                    tier_root, tier_storage = tier.open()
                    there = tier_storage.join(tier_root, checkpoint_dir_name(step))
                    if part_here(tier_storage, there, rank, self._group.world_size) == wanted:
                        outcome[0] = self._fetch(step, tier.uri)
                        return
            except Exception as exc:  # a tier down now: said to every rank, not raised alone
                outcome[0] = (f"{type(exc).__name__}: {exc}", unreadable(exc))

        self._agreement.on_leaders(placement.leads, download)
        outcomes = self._group.all_gather(outcome[0])
        failed = [f"rank {r}: {why}" for r, (why, _) in enumerate(outcomes) if why]
        return "; ".join(failed), any(was for why, was in outcomes if why)

    def _try_source(
        self,
        state: TrainState,
        candidate: int,
        path: str,
        source: str | None,
        skipped: list[str],
        vanished: list[int],
        refused: list[str],
    ) -> tuple[int, str] | None:
        """Restore ``candidate`` from its local copy (``source`` None), the agent's memory or a
        tier's copy."""
        storage, where = self._shared.storage, path
        self.last_kind = "local" if source is None else "tier"
        self.last_verified_by = "restore"
        if source == MEMORY and self._memory is not None:
            memory = self._memory
            # (On every rank the same: whether any rank's part came from a peer's agent.)
            peer = any(self._group.all_gather(memory.origin(candidate) != "local"))
            self.last_kind = "peer" if peer else "memory"
            slot_storage, where = memory.storage(candidate)
            if memory.verified(candidate):
                self.last_verified_by = "agent"
            plan = functools.partial(self._memory_plan, memory, candidate)
            restored = self._try_restore(
                state, candidate, where, skipped, slot_storage, vanished, refused, plan=plan
            )
            if restored is None:  # found wanting on some rank: never offered again
                memory.drop(candidate)
            return restored
        if source == NODE_TIERS:  # each node brings its own part from its tiers first
            fetched, was_refused = self._fetch_node_part(candidate)
            if fetched:
                (refused if was_refused else skipped).append(
                    f"step {candidate} from the tiers: {fetched}"
                )
                return None
        elif source is not None and self._read_only:  # read in place: the root stays as is
            try:
                root, storage = self._tiers.open_tier(source)
            except Exception as exc:
                (refused if unreadable(exc) else skipped).append(
                    f"step {candidate} in {source}: {exc}"
                )
                return None
            where = storage.join(root, checkpoint_dir_name(candidate))
        elif source is not None:  # a remote copy: bring it here first
            fetched, was_refused = self._agreement.on_rank0(
                functools.partial(self._fetch, candidate, source)
            )
            if fetched:
                # A tier that refused the read (an I/O error, no access, unreachable) says
                # nothing against its copy: like a local refusal, restore stops there.
                (refused if was_refused else skipped).append(
                    f"step {candidate} in {source}: {fetched}"
                )
                return None
        own_plan: Callable[[], RankPlan] | None = None
        if self._shared.placement.node_local:
            own_plan = functools.partial(plan_node_part, storage, where, self._group.rank)
        return self._try_restore(
            state,
            candidate,
            where,
            skipped,
            storage,
            vanished,
            refused,
            plan=own_plan,
            on_disk=True,
        )

    def _fetch(self, step: int, uri: str) -> tuple[str, bool]:
        """Download checkpoint ``step`` (and the full checkpoint it needs, if a delta) from the tier
        ``uri`` into the local root; returns ("", False) on success, else why not and whether
        the tier refused a read (rather than found the copy corrupt)."""
        local_storage, local_root = self._shared.storage, self._shared.root
        started = time.perf_counter()
        self._shared.known[step] = None  # ours to bring in: not a second writer's
        try:
            root, storage = self._tiers.open_tier(uri)
            manifest = download_checkpoint(
                storage,
                storage.join(root, checkpoint_dir_name(step)),
                local_storage,
                local_root,
                checkpoint_dir_name(step),
            )
            base = manifest.base_step
            if base is not None and checkpoint_dir_name(base) not in local_storage.list(local_root):
                self._shared.known[base] = None
                download_checkpoint(
                    storage,
                    storage.join(root, checkpoint_dir_name(base)),
                    local_storage,
                    local_root,
                    checkpoint_dir_name(base),
                )
        except Exception as exc:
            log.warning("cannot restore checkpoint step %d from %s: %s", step, uri, exc)
            return f"{type(exc).__name__}: {exc}", unreadable(exc)
        self._shared.corrupt.discard(step)  # a verified copy replaced the local one
        log.info(
            "downloaded checkpoint step %d from %s in %.2f s",
            step,
            uri,
            time.perf_counter() - started,
        )
        return "", False

    def _try_restore(
        self,
        state: TrainState,
        candidate: int,
        path: str,
        skipped: list[str],
        storage: Storage,
        vanished: list[int],
        refused: list[str],
        *,
        plan: Callable[[], RankPlan] | None = None,
        on_disk: bool = False,
    ) -> tuple[int, str] | None:
        """Restore ``candidate`` if every rank verifies it; None (and a line in ``skipped``) if
        not, with ``candidate`` in ``vanished`` when it is no longer there on some rank and why
        in ``refused`` when the storage refused a read on some rank.

        Two phases: every rank verifies its part and checks (and trial-loads) everything with
        real values, the live tensors' values aside, before any rank writes anything live; the
        loading that follows has nothing left to refuse.

        ``plan``: this rank's part, planned by itself (a snapshot in memory, or a part on its
        node's own root, which only this rank's node holds) instead of by rank 0 from the
        manifest. ``on_disk``: read from the root (not memory), with a plan of its own."""
        started = time.perf_counter()
        status, reader, reason = self._load_candidate(state, candidate, path, storage, plan)
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
                if storage is self._shared.storage and any(s == "corrupt" for s, _ in statuses):
                    self._shared.corrupt.add(candidate)  # the local copy: retention may free it
                if any(s == "gone" for s, _ in statuses):
                    vanished.append(candidate)
                refused.extend(r for s, r in statuses if s == "unreadable")
                return None
            assert reader is not None
            # Loading code that could not be tried on a copy (its module cannot be copied)
            # runs on the live model: keep its tensors to put back should that code refuse.
            kept = _copy_tensors(state) if state.untried else None
            failure: CorruptCheckpointError | None = None
            try:
                tree = reader.finish(reader.sharded_values)
            except (CorruptCheckpointError, OSError, EOFError) as exc:
                # Tensors beyond the read buffer are read a second time, straight into the live
                # ones: a file changed or removed (an object store's) since it verified, or an
                # I/O error, fails part-way through writing them.
                failure = _half_written(where, candidate, exc)
                failure.__cause__ = exc
        finally:
            if reader is not None:
                reader.close()
        if failure is None:
            failure = _load_tree(state, tree, kept, where, candidate)
        # Each rank loads its own part: when one fails, all do, so no rank trains on alone.
        peers = self._group.all_gather(None if failure is None else str(failure))
        if failure is not None:
            raise failure
        peer = next((f for f in peers if f is not None), None)
        if peer is not None:
            raise CorruptCheckpointError(
                f"{where}: another rank failed to load step {candidate} ({peer}); this rank "
                "loaded it, but the ranks no longer hold one state: restore again"
            )
        self._warn_if_inexact(candidate, state)
        shared = self._shared
        shared.last_save_step, shared.last_save_s = candidate, time.monotonic()
        if plan is None or on_disk:  # (a step in memory may not be on disk: retention goes by it)
            shared.newest_valid = candidate
        # Deltas are taken against what this manager committed; after a restore (or a rollback)
        # the next save is full, or it could name a base that is later than it or gone.
        shared.delta_base = None
        if self._group.rank == 0:
            announce(
                log,
                f"resumed from checkpoint step {candidate} ({storage.describe(path)}) in "
                f"{time.perf_counter() - started:.2f} s",
            )
        return int(candidate), storage.describe(path)

    def _warn_if_inexact(self, step: int, state: TrainState) -> None:
        """Say so when the run that saved (or this one) uses kernels that may not be bit-exact."""
        env = self._restored_environment
        now = exactness_environment()
        if self._group.world_size >= 3 and state.ddp_regroups_gradients() and self._group.rank == 0:
            log.warning(
                "resuming from step %d with DistributedDataParallel on %d ranks: DDP regroups its "
                "gradient buckets after a process's first step, so the first step after this "
                "resume sums gradients in another order than the uninterrupted run did, and the "
                "runs differ in the last bits; for bit-exact resumes pass "
                "find_unused_parameters=True to DistributedDataParallel, which keeps its first "
                "grouping (see docs/exactness.md)",
                step,
                self._group.world_size,
            )
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

    def _buffer_bytes(self) -> int:
        """What this restore may hold in memory to read each byte once (see
        ``ManagerOptions.restore_memory_bytes``)."""
        if self._memory_bytes is not None:
            return self._memory_bytes
        available = _host_memory.available_memory_bytes()
        return 0 if available is None else max(0, available - HEADROOM_BYTES)

    def _plan(self, state: TrainState, path: str, storage: Storage) -> RankPlan:
        """This rank's part of the checkpoint in ``path``, read once by rank 0 and handed out
        (:mod:`crashproof.checkpoint.restore._fan_out`): every rank calls this, and what rank
        0 met reading it (a corrupt or refused file, a mismatch) is raised on every rank."""
        plans: list[RankPlan | Exception] | None = None
        if self._group.rank == 0:
            try:
                plans = list(
                    plan_restore(
                        storage, path, self._group.world_size, per_rank=state.per_rank_names()
                    )
                )
            except Exception as exc:  # every rank raises it, rather than wait for rank 0
                plans = [_portable(exc)] * self._group.world_size
            except BaseException as exc:  # interrupted: the others are told, not left waiting
                stopped = RuntimeError(
                    f"rank 0 stopped while reading the checkpoint ({type(exc).__name__})"
                )
                with contextlib.suppress(Exception):
                    self._group.scatter([stopped] * self._group.world_size)
                raise
        mine = self._group.scatter(plans)
        plans = None
        if isinstance(mine, Exception):
            try:
                raise mine
            finally:
                del mine
        assert isinstance(mine, RankPlan)
        return mine

    def _memory_plan(self, memory: MemorySnapshots, step: int) -> RankPlan:
        return RankPlan(memory.manifest(step), self._group.rank)

    def _load_candidate(
        self,
        state: TrainState,
        step: int,
        path: str,
        storage: Storage,
        local_plan: Callable[[], RankPlan] | None = None,
    ) -> tuple[str, RankRead | None, str]:
        """Check and verify one candidate without touching the live state.

        Returns ``("ok", reader, "")`` (the caller finishes the read into the live tensors),
        ``("corrupt", None, why)``, ``("unreadable", None, why)`` (the storage refused a read),
        ``("gone", None, why)`` (it vanished while it was read) or
        ``("mismatch", None, why)``.
        """
        rank, world_size = self._group.rank, self._group.world_size
        reader: RankRead | None = None
        identity = _directory_identity(storage, path)
        try:
            # (Rank 0's plan also checks that it is this step's.)
            plan = local_plan() if local_plan is not None else self._plan(state, path, storage)
            manifest, source = plan.manifest, plan.source
            # Another world size: replicated state only, each rank reading a saved rank's part.
            if source != rank or manifest.world_size != world_size:
                log.info(
                    "checkpoint step %d was saved by %d ranks: rank %d restores saved rank %d's state",
                    step,
                    manifest.world_size,
                    rank,
                    source,
                )
                if state.data is not None and state.sampler is None and rank == 0:
                    log.warning(
                        "checkpoint step %d was saved by %d ranks and is restored on %d: the "
                        "data loader's own state_dict() is per rank, so each rank resumes from a "
                        "saved rank's position and samples may be repeated or skipped; a "
                        "DataLoader over crashproof.ResumableSampler carries the global position",
                        step,
                        manifest.world_size,
                        world_size,
                    )

            self.last_bytes = 0
            counting = threading.Lock()

            def count(nbytes: int) -> None:  # (called by the read threads)
                with counting:
                    self.last_bytes += nbytes

            def read(manifest: Manifest, base: Manifest | None = None) -> RankRead:
                return RankRead(
                    storage, path, manifest, source, base=base, on_bytes=count,
                    into=state.live_tensors(), buffer=ReadBuffer(self._buffer_bytes()),
                )  # fmt: skip

            try:
                reader = read(manifest, base=plan.base)
            except PartialManifest:  # its index needs more than its plan: the whole manifest
                manifest = read_manifest(storage, path)
                reader = read(manifest)
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
            saved = None
            if pieces:  # every rank's pieces tile their tensors (metadata only) before sizing
                from crashproof.checkpoint.restore import (
                    CrashproofReader,
                    load_sharded,
                    restore_targets,
                )

                saved = CrashproofReader(path, storage=storage, manifest=manifest)
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
            # A file the storage refuses to read (an I/O error, permissions) says nothing of
            # the checkpoint: skipped all the same, but never judged corrupt (and so removable).
            status, why = "unreadable" if unreadable(exc) else "corrupt", str(exc)
            there = _still_there(storage, path)
            if there is None:  # the root cannot be listed either: the storage refuses
                status = "unreadable"
            elif not there or _directory_identity(storage, path) != identity:
                # Removed while it was read, or replaced: a writer saved this step again and
                # swapped the copies mid-read (this manifest, the other copy's files). The
                # listing is out of date; read the step again rather than judge it.
                status = "gone"
        if reader is not None:
            reader.close()
        return status, None, why


def _portable(exc: Exception) -> Exception:
    """``exc``, raised on rank 0 while planning a restore, as every rank can receive it: of the
    kind that decides what restore does with it (a mismatch, a refused read, corruption), with
    its message and no traceback. Any exception could not be sent (one that does not pickle
    would leave the other ranks waiting), and no cycle through the planning frame keeps the
    manager, and with it the root's lock, alive after a failure."""
    message = str(exc)
    if isinstance(exc, CrashproofError):  # (each takes its message alone)
        return type(exc)(message)
    if unreadable(exc):
        assert isinstance(exc, OSError)
        return OSError(exc.errno, exc.strerror, exc.filename) if exc.errno else OSError(message)
    if isinstance(exc, FileNotFoundError):  # (a file the manifest lists is missing: corrupt)
        return FileNotFoundError(message)
    return RuntimeError(f"rank 0 failed to read the checkpoint: {type(exc).__name__}: {message}")


def _load_tree(
    state: TrainState,
    tree: Any,
    kept: list[tuple[torch.Tensor, torch.Tensor]] | None,
    where: str,
    candidate: int,
) -> CorruptCheckpointError | None:
    """Load the verified ``tree`` into ``state``; the error if that failed (None if not)."""
    try:
        state.restore(tree, where=where, checked=True)
    except Exception as exc:
        if kept is not None:
            _put_back(kept)
            failure = CorruptCheckpointError(
                f"{where}: loading step {candidate} failed in code that could not be tried "
                f"first ({', '.join(state.untried)} cannot be copied): {type(exc).__name__}: "
                f"{exc}. The model's tensors were put back as they were"
            )
        else:
            # Checked and trial-loaded before, so only an object that cannot be copied for a
            # trial (or that loads differently the second time) gets here, with the live state
            # partly written: never a bare error, never a silent fallback over a half-load.
            failure = _half_written(where, candidate, exc)
        failure.__cause__ = exc
        return failure
    return None


def _half_written(where: str, step: int, exc: BaseException) -> CorruptCheckpointError:
    """The error for a load that failed after it began to write the live state."""
    return CorruptCheckpointError(
        f"{where}: loading step {step} failed after the live tensors were written "
        f"({type(exc).__name__}: {exc}); the model, optimizer and other components may "
        "now hold a mix of this checkpoint and their earlier state. Create them anew and "
        "restore again, or restore an earlier step"
    )


def _read_refused(step: int, why: str) -> CheckpointReadError:
    """The error for a candidate no copy of which could be read because the storage refused.

    Falling back past it would resume from an older step and, once training saved that step
    again, replace a checkpoint nothing is known against: its steps would be lost for a
    permission or a passing I/O error. Stopping costs a restart (``crashproof run`` makes it)."""
    return CheckpointReadError(
        f"checkpoint step {step} could not be read: {why}. Nothing was changed and restore did "
        "not fall back past it, which would lose its steps: restore again once the storage "
        "reads it (a restart, fixed permissions), or move its directory out of the root to "
        "resume from the checkpoint before it"
    )


def _copy_tensors(state: TrainState) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor of the model and of module extras, with a copy of it in host memory: the
    cost of loading code that could not be tried first (one copy of the model)."""
    modules = [state.model, *state.extra.values()]
    seen: set[int] = set()
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for module in modules:
        if isinstance(module, nn.Module):
            for tensor in [*module.parameters(), *module.buffers()]:
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    kept.append((tensor, tensor.detach().to("cpu", copy=True)))
    return kept


def _put_back(kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for tensor, copy in kept:
            tensor.copy_(copy)


def _abandoned_copy(marks: list[RollbackMark], storage: Storage, step: int, ckpt_dir: str) -> bool:
    """Whether a tier's copy ``ckpt_dir`` of ``step`` is one a rollback abandoned (its commit
    time is read only where a mark could concern it)."""
    return any(step > m.after for m in marks) and abandoned(
        marks, step, _created_unix(storage, ckpt_dir)
    )


def _created_unix(storage: Storage, ckpt_dir: str) -> float | None:
    try:
        return read_manifest(storage, ckpt_dir).created_unix
    except (CorruptCheckpointError, OSError):
        return None


def _directory_identity(storage: Storage, ckpt_dir: str) -> tuple[int, int] | None:
    """Which directory ``ckpt_dir`` is on a local file system (device, inode), else None."""
    if local_backend(storage) is None:
        return None
    try:
        found = os.stat(ckpt_dir, follow_symlinks=False)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _still_there(storage: Storage, ckpt_dir: str) -> bool | None:
    """Whether the checkpoint directory ``ckpt_dir`` is still in its root (a directory left
    without its manifest is there: a corrupt checkpoint, not a removed one); None when the
    root cannot be listed (the storage refuses: no verdict)."""
    parent, name = posixpath.split(ckpt_dir.rstrip("/"))
    try:
        return name in storage.list(parent)
    except FileNotFoundError:
        return False
    except Exception:
        return None


def _ranges(nodes: tuple[tuple[int, ...], ...]) -> str:
    """Each node's ranks, ``0-1 | 2-3`` (a node's ranks are consecutive, or listed)."""
    return " | ".join(
        f"{r[0]}-{r[-1]}"
        if len(r) > 1 and list(r) == list(range(r[0], r[-1] + 1))
        else ",".join(map(str, r))
        for r in nodes
    )


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
