"""Snapshots replicated between the agents of a multi-node run, so that losing a node (its agent
and all its trainers at once) loses no snapshot.

Each agent's memory host listens on TCP. At every rendezvous the agents publish their address in
the rendezvous store, with a secret every connection must prove it knows (HMAC), and learn each
other's. After each snapshot a trainer commits, its agent streams the segment to the next
``replicas`` agents of the ring (group rank + 1, + 2, ...), which keep a copy in shared memory of
their own: the newest snapshot of each slot only (a push that falls behind skips to the newest,
never queues), and a push the trainer overwrote meanwhile is dropped by the receiver. Every copy
is checksummed on the wire, and a restore verifies it again, tensor by tensor.

Instead of full copies, the agents can keep XOR parity (:mod:`._memory_parity`): a ``1/k``
piece of each node's snapshots per node instead of a whole copy. It is the default from three
nodes on.

When a trainer asks its agent for its snapshots and the agent holds none for that rank (a new
node in a lost one's place, or a rank that moved to another node), the agent fetches the newest
copy any peer holds, or else rebuilds it from the parity and the survivors' own snapshots, before
the trainer's restore starts. The copy's origin (``peer:<node>``) reaches the restore event.

Whatever the scheme, a step every node has copied (or coded) is *covered*; each agent then pins
it, so that its trainers' next memory snapshots leave it in place until a newer one is covered:
the protection never lapses while a newer snapshot is on its way.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from crashproof.checkpoint.format import new_hasher
from crashproof.link import recv_exactly, recv_message, send_message
from crashproof.supervisor._memory_parity import ParityHolder, ParityPlan, piece_span
from crashproof.supervisor._memory_rebuild import rebuild
from crashproof.supervisor._peer_requests import MAX_SLOTS, Malformed, checked
from crashproof.supervisor._peer_wire import (
    CHUNK,
    Dropped,
    Pacer,
    bytes_of,
    receive_bytes,
    send_range,
)
from crashproof.telemetry import EventLog

__all__ = ["PeerCopy", "Peers"]

log = logging.getLogger("crashproof.supervisor")

_TIMEOUT_S = 60.0
_PREFETCH_ASK_S = 5.0
"""How long a prefetch asks a peer that refuses it (it has not taken the round's secret yet)."""
_STORE_PREFIX = "crashproof/memory"
DEFAULT_PARITY = 4
"""Pieces per node with parity by default (at most: fewer nodes, fewer pieces)."""

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


class Peers:
    """The replication between this node's memory host and the other nodes'.

    ``replicas`` full copies, or ``parity`` (pieces per node, XOR); neither given: parity from
    three nodes on, one copy on two. ``bandwidth`` (bytes a second) caps what the background
    copies send, leaving the network to the training's own traffic."""

    def __init__(
        self,
        host: PeerCopy,
        events: EventLog,
        *,
        replicas: int | None,
        advertise: str,
        parity: int | None = None,
        bandwidth: int | None = None,
    ) -> None:
        self._host = host
        self._pace = Pacer(bandwidth) if bandwidth else None
        self._events = events
        self._replicas = replicas
        self._parity = parity
        self._advertise = advertise
        self._node = os.uname().nodename
        self._agent = host.token
        self._secret = b""
        self._lock = threading.Lock()
        self._peers: dict[int, dict[str, Any]] = {}  # group rank -> {host, port, node, agent}
        self._group_rank = 0
        self._ranks: list[int] | None = None  # this node's global ranks (None: its segments')
        self.scheme: tuple[str, int] | None = None
        """("replicas", K) or ("parity", k) this round; None: no copies."""
        self._plan: ParityPlan | None = None
        self.holder = ParityHolder()
        self._jobs: dict[tuple[Any, ...], tuple[int, int]] = {}  # -> (world size, step)
        self._wake = threading.Condition(self._lock)
        self._sent: dict[str, int] = {}  # parity: the newest step sent, per root key
        self._acked: dict[tuple[str, int], set[int]] = {}  # copies: ranks copied, per step
        self._reports: dict[str, dict[int, set[str]]] = {}  # covered: who said so, per step
        self._newest_covered: dict[str, int] = {}
        self._tally = {"copies": 0, "pieces": 0, "bytes": 0, "covered": 0}
        """What this agent sent (whole copies, parity pieces, their bytes) and how many steps
        every node covered, over the run: the ``memory_copies`` event at the end."""
        self._newest_ever: int | None = None  # (of those steps, over every round)
        self._last_round: int | None = None
        self._round_serial = 0  # join_round's calls: a prefetch of an earlier round stops
        self.missed_rounds = False
        """Whether this node was out of the rounds before the one it joined last."""
        self._closed = False
        self._server = socket.create_server(("", 0), backlog=64)
        self.port = self._server.getsockname()[1]
        self._out: dict[int, socket.socket] = {}  # persistent connections, by group rank
        threading.Thread(target=self._serve, name="crashproof-peers", daemon=True).start()
        threading.Thread(target=self._push_loop, name="crashproof-push", daemon=True).start()

    # -- membership --------------------------------------------------------------------------

    def join_round(
        self,
        store: Any,
        group_rank: int,
        group_world_size: int,
        ranks: list[int] | None = None,
        round_number: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """Publish this host in the rendezvous ``store`` of the round just completed and learn
        the others' (a collective of the agents: each sets its key, then reads everyone's);
        ``ranks``: this node's global ranks in the round, of ``world_size``; ``round_number``:
        the rendezvous'. With ``ranks`` and ``world_size``, the snapshots of those ranks that
        peers hold and this node does not are fetched at once, while its trainers start."""
        # Rounds without this node (it waited as a spare): its snapshots are of then, and a
        # peer may hold newer copies of its ranks' (MemoryHost.prepare asks for them).
        self.missed_rounds = (
            round_number is not None
            and self._last_round is not None
            and round_number > self._last_round + 1
        )
        self._last_round = round_number
        # Each agent brings a random token; the secret is all of them together, so no store
        # operation beyond set and get is needed (etcd's store has no compare-and-set).
        me = {"host": self._advertise, "port": self.port, "node": self._node,
              "token": secrets.token_hex(16), "agent": self._agent}  # fmt: skip
        store.set(f"{_STORE_PREFIX}/peer/{group_rank}", json.dumps(me))
        peers = {
            r: json.loads(store.get(f"{_STORE_PREFIX}/peer/{r}")) for r in range(group_world_size)
        }
        secret = hashlib.sha256("".join(peers[r]["token"] for r in sorted(peers)).encode())
        scheme = self._scheme(group_world_size)
        with self._lock:
            self._secret = secret.digest()
            self._peers, self._group_rank, self._ranks = peers, group_rank, ranks
            self.scheme = scheme
            self._plan = (
                ParityPlan.of(group_rank, group_world_size, scheme[1])
                if scheme is not None and scheme[0] == "parity"
                else None
            )
            # Coverage starts again: the trainers restore now, perhaps to an older step than
            # the one covered (the parities kept stay offered, for rebuilding a lost node).
            self._sent, self._acked, self._jobs, self._reports = {}, {}, {}, {}
            self._newest_covered = {}
            for connection in self._out.values():
                connection.close()
            self._out = {}
            self._round_serial += 1
            serial = self._round_serial
        self.holder.new_round()
        log.info(
            "memory peers this round: %s; %s",
            {r: p["node"] for r, p in peers.items()},
            "no copies" if scheme is None else f"{scheme[0]} {scheme[1]}",
        )
        if scheme is not None and ranks and world_size is not None:
            threading.Thread(
                target=self._prefetch, args=(serial, sorted(ranks), world_size),
                name="crashproof-prefetch", daemon=True,
            ).start()  # fmt: skip

    def _scheme(self, nodes: int) -> tuple[str, int] | None:
        if nodes < 2:
            return None
        if self._parity is not None:
            return ("parity", self._parity)
        if self._replicas is not None:
            return ("replicas", self._replicas) if self._replicas > 0 else None
        return ("parity", min(DEFAULT_PARITY, nodes - 1)) if nodes >= 3 else ("replicas", 1)

    def _targets(self) -> list[int]:
        n = len(self._peers)
        if self.scheme is None or self.scheme[0] != "replicas":
            return []
        return [(self._group_rank + i) % n for i in range(1, min(self.scheme[1], n - 1) + 1)]

    @property
    def round_serial(self) -> int:
        """How many rounds this host has joined (the current one's number, from 1)."""
        with self._lock:
            return self._round_serial

    def _others(self) -> list[int]:
        return [r for r in sorted(self._peers) if r != self._group_rank]

    def _my_ranks(self, key: str) -> list[int]:
        if self._ranks is not None:
            return sorted(self._ranks)
        return self._host.ranks(key)

    # -- pushing copies and pieces -----------------------------------------------------------

    def replicate(self, key: Key, world_size: int, step: int) -> None:
        """Segment ``key`` just committed ``step``: copy it (or its node's piece of parity, once
        every rank of the node has) to the other agents, in the background; a newer commit
        before the push starts replaces it."""
        with self._lock:
            if self.scheme is None:
                return
            job = ("copy", key) if self.scheme[0] == "replicas" else ("parity", key[0])
            self._jobs.pop(job, None)  # (to the back of the queue)
            self._jobs[job] = (world_size, step)
            self._wake.notify()

    def _push_loop(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                job, (world_size, step) = next(iter(self._jobs.items()))
                del self._jobs[job]
            try:
                if job[0] == "copy":
                    self._push_copies(job[1], world_size, step)
                elif job[0] == "parity":
                    self._push_pieces(job[1], world_size, step)
                else:
                    self._tell_covered(job[1], step)
            except Exception:  # (the thread must go on: the next commit retries)
                log.exception("sending a snapshot to the other agents failed")

    def _push_copies(self, key: Key, world_size: int, step: int) -> None:
        with self._lock:
            targets = self._targets()
        copied = 0
        for target in targets:
            try:
                copied += self._push(key, world_size, step, target)
            except Exception as exc:
                log.warning("replicating rank %d's snapshot to a peer failed: %s", key[1], exc)
                self._drop_connection(target)
        if targets and copied == len(targets):
            with self._lock:
                done = self._acked.setdefault((key[0], step), set())
                done.add(key[1])
                whole = done >= set(self._my_ranks(key[0]))
                if whole:
                    for old in [k for k in self._acked if k[0] == key[0] and k[1] <= step]:
                        del self._acked[old]
            if whole:
                self._report(key[0], step)

    def _push(self, key: Key, world_size: int, step: int, target: int) -> bool:
        # (Overwritten since, if not at ``step``: its own commit pushes it.)
        copy = self._copy_of(key[0], key[1], world_size, slot=key[2], step=step)
        if copy is None:
            return False
        try:
            connection = self._connection(target)
            header = {"op": "push", "key": key[0], "rank": key[1], "world_size": world_size,
                      "node": self._node}  # fmt: skip
            self._host.sending([key], True)
            try:
                self._send_copy(connection, key, copy, header, self._pace)
            finally:
                self._host.sending([key], False)
            reply, _ = recv_message(connection)
            if "error" in reply:
                log.warning("a peer refused rank %d's snapshot: %s", key[1], reply["error"])
                return False
            self._count(copies=1, bytes=int(copy["nbytes"]))
            return True
        finally:
            if "fd" in copy:
                os.close(copy.pop("fd"))

    def _push_pieces(self, key: str, world_size: int, step: int) -> None:
        """Send this node's payload at ``step`` (once every rank of it has committed the step)
        in pieces, one to each other member of its parity group."""
        with self._lock:
            plan, peers = self._plan, dict(self._peers)
            if plan is None or self._sent.get(key, -1) >= step:
                return
        parts = self._payload(key, world_size, step)
        if parts is None:
            return  # (not every rank has committed it yet: the last one's commit sends it)
        with self._lock:
            self._sent[key] = step
        keys = [_key_of(key, c) for c in parts]
        self._host.sending(keys, True)
        try:
            length = sum(int(c["nbytes"]) for c in parts)
            segments = [
                {"rank": c["rank"], "slot": c["slot"], "nbytes": c["nbytes"],
                 "contents": c["contents"]}
                for c in parts
            ]  # fmt: skip
            for piece in range(plan.pieces):
                target = plan.holder(piece)
                offset, size = piece_span(length, plan.pieces, piece)
                record = {"segments": segments, "length": length, "pieces": plan.pieces,
                          "piece": piece, "offset": offset, "size": size, "node": self._node}  # fmt: skip
                expected = [peers[m]["agent"] for m in plan.members if m != target]
                header = {"op": "piece", "key": key, "step": step, "world_size": world_size,
                          "agent": self._agent, "expected": expected, "record": record}  # fmt: skip
                try:
                    connection = self._connection(target)
                    send_message(connection, header)
                    checksum = send_range(connection, parts, offset, size, self._pace)
                    whole = all(self._host.generation(_key_of(key, c)) == c["gen"] for c in parts)
                    send_message(connection, {"whole": whole, "checksum": checksum})
                    reply, _ = recv_message(connection)
                    if "error" in reply:
                        log.warning("a peer refused this node's parity piece: %s", reply["error"])
                    else:
                        self._count(pieces=1, bytes=size)
                except OSError as exc:
                    log.warning("sending a parity piece to a peer failed: %s", exc)
                    self._drop_connection(target)
        finally:
            self._host.sending(keys, False)
            for copy in parts:
                os.close(copy.pop("fd"))

    def _payload(self, key: str, world_size: int, step: int) -> list[dict[str, Any]] | None:
        """This node's segments holding ``step``, one per rank in rank order (descriptors the
        caller closes), or None when a rank has not committed it."""
        parts: list[dict[str, Any]] = []
        for rank in self._my_ranks(key):
            copy = self._copy_of(key, rank, world_size, step=step)
            if copy is None:
                for part in parts:
                    os.close(part.pop("fd"))
                return None
            parts.append(copy)
        return parts or None

    def _copy_of(
        self, key: str, rank: int, world_size: int, *, slot: int | None = None, step: int
    ) -> dict[str, Any] | None:
        """The committed segment of (key, rank) holding ``step`` (in ``slot``, if given), with
        its ``rank``, as :meth:`PeerCopy.committed` gives it (its descriptor the caller's), or
        None; the descriptors of the others are closed."""
        found = None
        for copy in self._host.committed(key, rank, world_size):
            if found is None and copy["step"] == step and slot in (None, copy["slot"]):
                found = {**copy, "rank": rank}
            else:
                os.close(copy.pop("fd"))
        return found

    # -- coverage ----------------------------------------------------------------------------

    def _report(self, key: str, step: int) -> None:
        """This agent's part of ``step`` is done (its copies kept, or its parity complete):
        tell every agent, this one included."""
        self._covered(key, step, self._agent)
        with self._lock:
            self._jobs[("covered", key)] = (0, step)
            self._wake.notify()

    def _tell_covered(self, key: str, step: int) -> None:
        with self._lock:
            others = self._others()
        for target in others:
            try:
                connection = self._connection(target)
                send_message(connection, {"op": "covered", "key": key, "step": step,
                                          "agent": self._agent})  # fmt: skip
                recv_message(connection)
            except OSError as exc:
                log.warning("telling a peer of a covered snapshot failed: %s", exc)
                self._drop_connection(target)

    def _covered(self, key: str, step: int, agent: str) -> None:
        with self._lock:
            everyone = {p["agent"] for p in self._peers.values()}
            if agent not in everyone or step <= self._newest_covered.get(key, -1):
                return  # (another round's agent, or an older step completed late)
            reports = self._reports.setdefault(key, {})
            reports.setdefault(step, set()).add(agent)
            if not reports[step] >= everyone:
                return
            for old in [s for s in reports if s <= step]:
                del reports[old]
            self._newest_covered[key] = step
            self._tally["covered"] += 1
            self._newest_ever = max(step, self._newest_ever or step)
        self._host.pin(key, step)
        self.holder.covered(key, step)

    # -- connections -------------------------------------------------------------------------

    def _connection(self, target: int) -> socket.socket:
        with self._lock:
            connection = self._out.get(target)
            peer = self._peers[target]
        if connection is not None:
            return connection
        connection = self._dial(peer)
        with self._lock:
            self._out[target] = connection
        return connection

    def _drop_connection(self, target: int) -> None:
        with self._lock:
            stale = self._out.pop(target, None)
        if stale is not None:
            stale.close()

    def _dial(self, peer: dict[str, Any]) -> socket.socket:
        connection = socket.create_connection((peer["host"], peer["port"]), timeout=_TIMEOUT_S)
        challenge = recv_exactly(connection, 32)
        connection.sendall(hmac.new(self._secret, challenge, hashlib.sha256).digest())
        return connection

    def _ask(self, peer: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
        with contextlib.closing(self._dial(peer)) as connection:
            send_message(connection, message)
            return recv_message(connection)[0]

    def _ask_each(
        self, peers: list[dict[str, Any]], message: dict[str, Any], what: str
    ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """Each of ``peers`` that answers ``message``, with its reply (one that cannot be
        reached, or answers nonsense, is logged and passed over)."""
        for peer in peers:
            try:
                reply = self._ask(peer, message)
            except (OSError, ValueError) as exc:
                log.warning("cannot ask %s for %s: %s", peer["node"], what, exc)
                continue
            yield peer, reply

    # -- fetching copies ---------------------------------------------------------------------

    def _prefetch(self, serial: int, ranks: list[int], world_size: int) -> None:
        """Ask the other agents which roots they hold snapshots of ``ranks`` for, then fetch
        those this node lacks, while its trainers start (a new node, or a spare taken in: the
        fetch would otherwise wait for the trainer's first request, after its imports and its
        model are built)."""
        if not self.missed_rounds and all(self._host.keys({r}, world_size) for r in ranks):
            return  # (a node that kept its ranks: the usual case, and nothing to ask for)
        with self._lock:
            others = [self._peers[r] for r in self._others()]
        ask = {"op": "held", "ranks": ranks, "world_size": world_size}
        keys: set[str] = set()
        for peer in others:
            keys |= self._held_by(peer, ask, serial)
        for key in sorted(keys):
            for rank in ranks:
                with self._lock:
                    if self._round_serial != serial or self._closed:
                        return  # (a new round: its own prefetch takes over)
                self._host.prepare(key, rank, world_size, ahead_of_round=serial)

    def _held_by(self, peer: dict[str, Any], ask: dict[str, Any], serial: int) -> set[str]:
        """The root keys ``peer`` holds snapshots of the ranks in ``ask`` for. It may not have
        taken this round's secret yet (each agent takes it as it leaves the rendezvous): it
        refuses the connection until it has, so it is asked again for a few seconds."""
        deadline = time.monotonic() + _PREFETCH_ASK_S
        while True:
            try:
                reply = self._ask(peer, ask)
                held = reply.get("keys", [])
                if not isinstance(held, list):
                    raise Malformed(f"{peer['node']} answered {str(held)[:80]!r}")
                return {k for k in held if isinstance(k, str) and 0 < len(k) <= 256}
            except (OSError, ValueError) as exc:
                with self._lock:
                    stale = self._round_serial != serial or self._closed
                if stale or time.monotonic() > deadline:
                    log.debug("no prefetch from %s: %s", peer["node"], exc)
                    return set()
                time.sleep(0.05)

    def fetch(
        self, key: str, rank: int, world_size: int, *, newer_than: int | None = None
    ) -> list[str]:
        """Copy the newest snapshots of (key, rank) a peer holds into this host, or rebuild them
        from parity (a trainer of that rank is starting here and this host has none); returns
        the origins stored. With ``newer_than`` (the newest step this host holds), only a peer's
        newer copies are taken, and nothing is rebuilt."""
        with self._lock:
            others = [self._peers[r] for r in self._others()]
        best: tuple[int, dict[str, Any]] | None = None
        ask = {"op": "have", "key": key, "rank": rank, "world_size": world_size}
        for peer, reply in self._ask_each(others, ask, f"rank {rank}'s snapshots"):
            newest = max((int(s["step"]) for s in reply.get("slots", [])), default=-1)
            if newest >= 0 and (best is None or newest > best[0]):
                best = (newest, peer)
        if newer_than is not None and (best is None or best[0] <= newer_than):
            return []
        started = time.monotonic()
        if best is not None:
            peer = best[1]
            stored = self._fetch_copies(peer, key, rank, world_size)
            source = peer["node"]
        else:
            with self._lock:
                everyone = [self._peers[r] for r in sorted(self._peers)]  # (itself included)
            stored, source = self._rebuild(key, rank, world_size, everyone)
            if not stored:
                return []
        seconds = time.monotonic() - started
        self._events.emit("memory_fetched", rank=rank, peer=source, snapshots=len(stored),
                          seconds=round(seconds, 4))  # fmt: skip
        log.info("fetched %d snapshot(s) of rank %d from %s in %.2f s", len(stored), rank,
                 source, seconds)  # fmt: skip
        return stored

    def _fetch_copies(
        self, peer: dict[str, Any], key: str, rank: int, world_size: int
    ) -> list[str]:
        origin = f"peer:{peer['node']}"
        stored = []
        with contextlib.closing(self._dial(peer)) as connection:
            send_message(connection, {"op": "fetch", "key": key, "rank": rank,
                                      "world_size": world_size})  # fmt: skip
            count = int(recv_message(connection)[0]["count"])
            if not 0 <= count <= MAX_SLOTS:
                raise Malformed(f"{peer['node']} offers {count} copies of rank {rank}")
            for _ in range(count):
                meta, _ = recv_message(connection)
                # (checked as the peer would check it, had this been pushed)
                checked({**meta, "op": "push", "key": key, "rank": rank})
                why = self._receive(connection, (key, rank, int(meta["slot"])), meta, origin)
                if why is None:
                    stored.append(origin)
        return stored

    # -- rebuilding from parity --------------------------------------------------------------

    def _rebuild(
        self, key: str, rank: int, world_size: int, others: list[dict[str, Any]]
    ) -> tuple[list[str], str]:
        """Rebuild (key, rank)'s newest snapshot that parity and the survivors still hold;
        returns the origins stored and where from."""
        offers: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        ask = {"op": "parity_have", "key": key, "rank": rank, "world_size": world_size}
        for peer, reply in self._ask_each(others, ask, f"parity of rank {rank}"):
            for record in reply.get("parities", []):
                offers.setdefault(int(record["step"]), []).append((peer, record))
        with self._lock:
            agents = {p["agent"]: p for p in self._peers.values()}
        if not offers:
            log.info("no agent holds rank %d's snapshots: it restores from storage", rank)
            return [], ""
        stored, source, why = rebuild(
            key, rank, world_size, offers, agents, self._dial, self._host.store_copy
        )
        if not stored:
            self._events.emit("memory_missing", rank=rank, why=why)
            log.warning("rank %d's snapshot is in no agent's memory (%s): it restores from "
                        "storage", rank, why)  # fmt: skip
        return stored, source

    # -- receiving ---------------------------------------------------------------------------

    def _receive(
        self,
        connection: socket.socket,
        key: Key,
        meta: dict[str, Any],
        origin: str,
        *,
        as_replica: bool = False,
    ) -> str | None:
        """Read one segment's bytes and its trailer off ``connection`` into a copy; returns why
        it was not kept (None: kept)."""
        nbytes = int(meta["nbytes"])

        def fill(into: memoryview) -> None:
            computed = receive_bytes(connection, nbytes, into)
            trailer, _ = recv_message(connection)
            if not trailer.get("whole") or trailer.get("checksum") != computed:
                raise Dropped("overwritten while it was sent, or damaged on the way")

        try:
            return self._host.store_copy(key, meta, fill, origin, as_replica=as_replica)
        except Dropped as exc:
            return str(exc)

    def _receive_piece(self, connection: socket.socket, message: dict[str, Any]) -> None:
        """Receive a piece of another member's payload and XOR it into the parity as it comes,
        a chunk at a time: no copy of the piece is held."""
        key, step, agent = str(message["key"]), int(message["step"]), str(message["agent"])
        record = dict(message["record"])
        size = int(record["size"])
        expected = [str(a) for a in message["expected"]]
        room = self._host.has_room(size)
        world_size = int(message["world_size"])
        wanted = room and self.holder.open_piece(key, step, world_size, agent, expected, size)
        if not room:
            log.warning("no memory for a %d-byte parity piece of step %d", size, step)

        def xor(offset: int, chunk: memoryview) -> None:
            if wanted:
                self.holder.xor_in(key, step, offset, chunk)

        computed = receive_bytes(connection, size, None, xor)
        trailer, _ = recv_message(connection)
        if not wanted:
            send_message(connection, {"error": "not wanted (no memory, or not this round's)"})
            return
        whole = bool(trailer.get("whole")) and trailer.get("checksum") == computed
        complete = self.holder.close_piece(
            key, step, agent, {**record, "checksum": computed} if whole else None
        )
        send_message(connection, {"ok": True} if whole else {"error": "overwritten or damaged"})
        if complete:
            self._report(key, step)

    # -- serving the other agents ------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(
                target=self._converse, args=(connection,), name="crashproof-peer", daemon=True
            ).start()

    def _converse(self, connection: socket.socket) -> None:
        with contextlib.closing(connection):
            connection.settimeout(_TIMEOUT_S)
            try:
                challenge = secrets.token_bytes(32)
                connection.sendall(challenge)
                proof = recv_exactly(connection, 32)
                with self._lock:
                    secret = self._secret
                expected = hmac.new(secret, challenge, hashlib.sha256).digest()
                if not secret or not hmac.compare_digest(proof, expected):
                    return  # not one of this run's agents
                connection.settimeout(None)
                while True:
                    message, _ = recv_message(connection)
                    self._answer(connection, checked(message))
            except Malformed as exc:
                log.warning("refused a peer's request: %s", exc)
                with contextlib.suppress(OSError):
                    send_message(connection, {"error": f"malformed request: {exc}"})
            except (OSError, ValueError, KeyError, TypeError):
                return
            except Exception:  # a bug here must not pass silently, nor end the agent
                log.exception("serving a peer's request failed")
                return

    def _answer(self, connection: socket.socket, message: dict[str, Any]) -> None:
        if message["op"] == "held":
            ranks, world_size = set(message["ranks"]), int(message["world_size"])
            keys = self._host.keys(ranks, world_size) | self.holder.keys(ranks, world_size)
            send_message(connection, {"keys": sorted(keys)})
            return
        op, key = message["op"], str(message["key"])
        if op == "piece":
            self._receive_piece(connection, message)
        elif op == "covered":
            self._covered(key, int(message["step"]), str(message["agent"]))
            send_message(connection, {"ok": True})
        elif op == "parity_fetch":
            self._send_parity(connection, key, int(message["step"]))
        elif op == "piece_fetch":
            self._send_piece(connection, message)
        elif op == "parity_have":
            records = self.holder.records(key, int(message["rank"]), int(message["world_size"]))
            send_message(connection, {"parities": records})
        else:
            self._answer_copies(connection, op, message)

    def _answer_copies(self, connection: socket.socket, op: str, message: dict[str, Any]) -> None:
        key, rank, world_size = (
            str(message["key"]),
            int(message["rank"]),
            int(message["world_size"]),
        )
        if op == "push":
            slot = (key, rank, int(message["slot"]))
            origin = f"peer:{message.get('node', '?')}"
            why = self._receive(connection, slot, message, origin, as_replica=True)
            send_message(connection, {"ok": True} if why is None else {"error": why})
            return
        held = self._host.committed(key, rank, world_size)
        try:
            if op == "have":
                send_message(connection, {"slots": [{"slot": c["slot"], "step": c["step"]}
                                                    for c in held]})  # fmt: skip
            else:  # fetch (an unknown request is refused by the checks before it gets here)
                send_message(connection, {"count": len(held)})
                for copy in held:
                    header = {"world_size": world_size}
                    self._send_copy(connection, (key, rank, copy["slot"]), copy, header)
        finally:
            for copy in held:
                if "fd" in copy:
                    os.close(copy.pop("fd"))

    def _send_parity(self, connection: socket.socket, key: str, step: int) -> None:
        parity = self.holder.read(key, step)
        if parity is None:
            send_message(connection, {"error": f"no parity of step {step}"})
            return
        send_message(connection, {"size": int(parity.numel())})
        data = bytes_of(parity)
        hasher = new_hasher()
        for start in range(0, len(data), CHUNK):
            chunk = data[start : start + CHUNK]
            hasher.update(chunk)
            connection.sendall(chunk)
        send_message(connection, {"checksum": hasher.hexdigest()})

    def _send_piece(self, connection: socket.socket, message: dict[str, Any]) -> None:
        """Send again a piece of this node's payload at a step, from its own segments."""
        key, step = str(message["key"]), int(message["step"])
        world_size = int(message["world_size"])
        parts: list[dict[str, Any]] = []
        try:
            for wanted in message["segments"]:
                rank, slot = int(wanted["rank"]), int(wanted["slot"])
                found = self._copy_of(key, rank, world_size, slot=slot, step=step)
                if found is None:
                    send_message(connection, {"error": f"rank {rank}'s step {step} is gone"})
                    return
                parts.append(found)
            send_message(connection, {"ok": True})
            checksum = send_range(connection, parts, int(message["offset"]), int(message["size"]))
            whole = all(self._host.generation(_key_of(key, c)) == c["gen"] for c in parts)
            send_message(connection, {"whole": whole, "checksum": checksum})
        finally:
            for copy in parts:
                if "fd" in copy:
                    os.close(copy.pop("fd"))

    def _send_copy(
        self,
        connection: socket.socket,
        key: Key,
        copy: dict[str, Any],
        header: dict[str, Any],
        pace: Pacer | None = None,
    ) -> None:
        """Send one of :meth:`PeerCopy.committed`'s copies (its descriptor is closed): its
        record after ``header``, its bytes, then whether it stayed whole and their checksum (the
        trainer may have started to overwrite it meanwhile: then the receiver drops it)."""
        try:
            send_message(
                connection, {**header, **{k: v for k, v in copy.items() if k not in ("gen", "fd")}}
            )
            checksum = send_range(connection, [copy], 0, int(copy["nbytes"]), pace)
            whole = self._host.generation(key) == copy["gen"]
            send_message(connection, {"whole": whole, "checksum": checksum})
        finally:
            os.close(copy.pop("fd"))

    def _count(self, **sent: int) -> None:
        with self._lock:
            for what, n in sent.items():
                self._tally[what] += n

    def close(self) -> None:
        """Stop serving and sending; the run's ``memory_copies`` event, if anything was."""
        with self._lock:
            tally, newest = dict(self._tally), self._newest_ever
        if self.scheme is not None or any(tally.values()):
            self._events.emit("memory_copies", **tally, newest_covered=newest)
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            connections, self._out = list(self._out.values()), {}
        with contextlib.suppress(OSError):
            self._server.close()
        for connection in connections:
            connection.close()


def _key_of(key: str, copy: dict[str, Any]) -> Key:
    return (key, int(copy["rank"]), int(copy["slot"]))
