"""The save pipeline: snapshot the state, persist it, commit it.

1. :func:`take_snapshot` (the only part that pauses training) turns the captured state tree into
   JSON plus a list of CPU tensors. With ``copy=True`` the tensors are copied, so training may
   change its parameters while the snapshot is being written; without, they are the live tensors
   and the caller must wait for the persist to finish.
2. :func:`persist` writes every rank's shard and index into a temporary directory, checksumming as
   it writes and fsyncing each file; the coordinator (rank 0) then writes the manifest last and
   publishes the directory under its final name. A failure on any rank means no commit.

The synchronous and the asynchronous save are this same pipeline; the manager only decides whether
to wait for step 2.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

import crashproof
from crashproof.checkpoint._format import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    RankIndex,
    checkpoint_dir_name,
    dumps,
    index_name,
    shard_name,
)
from crashproof.checkpoint._group import Group
from crashproof.checkpoint._hashing import HASH_ALGORITHM, digest
from crashproof.checkpoint._shard import write_shard
from crashproof.checkpoint._tree import JSONValue, encode_tree
from crashproof.errors import CheckpointWriteError
from crashproof.storage import Storage, write_all

__all__ = ["TMP_PREFIX", "CommitResult", "Snapshot", "new_tmp_name", "persist", "take_snapshot"]

TMP_PREFIX = ".tmp-"


@dataclass(slots=True)
class Snapshot:
    step: int
    tree: JSONValue
    tensors: list[tuple[str, torch.Tensor]]
    metadata: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@dataclass(frozen=True, slots=True)
class CommitResult:
    step: int
    path: str
    bytes_written: int
    persist_s: float


def take_snapshot(
    step: int, state: Any, *, copy: bool, metadata: dict[str, Any] | None = None
) -> Snapshot:
    """Encode ``state``; tensors become CPU, contiguous and, with ``copy``, private copies."""
    found: list[tuple[str, torch.Tensor]] = []
    tree = encode_tree(state, found)
    tensors: list[tuple[str, torch.Tensor]] = []
    used: set[str] = set()
    for path, tensor in found:
        tensor = tensor.detach()
        if tensor.is_conj():
            tensor = tensor.resolve_conj()
        if tensor.is_neg():
            tensor = tensor.resolve_neg()
        if copy or tensor.device.type != "cpu":
            tensor = tensor.to("cpu", copy=True, memory_format=torch.contiguous_format)
        else:
            tensor = tensor.contiguous()
        tensors.append((_unique(path.lstrip("/") or "tensor", used), tensor))
    return Snapshot(
        step=step,
        tree=tree,
        tensors=tensors,
        metadata=dict(metadata or {}),
        environment=exactness_environment(),
    )


def exactness_environment() -> dict[str, Any]:
    """What decides whether resuming from this checkpoint can be bit-exact (see docs/exactness.md)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cuda": cuda,
    }


def _unique(name: str, used: set[str]) -> str:
    candidate, n = name, 1
    while candidate in used:
        candidate, n = f"{name}#{n}", n + 1
    used.add(candidate)
    return candidate


def new_tmp_name(step: int) -> str:
    return f"{TMP_PREFIX}{checkpoint_dir_name(step)}-{uuid.uuid4().hex[:12]}"


def persist(
    storage: Storage, root: str, snapshot: Snapshot, group: Group, tmp_name: str
) -> CommitResult:
    """Write this rank's part of ``snapshot`` and, on the coordinator, commit the checkpoint.

    Every rank takes part in the gather and broadcast even when its own write failed, so a failure
    anywhere becomes a :class:`CheckpointWriteError` everywhere instead of a hang.
    """
    started = time.perf_counter()
    tmp_dir = storage.join(root, tmp_name)
    final_dir = storage.join(root, checkpoint_dir_name(snapshot.step))
    files: dict[str, FileEntry] | None = None
    error = ""
    try:
        storage.make_dirs(tmp_dir)
        files = _write_rank(storage, tmp_dir, snapshot, group.rank)
    except Exception as exc:
        error = f"rank {group.rank}: {type(exc).__name__}: {exc}"
    reports = group.gather((files, error))
    outcome = ""
    if reports is not None:  # the coordinator
        outcome = _commit(storage, tmp_dir, final_dir, snapshot, reports, group.world_size)
    outcome = group.broadcast(outcome)
    if outcome:
        raise CheckpointWriteError(
            f"checkpoint of step {snapshot.step} was not committed ({outcome}); "
            f"the checkpoints committed before it in {storage.describe(root)} are intact"
        )
    return CommitResult(
        step=snapshot.step,
        path=final_dir,
        bytes_written=sum(e.size for e in (files or {}).values()),
        persist_s=time.perf_counter() - started,
    )


def _write_rank(
    storage: Storage, tmp_dir: str, snapshot: Snapshot, rank: int
) -> dict[str, FileEntry]:
    shard_file = shard_name(rank)
    entries, shard_entry = write_shard(storage, storage.join(tmp_dir, shard_file), snapshot.tensors)
    index = RankIndex(
        rank=rank, step=snapshot.step, shard_file=shard_file, tensors=entries, state=snapshot.tree
    )
    index_bytes = dumps(index.to_json())
    write_all(storage, storage.join(tmp_dir, index_name(rank)), index_bytes)
    return {
        shard_file: shard_entry,
        index_name(rank): FileEntry(len(index_bytes), digest(index_bytes)),
    }


def _commit(
    storage: Storage,
    tmp_dir: str,
    final_dir: str,
    snapshot: Snapshot,
    reports: list[Any],
    world_size: int,
) -> str:
    """On the coordinator: write the manifest and publish; returns an error text, empty on success."""
    errors = [error for _, error in reports if error]
    published = False
    try:
        if errors:
            return "; ".join(errors)
        files: dict[str, FileEntry] = {}
        for rank_files, _ in reports:
            files.update(rank_files)
        manifest = Manifest(
            step=snapshot.step,
            world_size=world_size,
            kind="full",
            created_unix=time.time(),
            library_version=crashproof.__version__,
            torch_version=str(torch.__version__),
            hash_algorithm=HASH_ALGORITHM,
            files=files,
            metadata=snapshot.metadata,
            environment=snapshot.environment,
        )
        write_all(storage, storage.join(tmp_dir, MANIFEST_NAME), dumps(manifest.to_json()))
        storage.publish(tmp_dir, final_dir)
        published = True
        return ""
    except Exception as exc:
        return f"commit on rank 0: {type(exc).__name__}: {exc}"
    finally:
        if not published:
            storage.remove(tmp_dir)
