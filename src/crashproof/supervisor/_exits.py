"""When did each trainer exit? A thread that wakes the moment a trainer process ends.

torch elastic polls its trainers every monitor interval and, when one fails, stops the rest; the
survivors then fail too (a peer's closed connection), often within the same interval. Which rank
failed *first* is the root cause the user needs, so this watcher waits on a pidfd per trainer
(Linux >= 5.3; it works for the forkserver's children as well, which are not the agent's) and
records the order of exits as they happen. It also wakes the agent's monitor loop at once, so a
failure is acted on without waiting for the next monitor interval. Where pidfds are missing it
records nothing and the agent falls back to torch's own timestamps and its polling.
"""

from __future__ import annotations

import os
import re
import select
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import Worker
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

__all__ = ["ExitWatcher", "failure_order", "lost_a_peer"]


class ExitWatcher:
    def __init__(self, pids: list[int], on_exit: Callable[[], None] | None = None) -> None:
        """Watch ``pids``; ``on_exit`` is called (on the watcher's thread) after each exit."""
        self.exited_s: dict[int, float] = {}
        """``time.monotonic()`` at which each trainer was seen to exit, by pid."""
        self._fds: dict[int, int] = {}
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except (AttributeError, OSError):  # no pidfd support, or the process is gone
                continue
        self._on_exit = on_exit
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="crashproof-exits", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        pending = set(self._fds)
        while pending:
            for fd, _ in poller.poll():
                if fd == self._stop_r:
                    return
                self.exited_s.setdefault(self._fds[fd], time.monotonic())
                poller.unregister(fd)
                pending.discard(fd)
                if self._on_exit is not None:
                    self._on_exit()

    def order(self, pid: int) -> float:
        """A sort key: when ``pid`` exited (infinity if not seen)."""
        return self.exited_s.get(pid, float("inf"))

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=1)
        for fd in (*self._fds, self._stop_r, self._stop_w):
            os.close(fd)
        self._fds.clear()


_PEER_LOST = re.compile(r"reset by peer|closed by peer|broken pipe|remote process exited", re.I)
"""What gloo and NCCL say when a collective's connection to a peer breaks under it."""


def lost_a_peer(error: str | None) -> bool:
    """Whether a trainer's error is the mark of a peer gone (a collective's connection broken):
    the consequence of another rank's failure, not a cause of its own."""
    return error is not None and _PEER_LOST.search(error) is not None


def failure_order(
    workers: Sequence[Worker],
    stopped: Collection[int | None],
    watcher: ExitWatcher | None,
    failures: Mapping[int, ProcessFailure],
    errors: Mapping[int | None, str | None] | None = None,
) -> list[Worker]:
    """``workers`` in the order they failed, the root cause first.

    torch reports one failure (or all, with the survivors it killed as failures too); the
    watcher saw the order in which the processes really ended. Ranks the agent ``stopped``
    because a peer had failed come after every other: a watcher woken late sees both exits in
    one poll, in no particular order. So do ranks whose error (``errors``, by pid) says a
    peer's connection broke: a process's sockets close as it exits, before its end can be seen,
    so the peer it left may fail of it and be seen to end first."""
    errors = errors or {}
    return sorted(
        workers,
        key=lambda w: (
            w.id in stopped,
            lost_a_peer(errors.get(w.id)),
            watcher.order(w.id) if watcher is not None and w.id is not None else 0.0,
            failures[w.global_rank].timestamp if w.global_rank in failures else 2**62,
        ),
    )
