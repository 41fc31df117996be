"""The DCP storage reader: crashproof's :class:`CrashproofReader`, plus the non-tensor values.

:class:`~crashproof.checkpoint.restore.CrashproofReader` (the reader crashproof restores FSDP2
state with) already offers every tensor of a checkpoint to DCP's planner and reads each piece
verified against its checksum. A checkpoint the DCP writer made also holds the state dict's other
values, as JSON under the ``dcp`` section of each rank's index; this reader offers them too and
hands them to the planner decoded, never unpickled.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from crashproof.checkpoint.format import MANIFEST_NAME, JSONValue, Manifest, decode_tree
from crashproof.checkpoint.restore import CrashproofReader, read_manifest, read_rank_index
from crashproof.errors import CorruptCheckpointError
from crashproof.integrations._dcp_target import Target
from crashproof.integrations._dcp_writer import DCP_SECTION

try:  # what DefaultLoadPlanner.load_bytes itself uses to put a value in place
    from torch.distributed.checkpoint._traverse import set_element
except ImportError:  # pragma: no cover - another torch: values go through load_bytes instead
    set_element = None  # type: ignore[assignment]

__all__ = ["StorageReader"]

_TENSOR_TAGS = ("$tensor", "$dtensor", "$ndarray")


class StorageReader(CrashproofReader):
    """Reads a crashproof checkpoint with ``torch.distributed.checkpoint.load``.

    ``StorageReader(path)`` reads the checkpoint directory ``path``; ``StorageReader(root,
    step=N)`` reads ``root/step_000000000N``. It offers every tensor under its name in the
    checkpoint (``crashproof inspect`` lists them): the state dict's keys for a checkpoint the
    DCP :class:`StorageWriter` wrote, ``model/<fqn>``, ``optimizer/state/...`` for one a
    :class:`~crashproof.CheckpointManager` wrote; and, in a DCP-written checkpoint, every other
    value the state dict held. DCP's planner picks what the live state dict asks for, resharding
    across world sizes as it does. Every byte read is checked against its checksum first: a
    damaged file raises :class:`CorruptCheckpointError` naming it. Nothing is ever unpickled.
    """

    def __init__(self, path: str | os.PathLike[str], *, step: int | None = None) -> None:
        target = Target.of(path, step)
        manifest = read_manifest(target.storage, target.final)
        super().__init__(target.final, storage=target.storage, manifest=manifest)
        self._values = _saved_values(target, manifest)
        tensors = super().read_metadata().state_dict_metadata
        described: dict[str, Any] = {name: BytesStorageMetadata() for name in self._values}
        self._described = Metadata(state_dict_metadata={**described, **tensors})

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory this reader reads."""
        return self.where

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins; ``checkpoint_id`` (``dcp.load(..., checkpoint_id=...)``), when
        given, is the checkpoint directory it reads from now on."""
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.where:
            self.__init__(checkpoint_id)  # type: ignore[misc]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._described

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """The values first (decoded JSON), then every tensor piece, each verified once."""
        tensors: list[ReadItem] = []
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                tensors.append(item)
                continue
            name = item.storage_index.fqn
            if name not in self._values:
                raise CorruptCheckpointError(f"{self.where}: holds no value {name!r}")
            value = decode_tree(self._values[name], _no_tensor(self.where, name), self.where)
            _hand_over(planner, item, value)
        return super().read_data(dataclasses.replace(plan, items=tensors), planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a directory holding a crashproof manifest."""
        try:
            target = Target.of(checkpoint_id)
            return MANIFEST_NAME in target.storage.list(target.final)
        except Exception:  # DCP asks only yes or no
            return False


def _saved_values(target: Target, manifest: Manifest) -> dict[str, JSONValue]:
    """The non-tensor values of a DCP-written checkpoint by name, as stored (JSON); the rank
    that wrote each is the one DCP's planner gave it to (the lowest, where several did)."""
    values: dict[str, JSONValue] = {}
    for rank in range(manifest.world_size):
        state = read_rank_index(target.storage, target.final, manifest, rank).state
        section = state.get(DCP_SECTION) if isinstance(state, dict) else None
        if not isinstance(section, dict):
            continue  # a checkpoint the manager wrote: tensors only
        for name, node in section.items():
            is_tensor = isinstance(node, dict) and any(tag in node for tag in _TENSOR_TAGS)
            if not is_tensor:
                values.setdefault(name, node)
    return values


def _no_tensor(where: str, name: str) -> Any:
    def refuse(index: int) -> torch.Tensor:
        raise CorruptCheckpointError(f"{where}: value {name!r} refers to tensor #{index}")

    return refuse


def _hand_over(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Put ``value`` where the planner wants it, as ``DefaultLoadPlanner.load_bytes`` would but
    without its ``torch.load``. A planner with a ``load_bytes`` of its own gets the value as
    ``torch.save`` bytes made here from the decoded JSON: nothing read from disk is unpickled."""
    name = item.dest_index.fqn
    default = type(planner).load_bytes is DefaultLoadPlanner.load_bytes
    if isinstance(planner, DefaultLoadPlanner) and default and set_element is not None:
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[name], value)
        else:
            planner.state_dict[name] = value
        return
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    planner.load_bytes(item, stream)
