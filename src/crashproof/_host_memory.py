"""How much host memory this process may still allocate, and how much crashproof leaves free.

Staging buffers for asynchronous saves and a restore's read buffer are both sized against it.
The machine's ``MemAvailable`` alone overstates it wherever a job runs under a limit of its own:
a container's or a Slurm job's memory cgroup (64 GB of a 1 TB node), or an address-space limit
(``ulimit -v``). Past such a limit the allocation fails, or the kernel kills the process, though
the machine has memory to spare; so the smallest of the three is what is available.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

__all__ = ["HEADROOM_BYTES", "available_memory_bytes"]

HEADROOM_BYTES = 256 * 1024 * 1024
"""Left free beyond crashproof's own buffers: the writer, the page cache and the training loop's
own growth need room too."""

_NO_LIMIT = 1 << 60
"""A cgroup limit at or above this is "max" written as a number (v1 writes 2**63 rounded down to
a page)."""


def available_memory_bytes() -> int | None:
    """Memory this process may still allocate: the least of the machine's available memory, its
    memory cgroups' room and its address-space limit's room; None if none is known."""
    known = [
        found
        for found in (_machine_available(), cgroup_room(), _address_space_room())
        if found is not None
    ]
    return max(0, min(known)) if known else None


def _machine_available() -> int | None:
    """The machine's memory available for new allocations (Linux ``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cgroup_room(
    proc_cgroup: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup"
) -> int | None:
    """What the memory cgroups this process is in still allow it (v1 or v2): the least, over
    its cgroup and every ancestor with a limit, of the limit less the memory in use that cannot
    be reclaimed (the usage less the inactive page cache, as the kernel and container runtimes
    count a working set). None when no limit applies or none can be read."""
    try:  # a cgroup's name may hold any byte but "/": kept as is (surrogateescape)
        lines = Path(proc_cgroup).read_text(errors="surrogateescape").splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one unified hierarchy
            base = Path(mount)
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            base = Path(mount) / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        rooms.extend(_rooms_up_to_root(base, path, *files))
    return min(rooms) if rooms else None


def _rooms_up_to_root(base: Path, path: str, limit: str, usage: str, inactive: str) -> list[int]:
    # Inside a container the hierarchy is often mounted at the container's own cgroup, so
    # /proc/self/cgroup names a path that is not under the mount: then the mount is the cgroup.
    here = base / path.lstrip("/")
    if not here.is_dir():
        here = base
    rooms = []
    while True:
        room = _room(here, limit, usage, inactive)
        if room is not None:
            rooms.append(room)
        if here == base or here.parent == here:
            return rooms
        here = here.parent


def _room(cgroup: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        raw = (cgroup / limit_file).read_text().strip()
        if raw == "max" or not 0 <= int(raw) < _NO_LIMIT:
            return None
        limit, usage = int(raw), int((cgroup / usage_file).read_text().strip())
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return None
    inactive = 0
    try:
        for line in (cgroup / "memory.stat").read_text(errors="replace").splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
                break
    except (OSError, ValueError):
        pass
    return limit - max(0, usage - inactive)


def _address_space_room() -> int | None:
    """What ``RLIMIT_AS`` (``ulimit -v``) leaves this process: the limit less its virtual size."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return soft - int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
