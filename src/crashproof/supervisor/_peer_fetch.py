"""Fetching a rank's snapshots from the other agents' memory (:mod:`._memory_peers`).

When a trainer asks its agent for its snapshots and the agent holds none for that rank (a new
node in a lost one's place, or a rank that moved to another node), the agent fetches the newest
whole copy a peer holds, or else rebuilds the snapshot from the parity and the survivors' own
snapshots (:mod:`._memory_rebuild`), before the trainer's restore starts.

A node that missed rounds or lacks its ranks' snapshots does not wait for that request: as soon
as the round forms, it asks the others which checkpoint roots they hold snapshots of its ranks
for, and fetches them while its trainers start (their imports and their model take seconds).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from crashproof.link import recv_message, send_message
from crashproof.supervisor._memory_rebuild import rebuild
from crashproof.supervisor._peer_copy import Key, PeerCopy
from crashproof.supervisor._peer_links import Peer, PeerLinks
from crashproof.supervisor._peer_requests import MAX_ROOTS, MAX_SLOTS, MAX_TEXT, Malformed, checked
from crashproof.supervisor._peer_wire import Dropped, receive_bytes
from crashproof.telemetry import EventLog

__all__ = ["Members", "PeerFetch", "receive_copy"]

log = logging.getLogger("crashproof.supervisor")

_PREFETCH_ASK_S = 5.0
"""How long a prefetch asks a peer that refuses it (it has not taken the round's secret yet)."""
_ASKING_THREADS = 8
"""How many peers a prefetch asks at once."""


@dataclass(frozen=True)
class Members:
    """The agents of the round, as this one knows them when it fetches."""

    others: list[Peer]
    everyone: list[Peer]
    """In group-rank order, this agent included."""


def receive_copy(
    host: PeerCopy,
    connection: socket.socket,
    key: Key,
    meta: dict[str, Any],
    origin: str,
    *,
    as_replica: bool = False,
) -> str | None:
    """Read one segment's bytes and its trailer off ``connection`` into a copy ``host`` keeps;
    returns why it was not kept (None: kept)."""
    nbytes = int(meta["nbytes"])

    def fill(into: memoryview) -> None:
        computed = receive_bytes(connection, nbytes, into)
        trailer, _ = recv_message(connection)
        if not trailer.get("whole") or trailer.get("checksum") != computed:
            raise Dropped("overwritten while it was sent, or damaged on the way")

    try:
        return host.store_copy(key, meta, fill, origin, as_replica=as_replica)
    except Dropped as exc:
        return str(exc)


class PeerFetch:
    """Fetches (or rebuilds) snapshots of this node's ranks out of the other agents' memory."""

    def __init__(self, host: PeerCopy, events: EventLog, links: PeerLinks) -> None:
        self._host = host
        self._events = events
        self._links = links

    def ahead(
        self,
        members: Members,
        ranks: list[int],
        world_size: int,
        prepare: Callable[[str, int], None],
        current: Callable[[], bool],
    ) -> None:
        """Ask the other agents which roots they hold snapshots of ``ranks`` for, and
        ``prepare`` (key, rank) for each, while ``current()`` (the round it was asked for is
        still this agent's)."""
        ask = {"op": "held", "ranks": ranks, "world_size": world_size}
        found: list[set[str]] = []

        def ask_some(peers: list[Peer]) -> None:
            for peer in peers:
                held = self._held_by(peer, ask, current)
                with lock:
                    found.append(held)

        # A few peers at a time, each thread asking its share in turn; daemon threads, so that
        # an ask left hanging by a peer never holds up the agent's exit.
        lock = threading.Lock()
        others = members.others
        shares = [others[i::_ASKING_THREADS] for i in range(min(_ASKING_THREADS, len(others)))]
        threads = [
            threading.Thread(target=ask_some, args=(share,), name="crashproof-held", daemon=True)
            for share in shares
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        keys = set().union(*found)
        for key in sorted(keys):
            for rank in ranks:
                if not current():
                    return  # (a new round: its own prefetch takes over)
                prepare(key, rank)

    def _held_by(self, peer: Peer, ask: dict[str, Any], current: Callable[[], bool]) -> set[str]:
        """The root keys ``peer`` holds snapshots of the ranks in ``ask`` for. It may not have
        taken this round's secret yet (each agent takes it as it leaves the rendezvous): it
        refuses the connection until it has, so it is asked again for a few seconds."""
        deadline = time.monotonic() + _PREFETCH_ASK_S
        while True:
            try:
                held = self._links.ask(peer, ask).get("keys", [])
                break
            except OSError as exc:
                if not current() or time.monotonic() > deadline:
                    log.debug("no prefetch from %s: %s", peer["node"], exc)
                    return set()
                time.sleep(0.05)
            except ValueError as exc:
                log.warning("no prefetch from %s: it answered nonsense (%s)", peer["node"], exc)
                return set()
        if not isinstance(held, list):
            log.warning("no prefetch from %s: it answered %s", peer["node"], str(held)[:80])
            return set()
        # (at most MAX_ROOTS of them: a trainer asks for any other root itself, when it starts)
        return {k for k in held[:MAX_ROOTS] if isinstance(k, str) and 0 < len(k) <= MAX_TEXT}

    def fetch(
        self,
        members: Members,
        key: str,
        rank: int,
        world_size: int,
        *,
        newer_than: int | None = None,
    ) -> list[str]:
        """Copy the newest snapshots of (key, rank) a peer holds into the host, or rebuild them
        from parity; returns the origins stored. With ``newer_than`` (the newest step the host
        holds), only a peer's newer copies are taken, and nothing is rebuilt."""
        best: tuple[int, Peer] | None = None
        ask = {"op": "have", "key": key, "rank": rank, "world_size": world_size}
        for peer, reply in self._links.ask_each(members.others, ask, f"rank {rank}'s snapshots"):
            newest = max((int(s["step"]) for s in reply.get("slots", [])), default=-1)
            if newest >= 0 and (best is None or newest > best[0]):
                best = (newest, peer)
        if newer_than is not None and (best is None or best[0] <= newer_than):
            return []
        started = time.monotonic()
        if best is not None:
            peer = best[1]
            stored = self._copies_from(peer, key, rank, world_size)
            source = peer["node"]
        else:
            stored, source = self._rebuild(key, rank, world_size, members.everyone)
            if not stored:
                return []
        seconds = time.monotonic() - started
        self._events.emit("memory_fetched", rank=rank, peer=source, snapshots=len(stored),
                          seconds=round(seconds, 4))  # fmt: skip
        log.info("fetched %d snapshot(s) of rank %d from %s in %.2f s", len(stored), rank,
                 source, seconds)  # fmt: skip
        return stored

    def _copies_from(self, peer: Peer, key: str, rank: int, world_size: int) -> list[str]:
        origin = f"peer:{peer['node']}"
        stored = []
        with contextlib.closing(self._links.dial(peer)) as connection:
            send_message(connection, {"op": "fetch", "key": key, "rank": rank,
                                      "world_size": world_size})  # fmt: skip
            count = int(recv_message(connection)[0]["count"])
            if not 0 <= count <= MAX_SLOTS:
                raise Malformed(f"{peer['node']} offers {count} copies of rank {rank}")
            for _ in range(count):
                meta, _ = recv_message(connection)
                # (checked as the peer would check it, had this been pushed)
                checked({**meta, "op": "push", "key": key, "rank": rank})
                slot = (key, rank, int(meta["slot"]))
                if receive_copy(self._host, connection, slot, meta, origin) is None:
                    stored.append(origin)
        return stored

    def _rebuild(
        self, key: str, rank: int, world_size: int, everyone: list[Peer]
    ) -> tuple[list[str], str]:
        """Rebuild (key, rank)'s newest snapshot that parity and the survivors still hold;
        returns the origins stored and where from."""
        offers: dict[int, list[tuple[Peer, dict[str, Any]]]] = {}
        ask = {"op": "parity_have", "key": key, "rank": rank, "world_size": world_size}
        for peer, reply in self._links.ask_each(everyone, ask, f"parity of rank {rank}"):
            for record in reply.get("parities", []):
                offers.setdefault(int(record["step"]), []).append((peer, record))
        if not offers:
            log.info("no agent holds rank %d's snapshots: it restores from storage", rank)
            return [], ""
        agents = {p["agent"]: p for p in everyone}
        stored, source, why = rebuild(
            key, rank, world_size, offers, agents, self._links.dial, self._host.store_copies
        )
        if not stored:
            self._events.emit("memory_missing", rank=rank, why=why)
            log.warning("rank %d's snapshot is in no agent's memory (%s): it restores from "
                        "storage", rank, why)  # fmt: skip
        return stored, source
