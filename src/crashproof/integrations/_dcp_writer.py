"""The DCP storage writer: each rank's items become its shard and index; the coordinator commits.

DCP's protocol maps onto crashproof's save (docs/format.md, "Commit protocol"):
``prepare_global_plan`` (the coordinator, before any rank writes) checks the target and gives
each rank its number; ``write_data`` (every rank) writes the rank's shard and index into the
temporary directory, checksummed and fsynced; ``finish`` (the coordinator, only once every rank
wrote) writes the manifest last and publishes the directory atomically. The writing and the
commit are crashproof's own (:func:`~crashproof.checkpoint.save.write_rank_files`,
:func:`~crashproof.checkpoint.save.commit_rank_files`), so the result is a crashproof
checkpoint like any other.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from crashproof.checkpoint.format import FileEntry, JSONValue, checked_metadata, encode_tree
from crashproof.checkpoint.save import (
    Snapshot,
    commit_rank_files,
    exactness_environment,
    write_rank_files,
)
from crashproof.errors import CheckpointWriteError, ConfigError, UnsupportedStateError
from crashproof.integrations._dcp_target import Target
from crashproof.state import capture_rng

__all__ = ["DCP_SECTION", "RNG_SECTION", "StorageWriter"]

DCP_SECTION = "dcp"
"""The one top-level key of a DCP-written rank index's state tree: under it, each item the rank
wrote, by DCP's name for it (a tensor as ``{"$dtensor": i}``, any other value as JSON)."""

RNG_SECTION = "rng"
"""Beside it, as in every crashproof checkpoint, the rank's RNG states (``rng/torch``, ...)."""

_RANK_FILES = "<crashproof: rank files>"
"""The name of the one extra ``WriteResult`` a rank returns: its files, for the manifest."""


@dataclasses.dataclass(frozen=True)
class _Stamp:
    """What the coordinator tells each rank in its plan: which rank it is, so that rank ``r``
    writes ``rank_<r>.*`` and the coordinator finds rank ``r``'s report at ``results[r]``."""

    rank: int


class StorageWriter(_DCPStorageWriter):
    """Writes ``torch.distributed.checkpoint.save`` (and ``async_save``) as a crashproof
    checkpoint: atomic commit, every byte checksummed, nothing pickled.

    ``StorageWriter(path)`` writes the checkpoint directory ``path`` (a local path or a storage
    URI); ``StorageWriter(root, step=N)`` writes ``root/step_000000000N``, a directory
    ``crashproof ls/verify/inspect ROOT`` and a :class:`~crashproof.CheckpointManager` on
    ``root`` see. The directory appears complete or not at all. A directory that already holds a
    committed checkpoint is replaced (atomically) only with ``overwrite=True``; one holding
    anything else never is. ``metadata`` (JSON, at most 1 MiB) is recorded in the manifest.

    Tensors are stored as they are; any other value of the state dict must be JSON-like (numbers,
    strings, bools, None, lists, tuples and dicts of them: what crashproof's state tree stores
    exactly) and is stored as JSON; anything else is refused with :class:`UnsupportedStateError`
    naming its key. Every rank must be given the same ``path``, on storage every rank reaches.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._target = Target.of(path, step)
        self._overwrite = overwrite
        self._metadata = checked_metadata(metadata)
        self._save_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory this writer commits."""
        return self._target.where

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins; ``checkpoint_id`` (``dcp.save(..., checkpoint_id=...)``), when
        given, is the checkpoint directory it writes from now on."""
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self._target.where:
            self._target = Target.of(checkpoint_id)
        self._save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Without collectives every rank would act as a world of one and commit alone.
        if kwargs.get("use_collectives") is False and _several_ranks():
            raise ConfigError(
                "crashproof's StorageWriter commits a checkpoint once every rank has written its "
                "part, which needs DCP's collectives: call dcp.save without use_collectives=False"
            )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._target.where, save_id=self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator, before any rank writes: refuse a target that must not be
        replaced, clear a temporary directory an earlier save left, number the ranks."""
        self._target.prepare(overwrite=self._overwrite)
        return [
            dataclasses.replace(plan, storage_data=_Stamp(rank)) for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's shard and index, into the temporary directory; nothing is committed."""
        stamp = plan.storage_data
        if not isinstance(stamp, _Stamp):
            raise CheckpointWriteError(
                f"{self._target.where}: the save plan was not prepared by this StorageWriter "
                "(a planner that replaces storage_data?)"
            )
        snapshot = _snapshot(plan, planner, self._target.step)
        files = write_rank_files(self._target.storage, self._target.tmp, snapshot, stamp.rank)
        results = [
            WriteResult(index=item.index, size_in_bytes=_nbytes(item), storage_data=None)
            for item in plan.items
        ]
        report = {
            "rank": stamp.rank,
            "tmp": self._target.tmp,
            "files": {name: [e.size, e.checksum, e.scheme] for name, e in files.items()},
        }  # plain values: DCP gathers them to the coordinator
        results.append(
            WriteResult(
                index=MetadataIndex(_RANK_FILES),
                size_in_bytes=sum(e.size for e in files.values()),
                storage_data=report,
            )
        )
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, once every rank wrote: the manifest, last, then the atomic publish."""
        files: list[dict[str, FileEntry]] = []
        for rank, rank_results in enumerate(results):
            report = next(
                (r.storage_data for r in rank_results if r.index.fqn == _RANK_FILES), None
            )
            if not isinstance(report, dict) or report.get("rank") != rank:
                raise CheckpointWriteError(
                    f"{self._target.where}: rank {rank} reported no files; nothing committed"
                )
            if report["tmp"] != self._target.tmp:
                raise CheckpointWriteError(
                    f"{self._target.where}: rank {rank} wrote into {report['tmp']}, rank 0 "
                    f"commits {self._target.tmp}: every rank must be given the same path; "
                    "nothing committed"
                )
            files.append({n: FileEntry(*entry) for n, entry in report["files"].items()})
        snapshot = Snapshot(
            step=self._target.step,
            tree=None,
            tensors=[],
            metadata=self._metadata,
            environment=exactness_environment(),
        )
        commit_rank_files(
            self._target.storage, self._target.tmp, self._target.final, snapshot, files
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any path or storage URI names a directory this writer can write."""
        return bool(os.fspath(checkpoint_id))


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _nbytes(item: WriteItem) -> int:
    return item.tensor_storage_size() or 0


def _snapshot(plan: SavePlan, planner: SavePlanner, step: int) -> Snapshot:
    """This rank's items as crashproof saves them: each tensor piece with its place in the
    whole tensor (a whole tensor is the one piece of itself), every other value as JSON."""
    entries: dict[str, JSONValue] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    sharded: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for item in plan.items:
        name = item.index.fqn
        if name in entries:
            raise UnsupportedStateError(
                f"{name!r}: this rank holds two pieces of it; crashproof stores one piece of a "
                "tensor per rank (a DTensor has one)"
            )
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            entries[name] = _json_value(planner, item)
            continue
        tensor = _host_piece(planner.resolve_data(item), name)
        chunk = item.tensor_data.chunk
        if tuple(tensor.shape) != tuple(chunk.sizes):
            raise UnsupportedStateError(
                f"{name!r}: the planner gave a {list(tensor.shape)} tensor for a "
                f"{list(chunk.sizes)} piece"
            )
        sharded[name] = (tuple(item.tensor_data.size), tuple(chunk.offsets))
        entries[name] = {"$dtensor": len(tensors)}
        tensors.append((name, tensor))
    # Every crashproof checkpoint records its rank's RNG state (crashproof verify checks it):
    # here the state as this rank writes its part. DCP's load does not restore it.
    rng = encode_tree(capture_rng(), tensors, RNG_SECTION)
    names = [name for name, _ in tensors]
    if len(set(names)) != len(names):
        clash = next(
            name for name in names if name.startswith(f"{RNG_SECTION}/") and name in entries
        )
        raise UnsupportedStateError(
            f"{clash!r}: the name crashproof gives this rank's RNG state; rename that key"
        )
    tree = {DCP_SECTION: entries, RNG_SECTION: rng}
    return Snapshot(step=step, tree=tree, tensors=tensors, sharded=sharded)


def _host_piece(data: Any, name: str) -> torch.Tensor:
    """A CPU, contiguous, plain tensor holding the bytes of ``data``."""
    if not isinstance(data, torch.Tensor) or data.layout != torch.strided:
        raise UnsupportedStateError(
            f"{name!r}: the planner gave {type(data).__name__}, not a dense tensor"
        )
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous()


def _json_value(planner: SavePlanner, item: WriteItem) -> JSONValue:
    """A non-tensor value as JSON, from the planner's original object: DCP's own path
    (``resolve_data``) would hand it over pickled, and crashproof never pickles."""
    name = item.index.fqn
    lookup = getattr(planner, "lookup_object", None)
    if not callable(lookup):
        raise UnsupportedStateError(
            f"{name!r}: a non-tensor value, which {type(planner).__name__} gives only pickled; "
            "crashproof never pickles: use DefaultSavePlanner (or a planner derived from it)"
        )
    value = lookup(item.index)
    found: list[tuple[str, torch.Tensor]] = []
    try:
        encoded = encode_tree(value, found, name)
    except UnsupportedStateError as exc:
        what = str(exc).split(": crashproof stores", 1)[0]
        raise UnsupportedStateError(
            f"state dict key {name!r} cannot be saved ({what}): crashproof stores tensors and "
            "JSON-like values (numbers, strings, bools, None, lists, tuples and dicts of them) "
            "and never pickles. Convert it in your state_dict() (a set to a sorted list, an "
            "object to a dict of its fields), or leave it out of the state dict"
        ) from None
    if found:
        raise UnsupportedStateError(
            f"state dict key {name!r} holds a tensor inside a value DCP saves whole "
            f"({found[0][0]!r}): put each tensor under a key of its own (in a dict, not a tuple)"
        )
    return encoded
