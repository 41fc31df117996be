"""The bytes between agents: segments streamed out of shared memory, and read back in, with a
checksum of what passed, at a pace if asked (:mod:`._memory_peers`, :mod:`._memory_rebuild`)."""

from __future__ import annotations

import mmap
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from crashproof.checkpoint.format import new_hasher

__all__ = ["CHUNK", "Dropped", "Pacer", "bytes_of", "receive_bytes", "send_range", "tensor_of"]

CHUNK = 8 * 1024 * 1024
_SCRATCH = 1024 * 1024
_BURST_S = 0.05


def tensor_of(data: bytearray | memoryview) -> torch.Tensor:
    """``data`` as a uint8 tensor, sharing its memory."""
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A uint8 tensor's bytes, without a copy."""
    return tensor.numpy().data if tensor.numel() else memoryview(b"")


class Pacer:
    """Keeps what passes through it under ``rate`` bytes a second (a short burst allowed)."""

    def __init__(self, rate: int) -> None:
        self._rate = rate
        self._free_at = time.monotonic()

    def __call__(self, nbytes: int) -> None:
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + nbytes / self._rate
        if self._free_at - now > _BURST_S:
            time.sleep(self._free_at - now - _BURST_S)


def send_range(
    connection: socket.socket,
    parts: list[dict[str, Any]],
    offset: int,
    size: int,
    pace: Pacer | None = None,
) -> str:
    """Stream bytes ``offset .. offset + size`` of the segments ``parts`` (``fd``, ``nbytes``)
    laid end to end, ``pace``d; returns their checksum."""
    hasher = new_hasher()
    at = 0
    for part in parts:
        nbytes = int(part["nbytes"])
        start, end = max(offset, at), min(offset + size, at + nbytes)
        if start < end:
            with (
                mmap.mmap(part["fd"], nbytes, mmap.MAP_SHARED, mmap.PROT_READ) as mm,
                memoryview(mm) as view,
            ):
                for pos in range(start - at, end - at, CHUNK):
                    with view[pos : min(pos + CHUNK, end - at)] as chunk:
                        if pace is not None:
                            pace(len(chunk))
                        hasher.update(chunk)
                        connection.sendall(chunk)
        at += nbytes
    return hasher.hexdigest()


def receive_bytes(
    connection: socket.socket,
    nbytes: int,
    into: memoryview | None,
    each: Callable[[int, memoryview], None] | None = None,
) -> str:
    """Read ``nbytes`` off ``connection`` into ``into`` (None: a chunk at a time, each handed to
    ``each`` with its offset, then dropped); returns their checksum."""
    hasher = new_hasher()
    # (A small scratch: freed memory of a connection's thread stays with its malloc arena.)
    chunk_size = CHUNK if into is not None else _SCRATCH
    scratch = memoryview(bytearray(min(chunk_size, nbytes))) if into is None else None
    pos = 0
    while pos < nbytes:
        want = min(chunk_size, nbytes - pos)
        # Each view released at once, an error's too: a view left to an exception's traceback
        # keeps ``into``'s mapping from being closed (BufferError, the mapping held meanwhile).
        with into[pos : pos + want] if into is not None else scratch[:want] as target:  # type: ignore[index]
            got = connection.recv_into(target)
            if not got:
                raise ConnectionError("the peer closed the connection mid-copy")
            with target[:got] as received:
                hasher.update(received)
                if each is not None:
                    each(pos, received)
        pos += got
    return hasher.hexdigest()


class Dropped(Exception):
    """A copy received whole but not to be kept (overwritten while sent, or damaged)."""
