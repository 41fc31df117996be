"""The keyword options of :class:`~crashproof.CheckpointManager`, documented and checked in one
place: :class:`ManagerOptions`. The manager builds one from its keywords; a bad value fails there
with :class:`~crashproof.ConfigError`, before anything is opened or started."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from crashproof._arguments import is_count, is_positive_seconds, is_real, is_switch
from crashproof.checkpoint.save import Delta
from crashproof.checkpoint.tiers import Tier
from crashproof.errors import ConfigError
from crashproof.link import PREEMPTION_SIGNALS
from crashproof.policy import (
    EverySteps,
    KeepLast,
    RetentionPolicy,
    SavePolicy,
    is_retention_policy,
    is_save_policy,
)
from crashproof.storage import Storage

__all__ = ["DEFAULT_EVERY", "DEFAULT_KEEP", "MAX_STAGING_BUFFERS", "ManagerOptions"]

MAX_STAGING_BUFFERS = 4
"""Copies of the state a manager may stage into (each costs host memory the size of the state)."""

DEFAULT_EVERY: SavePolicy = EverySteps(1000)
"""The save policy of a manager given no ``every``."""

DEFAULT_KEEP: RetentionPolicy = KeepLast(5)
"""The retention of a manager given no ``keep``: the newest 5 checkpoints."""


@dataclass(frozen=True, kw_only=True)
class ManagerOptions:
    """How a :class:`~crashproof.CheckpointManager` saves, keeps, replicates and restores."""

    every: SavePolicy | None = None
    """When :meth:`~crashproof.CheckpointManager.maybe_save` saves; None: ``EverySteps(1000)``."""
    keep: RetentionPolicy | None = None
    """Which checkpoints retention keeps; None: :data:`DEFAULT_KEEP`, the newest 5 (enough to
    fall back past a corrupted newest one, or roll back before a loss spike; ``KeepAll()`` keeps
    every one). The newest valid checkpoint and one being written are always kept."""
    async_save: bool = True
    """Return from :meth:`~crashproof.CheckpointManager.save` once the state is copied into host
    buffers (reused across saves) and write it in the background; with False, ``save`` writes
    straight from the live tensors and returns once the checkpoint is committed."""
    on_busy: Literal["wait", "skip"] = "wait"
    """When a save is due while the previous one is still being written: ``"wait"`` for it, or
    ``"skip"`` the new one. Either is logged and counted in the manager's ``stats``."""
    on_disk_full: Literal["continue", "raise"] = "continue"
    """When a save fails because the disk is full: ``"continue"`` training (the failure is logged
    and counted; earlier checkpoints stay) or ``"raise"``."""
    staging_buffers: int = 1
    """1 (host staging costs one copy of the state) or 2 (double buffering: the next save can be
    snapshotted while the previous one is still being written, at the cost of a second copy; as
    many saves as buffers are then in flight, written one after the other), up to 4; more than 1
    needs ``async_save``. Under ``crashproof run`` they are the memory snapshots' slots too: on
    several nodes with copies paced by ``--peer-bandwidth``, a third lets memory snapshots go on
    while one slot holds the step the other nodes cover and another is being copied."""
    storage: Storage | None = None
    """The storage backend; None: chosen from the root."""
    timeout_s: float = 600.0
    """How long ranks wait for each other during a save before giving up."""
    handle_signals: bool = True
    """Treat SIGTERM, SIGUSR1 (SLURM's ``--signal``) and a first SIGINT as a request to stop: at
    the next ``maybe_save`` all ranks agree, save that step and raise
    :class:`~crashproof.PreemptedExit` (exit code 75, "resumable"). Handlers installed before are
    still called. Needs the main thread; restored by ``close``."""
    on_interrupt: Literal["checkpoint", "raise"] = "checkpoint"
    """What a first Ctrl-C (SIGINT) does with ``handle_signals``: ``"checkpoint"`` (save the
    current step and exit 75, like a preemption; a second Ctrl-C interrupts at once), or
    ``"raise"`` (Python's own ``KeyboardInterrupt``, so the script's ``except KeyboardInterrupt``
    runs; SIGTERM and SIGUSR1 still checkpoint)."""
    check_finite: bool = True
    """Refuse to commit a checkpoint whose parameters or optimizer state hold NaN or inf (checked
    by the background writer: it costs training nothing); the refusal is raised as
    :class:`~crashproof.NonFiniteStateError` at the next call, like any failed save."""
    delta: Delta | None = None
    """Save deltas between full checkpoints (:class:`~crashproof.Delta`): only how each tensor
    changed since the newest full one, losslessly. Costs one more host copy of the state (the
    base). None: every checkpoint is full."""
    dedup_replicated: bool = True
    """In a DDP job, write the replicated model and optimizer state once, spread over the ranks
    (each writes about 1/W of it), instead of once per rank; every rank's copy is still
    checksummed and a rank whose copy differs fails the save. Not with ``delta``."""
    remote: str | Tier | Sequence[str | Tier] | None = None
    """Durable tiers behind the local root: a URI (``"s3://bucket/run"``), a
    :class:`~crashproof.Tier` (its own retention, options, backlog), or a list of them (e.g. two
    regions). Each committed checkpoint is copied to every tier in the background, verified there,
    and ``restore`` takes the newest valid checkpoint of any tier. Rank 0 copies (the root must be
    one directory all ranks write into)."""
    remote_timeout_s: float = 600.0
    """How long ``close`` waits for the newest checkpoint to be durable in every tier before it
    gives up, logging what is still pending (it stays on the local disk and the next manager with
    the same tiers uploads it)."""
    replicate: bool = True
    """Copy checkpoints to the tiers (rank 0, or the agent). False for a process that only
    restores from them (an evaluation job): it then never writes to a tier."""
    restore_memory_bytes: int | None = None
    """Host memory ``restore`` may hold for tensor data. Tensors with no live destination
    (a fresh optimizer's state, GPU tensors) are read into new memory either way and count
    first; in what is left, a tensor bound for a live CPU tensor is read once, verified, and
    copied into the live tensor only after the whole checkpoint verified. A tensor beyond it is
    only hashed then, and read a second time straight into its live tensor (less memory, twice
    the reading). None: the host memory this process may still allocate at the restore (the
    machine's, within its memory cgroup and address-space limits), less 256 MiB of headroom; 0:
    always read the live tensors' bytes twice."""
    memory_every: SavePolicy | None = None
    """When :meth:`~crashproof.CheckpointManager.maybe_save` also snapshots the state into the
    memory of ``crashproof run``'s agent, between the checkpoints ``every`` writes to disk (e.g.
    ``EverySteps(10)`` beside ``every=EverySteps(500)``). A trainer that crashes resumes from the
    newest snapshot every rank holds, read from RAM and verified like a checkpoint on disk. A
    snapshot costs one copy of the state into the staging buffers and never waits for a save
    in flight (it is skipped instead). Under ``crashproof run`` every asynchronous save is a
    memory snapshot too, with or without this; not under it, this does nothing. See
    docs/recovery.md. With several ranks, a policy that counts steps (every rank snapshots the
    same steps)."""
    memory: bool = True
    """Under ``crashproof run``, keep snapshots in the agent's memory (the staging buffers of
    asynchronous saves live there). False: staging buffers in this process, restores from
    storage only (as ``crashproof run --no-memory`` does for every manager)."""
    root_scope: Literal["auto", "shared", "node"] = "shared"
    """Who shares the root. ``"shared"`` (the default): one directory every rank writes into (a
    shared filesystem, an object store); a rank that does not see it fails the manager on every
    rank. ``"node"``: a directory of each node's own (its local NVMe disk): each node's ranks
    write their files into their node's root, and a checkpoint commits only once every node's
    part is durable (see docs/storage.md); nodes that see one directory fail the manager.
    ``"auto"``: shared where every rank sees rank 0's root, else node-local where each node's
    ranks see their node's own (a node whose shared mount is missing then writes to its own
    disk: say which you have where you know it)."""
    read_only: bool = False
    """Only restore and look (an evaluation job, a tool): the manager takes no lock, never saves,
    prunes or rolls back, never removes or renames anything in the root (not even a save in
    progress of the run that writes it), never writes to a tier, and restores a tier's checkpoint
    straight from the tier."""

    def preemption_signals(self) -> tuple[signal.Signals, ...]:
        """The signals that ask for an emergency checkpoint (``handle_signals``)."""
        if self.on_interrupt == "raise":
            return tuple(s for s in PREEMPTION_SIGNALS if s != signal.SIGINT)
        return PREEMPTION_SIGNALS

    def describe(self, root: str) -> str:
        """The policies in force, in one line (announced when a writing manager opens)."""
        every = self.every if self.every is not None else DEFAULT_EVERY
        keep = self.keep if self.keep is not None else DEFAULT_KEEP
        remote = [self.remote] if isinstance(self.remote, str | Tier) else list(self.remote or [])
        tiers = [t.uri if isinstance(t, Tier) else t for t in remote]
        return (
            f"checkpoints to {root}: {every!r}, keep {keep!r}, "
            f"{'asynchronous' if self.async_save else 'synchronous'} saves"
            + (f", copied to {', '.join(tiers)}" if tiers else "")
        )

    def __post_init__(self) -> None:
        self._check_types()
        if self.memory_every is not None and self.read_only:
            raise ConfigError(
                "CheckpointManager(memory_every=..., read_only=True): a read-only manager takes "
                "no snapshots; drop memory_every"
            )
        if self.root_scope not in ("auto", "shared", "node"):
            raise ConfigError(
                f"CheckpointManager(root_scope={self.root_scope!r}): use 'auto', 'shared' or 'node'"
            )
        if self.on_busy not in ("wait", "skip"):
            raise ConfigError(f"CheckpointManager(on_busy={self.on_busy!r}): use 'wait' or 'skip'")
        if self.on_interrupt not in ("checkpoint", "raise"):
            raise ConfigError(
                f"CheckpointManager(on_interrupt={self.on_interrupt!r}): use 'checkpoint' or "
                "'raise'"
            )
        if self.on_disk_full not in ("continue", "raise"):
            raise ConfigError(
                f"CheckpointManager(on_disk_full={self.on_disk_full!r}): use 'continue' or 'raise'"
            )
        if self.restore_memory_bytes is not None and (
            isinstance(self.restore_memory_bytes, bool)
            or not isinstance(self.restore_memory_bytes, int)
            or self.restore_memory_bytes < 0
        ):
            raise ConfigError(
                f"CheckpointManager(restore_memory_bytes={self.restore_memory_bytes!r}): use a "
                "number of bytes >= 0, or None for what the host has available"
            )
        if (
            isinstance(self.staging_buffers, bool)
            or not isinstance(self.staging_buffers, int)
            or not 1 <= self.staging_buffers <= MAX_STAGING_BUFFERS
            or (self.staging_buffers > 1 and not self.async_save)
        ):
            raise ConfigError(
                f"CheckpointManager(staging_buffers={self.staging_buffers!r}): use 1, or 2 to "
                f"{MAX_STAGING_BUFFERS} with async_save=True"
            )

    def _check_types(self) -> None:
        """Each option of the kind it must be, refused where it is given: a number for a policy
        (``every=500``) would fail at the first step, a string for a switch (``async_save="no"``)
        would be read as true."""
        for name in ("every", "memory_every"):
            value = getattr(self, name)
            if value is not None and not is_save_policy(value):
                hint = (
                    f"crashproof.EverySteps({value})"
                    if is_count(value)
                    else ("crashproof.EverySteps(500), crashproof.EverySeconds(1800)")
                )
                raise ConfigError(
                    f"CheckpointManager({name}={value!r}): give a save policy, e.g. {hint}"
                )
        if self.keep is not None and not is_retention_policy(self.keep):
            hint = (
                f"crashproof.KeepLast({self.keep})"
                if is_count(self.keep)
                else ("crashproof.KeepLast(5)")
            )
            raise ConfigError(
                f"CheckpointManager(keep={self.keep!r}): give a retention policy, e.g. {hint}"
            )
        for name in _SWITCHES:
            if not is_switch(getattr(self, name)):
                raise ConfigError(
                    f"CheckpointManager({name}={getattr(self, name)!r}): use True or False"
                )
        if not is_positive_seconds(self.timeout_s):
            raise ConfigError(
                f"CheckpointManager(timeout_s={self.timeout_s!r}): give a positive, finite number "
                "of seconds"
            )
        if not (is_real(self.remote_timeout_s) and self.remote_timeout_s >= 0):
            raise ConfigError(
                f"CheckpointManager(remote_timeout_s={self.remote_timeout_s!r}): give a finite "
                "number of seconds, or 0 not to wait for the tiers at close"
            )


_SWITCHES = (
    "async_save",
    "handle_signals",
    "check_finite",
    "dedup_replicated",
    "replicate",
    "memory",
    "read_only",
)
"""The options that are True or False."""
