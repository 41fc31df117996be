"""Snapshots replicated between the agents of a multi-node run, so that losing a node (its agent
and all its trainers at once) loses no snapshot.

Each agent's memory host listens on TCP. At every rendezvous the agents publish their address in
the rendezvous store, with a secret every connection must prove it knows (:mod:`._peer_links`),
and learn each other's. After each snapshot a trainer commits, its agent streams the segment to
the next ``replicas`` agents of the ring (group rank + 1, + 2, ...), which keep a copy in shared
memory of their own: the newest snapshot of each slot only (a push that falls behind skips to
the newest, never queues), and a push the trainer overwrote meanwhile is dropped by the
receiver. Every copy is checksummed on the wire, and a restore verifies it again, tensor by
tensor.

Instead of full copies, the agents can keep XOR parity (:mod:`._memory_parity`): a ``1/k``
piece of each node's snapshots per node instead of a whole copy. It is the default from three
nodes on.

When a trainer asks its agent for its snapshots and the agent holds none for that rank (a new
node in a lost one's place, or a rank that moved to another node), the agent fetches the newest
copy any peer holds, or else rebuilds it from the parity and the survivors' own snapshots, before
the trainer's restore starts (:mod:`._peer_fetch`; a new node fetches ahead, as the round forms).
The copy's origin (``peer:<node>``) reaches the restore event.

Whatever the scheme, a step every node has copied (or coded) is *covered*; each agent then pins
it, so that its trainers' next memory snapshots leave it in place until a newer one is covered:
the protection never lapses while a newer snapshot is on its way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
from typing import Any

from crashproof.checkpoint.format import new_hasher
from crashproof.link import recv_message, send_message
from crashproof.supervisor._memory_parity import ParityHolder, ParityPlan, piece_span
from crashproof.supervisor._peer_copy import Key, PeerCopy
from crashproof.supervisor._peer_fetch import Members, PeerFetch, receive_copy
from crashproof.supervisor._peer_links import TIMEOUT_S, PeerLinks
from crashproof.supervisor._peer_requests import Malformed, checked
from crashproof.supervisor._peer_wire import (
    CHUNK,
    Pacer,
    bytes_of,
    receive_bytes,
    send_range,
)
from crashproof.telemetry import EventLog

__all__ = ["Peers"]

log = logging.getLogger("crashproof.supervisor")

_STORE_PREFIX = "crashproof/memory"
DEFAULT_PARITY = 4
"""Pieces per node with parity by default (at most: fewer nodes, fewer pieces)."""


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
        self._links = PeerLinks()
        self._fetch = PeerFetch(host, events, self._links)
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
            self._links.new_round(secret.digest())
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
                self._links.drop(target)
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
                    self._links.drop(target)
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
                self._links.drop(target)

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

    # -- connections and fetching -----------------------------------------------------------

    def _connection(self, target: int) -> socket.socket:
        with self._lock:
            peer = self._peers[target]
        return self._links.kept(target, peer)

    def _members(self) -> Members:
        with self._lock:
            return Members(
                others=[self._peers[r] for r in self._others()],
                everyone=[self._peers[r] for r in sorted(self._peers)],
            )

    def _current(self, serial: int) -> bool:
        """Whether round ``serial`` is still this agent's (and it is not closed)."""
        with self._lock:
            return self._round_serial == serial and not self._closed

    def _prefetch(self, serial: int, ranks: list[int], world_size: int) -> None:
        """Fetch the snapshots of ``ranks`` the peers hold and this node lacks, while its
        trainers start (:meth:`PeerFetch.ahead`): a new node, or a spare taken in, whose fetch
        would otherwise wait for the trainer's first request."""
        if not self.missed_rounds and all(self._host.keys({r}, world_size) for r in ranks):
            return  # (a node that kept its ranks: the usual case, and nothing to ask for)

        def prepare(key: str, rank: int) -> None:
            self._host.prepare(key, rank, world_size, ahead_of_round=serial)

        self._fetch.ahead(
            self._members(), ranks, world_size, prepare, lambda: self._current(serial)
        )

    def fetch(
        self, key: str, rank: int, world_size: int, *, newer_than: int | None = None
    ) -> list[str]:
        """Copy the newest snapshots of (key, rank) a peer holds into this host, or rebuild them
        from parity (a trainer of that rank is starting here and this host has none); returns
        the origins stored. With ``newer_than`` (the newest step this host holds), only a peer's
        newer copies are taken, and nothing is rebuilt."""
        return self._fetch.fetch(self._members(), key, rank, world_size, newer_than=newer_than)

    # -- receiving ---------------------------------------------------------------------------

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
            connection.settimeout(TIMEOUT_S)
            try:
                if not self._links.admit(connection):
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
            why = receive_copy(self._host, connection, slot, message, origin, as_replica=True)
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
        with contextlib.suppress(OSError):
            self._server.close()
        self._links.close()


def _key_of(key: str, copy: dict[str, Any]) -> Key:
    return (key, int(copy["rank"]), int(copy["slot"]))
