"""Rebuilding a lost node's snapshots from the parity its group holds (:mod:`._memory_parity`).

Each of the lost node's pieces is rebuilt by a thread of its own, straight into the segments
that will hold the lost node's snapshots (made first, all of them, and counted against the
node's memory like any copy): the parity is read from the member that keeps it, and each other
member's piece that went into it is read again from that member's memory and XORed in as it
arrives, a chunk at a time (no copy of a parity, a piece or the payload is held). Every piece
read is checked against the checksum it had when it was first sent, and each rebuilt piece
against its own; a rebuild that fails any check keeps nothing.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from crashproof.checkpoint.format import new_hasher
from crashproof.link import recv_message, send_message
from crashproof.supervisor._peer_wire import Dropped, receive_bytes, tensor_of

__all__ = ["rebuild"]

log = logging.getLogger("crashproof.supervisor")

Peer = dict[str, Any]
Offer = tuple[Peer, dict[str, Any]]
"""A peer, and a complete parity record it holds (``step``, ``size``, ``contributors``)."""


def rebuild(
    key: str,
    rank: int,
    world_size: int,
    offers: dict[int, list[Offer]],
    agents: dict[str, Peer],
    dial: Callable[[Peer], socket.socket],
    store: Callable[..., str | None],
) -> tuple[list[str], str, str]:
    """Rebuild (key, rank)'s newest snapshot the ``offers`` (by step) and the survivors
    (``agents``, by name) still hold, into segments ``store`` makes and keeps
    (:meth:`PeerCopy.store_copies`); returns the origins stored, where from, and why nothing
    was (when nothing was)."""
    why = ""
    for step in sorted(offers, reverse=True):
        started = time.monotonic()
        try:
            stored = _rebuild_step(key, rank, world_size, step, offers[step], agents, dial, store)
        except (OSError, ValueError, KeyError, TypeError, Dropped) as exc:
            why = f"step {step}: {exc}"
            log.warning("cannot rebuild rank %d's snapshot of %s", rank, why)
            continue
        holders = sorted({peer["node"] for peer, _ in offers[step]})
        log.info("rebuilt rank %d's snapshot of step %d from parity in %.2f s", rank, step,
                 time.monotonic() - started)  # fmt: skip
        return stored, f"parity on {', '.join(holders)}", ""
    return [], "", why


def _rebuild_step(
    key: str,
    rank: int,
    world_size: int,
    step: int,
    offered: list[Offer],
    agents: dict[str, Peer],
    dial: Callable[[Peer], socket.socket],
    store: Callable[..., str | None],
) -> list[str]:
    lost = next(
        agent
        for _, record in offered
        for agent, piece in record["contributors"].items()
        if any(int(s["rank"]) == rank for s in piece["segments"])
    )
    pieces = {
        int(record["contributors"][lost]["piece"]): (peer, record)
        for peer, record in offered
        if lost in record["contributors"]
    }
    mine = next(iter(pieces.values()))[1]["contributors"][lost]
    count, length = int(mine["pieces"]), int(mine["length"])
    if set(pieces) != set(range(count)):
        raise Dropped(
            f"only {len(pieces)} of its {count} parity pieces are on nodes still here "
            "(more nodes were lost than the parity covers)"
        )
    for _, record in pieces.values():
        for agent, piece in record["contributors"].items():
            if agent != lost and agent not in agents:
                raise Dropped(f"{piece['node']}, which has a part in it, is gone too")
    origin = f"peer:{', '.join(sorted({p['node'] for p, _ in pieces.values()}))} (parity)"
    segments = [
        ((key, int(segment["rank"]), int(segment["slot"])),
         {"nbytes": int(segment["nbytes"]), "world_size": world_size, "step": step,
          "contents": segment["contents"]})
        for segment in mine["segments"]
    ]  # fmt: skip
    if sum(meta["nbytes"] for _, meta in segments) != length:
        raise Dropped("its parity record does not add up")

    def rebuild_into(views: list[memoryview]) -> None:
        payload = _Spread(views)
        with ThreadPoolExecutor(len(pieces), thread_name_prefix="crashproof-rebuild") as pool:
            futures = [
                pool.submit(
                    _rebuild_piece, dial, key, world_size, step, peer, record, lost, agents,
                    payload,
                )
                for peer, record in pieces.values()
            ]  # fmt: skip
            for future in futures:
                future.result()  # (the first failure, raised)

    copies = [(slot, meta, slot[1] != rank) for slot, meta in segments]
    why = store(copies, rebuild_into, origin)
    if why is not None:
        raise Dropped(why)
    return [origin for slot, _ in segments if slot[1] == rank]


class _Spread:
    """The lost node's payload (its segments one after the other), written where it lies: in
    the segments it is rebuilt into."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._starts = [0]
        for view in views:
            self._starts.append(self._starts[-1] + len(view))

    def _spans(self, pos: int, size: int) -> Iterator[tuple[memoryview, int, int, int]]:
        """The parts of payload bytes ``[pos, pos + size)``: (segment, offset in it, offset in
        the range, length)."""
        for view, start, end in zip(self._views, self._starts, self._starts[1:], strict=False):
            low, high = max(pos, start), min(pos + size, end)
            if low < high:
                yield view, low - start, low - pos, high - low

    def write(self, pos: int, chunk: memoryview) -> None:
        for view, at, offset, n in self._spans(pos, len(chunk)):
            with view[at : at + n] as into:
                into[:] = chunk[offset : offset + n]

    def xor(self, pos: int, chunk: memoryview) -> None:
        for view, at, offset, n in self._spans(pos, len(chunk)):
            with view[at : at + n] as into, chunk[offset : offset + n] as part:
                rebuilt = tensor_of(into)
                rebuilt.bitwise_xor_(tensor_of(part))
                del rebuilt  # (its hold on the segment's mapping, before the view is released)

    def checksum(self, pos: int, size: int) -> str:
        hasher = new_hasher()
        for view, at, _, n in self._spans(pos, size):
            with view[at : at + n] as part:
                hasher.update(part)
        return hasher.hexdigest()


def _rebuild_piece(
    dial: Callable[[Peer], socket.socket],
    key: str,
    world_size: int,
    step: int,
    peer: Peer,
    record: dict[str, Any],
    lost: str,
    agents: dict[str, Peer],
    payload: _Spread,
) -> None:
    """Rebuild the lost node's piece kept in ``record``'s parity into its place in ``payload``."""
    mine = record["contributors"][lost]
    offset, size = int(mine["offset"]), int(mine["size"])

    def keep(pos: int, chunk: memoryview) -> None:  # the parity: its first ``size`` bytes
        if pos < size:
            with chunk[: size - pos] as part:
                payload.write(offset + pos, part)

    def xor(pos: int, chunk: memoryview) -> None:  # another member's piece, XORed in
        if pos < size:
            with chunk[: size - pos] as part:
                payload.xor(offset + pos, part)

    with contextlib.closing(dial(peer)) as connection:
        send_message(connection, {"op": "parity_fetch", "key": key, "step": step})
        reply, _ = recv_message(connection)
        if "error" in reply or int(reply["size"]) != int(record["size"]):
            raise Dropped(f"{peer['node']} no longer holds the parity")
        computed = receive_bytes(connection, int(reply["size"]), None, keep)
        if recv_message(connection)[0].get("checksum") != computed:
            raise Dropped(f"the parity from {peer['node']} was damaged on the way")
    for agent, piece in record["contributors"].items():
        if agent == lost:
            continue
        with contextlib.closing(dial(agents[agent])) as connection:
            send_message(connection, {"op": "piece_fetch", "key": key, "step": step,
                                      "world_size": world_size, "segments": piece["segments"],
                                      "offset": piece["offset"], "size": piece["size"]})  # fmt: skip
            reply, _ = recv_message(connection)
            if "error" in reply:
                raise Dropped(f"{piece['node']}: {reply['error']}")
            computed = receive_bytes(connection, int(piece["size"]), None, xor)
            trailer, _ = recv_message(connection)
        if not trailer.get("whole") or computed != piece["checksum"]:
            raise Dropped(f"{piece['node']} no longer holds the same snapshot of step {step}")
    if payload.checksum(offset, size) != mine["checksum"]:
        raise Dropped(f"piece {mine['piece']} rebuilt does not match its checksum")
