"""Snapshots replicated between the agents of a multi-node run, so that losing a node (its agent
and all its trainers at once) loses no snapshot.

Each agent's memory host listens on TCP. At every rendezvous the agents publish their address in
the rendezvous store, with a secret every connection must prove it knows (HMAC), and learn each
other's. After each snapshot a trainer commits, its agent streams the segment to the next
``replicas`` agents of the ring (group rank + 1, + 2, ...), which keep a copy in shared memory of
their own: the newest snapshot of each slot only (a push that falls behind skips to the newest,
never queues), and a push the trainer overwrote meanwhile is dropped by the receiver. Every copy
is checksummed on the wire, and a restore verifies it again, tensor by tensor.

When a trainer asks its agent for its snapshots and the agent holds none for that rank (a new
node in a lost one's place, or a rank that moved to another node), the agent fetches the newest
copy any peer holds, before the trainer's restore starts. The copy's origin (``peer:<node>``)
reaches the restore event.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import mmap
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from crashproof.checkpoint.format import new_hasher
from crashproof.link import recv_exactly, recv_message, send_message
from crashproof.telemetry import EventLog

__all__ = ["PeerCopy", "Peers"]

log = logging.getLogger("crashproof.supervisor")

_CHUNK = 8 * 1024 * 1024
_TIMEOUT_S = 60.0
_STORE_PREFIX = "crashproof/memory"

Key = tuple[str, int, int]
"""A segment: the root's key, the global rank, the slot."""


class PeerCopy(Protocol):
    """What the host lends the replication: its committed segments, and a place for copies."""

    def committed(self, key: str, rank: int, world_size: int) -> list[dict[str, Any]]:
        """Every committed segment or copy of (key, rank): ``slot``, ``step``, ``nbytes``,
        ``contents``, ``fd`` (a duplicate, the caller's to close) and ``gen``."""
        ...

    def generation(self, key: Key) -> int | None:
        """A counter that changes whenever the segment is overwritten or committed."""
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
    """The replication between this node's memory host and the other nodes'."""

    def __init__(self, host: PeerCopy, events: EventLog, *, replicas: int, advertise: str) -> None:
        self._host = host
        self._events = events
        self._replicas = replicas
        self._advertise = advertise
        self._node = os.uname().nodename
        self._secret = b""
        self._lock = threading.Lock()
        self._peers: dict[int, dict[str, Any]] = {}  # group rank -> {host, port, node}
        self._group_rank = 0
        self._pending: dict[Key, int] = {}  # segments to push, and the world size
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._server = socket.create_server(("", 0), backlog=64)
        self.port = self._server.getsockname()[1]
        self._out: dict[int, socket.socket] = {}  # persistent connections, by group rank
        threading.Thread(target=self._serve, name="crashproof-peers", daemon=True).start()
        threading.Thread(target=self._push_loop, name="crashproof-push", daemon=True).start()

    # -- membership --------------------------------------------------------------------------

    def join_round(self, store: Any, group_rank: int, group_world_size: int) -> None:
        """Publish this host in the rendezvous ``store`` of the round just completed and learn
        the others' (a collective of the agents: each sets its key, then reads everyone's)."""
        # Each agent brings a random token; the secret is all of them together, so no store
        # operation beyond set and get is needed (etcd's store has no compare-and-set).
        me = {"host": self._advertise, "port": self.port, "node": self._node,
              "token": secrets.token_hex(16)}  # fmt: skip
        store.set(f"{_STORE_PREFIX}/peer/{group_rank}", json.dumps(me))
        peers = {
            r: json.loads(store.get(f"{_STORE_PREFIX}/peer/{r}")) for r in range(group_world_size)
        }
        secret = hashlib.sha256("".join(peers[r]["token"] for r in sorted(peers)).encode())
        with self._lock:
            self._secret = secret.digest()
            self._peers, self._group_rank = peers, group_rank
            for connection in self._out.values():
                connection.close()
            self._out = {}
        log.info("memory peers this round: %s", {r: p["node"] for r, p in peers.items()})

    def _targets(self) -> list[int]:
        n = len(self._peers)
        if n < 2 or self._replicas < 1:
            return []
        return [(self._group_rank + i) % n for i in range(1, min(self._replicas, n - 1) + 1)]

    def _others(self) -> list[int]:
        return [r for r in sorted(self._peers) if r != self._group_rank]

    # -- pushing copies ----------------------------------------------------------------------

    def replicate(self, key: Key, world_size: int) -> None:
        """Push segment ``key`` (just committed) to the next agents of the ring, in the
        background; a newer commit of it before the push starts replaces it."""
        with self._lock:
            if not self._targets():
                return
            self._pending[key] = world_size
            self._wake.notify()

    def _push_loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                key, world_size = next(iter(self._pending.items()))
                del self._pending[key]
                targets = self._targets()
            for target in targets:
                try:
                    self._push(key, world_size, target)
                except Exception as exc:  # (the thread must go on: the next commit retries)
                    log.warning("replicating rank %d's snapshot to a peer failed: %s", key[1], exc)
                    with self._lock:
                        stale = self._out.pop(target, None)
                    if stale is not None:
                        stale.close()

    def _push(self, key: Key, world_size: int, target: int) -> None:
        held = [c for c in self._host.committed(key[0], key[1], world_size) if c["slot"] == key[2]]
        for other in held[1:]:
            os.close(other.pop("fd"))
        if not held:
            return
        copy = held[0]
        try:
            connection = self._connection(target)
            header = {"op": "push", "key": key[0], "rank": key[1], "world_size": world_size,
                      "node": self._node}  # fmt: skip
            self._send_copy(connection, key, copy, header)
            reply, _ = recv_message(connection)
            if "error" in reply:
                log.warning("a peer refused rank %d's snapshot: %s", key[1], reply["error"])
        finally:
            if "fd" in copy:
                os.close(copy.pop("fd"))

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

    def _dial(self, peer: dict[str, Any]) -> socket.socket:
        connection = socket.create_connection((peer["host"], peer["port"]), timeout=_TIMEOUT_S)
        challenge = recv_exactly(connection, 32)
        connection.sendall(hmac.new(self._secret, challenge, hashlib.sha256).digest())
        return connection

    # -- fetching copies ---------------------------------------------------------------------

    def fetch(self, key: str, rank: int, world_size: int) -> list[str]:
        """Copy the newest snapshots of (key, rank) a peer holds into this host (a trainer of
        that rank is starting here and this host has none); returns the origins stored."""
        with self._lock:
            others = [(r, self._peers[r]) for r in self._others()]
        best: tuple[int, dict[str, Any]] | None = None
        for _, peer in others:
            try:
                with contextlib.closing(self._dial(peer)) as connection:
                    send_message(connection, {"op": "have", "key": key, "rank": rank,
                                              "world_size": world_size})  # fmt: skip
                    reply, _ = recv_message(connection)
            except (OSError, ValueError) as exc:
                log.warning("cannot ask %s for rank %d's snapshots: %s", peer["node"], rank, exc)
                continue
            newest = max((int(s["step"]) for s in reply.get("slots", [])), default=-1)
            if newest >= 0 and (best is None or newest > best[0]):
                best = (newest, peer)
        if best is None:
            return []
        peer = best[1]
        origin = f"peer:{peer['node']}"
        stored = []
        started = time.monotonic()
        with contextlib.closing(self._dial(peer)) as connection:
            send_message(connection, {"op": "fetch", "key": key, "rank": rank,
                                      "world_size": world_size})  # fmt: skip
            count = int(recv_message(connection)[0]["count"])
            for _ in range(count):
                meta, _ = recv_message(connection)
                why = self._receive(connection, (key, rank, int(meta["slot"])), meta, origin)
                if why is None:
                    stored.append(origin)
        seconds = time.monotonic() - started
        self._events.emit("memory_fetched", rank=rank, peer=peer["node"], snapshots=len(stored),
                          seconds=round(seconds, 4))  # fmt: skip
        log.info("fetched %d snapshot(s) of rank %d from %s in %.2f s", len(stored), rank,
                 peer["node"], seconds)  # fmt: skip
        return stored

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
        outcome: dict[str, Any] = {}

        def fill(into: memoryview) -> None:
            hasher = new_hasher()
            pos = 0
            while pos < nbytes:
                got = connection.recv_into(into[pos : pos + min(_CHUNK, nbytes - pos)])
                if not got:
                    raise ConnectionError("the peer closed the connection mid-copy")
                hasher.update(into[pos : pos + got])
                pos += got
            trailer, _ = recv_message(connection)
            outcome.update(trailer, computed=hasher.hexdigest())
            if not trailer.get("whole") or trailer.get("checksum") != outcome["computed"]:
                raise _Dropped("overwritten while it was sent, or damaged on the way")

        try:
            return self._host.store_copy(key, meta, fill, origin, as_replica=as_replica)
        except _Dropped as exc:
            return str(exc)

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
                    self._answer(connection, message)
            except (OSError, ValueError, KeyError, TypeError):
                return
            except Exception:  # a bug here must not pass silently, nor end the agent
                log.exception("serving a peer's request failed")
                return

    def _answer(self, connection: socket.socket, message: dict[str, Any]) -> None:
        op, key, rank = message["op"], str(message["key"]), int(message["rank"])
        world_size = int(message["world_size"])
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
            elif op == "fetch":
                send_message(connection, {"count": len(held)})
                for copy in held:
                    header = {"world_size": world_size}
                    self._send_copy(connection, (key, rank, copy["slot"]), copy, header)
        finally:
            for copy in held:
                if "fd" in copy:
                    os.close(copy.pop("fd"))

    def _send_copy(
        self, connection: socket.socket, key: Key, copy: dict[str, Any], header: dict[str, Any]
    ) -> None:
        """Send one of :meth:`PeerCopy.committed`'s copies (its descriptor is closed): its
        record after ``header``, its bytes, then whether it stayed whole and their checksum (the
        trainer may have started to overwrite it meanwhile: then the receiver drops it)."""
        fd = copy.pop("fd")
        try:
            send_message(connection, {**header, **{k: v for k, v in copy.items() if k != "gen"}})
            checksum = _send_segment(connection, fd, copy["nbytes"])
            whole = self._host.generation(key) == copy["gen"]
            send_message(connection, {"whole": whole, "checksum": checksum})
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            connections, self._out = list(self._out.values()), {}
        with contextlib.suppress(OSError):
            self._server.close()
        for connection in connections:
            connection.close()


def _send_segment(connection: socket.socket, fd: int, nbytes: int) -> str:
    """Stream a segment's bytes; returns their checksum."""
    hasher = new_hasher()
    with (
        mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ) as mm,
        memoryview(mm) as view,
    ):
        for start in range(0, nbytes, _CHUNK):
            with view[start : start + _CHUNK] as chunk:
                hasher.update(chunk)
                connection.sendall(chunk)
    return hasher.hexdigest()


class _Dropped(Exception):
    """A copy received whole but not to be kept (overwritten while sent, or damaged)."""
