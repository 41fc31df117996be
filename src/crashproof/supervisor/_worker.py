"""A trainer's link to ``crashproof run``: heartbeat file and on-demand stack dumps.

Under the supervisor (``CRASHPROOF_HEARTBEAT_DIR`` is set), ``import crashproof`` calls
:func:`attach_to_supervisor`, which

* creates the trainer's heartbeat record in phase "startup", so a trainer that hangs before its
  first step is noticed too;
* asks the kernel to SIGKILL it when its parent dies: torch starts trainers in sessions of
  their own, so a trainer whose agent was SIGKILLed would otherwise train on alone;
* registers :mod:`faulthandler` on ``SIGUSR2`` to write every thread's Python stack to
  ``RUN_DIR/stacks/attempt_<k>/rank_<r>.txt``. The dump runs inside the signal handler, in C,
  so it works while the interpreter is stuck in a collective or holds the GIL in native code.

Outside the supervisor it does nothing.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
from typing import IO

from crashproof.supervisor._heartbeat import ENV_HEARTBEAT_DIR, worker_heartbeat
from crashproof.telemetry._events import ENV_RUN_DIR

__all__ = ["STACK_DUMP_SIGNAL", "attach_to_supervisor", "stack_dump_path"]

STACK_DUMP_SIGNAL = signal.SIGUSR2

_stack_file: IO[str] | None = None
_attached_pid = 0


def stack_dump_path(run_dir: str, attempt: int, rank: int) -> str:
    return os.path.join(run_dir, "stacks", f"attempt_{attempt}", f"rank_{rank}.txt")


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
    _die_with_parent()
    worker_heartbeat()
    # This process owns the record now; its children (spawned DataLoader workers, helper
    # scripts) must not open it again, truncating the trainer's record and stack file.
    os.environ.pop(ENV_HEARTBEAT_DIR, None)
    run_dir = os.environ.get(ENV_RUN_DIR)
    if run_dir:
        path = stack_dump_path(
            run_dir,
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            int(os.environ.get("RANK", "0")),
        )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Kept open for the life of the process: the handler can only write to an open file.
        if _stack_file is not None:
            _stack_file.close()
        _stack_file = open(path, "w", encoding="utf-8")  # noqa: SIM115
        faulthandler.register(STACK_DUMP_SIGNAL, file=_stack_file, all_threads=True, chain=False)


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
