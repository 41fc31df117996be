"""The connections between the agents of a round (:mod:`._memory_peers`).

Every connection proves it knows the round's secret: the agent it reaches sends a random
challenge, and only its HMAC under the secret lets the conversation go on. The secret changes
with every rendezvous, so an agent of an earlier round (a node fenced out) is refused. The
connections this agent sends copies and pieces on are kept open, one per peer, for the round.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import threading
from collections.abc import Iterator
from typing import Any

from crashproof.link import recv_exactly, recv_message, send_message

__all__ = ["Peer", "PeerLinks"]

log = logging.getLogger("crashproof.supervisor")

Peer = dict[str, Any]
"""Another agent as it published itself for the round: ``host``, ``port``, ``node``, ``agent``."""

TIMEOUT_S = 60.0
_CHALLENGE = 32


class PeerLinks:
    """This agent's side of the connections to the other agents of its round."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._secret = b""
        self._out: dict[int, tuple[str, socket.socket]] = {}
        """Kept open, by the peer's group rank: the agent it leads to, and the connection."""

    def new_round(self, secret: bytes) -> None:
        """Take the secret of the round just formed; the connections of the one before close."""
        with self._lock:
            self._secret = secret
            stale, self._out = list(self._out.values()), {}
        for _, connection in stale:
            connection.close()

    def admit(self, connection: socket.socket) -> bool:
        """Challenge a connection made to this agent: whether it proved it knows the secret."""
        challenge = secrets.token_bytes(_CHALLENGE)
        connection.sendall(challenge)
        proof = recv_exactly(connection, _CHALLENGE)
        with self._lock:
            secret = self._secret
        expected = hmac.new(secret, challenge, hashlib.sha256).digest()
        return bool(secret) and hmac.compare_digest(proof, expected)

    def dial(self, peer: Peer) -> socket.socket:
        """A new connection to ``peer``, admitted (the caller's to close)."""
        connection = socket.create_connection((peer["host"], peer["port"]), timeout=TIMEOUT_S)
        try:
            challenge = recv_exactly(connection, _CHALLENGE)
            with self._lock:
                secret = self._secret
            connection.sendall(hmac.new(secret, challenge, hashlib.sha256).digest())
        except BaseException:
            connection.close()
            raise
        return connection

    def kept(self, target: int, peer: Peer) -> socket.socket:
        """The connection kept open to ``peer`` (group rank ``target``), made if there is none,
        or if the one kept for ``target`` leads to another agent (the ranks of a new round)."""
        with self._lock:
            kept = self._out.get(target)
        if kept is not None and kept[0] == peer["agent"]:
            return kept[1]
        connection = self.dial(peer)
        with self._lock:
            stale = self._out.get(target)
            self._out[target] = (peer["agent"], connection)
        if stale is not None:
            stale[1].close()
        return connection

    def drop(self, target: int) -> None:
        """Close the connection kept to ``target`` (it failed: the next send dials again)."""
        with self._lock:
            stale = self._out.pop(target, None)
        if stale is not None:
            stale[1].close()

    def ask(self, peer: Peer, message: dict[str, Any]) -> dict[str, Any]:
        """``peer``'s reply to ``message``, on a connection of its own."""
        with contextlib.closing(self.dial(peer)) as connection:
            send_message(connection, message)
            return recv_message(connection)[0]

    def ask_each(
        self, peers: list[Peer], message: dict[str, Any], what: str
    ) -> Iterator[tuple[Peer, dict[str, Any]]]:
        """Each of ``peers`` that answers ``message``, with its reply (one that cannot be
        reached, or answers nonsense, is logged and passed over)."""
        for peer in peers:
            try:
                reply = self.ask(peer, message)
            except (OSError, ValueError) as exc:
                log.warning("cannot ask %s for %s: %s", peer["node"], what, exc)
                continue
            yield peer, reply

    def close(self) -> None:
        """Close every connection kept."""
        with self._lock:
            connections, self._out = list(self._out.values()), {}
        for _, connection in connections:
            connection.close()
