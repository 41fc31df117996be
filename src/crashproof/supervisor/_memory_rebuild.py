"""Rebuilding a lost node's snapshots from the parity its group holds (:mod:`._memory_parity`).

Each of the lost node's pieces is rebuilt by a thread of its own, straight into the rebuilt
snapshot: the parity is read from the member that keeps it, and each other member's piece that
went into it is read again from that member's memory and XORed in as it arrives, a chunk at a
time (no copy of a parity or a piece is held). Every piece read is checked against the checksum
it had when it was first sent, and each rebuilt piece against its own; a rebuild that fails any
check keeps nothing.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

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
    (``agents``, by name) still hold, and ``store`` it (:meth:`PeerCopy.store_copy`); returns
    the origins stored, where from, and why nothing was (when nothing was)."""
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
    payload = bytearray(length)
    view = memoryview(payload)
    with ThreadPoolExecutor(len(pieces), thread_name_prefix="crashproof-rebuild") as pool:
        futures = [
            pool.submit(
                _rebuild_piece, dial, key, world_size, step, peer, record, lost, agents, view
            )
            for peer, record in pieces.values()
        ]
        for future in futures:
            future.result()  # (the first failure, raised)
    origin = f"peer:{', '.join(sorted({p['node'] for p, _ in pieces.values()}))} (parity)"
    stored, at = [], 0
    for segment in mine["segments"]:
        nbytes = int(segment["nbytes"])
        chunk = view[at : at + nbytes]
        at += nbytes
        meta = {"nbytes": nbytes, "world_size": world_size, "step": step,
                "contents": segment["contents"]}  # fmt: skip

        def fill(into: memoryview, chunk: memoryview = chunk) -> None:
            into[:] = chunk

        slot = (key, int(segment["rank"]), int(segment["slot"]))
        why = store(slot, meta, fill, origin, as_replica=slot[1] != rank)
        if why is not None:
            raise Dropped(why)
        if slot[1] == rank:
            stored.append(origin)
    return stored


def _rebuild_piece(
    dial: Callable[[Peer], socket.socket],
    key: str,
    world_size: int,
    step: int,
    peer: Peer,
    record: dict[str, Any],
    lost: str,
    agents: dict[str, Peer],
    payload: memoryview,
) -> None:
    """Rebuild the lost node's piece kept in ``record``'s parity into its place in ``payload``."""
    mine = record["contributors"][lost]
    offset, size = int(mine["offset"]), int(mine["size"])
    target = payload[offset : offset + size]
    rebuilt = tensor_of(target)

    def keep(pos: int, chunk: memoryview) -> None:  # the parity: its first ``size`` bytes
        if pos < size:
            target[pos : pos + min(len(chunk), size - pos)] = chunk[: size - pos]

    def xor(pos: int, chunk: memoryview) -> None:  # another member's piece, XORed in
        if pos < size:
            n = min(len(chunk), size - pos)
            rebuilt[pos : pos + n].bitwise_xor_(torch.frombuffer(chunk, dtype=torch.uint8, count=n))

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
    hasher = new_hasher()
    hasher.update(target)
    if hasher.hexdigest() != mine["checksum"]:
        raise Dropped(f"piece {mine['piece']} rebuilt does not match its checksum")
