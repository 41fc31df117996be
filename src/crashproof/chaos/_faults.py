"""How each kind of fault is done to a running job: signals, a damaged file, an armed seam.

- ``kill``: SIGKILL to the rank's process.
- ``hang``: SIGSTOP to the rank's process, left stopped: finding it is the supervisor's job
  (its heartbeat goes silent). If nothing finds it the campaign sends SIGCONT when it gives up.
- ``straggler``: SIGSTOP and SIGCONT in a duty cycle (stopped ``stop`` of every ``period_s``)
  for ``for_s`` seconds, from a thread.
- ``corrupt``: every rank of the group is stopped (so nothing can commit meanwhile), a bit of the
  newest committed checkpoint's largest file is flipped (or the file is cut in half), and the
  group is SIGKILLed, the fault's rank first: a corruption shows only when a restore reads the
  file, and the restart makes one read it at once. Under ``crashproof run`` the fault's rank's
  snapshots in the agent's memory get a bit flipped too (a RAM error): the restore prefers them,
  so without it the damaged file would seldom be read.
- ``nan`` and ``storage``: a line in the seam's control file (:mod:`crashproof._seams`);
  the trainer fires it.

Only processes of the run's newest attempt are touched, and never the supervisor.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import threading
import time
from typing import Any

from crashproof.checkpoint import committed_steps, read_manifest
from crashproof.storage import LocalStorage

__all__ = [
    "DutyCycle",
    "corrupt_memory",
    "corrupt_newest",
    "process_state",
    "send",
    "stop_all",
]


def send(pid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid``; False when the process is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``T``...); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0]


def stop_all(pids: list[int], *, timeout_s: float = 5.0) -> list[int]:
    """SIGSTOP every process and wait until the kernel shows each stopped (a signal is delivered
    asynchronously); returns the pids that were stopped (the others are gone)."""
    stopped = [pid for pid in pids if send(pid, signal.SIGSTOP)]
    deadline = time.monotonic() + timeout_s
    for pid in stopped:
        while process_state(pid) not in ("T", "t", None, "Z") and time.monotonic() < deadline:
            time.sleep(0.001)
    return stopped


def corrupt_newest(root: str, mode: str, rng: random.Random) -> dict[str, Any]:
    """Damage the newest committed checkpoint under the local directory ``root``: flip one bit of
    its largest file (``flip``) or cut that file to half its size (``truncate``). Returns what
    was done: ``step``, ``file``, ``size`` and ``offset``/``bit`` or ``new_size``."""
    storage = LocalStorage()
    found = committed_steps(storage, root)
    if not found:
        raise FileNotFoundError(f"no committed checkpoint in {root} to corrupt")
    step, ckpt = found[0]
    manifest = read_manifest(storage, ckpt)
    name, _ = max(manifest.files.items(), key=lambda item: (item[1].size, item[0]))
    path = os.path.join(ckpt, name)
    size = os.path.getsize(path)
    details: dict[str, Any] = {"step": step, "file": path, "size": size, "mode": mode}
    if mode == "truncate" or size == 0:
        new_size = size // 2
        os.truncate(path, new_size)
        details["new_size"] = new_size
        return details
    offset, bit = rng.randrange(size), rng.randrange(8)
    fd = os.open(path, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ (1 << bit)]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    details.update(offset=offset, bit=bit)
    return details


_TRAINER_SEGMENT = re.compile(r"/memfd:crashproof:[0-9a-f]+:r(\d+):s(\d+) \(deleted\)")
"""How a trainer's snapshot segment shows among its agent's descriptors (copies of other
nodes' end in ``:copy`` and are left alone)."""


def corrupt_memory(agent_pid: int, rank: int, rng: random.Random) -> list[dict[str, Any]]:
    """Flip one bit, at a random place, of each snapshot segment of ``rank`` that the agent
    ``agent_pid`` holds (reached through ``/proc/<agent>/fd``, as its own user may). Returns
    each flip's ``segment`` (its slot), ``size``, ``offset`` and ``bit``; none when the agent
    holds no segment of the rank or its descriptors cannot be reached."""
    flips: list[dict[str, Any]] = []
    seen: set[int] = set()  # segments by inode: one may be open under several descriptors
    fd_dir = f"/proc/{agent_pid}/fd"
    try:
        names = sorted(os.listdir(fd_dir), key=int)
    except (OSError, ValueError):
        return flips
    for name in names:
        try:
            match = _TRAINER_SEGMENT.fullmatch(os.readlink(f"{fd_dir}/{name}"))
            if match is None or int(match.group(1)) != rank:
                continue
            fd = os.open(f"{fd_dir}/{name}", os.O_RDWR)
        except OSError:
            continue  # closed meanwhile, or not ours to open
        try:
            info = os.fstat(fd)
            size = info.st_size
            if size == 0 or info.st_ino in seen:
                continue
            seen.add(info.st_ino)
            offset, bit = rng.randrange(size), rng.randrange(8)
            (byte,) = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte ^ (1 << bit)]), offset)
        finally:
            os.close(fd)
        flips.append({"slot": int(match.group(2)), "size": size, "offset": offset, "bit": bit})
    return flips


class DutyCycle:
    """Slow a process down: stopped ``stop`` of every ``period_s`` seconds for ``for_s`` seconds
    (a thread). :meth:`finish` ends it early; either way the process is left running."""

    def __init__(self, pid: int, *, stop: float, period_s: float, for_s: float) -> None:
        self.pid = pid
        # Signals through a pidfd reach this very process or none: a pid freed by the trainer's
        # exit and reused meanwhile must never be stopped.
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(pid)
        self.stopped_s = stop * period_s
        self.period_s = period_s
        self.for_s = for_s
        self.cycles = 0
        self.ended_ts: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crashproof-chaos-straggler")
        self._thread.daemon = True
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def finish(self) -> None:
        self._done.set()
        self._thread.join()

    def _send(self, sig: signal.Signals) -> bool:
        if self._pidfd is None:
            return send(self.pid, sig)
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:
            return False
        return True

    def _run(self) -> None:
        until = time.monotonic() + self.for_s
        try:
            while not self._done.is_set() and time.monotonic() < until:
                if not self._send(signal.SIGSTOP):
                    return
                self._done.wait(self.stopped_s)
                self._send(signal.SIGCONT)
                self.cycles += 1
                self._done.wait(self.period_s - self.stopped_s)
        finally:
            with contextlib.suppress(OSError):
                self._send(signal.SIGCONT)
            if self._pidfd is not None:
                os.close(self._pidfd)
            self.ended_ts = time.time()
