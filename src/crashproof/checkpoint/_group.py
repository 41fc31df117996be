"""How the ranks of one job agree during a save or restore.

One rank (0) coordinates: it lists checkpoints, writes the manifest and commits. The others tell
it what they wrote. Collectives run on a dedicated gloo group so that a save persisting in the
background never interleaves with the training loop's own collectives, and so that a rank that
dies mid-save makes the others fail after ``timeout_s`` instead of hanging.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["DistGroup", "Group", "SoloGroup", "default_group"]


class Group(Protocol):
    rank: int
    world_size: int

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None elsewhere."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank (in rank order)."""
        ...

    def max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's ``values`` (cheap: one small all-reduce)."""
        ...


class SoloGroup:
    """A job of one process."""

    rank = 0
    world_size = 1

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def max(self, values: list[int]) -> list[int]:
        return list(values)


class DistGroup:
    """The ranks of the default ``torch.distributed`` process group, over a private gloo group."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # new_group is itself a collective: every rank creates its CheckpointManager in step.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def max(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
        return [int(v) for v in tensor.tolist()]


def default_group(timeout_s: float = 600.0) -> Group:
    """A :class:`DistGroup` when ``torch.distributed`` is initialised with several ranks."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DistGroup(timeout_s)
    return SoloGroup()
