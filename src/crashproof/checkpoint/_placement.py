"""Which ranks share a root: :class:`Placement`.

A root is *shared* (one directory every rank writes into: a shared filesystem, an object store)
or *node-local* (one directory per node, e.g. each node's NVMe disk, holding that node's ranks'
files). Ranks are on one node when :func:`node_key` says so; a writing manager then checks that
the ranks of a node really see one directory, and those of different nodes different ones
(:mod:`crashproof.checkpoint._manager_state`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = ["NODE_ENV", "Placement", "node_key"]

NODE_ENV = "CRASHPROOF_NODE"
"""Names the node a process is on, where the host name and torchrun's ``GROUP_RANK`` do not tell
(several simulated nodes on one host, a launcher of its own)."""


def node_key() -> str:
    """This process's node: ``$CRASHPROOF_NODE``, else the host name and torchrun's node rank."""
    named = os.environ.get(NODE_ENV, "").strip()
    if named:
        return f"named:{named}"
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"


@dataclass(frozen=True, slots=True)
class Placement:
    """The ranks of each root: one node holding every rank for a shared root."""

    nodes: tuple[tuple[int, ...], ...]
    rank: int

    @classmethod
    def shared(cls, world_size: int, rank: int) -> Placement:
        return cls((tuple(range(world_size)),), rank)

    @classmethod
    def from_keys(cls, keys: list[str], rank: int) -> Placement:
        """One node per distinct key (in ``keys``, every rank's), nodes in order of first rank."""
        grouped: dict[str, list[int]] = {}
        for r, key in enumerate(keys):
            grouped.setdefault(key, []).append(r)
        return cls(tuple(tuple(ranks) for ranks in grouped.values()), rank)

    @property
    def node_local(self) -> bool:
        """Whether each node has a root of its own (more than one node)."""
        return len(self.nodes) > 1

    @property
    def my_node(self) -> tuple[int, ...]:
        return next(ranks for ranks in self.nodes if self.rank in ranks)

    def leader_of(self, rank: int) -> int:
        """The rank that changes ``rank``'s root: its node's first rank."""
        return next(ranks[0] for ranks in self.nodes if rank in ranks)

    @property
    def leads(self) -> bool:
        """Whether this rank changes its root: commits, removes, holds the lock."""
        return self.leader_of(self.rank) == self.rank
