"""Sharded state (DTensors) read on any number of ranks, through ``torch.distributed.checkpoint``.

Each rank saved its own piece of every DTensor, with the piece's place in the whole tensor (see
:mod:`crashproof.state._dtensor`). :class:`CrashproofReader` is a ``torch.distributed.checkpoint``
storage reader over a crashproof checkpoint: it describes those pieces as DCP metadata, and DCP's
load planner works out which parts of which saved pieces each live piece needs, whatever the
saved and the current world sizes and placements. The bytes come from crashproof's own files
through its own reader: every piece read is checked against its checksum, nothing is unpickled.

Used by :class:`~crashproof.CheckpointManager` to restore FSDP2 models and their optimizers, and
usable directly::

    dcp.load(state_dict, storage_reader=CrashproofReader("ckpts/step_0000000100"))

where ``state_dict`` is keyed like the checkpoint (``model/<fqn>``,
``optimizer/state/<fqn>/exp_avg``; ``crashproof inspect`` lists the names).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from crashproof.checkpoint.format import (
    Manifest,
    Piece,
    ShardRead,
    TensorEntry,
    dtype_from_name,
    shard_name,
    sharded_pieces,
)
from crashproof.checkpoint.restore._read_manifest import (
    read_error,
    read_manifest,
    read_rank_index,
    refused,
)
from crashproof.errors import CorruptCheckpointError, StateMismatchError
from crashproof.state import empty_like_piece, is_dtensor
from crashproof.storage import Storage, storage_for

__all__ = ["CrashproofReader", "dcp_failures", "load_sharded", "restore_targets"]


class CrashproofReader(StorageReader):
    """A ``torch.distributed.checkpoint`` storage reader for one crashproof checkpoint.

    It offers every piece of every sharded tensor, and rank 0's whole tensors (replicated state
    such as buffers). Give it a checkpoint directory (local path or URI), or an open storage.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage: Storage | None = None,
        manifest: Manifest | None = None,
    ) -> None:
        super().__init__()
        if storage is None:
            self._dir, self._storage = storage_for(os.fspath(path))
        else:
            self._dir, self._storage = os.fspath(path), storage
        self._manifest = manifest or read_manifest(self._storage, self._dir)
        self._where = self._storage.describe(self._dir)
        if self._manifest.kind != "full":
            raise CorruptCheckpointError(
                f"{self._where}: a {self._manifest.kind} checkpoint; sharded state is only ever "
                "saved in full checkpoints"
            )
        self._pieces: dict[MetadataIndex, Piece] = {}
        self._wholes: dict[str, tuple[tuple[int, ...], str]] = {}
        self._metadata = self._describe()

    def _describe(self) -> Metadata:
        indexes = [
            read_rank_index(self._storage, self._dir, self._manifest, rank)
            for rank in range(self._manifest.world_size)
        ]
        # The same checks as verify_checkpoint's: the pieces agree and tile each tensor.
        tensors: dict[str, TensorStorageMetadata] = {}
        for name, pieces in sharded_pieces(indexes, self._where).items():
            first = pieces[0][1]
            whole = first.global_shape if first.global_shape is not None else first.shape
            dtype = dtype_from_name(first.dtype, where=self._where)
            listed = sum(entry.nbytes for _, entry in pieces)
            size = math.prod(whole) * dtype.itemsize
            if size > listed:  # the tiling implies it; what restore_targets allocates rests on it
                raise CorruptCheckpointError(
                    f"{self._where}: tensor {name!r} is {first.dtype}{list(whole)} ({size} bytes) "
                    f"but its saved pieces hold {listed} bytes"
                )
            self._wholes[name] = (tuple(whole), first.dtype)
            tensors[name] = TensorStorageMetadata(
                TensorProperties(dtype=dtype),
                torch.Size(whole),
                [],
            )
            for rank, entry in pieces:
                offset = entry.global_offset or (0,) * len(entry.shape)
                tensors[name].chunks.append(
                    ChunkStorageMetadata(torch.Size(offset), torch.Size(entry.shape))
                )
                self._pieces[MetadataIndex(name, torch.Size(offset))] = (rank, entry)
        return Metadata(state_dict_metadata=dict(tensors))

    @property
    def where(self) -> str:
        """The checkpoint directory, as messages name it."""
        return self._where

    def whole(self, name: str) -> tuple[tuple[int, ...], str] | None:
        """The whole shape and dtype of sharded tensor ``name``, as its saved pieces tile it."""
        return self._wholes.get(name)

    # -- the StorageReader interface ------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every saved piece the plan needs once, verified, and copy the parts asked for."""
        needed: dict[MetadataIndex, list[Any]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR or item.storage_index not in self._pieces:
                raise CorruptCheckpointError(
                    f"{self._where}: holds no tensor piece {item.storage_index.fqn!r} at "
                    f"{list(item.storage_index.offset or ())}"
                )
            needed.setdefault(item.storage_index, []).append(item)
        for key, items in needed.items():
            saved = self._read_piece(*self._pieces[key])
            for item in items:
                source = saved
                for dim, (start, length) in enumerate(
                    zip(item.storage_offsets, item.lengths, strict=True)
                ):
                    source = source.narrow(dim, start, length)
                target = planner.resolve_tensor(item).detach()
                target.copy_(source)
                planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # constructed with its checkpoint, never found by DCP from an id

    def _read_piece(self, rank: int, entry: TensorEntry) -> torch.Tensor:
        file = entry.file or shard_name(rank)
        where = f"{self._storage.describe(self._storage.join(self._dir, file))}"
        try:
            stream = self._storage.open(self._storage.join(self._dir, file))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: missing") from None
        except OSError as exc:
            raise refused(exc, where) from None
        try:
            read = ShardRead(stream, [entry], self._manifest.files[file], where, partial=True)
            read.verify()  # the piece's own checksum; the file is its writer's to verify whole
            return read.fill()[0]
        except (OSError, EOFError) as exc:
            raise read_error(exc, where) from None
        finally:
            stream.close()


def restore_targets(
    pieces: Mapping[str, TensorEntry],
    live: Mapping[str, torch.Tensor],
    saved: CrashproofReader,
) -> dict[str, torch.Tensor]:
    """New tensors to restore the saved sharded tensors into, by name: a DTensor laid out like its
    live counterpart (this run's mesh and placements, whatever the saved ones were), or a whole
    tensor where the live one is whole (a sharded checkpoint restored unsharded).

    ``saved`` (the reader :func:`load_sharded` then reads with) checked every rank's pieces when
    it was made: a whole tensor is allocated only with the shape its pieces tile, so never larger
    than the bytes they hold; a piece that claims another whole is
    :class:`CorruptCheckpointError`."""
    targets: dict[str, torch.Tensor] = {}
    for name, entry in pieces.items():
        counterpart = live.get(name)
        if counterpart is not None and is_dtensor(counterpart):
            targets[name] = empty_like_piece(counterpart)
            continue
        whole = saved.whole(name)
        if whole is None or (whole[0], whole[1]) != (entry.global_shape, entry.dtype):
            raise CorruptCheckpointError(
                f"{saved.where}: tensor {name!r} is a piece of a {entry.dtype}"
                f"{list(entry.global_shape or ())} tensor, which the ranks' pieces do not make up"
            )
        targets[name] = torch.empty(whole[0], dtype=dtype_from_name(whole[1], where=name))
    return targets


def load_sharded(
    storage: Storage,
    ckpt_dir: str,
    manifest: Manifest,
    targets: Mapping[str, torch.Tensor],
    *,
    reader: CrashproofReader | None = None,
) -> None:
    """Fill ``targets`` (DTensors, or whole tensors to consolidate) from the checkpoint's pieces.

    Planned by DCP on this rank alone (every rank has the whole metadata, so there is nothing to
    agree on); raises :class:`CorruptCheckpointError` when a piece is missing or corrupt, and
    :class:`StateMismatchError` when DCP finds that the saved tensors do not fit ``targets``.
    """
    if reader is None:
        reader = CrashproofReader(ckpt_dir, storage=storage, manifest=manifest)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(dict(targets), storage_reader=reader, no_dist=True)
    except CorruptCheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        # DCP wraps the errors of its reader (ours: a missing or corrupt piece, raised as
        # CorruptCheckpointError). Anything else is its planner finding a tensor that does not
        # fit (a name or a size the caller's checks let through, e.g. an optimizer's factored
        # state): the checkpoint is sound, the live state is not the one that saved it. Such a
        # restore must stop with the reason, not skip to an older checkpoint, or to step 0.
        cause = _root_cause(exc)
        if isinstance(cause, CorruptCheckpointError) or not isinstance(cause, Exception):
            raise cause from None  # and an interrupt (KeyboardInterrupt, SystemExit) stays one
        if isinstance(cause, OSError):
            raise CorruptCheckpointError(
                f"{storage.describe(ckpt_dir)}: the sharded state cannot be read: {cause}"
            ) from exc
        raise StateMismatchError(
            f"{storage.describe(ckpt_dir)}: the sharded state does not fit the tensors it is "
            f"restored into: {cause}. Was the model, the optimizer or their sharding changed?"
        ) from exc


def dcp_failures(exc: BaseException) -> list[BaseException]:
    """The exceptions behind a DCP failure, by rank: DCP catches what each rank's storage reader,
    writer or planner raises and raises a ``CheckpointException`` holding them per rank (empty
    for any other exception)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    found = []
    for rank in sorted(failures):
        inner = failures[rank]
        if isinstance(inner, tuple) and inner:  # (exception, its stack summary)
            inner = inner[0]
        if isinstance(inner, BaseException):
            found.append(inner)
    return found


def _root_cause(exc: BaseException) -> BaseException:
    """The first rank's exception under DCP's wrapper (``exc`` itself when it wraps none)."""
    return next(iter(dcp_failures(exc)), exc)
