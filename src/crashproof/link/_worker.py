"""A trainer's link to ``crashproof run``: heartbeat file and on-demand stack dumps.

Under the supervisor (``CRASHPROOF_HEARTBEAT_DIR`` is set), ``import crashproof`` calls
:func:`attach_to_supervisor`, which

* creates the trainer's heartbeat record in phase "startup", so a trainer that hangs before its
  first step is noticed too;
* asks the kernel to SIGKILL it when its parent dies (the agent, or the warm forkserver, which
  dies with the agent): a trainer whose agent was SIGKILLed would otherwise train on alone. The
  parent it expects is in ``CRASHPROOF_PARENT_PID``; if that one is already gone, it exits;
* asks the same for every process the trainer forks from its main thread (DataLoader workers):
  a forked worker holds copies of the trainer's sockets, so a SIGKILLed rank's connections to its
  peers stayed open until its workers noticed (up to 5 s, DataLoader's watchdog) and the peers
  sat in a collective all that time instead of failing at once;
* registers :mod:`faulthandler` on ``SIGUSR2`` to write every thread's Python stack to
  ``RUN_DIR/stacks/<agent session>/attempt_<k>/rank_<r>.txt`` (created, or appended to: never
  truncated, never through a link). The dump runs inside the signal handler, in C,
  so it works while the interpreter is stuck in a collective or holds the GIL in native code.

Outside the supervisor it does nothing.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
from typing import IO

from crashproof._rundir import RunDir
from crashproof._runfiles import RunFileRefused, open_run_file
from crashproof.link._heartbeat import ENV_HEARTBEAT_DIR, worker_heartbeat

__all__ = [
    "ENV_PARENT_PID",
    "STACK_DUMP_SIGNAL",
    "attach_to_supervisor",
    "die_with_parent",
    "script_returned",
]

STACK_DUMP_SIGNAL = signal.SIGUSR2

ENV_PARENT_PID = "CRASHPROOF_PARENT_PID"
"""The process a trainer must die with: the agent (set by it), or the warm forkserver (which
sets it for the trainers it forks)."""

_stack_file: IO[str] | None = None
_attached_pid = 0


def attach_to_supervisor() -> None:
    """Set up this process's heartbeat and stack dumps if ``crashproof run`` started it."""
    global _stack_file, _attached_pid
    # LOCAL_RANK too: the warm forkserver imports crashproof with the supervisor's environment
    # but is no trainer; its children attach when they start (crashproof.supervisor._entry).
    if not os.environ.get(ENV_HEARTBEAT_DIR) or "LOCAL_RANK" not in os.environ:
        return
    if _attached_pid == os.getpid():
        return
    _attached_pid = os.getpid()
    die_with_parent(int(os.environ.get(ENV_PARENT_PID) or 0) or None)
    _children_die_with_trainer()
    session = RunDir.session_of(os.environ[ENV_HEARTBEAT_DIR])
    worker_heartbeat()
    # This process owns the record now; its children (spawned DataLoader workers, helper
    # scripts) must not open it again, truncating the trainer's record.
    os.environ.pop(ENV_HEARTBEAT_DIR, None)
    run_dir = RunDir.from_env()
    if run_dir is not None:
        path = run_dir.stack_dump(
            session,
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            int(os.environ.get("RANK", "0")),
        )
        try:
            fd = open_run_file(
                run_dir.path, os.path.relpath(path, run_dir.path), "append", own=_is_stack_dump
            )
        except (RunFileRefused, OSError) as exc:
            print(f"crashproof: no stack dumps: {exc}", file=sys.stderr)
            return
        # Kept open for the life of the process: the handler can only write to an open file.
        if _stack_file is not None:
            _stack_file.close()
        _stack_file = os.fdopen(fd, "w", encoding="utf-8")
        faulthandler.register(STACK_DUMP_SIGNAL, file=_stack_file, all_threads=True, chain=False)


def script_returned() -> None:
    """Tell the agent this trainer's script returned normally and its exit handlers ran: what is
    left is waiting for torch to collect the result, so the agent may let torch stop it (after a
    peer crashed on its way out) without cutting short any of the script's own work."""
    writer = worker_heartbeat()
    if writer is not None:
        writer.set_phase("exiting")


def _is_stack_dump(head: bytes) -> bool:
    """Whether a file's first bytes are faulthandler's dump of every thread."""
    return head.startswith((b"Thread 0x", b"Current thread 0x"))


_hooked = False
_forking_parent = 0
"""The pid of the process forking now, from its main thread (0: another thread)."""


def _children_die_with_trainer() -> None:
    """Every child forked from the main thread dies with the trainer (see the module docstring).

    Only from the main thread: the kernel's parent-death signal fires when the *thread* that
    forked exits, and a worker forked by a short-lived thread would die with that thread.
    """
    global _hooked
    if _hooked or not sys.platform.startswith("linux"):
        return
    _hooked = True

    def before() -> None:
        global _forking_parent
        main = threading.current_thread() is threading.main_thread()
        _forking_parent = os.getpid() if main else 0

    def in_child() -> None:
        if _forking_parent and "LOCAL_RANK" in os.environ:
            die_with_parent(_forking_parent)

    os.register_at_fork(before=before, after_in_child=in_child)


def die_with_parent(expected: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent (thread) exits.

    ``expected``: the pid the parent must have; if the parent is another one already (it died
    before the request took effect, and this process was handed to a subreaper or init), exit
    now. Without it, only a parent that dies after this call is noticed.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = expected if expected is not None else os.getppid()
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os._exit(1)
