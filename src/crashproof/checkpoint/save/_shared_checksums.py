"""One snapshot written twice, hashed once: :class:`SharedChecksums`.

Under ``crashproof run`` a checkpoint's staged tensors live in a segment of the agent's memory,
and the same staged bytes are written twice: as the memory snapshot (in place: its writer only
hashes them and checks that they are finite) and as the checkpoint on disk. Both writers used to
hash every byte and check it for NaN and inf, on two background threads competing with training
for the same cores. Now the disk writer writes the bytes without hashing them, then takes the
checksums the memory snapshot's writer (which has nothing else to do) worked out meanwhile.

The bytes cannot change in between: a staging slot is reused only once both writes are collected.
A hand-over is given exactly once. The disk writer waits for the memory write to begin only when
that write was due to begin at once (its thread was idle), and for at most a few seconds; never
for a memory write queued behind an earlier commit (which may be waiting on an agent that
stopped answering). An empty hand-over (the memory write failed, was refused as non-finite, or
had not begun) leaves the disk writer to hash and check the bytes itself, as without an agent.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

__all__ = ["SharedChecksums"]


class SharedChecksums:
    """The checksums of a snapshot's tensors, by name, from the write that hashed them first
    (all of them, each finite where it must be), for a second write of the same bytes."""

    BEGIN_WITHIN_S = 5.0
    """How long a second write waits for a first one due to begin at once (a thread start)."""

    def __init__(self, *, begins_at_once: bool) -> None:
        self._begins_at_once = begins_at_once
        self._begun = threading.Event()
        self._given = threading.Event()
        self._lock = threading.Lock()
        self._checksums: Mapping[str, str] = {}

    def begin(self) -> None:
        """The first write begins to hash (from here to :meth:`give`, only the CPU is involved)."""
        self._begun.set()

    def give(self, checksums: Mapping[str, str]) -> None:
        """Hand the checksums over; only the first call counts (a failed write gives ``{}``, and
        nothing more)."""
        with self._lock:
            if self._given.is_set():
                return
            self._checksums = dict(checksums)
            self._given.set()
            self._begun.set()

    def take(self) -> Mapping[str, str]:
        """The checksums, once given; or ``{}`` (hash them yourself) when the first write has not
        begun, and was not due to begin at once or failed to within :attr:`BEGIN_WITHIN_S`. A
        second call answers as the first did, at once."""
        if not self._begun.wait(self.BEGIN_WITHIN_S if self._begins_at_once else 0):
            self.give({})  # (declined: a write that begins now keeps its checksums for itself)
            return {}
        self._given.wait()
        return self._checksums
