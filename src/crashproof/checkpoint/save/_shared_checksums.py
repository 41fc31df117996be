"""One snapshot written twice, hashed once: :class:`SharedChecksums`.

Under ``crashproof run`` a checkpoint's staged tensors live in a segment of the agent's memory,
and the same staged bytes are written twice: as the memory snapshot (in place: its writer only
hashes them and checks that they are finite) and as the checkpoint on disk. Both writers used to
hash every byte and check it for NaN and inf, on two background threads competing with training
for the same cores. Now the memory snapshot's writer, which has nothing else to do, hands its
checksums over, and the disk writer waits for them instead of hashing the same bytes again.

The bytes cannot change in between: a staging slot is reused only once both writes are collected.
A hand-over is given exactly once, and an empty one (the memory write failed, was refused as
non-finite, or never ran) leaves the disk writer to hash and check everything itself, as before.
The disk writer waits for the hashing only once it has begun: a memory write that has not begun
within a second (its thread still busy with an earlier commit, which may be waiting on an agent
that stopped answering) is not waited for, so the disk checkpoint never depends on the agent.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

__all__ = ["SharedChecksums"]


class SharedChecksums:
    """The checksums of a snapshot's tensors, by name, from the write that hashed them first
    (all of them, each finite where it must be), for a second write of the same bytes."""

    BEGIN_WITHIN_S = 1.0
    """How long the second write waits for the first to begin hashing before it hashes itself."""

    def __init__(self) -> None:
        self._begun = threading.Event()
        self._given = threading.Event()
        self._lock = threading.Lock()
        self._checksums: Mapping[str, str] = {}

    def begin(self) -> None:
        """The first write begins to hash (from here to :meth:`give`, only the CPU is involved)."""
        self._begun.set()

    def give(self, checksums: Mapping[str, str]) -> None:
        """Hand the checksums over; only the first call counts (a failed write gives ``{}``, and
        a safety net gives ``{}`` again once the write is over, whatever happened to it)."""
        with self._lock:
            if self._given.is_set():
                return
            self._checksums = dict(checksums)
            self._given.set()
            self._begun.set()

    def take(self) -> Mapping[str, str]:
        """The checksums once given, or ``{}`` (hash them yourself) when the first write has not
        begun within :attr:`BEGIN_WITHIN_S`."""
        if not self._begun.wait(self.BEGIN_WITHIN_S):
            return {}
        self._given.wait()
        return self._checksums
