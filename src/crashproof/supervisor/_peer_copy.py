"""What a node's memory host lends the replication between agents (:mod:`._memory_peers`): its
committed segments to send, and a place for the copies it receives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Key", "PeerCopy"]

Key = tuple[str, int, int]
"""A segment: the root's key, the global rank, the slot."""


class PeerCopy(Protocol):
    """What the host lends the replication: its committed segments, and a place for copies."""

    token: str
    """This agent's name among the others, for as long as it lives."""

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may be held (the node's memory, ``--memory-limit``)."""
        ...

    def pin(self, key: str, step: int) -> None:
        """Snapshots of ``step`` (of root ``key``) are covered: keep them until a newer is."""
        ...

    def ranks(self, key: str) -> list[int]:
        """The ranks of root ``key`` this node's trainers hold segments for."""
        ...

    def sending(self, keys: list[Key], busy: bool) -> None:
        """Segments ``keys`` are (busy) or are no longer being sent: their trainers' memory
        snapshots skip them meanwhile (backpressure: skipped, never waited for)."""
        ...

    def committed(self, key: str, rank: int, world_size: int) -> list[dict[str, Any]]:
        """Every committed segment or copy of (key, rank): ``slot``, ``step``, ``nbytes``,
        ``contents``, ``fd`` (a duplicate, the caller's to close) and ``gen``."""
        ...

    def generation(self, key: Key) -> int | None:
        """A counter that changes whenever the segment is overwritten or committed."""
        ...

    def keys(self, ranks: set[int], world_size: int) -> set[str]:
        """The root keys of the committed snapshots (own or copies) held of ``ranks``."""
        ...

    def prepare(
        self, key: str, rank: int, world_size: int, *, ahead_of_round: int | None = None
    ) -> None:
        """Fetch (or rebuild) the newest snapshots of (key, rank) a peer holds, if this host
        has none or only older ones; one at a time per rank, and ``ahead_of_round`` only while
        the rank's trainer has not asked for them in that round."""
        ...

    def store_copy(
        self,
        key: Key,
        meta: dict[str, Any],
        fill: Callable[[memoryview], None],
        origin: str,
        *,
        as_replica: bool,
    ) -> str | None:
        """Make a segment of ``meta["nbytes"]``, ``fill`` it, and keep it with what it holds
        (``meta``): as a replica for another node's rank, or as this node's own segment (a
        trainer here is about to restore from it); returns why not (no memory), or None."""
        ...

    def store_copies(
        self,
        copies: list[tuple[Key, dict[str, Any], bool]],
        fill: Callable[[list[memoryview]], None],
        origin: str,
    ) -> str | None:
        """:meth:`store_copy` of several segments at once, each ``(key, meta, as_replica)``:
        all are made, then ``fill`` is given all of them, then all are kept, or none is."""
        ...
