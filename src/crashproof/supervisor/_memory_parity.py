"""XOR parity between the agents of a multi-node run: losing any one node of a group loses no
snapshot, for ``1/k`` of the state's memory per node instead of a full copy's ``1``.

The nodes of a round are split into groups of ``k + 1`` or more consecutive nodes (at least two).
A node's *payload* at a step is its ranks' committed segments for that step, end to end in rank
order. A node of a group of ``g`` cuts its payload into ``g - 1`` pieces and sends piece ``p`` to
the member ``p + 1`` places after it in the group, so each member receives one piece from every
other member and keeps their XOR: the member's *parity* for that step, the size of one piece.

When a node is lost, each piece of its payload is rebuilt at one member: that member's parity XOR
the pieces the other members sent it, read again from their own memory (they still hold the step:
see *coverage* below). Every piece carries the checksum it had when it was first sent, so a rebuilt
piece, and every survivor's piece that goes into it, is checked before it is used, and the restore
checks every tensor once more.

*Coverage*: a member reports a step once its parity for it is complete; when every node of the
round has reported a step, the step is *covered*, and each agent pins it: its trainers' memory
snapshots leave the slot holding it alone until a newer step is covered, so that the step a lost
node would be rebuilt at is still in every survivor's memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ParityHolder", "ParityPlan", "parity_groups", "piece_span"]

_ALIGN = 64
_KEEP_BUILDING = 3
"""Parities being built for steps newer than the newest complete one, at most (the oldest go)."""
_KEEP_COMPLETE = 4
"""Complete parities kept at most (the covered step's is among the newest)."""


def parity_groups(nodes: int, k: int) -> list[list[int]]:
    """The group ranks ``0 .. nodes - 1`` split into consecutive groups of ``k + 1`` nodes or
    more, as even as possible (one group when there are fewer nodes)."""
    count = max(1, nodes // (k + 1))
    base, extra = divmod(nodes, count)
    groups, start = [], 0
    for index in range(count):
        size = base + (1 if index < extra else 0)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def piece_span(length: int, pieces: int, index: int) -> tuple[int, int]:
    """Where piece ``index`` of ``pieces`` lies in a payload of ``length`` bytes: its offset and
    size (pieces are the same size, aligned, the last one shorter or empty)."""
    size = -(-length // pieces)
    size = -(-size // _ALIGN) * _ALIGN
    start = min(length, index * size)
    return start, min(length, start + size) - start


@dataclass(frozen=True, slots=True)
class ParityPlan:
    """This node's place in the parity groups of a round."""

    members: list[int]
    """The group ranks of this node's group, this node among them."""
    me: int

    @property
    def pieces(self) -> int:
        return len(self.members) - 1

    def holder(self, piece: int) -> int:
        """The group rank that keeps the parity piece ``piece`` of this node's payload goes to."""
        at = self.members.index(self.me)
        return self.members[(at + 1 + piece) % len(self.members)]

    @classmethod
    def of(cls, group_rank: int, nodes: int, k: int) -> ParityPlan | None:
        for members in parity_groups(nodes, k):
            if group_rank in members:
                return cls(members, group_rank) if len(members) > 1 else None
        return None


@dataclass(slots=True)
class _Parity:
    world_size: int
    expected: frozenset[str]
    """The agents whose pieces make it whole (the other members of the holder's group)."""
    buffer: torch.Tensor | None = None
    contributors: dict[str, dict[str, Any]] = field(default_factory=dict)
    arriving: set[str] = field(default_factory=set)
    broken: bool = False

    @property
    def complete(self) -> bool:
        return not self.broken and set(self.contributors) == self.expected

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else int(self.buffer.numel())

    @property
    def ranks(self) -> set[int]:
        """The ranks whose segments the contributors' pieces hold."""
        return {int(s["rank"]) for r in self.contributors.values() for s in r["segments"]}


class ParityHolder:
    """The parities this agent keeps for the other members of its group: (root key, step) ->
    the XOR of their pieces, and each piece's record (the contributor's segments, what they
    hold, the piece's place and checksum)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parities: dict[tuple[str, int], _Parity] = {}
        self._floor: dict[str, int] = {}  # per key: the covered step (older parities go)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for p in self._parities.values())

    def open_piece(
        self, key: str, step: int, world_size: int, agent: str, expected: list[str], size: int
    ) -> bool:
        """Whether to receive ``agent``'s piece of ``size`` bytes for (key, step) (the parity
        grown to hold it); not when it is older than the covered step, a piece that parity has
        (or is receiving) already, or broken."""
        with self._lock:
            if step < self._floor.get(key, -1) or agent not in expected:
                return False
            parity = self._parities.get((key, step))
            fresh = _Parity(world_size, frozenset(expected))
            same_round = parity is not None and (parity.world_size, parity.expected) == (
                world_size, fresh.expected
            )  # fmt: skip
            if parity is None or (not same_round and not parity.complete):
                parity, same_round = fresh, True
                self._parities[(key, step)] = parity
            if not same_round or parity.broken:  # (a complete one of another round stays)
                return False
            if agent in parity.contributors or agent in parity.arriving:
                return False
            if parity.buffer is None or parity.nbytes < size:
                grown = torch.zeros(size, dtype=torch.uint8)
                if parity.buffer is not None:
                    grown[: parity.nbytes].copy_(parity.buffer)
                parity.buffer = grown
            parity.arriving.add(agent)
            return True

    def xor_in(self, key: str, step: int, offset: int, data: memoryview) -> None:
        """XOR ``data``, bytes ``offset ..`` of a piece being received, into the parity (under
        the lock: another piece may grow the buffer meanwhile)."""
        with self._lock:
            parity = self._parities.get((key, step))
            if parity is not None and parity.buffer is not None and len(data):
                chunk = torch.frombuffer(data, dtype=torch.uint8)
                parity.buffer[offset : offset + len(data)].bitwise_xor_(chunk)

    def close_piece(self, key: str, step: int, agent: str, record: dict[str, Any] | None) -> bool:
        """``agent``'s piece arrived whole (``record``), or not (None: the parity may hold part
        of it, and can never be complete); returns whether the parity is complete now."""
        with self._lock:
            parity = self._parities.get((key, step))
            if parity is None or agent not in parity.arriving:
                return False  # (retired meanwhile)
            parity.arriving.discard(agent)
            if record is None:
                parity.broken = True
                return False
            parity.contributors[agent] = record
            complete = parity.complete
            if complete:
                self._retire(key)
            return complete

    def new_round(self) -> None:
        """A new round: coverage starts again (its trainers may go back to older steps); the
        complete parities stay offered, the ones being built go."""
        with self._lock:
            self._floor = {}
            for k in [k for k, p in self._parities.items() if not p.complete]:
                del self._parities[k]

    def covered(self, key: str, step: int) -> None:
        """``step`` is covered: the parities of older steps are no longer needed."""
        with self._lock:
            self._floor[key] = max(step, self._floor.get(key, -1))
            for k, s in [k for k in self._parities if k[0] == key and k[1] < self._floor[key]]:
                del self._parities[(k, s)]

    def _retire(self, key: str) -> None:
        """Drop the parities being built for steps older than the newest complete one, and all
        but the newest few being built (the lock is held)."""
        steps = sorted(s for k, s in self._parities if k == key)
        complete = [s for s in steps if self._parities[(key, s)].complete]
        newest = complete[-1] if complete else -1
        building = [s for s in steps if s not in complete]
        for step in building:
            if step < newest or step in building[:-_KEEP_BUILDING]:
                del self._parities[(key, step)]
        # (Complete ones go when a newer step is covered; these few bound them if none is.)
        for step in complete[:-_KEEP_COMPLETE]:
            del self._parities[(key, step)]

    def records(self, key: str, rank: int, world_size: int) -> list[dict[str, Any]]:
        """The complete parities of ``key`` with a piece of ``rank``'s segments: ``step``,
        ``size`` and ``contributors`` (agent -> record)."""
        found = []
        with self._lock:
            for (k, step), parity in self._parities.items():
                if k != key or not parity.complete or parity.world_size != world_size:
                    continue
                if rank in parity.ranks:
                    found.append(
                        {"step": step, "size": parity.nbytes, "contributors": parity.contributors}
                    )
        return sorted(found, key=lambda r: -int(r["step"]))

    def keys(self, ranks: set[int], world_size: int) -> set[str]:
        """The root keys of the complete parities of ``world_size`` with a piece of any of
        ``ranks``' segments."""
        with self._lock:
            return {
                k
                for (k, _step), parity in self._parities.items()
                if parity.complete and parity.world_size == world_size and parity.ranks & ranks
            }

    def read(self, key: str, step: int) -> torch.Tensor | None:
        """The complete parity of (key, step) (a clone: it may go meanwhile), or None."""
        with self._lock:
            parity = self._parities.get((key, step))
            if parity is None or not parity.complete or parity.buffer is None:
                return None
            return parity.buffer.clone()
