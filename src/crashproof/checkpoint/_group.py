"""How the ranks of one job agree during a save or restore.

One rank (0) coordinates: it lists checkpoints, writes the manifest and commits. The others tell
it what they wrote. Collectives run on a dedicated gloo group so that a save persisting in the
background never interleaves with the training loop's own collectives, and so that a rank that
dies mid-save makes the others fail after ``timeout_s`` instead of hanging.
"""

from __future__ import annotations

import itertools
import logging
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from crashproof.errors import CheckpointWriteError

__all__ = [
    "ARRIVAL_PATIENCE_S",
    "DistGroup",
    "Group",
    "RankAlone",
    "SoloGroup",
    "default_group",
]

log = logging.getLogger("crashproof.checkpoint")

ARRIVAL_PATIENCE_S = 10.0
"""How long the ranks at a save wait for the others before saying which have not come."""

_groups = itertools.count()
"""Groups made in this process: the same on every rank (making one is a collective)."""


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

    def scatter(self, objs: list[Any] | None) -> Any:
        """``objs[r]`` (given on rank 0, one per rank) on rank ``r``: each rank receives its
        own, not every rank's."""
        ...

    def max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's ``values`` (cheap: one small all-reduce)."""
        ...

    def arrive(self, what: str) -> None:
        """Wait until every rank has come to ``what`` (the same call on every rank: a save);
        a rank that does not come is named within seconds, not after the collective timeout."""
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

    def scatter(self, objs: list[Any] | None) -> Any:
        assert objs is not None and len(objs) == 1
        return objs[0]

    def max(self, values: list[int]) -> list[int]:
        return list(values)

    def arrive(self, what: str) -> None:
        return None


class RankAlone(SoloGroup):
    """One rank of a job acting alone, keeping its rank and the job's size: its part of a
    checkpoint written and committed by itself (a snapshot in the agent's memory)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


class DistGroup:
    """The ranks of the default ``torch.distributed`` process group, over a private gloo group."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # new_group is itself a collective: every rank creates its CheckpointManager in step.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._timeout_s = timeout_s
        self._arrivals = 0
        self._prefix = f"crashproof/arrive/{next(_groups)}"

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

    def scatter(self, objs: list[Any] | None) -> Any:
        box: list[Any] = [None]
        dist.scatter_object_list(box, objs if self.rank == 0 else None, src=0, group=self._group)
        return box[0]

    def max(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
        return [int(v) for v in tensor.tolist()]

    def arrive(self, what: str) -> None:
        """Meet at ``what`` through the job's store (not a collective: a rank that never comes
        leaves no collective waiting). After :data:`ARRIVAL_PATIENCE_S` the ranks that came log
        which have not (a save called on some ranks only, e.g. ``if rank == 0: save()``, is
        a deadlock); after the group's timeout they give up with ``CheckpointWriteError``."""
        store = dist.distributed_c10d._get_default_store()
        key = f"{self._prefix}/{self._arrivals}"
        self._arrivals += 1
        store.set(f"{key}/{self.rank}", str(self.rank))
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        started, said, pause = time.monotonic(), False, 0.005
        while not store.check(keys):
            waited = time.monotonic() - started
            if waited > ARRIVAL_PATIENCE_S and not said:
                said = True
                log.error(
                    "%s: ranks %s have not come after %.0f s, while rank %d waits. Saves are "
                    "collective: every rank calls CheckpointManager.save (or maybe_save) for "
                    "the same step; a save on some ranks only hangs the job",
                    what,
                    self._missing(store, keys),
                    waited,
                    self.rank,
                )
            if waited > self._timeout_s:
                raise CheckpointWriteError(
                    f"{what}: ranks {self._missing(store, keys)} did not come within "
                    f"{self._timeout_s:.0f} s. Saves are collective: call CheckpointManager.save "
                    "(or maybe_save) on every rank, with the same step"
                )
            time.sleep(pause)
            pause = min(0.1, pause * 2)

    def _missing(self, store: Any, keys: list[str]) -> str:
        return ", ".join(str(r) for r, k in enumerate(keys) if not store.check([k]))


def default_group(timeout_s: float = 600.0) -> Group:
    """A :class:`DistGroup` when ``torch.distributed`` is initialised with several ranks."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DistGroup(timeout_s)
    return SoloGroup()
