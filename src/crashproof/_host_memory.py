"""How much host memory the machine has available, and how much crashproof leaves free.

Staging buffers for asynchronous saves and a restore's read buffer are both sized against it.
"""

from __future__ import annotations

import os

__all__ = ["HEADROOM_BYTES", "available_memory_bytes"]

HEADROOM_BYTES = 256 * 1024 * 1024
"""Left free beyond crashproof's own buffers: the writer, the page cache and the training loop's
own growth need room too."""


def available_memory_bytes() -> int | None:
    """Host memory available for new allocations (Linux ``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
