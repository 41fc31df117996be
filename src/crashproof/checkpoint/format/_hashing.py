"""Checksums for checkpoint files and tensors.

xxHash's XXH3-128 runs at well over ten times the speed of a disk (about 18 GB/s on one core here)
and releases the GIL on large buffers, so hashing while writing costs the save nothing measurable.
It is a checksum against corruption (bit rot, truncation, torn writes), not a signature against an
attacker: integrity against tampering needs a signature over the manifest, which is out of scope.
"""

from __future__ import annotations

from typing import Protocol

import xxhash

__all__ = ["HASH_ALGORITHM", "Hasher", "digest", "new_hasher"]

HASH_ALGORITHM = "xxh3_128"


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


def new_hasher() -> Hasher:
    """A streaming hasher of :data:`HASH_ALGORITHM`."""
    hasher: Hasher = xxhash.xxh3_128()
    return hasher


def digest(data: bytes | memoryview) -> str:
    """The hex checksum of ``data`` in one call."""
    return str(xxhash.xxh3_128_hexdigest(data))
