"""Preemption notices inside a trainer: signals become a flag, the work waits for a step boundary.

A scheduler announces the end of a machine with a signal (SIGTERM from Kubernetes, SLURM and
``crashproof run``; SIGUSR1 from SLURM's ``--signal``; SIGINT from a terminal) or a cloud
metadata notice, which ``crashproof run`` turns into a SIGTERM for its trainers. The handler only
records the notice: no I/O, no locks, nothing that could deadlock inside a signal handler. The
checkpoint manager looks at the flag at the next ``maybe_save``, all ranks agree on that step,
and the emergency save and the exit happen there, in ordinary code.

Handlers the user installed before are called too (chained). The interpreter's default SIGINT
handler is not: a first Ctrl-C asks for a clean stop with a checkpoint; a second one interrupts
at once, as usual.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from crashproof._files import read_json_object
from crashproof.exitcodes import EXIT_PREEMPTED

__all__ = [
    "ENV_NOTICE_FILE",
    "EXIT_PREEMPTED",
    "PREEMPTION_SIGNALS",
    "Notice",
    "PreemptedExit",
    "PreemptionListener",
]

log = logging.getLogger("crashproof.guard")


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

ENV_NOTICE_FILE = "CRASHPROOF_NOTICE_FILE"
"""Set by ``crashproof run``: a JSON file where it describes a cloud notice (source, deadline)."""


@dataclass(frozen=True, slots=True)
class Notice:
    """A request to stop: where it came from, when, and by when the work must be done."""

    source: str
    """``SIGTERM``, ``SIGUSR1``, ``SIGINT``, or a cloud provider's name."""
    received_s: float
    """``time.monotonic()`` when it arrived."""
    deadline_s: float | None = None
    """``time.monotonic()`` by which the machine goes away, when the notice says."""


class PreemptedExit(SystemExit):
    """Raised by the checkpoint manager after the emergency checkpoint: exits with code 75.

    A ``SystemExit``, so ``finally`` blocks and context managers run and an uncaught one ends
    the process with the code schedulers read as "stopped early, resumable".
    """

    def __init__(self, notice: Notice, step: int) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.notice = notice
        self.step = step


Handler = Callable[[int, FrameType | None], Any] | int | None


class PreemptionListener:
    """Turns preemption signals into a :class:`Notice`; installed from the main thread only."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.notice: Notice | None = None
        self._previous: dict[int, Handler] = {}
        self._pid = os.getpid()  # the process whose manager listens

    def install(self) -> bool:
        """Install the handlers; False (and nothing installed) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "preemption signals are not handled: the manager was created off the main thread"
            )
            return False
        self._pid = os.getpid()
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Put back the handlers found at :meth:`install` (unless someone replaced ours since)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            # A forked child (a multiprocessing Pool's worker, a DataLoader's) inherits the
            # handler but not the manager: recording a notice there would make it ignore the
            # signal, and Pool.terminate() (SIGTERM, then join) would wait for ever. It acts as
            # it would have without crashproof.
            _as_without_crashproof(self, signum, frame)
            return
        if signum == signal.SIGINT and self.notice is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        # Every manager's listener up the chain (each installed over the one before) records the
        # notice, walked in a loop rather than by each calling the next: managers that were
        # never closed leave their listeners in the chain, and a long-lived process could chain
        # more of them than Python's recursion allows. A handler of the user's, found beyond
        # them, is called once.
        listener: PreemptionListener = self
        seen: set[int] = set()
        while True:
            seen.add(id(listener))
            if listener.notice is None:
                listener.notice = Notice(signal.Signals(signum).name, time.monotonic())
            previous = listener._previous.get(signum)
            owner = getattr(previous, "__self__", None)
            if not isinstance(owner, PreemptionListener) or id(owner) in seen:
                break
            listener = owner
        if isinstance(owner, PreemptionListener):
            return  # a loop of listeners: every one has the notice already
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def pending(self) -> Notice | None:
        """The notice, with the deadline ``crashproof run`` wrote for a cloud notice, if any."""
        notice = self.notice
        if notice is None or notice.deadline_s is not None:
            return notice
        details = _read_notice_file()
        if details is not None:
            remaining = details.get("seconds_left")
            self.notice = Notice(
                str(details.get("source", notice.source)),
                notice.received_s,
                notice.received_s + float(remaining) if remaining is not None else None,
            )
        return self.notice

    def request(self, source: str) -> None:
        """Ask for a stop from code (e.g. a test, or a job's own time limit)."""
        if self.notice is None:
            self.notice = Notice(source, time.monotonic())


def _as_without_crashproof(
    listener: PreemptionListener, signum: int, frame: FrameType | None
) -> None:
    """Do what the handler found before the first crashproof listener would do with ``signum``:
    call it, ignore the signal, raise ``KeyboardInterrupt``, or die of it (the default)."""
    seen: set[int] = set()
    previous: Handler = listener._handle
    while isinstance(getattr(previous, "__self__", None), PreemptionListener):
        owner: PreemptionListener = previous.__self__  # type: ignore[union-attr]
        if id(owner) in seen:
            previous = signal.SIG_DFL
            break
        seen.add(id(owner))
        previous = owner._previous.get(signum, signal.SIG_DFL)
    if previous is signal.SIG_IGN:
        return
    if previous is signal.default_int_handler:
        raise KeyboardInterrupt
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # SIG_DFL, or None (set from outside Python)
    os.kill(os.getpid(), signum)


def _read_notice_file() -> dict[str, Any] | None:
    path = os.environ.get(ENV_NOTICE_FILE)
    if not path:
        return None
    return read_json_object(path)
