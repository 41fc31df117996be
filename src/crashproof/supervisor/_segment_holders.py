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
    user's processes cannot hold one unless handed it, and are not readable: not looked at.)

    A process of this user started after this agent whose ``/proc`` it may not read (one that
    made itself non-dumpable) counts as holding every segment: it could be a trainer's leftover,
    and what it holds cannot be seen. Its snapshots are then left to the restore to check."""
    needle, me = f"/memfd:crashproof:{token}:", os.getpid()
    born = _started("self")
    found: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/maps", "rb") as maps:
                text = maps.read().decode("utf-8", "replace")
            fds = list(os.scandir(f"/proc/{entry.name}/fd"))
        except PermissionError:
            if _could_hold(entry.name, born):
                for inode in inodes:
                    found.setdefault(inode, []).append(int(entry.name))
            continue
        except OSError:
            continue  # (gone)
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


def _could_hold(pid: str, born: int | None) -> bool:
    """Whether process ``pid``, whose maps and descriptors may not be read, could be a
    trainer's leftover: this user's, and started after this agent (``born``). Unsure: yes."""
    try:
        # (not the owner of /proc/PID: that is root for a non-dumpable process)
        with open(f"/proc/{pid}/status", "rb") as status:
            uids = next((line.split()[1:] for line in status if line.startswith(b"Uid:")), [])
        started = _started(pid)
    except OSError:
        return False  # (gone)
    mine = str(os.getuid()).encode() in uids
    return mine and (born is None or started is None or started >= born)


def _started(pid: str) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s 22nd
    field, counted after the command name, which may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""  # (closed meanwhile)
