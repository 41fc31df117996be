"""The wire between a trainer and its agent's memory host: framed JSON messages that may carry
file descriptors (the shared-memory segments), over a Unix socket.

A frame is an 8-byte header (payload length, number of descriptors) sent together with the
descriptors (``SCM_RIGHTS``), then the JSON payload. The socket lives in the abstract namespace
(a name, not a file: nothing to clean up after a SIGKILL, and no path-length limit); the
environment variable :data:`ENV_MEMORY_SOCKET` names it with ``@`` for the leading NUL byte, the
way ``ss`` prints such names.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ENV_MEMORY_SOCKET",
    "MAX_FDS",
    "MemoryClient",
    "memory_listener",
    "recv_exactly",
    "recv_message",
    "send_message",
]

ENV_MEMORY_SOCKET = "CRASHPROOF_MEMORY_SOCKET"
"""The agent's memory host, for its trainers (set by ``crashproof run``)."""

MAX_FDS = 64
"""The most descriptors one message carries (a reply to a restarted trainer: one per slot)."""

_HEADER = struct.Struct("<II")
_MAX_PAYLOAD = 64 * 1024 * 1024
"""The largest message (a trainer's commit holds its part's index: a few MB at most)."""


def _address(name: str) -> str:
    return "\0" + name[1:] if name.startswith("@") else name


def memory_listener(name: str) -> socket.socket:
    """A listening socket at ``name`` (``@`` first: abstract)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(_address(name))
    server.listen(64)
    return server


def _connect(name: str, timeout_s: float) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(timeout_s)
    try:
        client.connect(_address(name))
    except BaseException:
        client.close()
        raise
    return client


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send ``message`` (and ``fds``, over a Unix socket only)."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    header = _HEADER.pack(len(payload), len(fds))
    if fds:
        sent = socket.send_fds(sock, [header], list(fds))  # (the descriptors go with it)
        sock.sendall(header[sent:] + payload)  # (never empty: a JSON object is 2 bytes at least)
    else:  # (also over TCP, between agents: no ancillary data there)
        sock.sendall(header + payload)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The next message and the descriptors it carried (the caller owns and closes them).
    Raises ``ConnectionError`` when the other side has gone."""
    if sock.family == socket.AF_UNIX:
        # Close-on-exec: no program the receiver starts inherits a segment (and could write it).
        header, received, _, _ = socket.recv_fds(
            sock, _HEADER.size, MAX_FDS, socket.MSG_CMSG_CLOEXEC
        )
        fds = list(received)
    else:
        header, fds = sock.recv(_HEADER.size), []
    try:
        if not header:
            raise ConnectionError("the memory host's connection closed")
        header += recv_exactly(sock, _HEADER.size - len(header))
        size, count = _HEADER.unpack(header)
        if count != len(fds):
            raise ConnectionError(
                f"malformed message: {count} descriptors announced, {len(fds)} came"
            )
        if size > _MAX_PAYLOAD:
            raise ConnectionError(
                f"malformed message: {size} bytes announced, at most {_MAX_PAYLOAD}"
            )
        try:
            message = json.loads(recv_exactly(sock, size))
        except RecursionError:  # (nested deeper than any message is)
            raise ConnectionError("malformed message: nested too deep") from None
        if not isinstance(message, dict):
            raise ConnectionError("malformed message: not a JSON object")
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the memory host's connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class MemoryClient:
    """A trainer's connection to its agent's memory host: one request at a time (the training
    thread and the snapshot thread share it)."""

    def __init__(self, address: str, timeout_s: float = 60.0) -> None:
        self.address = address
        self._sock = _connect(address, timeout_s)
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls) -> MemoryClient | None:
        """The client of the memory host ``crashproof run`` started, or None (not supervised,
        or ``--no-memory``)."""
        address = os.environ.get(ENV_MEMORY_SOCKET)
        return cls(address) if address else None

    def request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """The host's reply to ``message``, and the descriptors it carried (the caller's)."""
        with self._lock:
            send_message(self._sock, message)
            return recv_message(self._sock)

    def close(self) -> None:
        with self._lock:
            self._sock.close()
