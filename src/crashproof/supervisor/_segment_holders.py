"""Who else holds the agent's memory segments: :func:`other_holders`.

The agent vouches for a snapshot it checked only if no process but itself could still write it.
A trainer's leftover that escaped its session and its parent (``setsid`` in a process forked
from a thread with no parent-death signal) is the one that could: it still maps the segment, or
holds its descriptor. The kernel tells in ``/proc``.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["other_holders"]


def other_holders(token: str, inodes: set[int]) -> dict[int, list[int]]:
    """The processes other than this one that map a segment of the host ``token`` (shared) or
    hold its descriptor (and so could write it), by the segment's inode, of those ``inodes``:
    from ``/proc``, a trainer's leftover that escaped its session and its parent. (Another
    user's processes cannot hold one unless handed it, and are not readable: not looked at.)"""
    needle, me = f"/memfd:crashproof:{token}:", os.getpid()
    found: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/maps", "rb") as maps:
                text = maps.read().decode("utf-8", "replace")
            fds = list(os.scandir(f"/proc/{entry.name}/fd"))
        except OSError:
            continue  # (gone, or not ours to read)
        held = set()
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            # (perms "r--s" too: a descriptor it was mapped from was writable, so mprotect can
            # make the mapping writable; the inode is the fifth field)
            if needle in line and len(fields) > 4 and fields[1][3:4] == "s":
                held.add(int(fields[4]))
        for fd in fds:
            if needle in _link(fd.path):
                with contextlib.suppress(OSError):
                    held.add(os.stat(fd.path).st_ino)
        for inode in held & inodes:
            found.setdefault(inode, []).append(int(entry.name))
    return found


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""  # (closed meanwhile)
