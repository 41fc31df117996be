"""A manager's durable tiers (``remote=``), as the manager drives them: :class:`TierCoordinator`.

It opens the tiers, starts rank 0's replication to them (hosted by the agent of ``crashproof run``
when there is one, so uploads outlive the trainer, else on threads of this process:
:mod:`crashproof.checkpoint.tiers._agent_replication`, :mod:`crashproof.checkpoint.tiers._replicator`), tells the
replicas of each commit, says what local retention must spare for them, waits for durability at
close and reports where each tier stands.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence

from crashproof.checkpoint._manager_state import ManagerState
from crashproof.checkpoint.tiers import (
    LocalCheckpoints,
    Replica,
    Tier,
    TierReplicator,
    TierStatus,
    agent_tiers,
    open_tiers,
)
from crashproof.link import Notice
from crashproof.policy import RetentionPolicy
from crashproof.storage import Storage
from crashproof.telemetry import emit

__all__ = ["PREEMPTION_DURABLE_WAIT_S", "TierCoordinator"]

log = logging.getLogger("crashproof.checkpoint")

PREEMPTION_DURABLE_WAIT_S = 10.0
"""How long a preempted run without a deadline waits for its tiers (what is left is uploaded by
the next run)."""


class TierCoordinator:
    """The tiers of one manager, and rank 0's replication to them (no replicas elsewhere)."""

    def __init__(
        self, shared: ManagerState, keep: RetentionPolicy, remote_timeout_s: float
    ) -> None:
        self._shared = shared
        self._keep = keep
        self._remote_timeout_s = remote_timeout_s
        self.tiers: list[Tier] = []
        self.by_agent = False
        self._replicas: list[Replica] = []

    def open(
        self,
        remote: str | Tier | Sequence[str | Tier] | None,
        *,
        replicate: bool,
        on_durable: Callable[[], None],
    ) -> None:
        """Open the tiers of ``remote``; with ``replicate``, start copying checkpoints to them.
        ``on_durable`` is called (on a replication thread) whenever a tier took a checkpoint.

        On node-local roots each node copies its own part, in parallel with the others, to a
        prefix of each tier named by its first rank (``node-00002``): one writer per prefix, each
        a node's root as it is on the node's disk, which a node that lost its disk (or took a
        lost node's ranks) downloads its part from."""
        self.tiers = open_tiers(remote)
        placement = self._shared.placement
        if placement.node_local:
            prefix = f"node-{placement.my_node[0]:05d}"
            self.tiers = [
                dataclasses.replace(t, uri=f"{t.uri.rstrip('/')}/{prefix}") for t in self.tiers
            ]
        if replicate and self.tiers:
            self._replicas = self._start_replication(on_durable)

    def _start_replication(self, on_durable: Callable[[], None]) -> list[Replica]:
        storage, root = self._shared.storage, self._shared.root
        local = LocalCheckpoints(storage, root)
        by_agent = agent_tiers(root, self.tiers, self._keep, local)
        if by_agent is not None:
            self.by_agent = True
            return list(by_agent)
        replicas: list[Replica] = []
        try:
            for tier in self.tiers:
                replicas.append(
                    TierReplicator(
                        storage, root, tier, keep=self._keep, emit=emit, on_durable=on_durable
                    )
                )
        except BaseException:  # one tier refused (its root is another run's): none replicates
            for replica in replicas:
                replica.stop()
            raise
        return replicas

    @property
    def replicating(self) -> bool:
        return bool(self._replicas)

    def open_tier(self, uri: str) -> tuple[str, Storage]:
        """The root and storage of the tier ``uri``."""
        return next(t for t in self.tiers if t.uri == uri).open()

    def notify(self) -> None:
        """A checkpoint was committed, or the local root changed (a rollback)."""
        for replica in self._replicas:
            replica.notify()

    def protected(self) -> set[int]:
        """The steps no tier has taken yet: local retention spares them."""
        steps: set[int] = set()
        for replica in self._replicas:
            steps |= replica.protected()
        return steps

    def status(self) -> list[TierStatus]:
        return [replica.status() for replica in self._replicas]

    def stop(self) -> None:
        for replica in self._replicas:
            replica.stop()

    def durable_wait_when_stopping(self, notice: Notice) -> float:
        """How long a preempted run waits for its tiers: not at all when the agent uploads (it
        outlives the trainers), else what the notice leaves (a few seconds kept for the exit),
        at most ``PREEMPTION_DURABLE_WAIT_S`` without a deadline; the checkpoint itself is
        already committed locally, and the next run uploads what is left."""
        if self.by_agent:
            return 0.0
        if notice.deadline_s is None:
            return min(self._remote_timeout_s, PREEMPTION_DURABLE_WAIT_S)
        return max(0.0, min(self._remote_timeout_s, notice.deadline_s - time.monotonic() - 5.0))

    def wait_durable(
        self, limit_s: float, *, on_rank0: Callable[[Callable[[], None]], None]
    ) -> None:
        """At close, on every rank: rank 0 waits for the tiers while the others wait with it in
        short collectives (``on_rank0``)."""
        if self.tiers:
            on_rank0(functools.partial(self._wait_durable, limit_s))

    def _wait_durable(self, limit_s: float) -> None:
        """Rank 0: wait (at most ``limit_s``) until every tier has what it wants; else say what
        is pending, and where it stays."""
        newest = self._shared.newest_valid
        if not self._replicas or newest is None:
            return
        uploader = "by the agent" if self.by_agent else None
        if limit_s <= 0:
            log.info(
                "not waiting for the durable tiers (stopping); what is pending is uploaded %s",
                uploader or "when a manager with these tiers starts again",
            )
            return
        deadline = time.monotonic() + limit_s
        for replica in self._replicas:
            left = max(0.0, deadline - time.monotonic())
            if not replica.wait_durable(left):
                status = replica.status()
                log.error(
                    "checkpoint step %d is not durable in %s after %.0f s (pending: steps %s; "
                    "last error: %s); it stays in %s and is uploaded %s",
                    newest,
                    status.uri,
                    limit_s,
                    status.pending,
                    status.last_error or "none",
                    self._shared.storage.describe(self._shared.root),
                    uploader or "when a manager with this remote starts again",
                )
