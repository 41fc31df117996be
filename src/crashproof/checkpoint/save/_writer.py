"""The save pipeline: snapshot the state, persist it, commit it.

1. :func:`take_snapshot` (the only part that pauses training) turns the captured state tree into
   JSON plus a list of CPU tensors. With a staging area the tensors are copied into its reusable
   buffers, so training may change its parameters while the snapshot is being written; without,
   they are the live tensors and the caller must wait for the persist to finish.
2. :func:`persist` writes every rank's shard and index into a temporary directory, checksumming as
   it writes and fsyncing each file; the coordinator (rank 0) then writes the manifest last and
   publishes the directory under its final name. A failure on any rank means no commit.

The synchronous and the asynchronous save are this same pipeline; the manager only decides whether
to wait for step 2.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import posixpath
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from crashproof._version import __version__
from crashproof.checkpoint._group import Group
from crashproof.checkpoint._placement import Placement
from crashproof.checkpoint.format import (
    HASH_ALGORITHM,
    MANIFEST_NAME,
    DeltaEntry,
    FileEntry,
    JSONValue,
    Manifest,
    RankIndex,
    TensorEntry,
    checkpoint_dir_name,
    digest,
    dumps,
    encode_tree,
    index_name,
    seal_manifest,
    shard_name,
    tensor_bytes,
    write_shard,
)
from crashproof.checkpoint.save._delta import Delta, DeltaBase, encode_delta
from crashproof.checkpoint.save._finite import FiniteCheck
from crashproof.checkpoint.save._shared_checksums import SharedChecksums
from crashproof.checkpoint.save._staging import StagingArea
from crashproof.errors import CheckpointWriteError, NonFiniteStateError
from crashproof.state import is_dtensor, local_piece, mkl_reproducible
from crashproof.storage import Storage, write_all

__all__ = [
    "TMP_PREFIX",
    "CommitResult",
    "Snapshot",
    "assign_owners",
    "named_tensors",
    "new_tmp_name",
    "persist",
    "take_snapshot",
]

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"

Failure = tuple[str, "int | None", bool]
"""What went wrong on a rank, its errno when it was an OSError (ENOSPC is treated apart), and
whether it was non-finite state (not a storage problem: raised as :class:`NonFiniteStateError`)."""


@dataclass(slots=True)
class Snapshot:
    step: int
    tree: JSONValue
    tensors: list[tuple[str, torch.Tensor]]
    metadata: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    ready: Any = None
    """A CUDA event the writer waits for before reading the tensors (None: ready now)."""
    must_be_finite: frozenset[str] = frozenset()
    """Names of tensors that may hold no NaN or inf: the save is refused if one does."""
    delta: tuple[Delta, DeltaBase] | None = None
    """Save as a delta against this base (see :mod:`crashproof.checkpoint.save._delta`); None: a full checkpoint."""
    owners: Mapping[str, int] = field(default_factory=dict)
    """Tensors every rank holds identically (replicated), by name: the rank that writes each.
    The others reference it in their index instead of writing it again (see :func:`assign_owners`)."""
    sharded: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    """Pieces of sharded tensors (DTensors), by name: the whole tensor's shape and the piece's
    offset in it. Their entry in ``tensors`` is this rank's piece."""
    committed_manifest: str | None = None
    """Set by :func:`persist` on the coordinator once committed: the checksum of the
    ``manifest.json`` it wrote (deltas taken against this checkpoint record it, see
    :class:`~crashproof.checkpoint.save._delta.DeltaBase`). None on the other ranks and before the commit."""
    checksums_to: SharedChecksums | None = None
    """Hand the tensors' checksums to a second write of the same staged bytes once they are all
    hashed and found finite, or nothing if this write fails (see :mod:`._shared_checksums`)."""
    checksums_from: SharedChecksums | None = None
    """Take the tensors' checksums from the first write of the same staged bytes instead of
    hashing them again (a full checkpoint only: a delta stores other bytes under the names)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@dataclass(frozen=True, slots=True)
class CommitResult:
    step: int
    path: str
    bytes_written: int
    persist_s: float
    kind: str = "full"
    checksums: Mapping[str, str] = field(default_factory=dict)
    """This rank's tensors' checksums by name (of the stored bytes)."""
    checkpoint_bytes: int | None = None
    """On the coordinator: the size of every rank's files together (None on other ranks)."""


def take_snapshot(
    step: int,
    state: Any,
    *,
    staging: StagingArea | None,
    metadata: dict[str, Any] | None = None,
    must_be_finite: frozenset[str] = frozenset(),
) -> Snapshot:
    """Encode ``state``; its tensors become CPU and contiguous.

    With ``staging`` they are copied into its reusable buffers, so training may go on changing
    them while the snapshot is written. Without, CPU tensors are the live ones (the caller waits
    for the write) and CUDA tensors are copied to the host here.
    """
    tree, found = named_tensors(state)
    tensors: list[tuple[str, torch.Tensor]] = []
    sharded: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, tensor in found:
        if is_dtensor(tensor):
            tensor, whole, offset = local_piece(tensor)
            sharded[name] = (whole, offset)
        tensor = tensor.detach()
        if tensor.is_conj():
            tensor = tensor.resolve_conj()
        if tensor.is_neg():
            tensor = tensor.resolve_neg()
        tensors.append((name, tensor.contiguous()))
    ready = None
    if staging is not None:
        tensors, ready = staging.stage(tensors)
    else:
        tensors = [(name, t if t.device.type == "cpu" else t.to("cpu")) for name, t in tensors]
    return Snapshot(
        step=step,
        tree=tree,
        tensors=tensors,
        metadata=dict(metadata or {}),
        environment=exactness_environment(),
        ready=ready,
        must_be_finite=must_be_finite,
        sharded=sharded,
    )


def exactness_environment() -> dict[str, Any]:
    """What decides whether resuming from this checkpoint can be bit-exact (see docs/exactness.md)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cuda": cuda,
        "mkl": bool(torch.backends.mkl.is_available()),  # type: ignore[no-untyped-call]
        "mkl_reproducible": mkl_reproducible(),
    }


def named_tensors(state: Any) -> tuple[JSONValue, list[tuple[str, torch.Tensor]]]:
    """``state`` encoded, and its tensors under the names a checkpoint gives them."""
    found: list[tuple[str, torch.Tensor]] = []
    tree = encode_tree(state, found)
    used: set[str] = set()
    return tree, [(_unique(path.lstrip("/") or "tensor", used), t) for path, t in found]


def _unique(name: str, used: set[str]) -> str:
    candidate, n = name, 1
    while candidate in used:
        candidate, n = f"{name}#{n}", n + 1
    used.add(candidate)
    return candidate


def new_tmp_name(step: int, token: str | None = None) -> str:
    """A temporary directory's name for a save of ``step``: unique with a random token, or with
    ``token`` (the same on every rank, so the ranks need not agree on a name at every save)."""
    return f"{TMP_PREFIX}{checkpoint_dir_name(step)}-{token or uuid.uuid4().hex[:12]}"


def persist(
    storage: Storage,
    root: str,
    snapshot: Snapshot,
    group: Group,
    tmp_name: str,
    placement: Placement | None = None,
) -> CommitResult:
    """Write this rank's part of ``snapshot`` and, on the coordinator, commit the checkpoint.

    ``placement``: the nodes whose ranks share a root; with several (node-local roots) each node
    commits its part in its own root, in a two-phase commit (:func:`_commit_on_nodes`).

    Every rank takes part in the gather and broadcast even when its own write failed, so a failure
    anywhere becomes a :class:`CheckpointWriteError` everywhere instead of a hang.
    """
    started = time.perf_counter()
    tmp_dir = storage.join(root, tmp_name)
    final_dir = storage.join(root, checkpoint_dir_name(snapshot.step))
    files: dict[str, FileEntry] | None = None
    checksums: dict[str, str] = {}
    failure: Failure | None = None
    shard: _Shard | None = None
    try:
        if snapshot.ready is not None:
            snapshot.ready.synchronize()  # the device-to-host copies of the snapshot are done
        storage.make_dirs(tmp_dir)
        shard = _write_shard(storage, tmp_dir, snapshot, group.rank)
    except Exception as exc:
        failure = _failure(f"rank {group.rank}", exc)
    # Replicated tensors: every rank learns where their owners wrote them (even a rank whose own
    # write failed takes part, or the others would wait for it).
    shared: list[dict[str, TensorEntry] | None] = []
    lost = functools.partial(_lost_a_rank, snapshot.step, storage.describe(root))
    if snapshot.owners:
        with lost("agree on who wrote the replicated tensors"):
            shared = group.all_gather(None if shard is None else shard.owned(snapshot.owners))
    if shard is not None and failure is None:
        try:
            files, checksums = _write_index(storage, tmp_dir, snapshot, group.rank, shard, shared)
        except Exception as exc:
            failure = _failure(f"rank {group.rank}", exc)
    with lost("gather every rank's report"):
        reports = group.gather((files, failure))
    outcome: Failure | None = None
    if placement is not None and placement.node_local:
        outcome = _commit_on_nodes(
            storage, tmp_dir, final_dir, snapshot, reports, group, placement, lost
        )
    elif reports is not None:  # the coordinator
        outcome = _commit(storage, tmp_dir, final_dir, snapshot, reports, group.world_size)
    try:
        if placement is None or not placement.node_local:
            outcome = group.broadcast(outcome)
    except Exception as exc:
        if reports is None:
            with lost("hear from rank 0 whether the checkpoint committed"):
                raise
        # Rank 0 knows the outcome (committed, or why not): it stands; only telling the other
        # ranks failed, and their own failure says why.
        log.warning(
            "checkpoint of step %d: %s, but the other ranks could not be told: %s",
            snapshot.step,
            "committed" if outcome is None else "not committed",
            exc,
        )
    if outcome is not None:
        text, code, nonfinite = outcome
        message = (
            f"checkpoint of step {snapshot.step} was not committed ({text}); "
            f"the checkpoints committed before it in {storage.describe(root)} are intact"
        )
        if nonfinite:
            raise NonFiniteStateError(message)
        raise CheckpointWriteError(code, message) if code else CheckpointWriteError(message)
    return CommitResult(
        step=snapshot.step,
        path=final_dir,
        bytes_written=sum(e.size for e in (files or {}).values()),
        persist_s=time.perf_counter() - started,
        kind="full" if snapshot.delta is None else "delta",
        checksums=checksums,
        checkpoint_bytes=None
        if reports is None
        else sum(e.size for rank_files, _ in reports for e in (rank_files or {}).values()),
    )


@contextlib.contextmanager
def _lost_a_rank(step: int, root: str, what: str) -> Iterator[None]:
    """A collective of the save that fails (a rank died, or stopped answering within the
    collective timeout) as a :class:`CheckpointWriteError` that says what it means."""
    try:
        yield
    except Exception as exc:
        raise CheckpointWriteError(
            f"checkpoint of step {step}: the ranks could not {what} ({type(exc).__name__}: "
            f"{exc}): a rank died or stopped responding. Rank 0 commits only once every rank's "
            f"part is written, so the step is in {root} only if `crashproof ls {root}` lists it; "
            "the checkpoints committed before it are intact"
        ) from exc


def _failure(who: str, exc: Exception) -> Failure:
    """What ``exc`` on ``who`` (``rank 3``, a node) means for the save."""
    return (
        f"{who}: {type(exc).__name__}: {exc}",
        getattr(exc, "errno", None),
        isinstance(exc, NonFiniteStateError),
    )


@dataclass(slots=True)
class _Shard:
    """What this rank wrote to its shard file, and the checksums of replicated tensors it did
    not write (another rank did), to compare with that rank's."""

    entries: list[TensorEntry]
    file_entry: FileEntry
    deltas: list[DeltaEntry]
    not_written: dict[str, str]

    def owned(self, owners: Mapping[str, int]) -> dict[str, TensorEntry]:
        return {e.name: e for e in self.entries if e.name in owners}


def _write_shard(storage: Storage, tmp_dir: str, snapshot: Snapshot, rank: int) -> _Shard:
    """This rank's shard: its own tensors and the replicated ones it owns."""
    share = snapshot.checksums_to
    if share is not None:
        share.begin()
    try:
        shard = _write_own_tensors(storage, tmp_dir, snapshot, rank)
    except BaseException:
        if share is not None:
            share.give({})  # (the second write hashes for itself)
        raise
    if share is not None:
        share.give({e.name: e.checksum for e in shard.entries})
    return shard


def _write_own_tensors(storage: Storage, tmp_dir: str, snapshot: Snapshot, rank: int) -> _Shard:
    # The checksums of a memory snapshot of the same staged bytes, taken once they are written
    # (a delta stores other bytes under the tensors' names).
    shared = snapshot.checksums_from if snapshot.delta is None else None
    written = [(n, t) for n, t in snapshot.tensors if snapshot.owners.get(n, rank) == rank]
    # On the hashing thread, each chunk as it is written: no wall time of its own. A refused save
    # is raised once the (then discarded) shard is written. A tensor whose checksum is handed
    # over was found finite by the write that hashed it.
    check = FiniteCheck(snapshot.step, written, snapshot.must_be_finite)
    tensors, deltas = written, list[DeltaEntry]()
    if snapshot.delta is not None:
        tensors, deltas = encode_delta(tensors, snapshot.delta[1], snapshot.delta[0], check)
    entries, file_entry = write_shard(
        storage,
        storage.join(tmp_dir, shard_name(rank)),
        tensors,
        inspect=check,
        known=None if shared is None else shared.take,
    )
    known = {} if shared is None else shared.take()
    check.raise_if_failed()
    # The copies this rank did not write are hashed all the same (xxh3, far faster than the
    # write): replicated state that is not the same on every rank is a bug to report, not save.
    not_written = {
        n: known.get(n) or digest(tensor_bytes(t))
        for n, t in snapshot.tensors
        if snapshot.owners.get(n, rank) != rank
    }
    return _Shard(entries, file_entry, deltas, not_written)


def _write_index(
    storage: Storage,
    tmp_dir: str,
    snapshot: Snapshot,
    rank: int,
    shard: _Shard,
    shared: list[dict[str, TensorEntry] | None],
) -> tuple[dict[str, FileEntry], dict[str, str]]:
    """This rank's index, every tensor in snapshot order: its own, or a reference to the owner's
    shard. Returns the rank's file entries and every tensor's checksum."""
    mine = {e.name: e for e in shard.entries}
    entries: list[TensorEntry] = []
    for name, _ in snapshot.tensors:
        owner = snapshot.owners.get(name, rank)
        if owner == rank:
            placement = snapshot.sharded.get(name)
            if placement is None:
                entries.append(mine[name])
            else:
                entries.append(
                    replace(mine[name], global_shape=placement[0], global_offset=placement[1])
                )
            continue
        theirs = shared[owner]
        if theirs is None:
            raise CheckpointWriteError(
                f"rank {owner}, which writes {name!r} for every rank, failed"
            )
        entry = theirs[name]
        if entry.checksum != shard.not_written[name]:
            raise CheckpointWriteError(
                f"{name!r} should be the same on every rank (replicated, e.g. by DDP) but rank "
                f"{rank}'s copy differs from rank {owner}'s: the ranks' models have diverged"
            )
        entries.append(replace(entry, file=shard_name(owner)))
    if snapshot.delta is not None:  # deltas are never deduplicated: the order is the shard's
        entries = shard.entries
    index = RankIndex(
        rank=rank,
        step=snapshot.step,
        shard_file=shard_name(rank),
        tensors=entries,
        state=snapshot.tree,
        deltas=shard.deltas,
    )
    index_bytes = dumps(index.to_json())
    write_all(storage, storage.join(tmp_dir, index_name(rank)), index_bytes)
    files = {
        shard_name(rank): shard.file_entry,
        index_name(rank): FileEntry(len(index_bytes), digest(index_bytes)),
    }
    return files, {entry.name: entry.checksum for entry in entries}


def assign_owners(named_sizes: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Which rank writes each replicated tensor: the largest first, each to the rank with the
    fewest bytes so far, so every rank writes about 1/W of the replicated state. Deterministic:
    every rank computes the same from the same names and sizes."""
    loads = [0] * world_size
    owners: dict[str, int] = {}
    for name, size in sorted(named_sizes, key=lambda item: (-item[1], item[0])):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[name] = rank
        loads[rank] += size
    return owners


def _seal(
    snapshot: Snapshot,
    reports: list[Any],
    world_size: int,
    nodes: tuple[tuple[int, ...], ...] | None,
) -> tuple[bytes | None, Failure | None]:
    """On the coordinator: the manifest's bytes for every rank's ``reports``, or why there is
    none (a rank failed). Raises what building or sealing it raises (its callers tell every
    rank)."""
    failures = [failure for _, failure in reports if failure is not None]
    if failures:
        text = "; ".join(text for text, _, _ in failures)
        return None, (text, failures[0][1], any(nonfinite for _, _, nonfinite in failures))
    files: dict[str, FileEntry] = {}
    for rank_files, _ in reports:
        files.update(rank_files)
    manifest = Manifest(
        step=snapshot.step,
        world_size=world_size,
        kind="full" if snapshot.delta is None else "delta",
        created_unix=time.time(),
        library_version=__version__,
        torch_version=str(torch.__version__),
        hash_algorithm=HASH_ALGORITHM,
        files=files,
        metadata=snapshot.metadata,
        environment=snapshot.environment,
        base_step=snapshot.delta[1].step if snapshot.delta is not None else None,
        base_manifest=snapshot.delta[1].manifest if snapshot.delta is not None else None,
        nodes=nodes,
    )
    return seal_manifest(manifest.to_json()), None


def _commit(
    storage: Storage,
    tmp_dir: str,
    final_dir: str,
    snapshot: Snapshot,
    reports: list[Any],
    world_size: int,
) -> Failure | None:
    """On the coordinator: write the manifest and publish; returns the failure, None on success."""
    published = publishing = False
    try:
        manifest_bytes, failure = _seal(snapshot, reports, world_size, None)
        if manifest_bytes is None:
            return failure
        write_all(storage, storage.join(tmp_dir, MANIFEST_NAME), manifest_bytes)
        publishing = True
        storage.publish(tmp_dir, final_dir, commit_marker=MANIFEST_NAME)
        published = True
        snapshot.committed_manifest = digest(manifest_bytes)
        return None
    except Exception as exc:
        return _failure("commit on rank 0", exc)
    finally:
        # A publish cut short may hold the only complete copy: start-up recovery finishes it.
        if not published and not publishing:
            storage.remove(tmp_dir)


def _commit_on_nodes(
    storage: Storage,
    tmp_dir: str,
    final_dir: str,
    snapshot: Snapshot,
    reports: list[Any] | None,
    group: Group,
    placement: Placement,
    lost: Callable[[str], contextlib.AbstractContextManager[None]],
) -> Failure | None:
    """Commit a checkpoint whose files are on each node's own root (every rank takes part);
    returns the failure, the same on every rank, or None once every node published.

    A two-phase commit. Rank 0 seals the manifest from every rank's report and sends it to each
    node's first rank, which writes it into its node's temporary directory (*prepare*); once
    every node has, each publishes its directory (*commit*). A checkpoint counts only where
    every node's root holds it with the same manifest (a restore checks, see
    :mod:`crashproof.checkpoint._restorer`), so a node lost between the phases leaves a step no
    restore takes, unless every node had prepared: then every part is durable and start-up
    recovery publishes the rest (:func:`~crashproof.checkpoint.root.recover_interrupted`)."""
    sealed: tuple[bytes | None, Failure | None] | None = None
    if reports is not None:
        try:
            sealed = _seal(snapshot, reports, group.world_size, placement.nodes)
        except Exception as exc:  # (told to every rank, which waits for the manifest)
            sealed = None, _failure("commit on rank 0", exc)
    outcome: Failure | None
    with lost("hear the manifest from rank 0"):
        manifest_bytes, outcome = group.broadcast(sealed)
    here = f"node of ranks {list(placement.my_node)}"
    vote: Failure | None = None
    if outcome is None and placement.leads:
        try:
            write_all(storage, storage.join(tmp_dir, MANIFEST_NAME), manifest_bytes)
        except Exception as exc:
            vote = _failure(here, exc)
    with lost("agree that every node prepared its part"):
        votes = group.all_gather(vote)
    outcome = outcome or next((v for v in votes if v is not None), None)
    published = replaced = False
    if outcome is None and placement.leads:
        try:
            parent, name = posixpath.split(final_dir.rstrip("/"))
            replaced = name in storage.list(parent)  # (a step saved again: its copy goes now)
            storage.publish(tmp_dir, final_dir, commit_marker=MANIFEST_NAME)
            published = True
        except Exception as exc:
            vote = _failure(here, exc)
    elif placement.leads:
        with contextlib.suppress(Exception):
            storage.remove(tmp_dir)
    if outcome is None:
        with lost("agree that every node published its part"):
            votes = group.all_gather(vote)
        outcome = next((v for v in votes if v is not None), None)
        if outcome is not None and placement.leads and not published:
            # The step is abandoned everywhere: this node's prepared part goes too (were the
            # rename cut short while replacing an earlier copy, start-up recovery then puts
            # back that copy, set aside as ``.replaced-*``, not the abandoned one).
            with contextlib.suppress(Exception):
                storage.remove(tmp_dir)
        # A part alone is no checkpoint: taken back, unless it replaced the step's earlier copy
        # (then it is all this node has of the step; a restore takes it only where every node
        # holds the same manifest, and retention keeps the newest step they all hold).
        if outcome is not None and published and not replaced:
            log.warning(
                "checkpoint step %d: another node could not publish its part (%s); removing "
                "this node's",
                snapshot.step,
                outcome[0],
            )
            with contextlib.suppress(Exception):
                storage.remove(final_dir)
    if outcome is None:
        snapshot.committed_manifest = digest(manifest_bytes)
    return outcome
