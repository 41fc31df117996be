"""The agent's hands on its trainer processes: signals, stack dumps, exit codes, last errors.

Everything here acts on processes or reads what they left; nothing decides. When to stop, kill
or dump a trainer is the agent's call (:mod:`crashproof.supervisor._agent`).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import signal
import stat
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import Worker
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from crashproof._rundir import RunDir
from crashproof.link import STACK_DUMP_SIGNAL
from crashproof.supervisor._keeper import end_sessions, forkserver_pid
from crashproof.telemetry import EventLog

log = logging.getLogger(__name__)

__all__ = [
    "dump_stacks",
    "end_leftovers",
    "exit_code",
    "exit_codes",
    "last_error",
    "process_state",
    "remove_empty_stack_dumps",
    "settle_clean_exits",
    "signal_name",
    "signal_trainers",
    "wait_for_exit_codes",
]

_DUMP_POLL_S = 0.05
_EXIT_CODE_WAIT_S = 0.05
"""How long a look waits for the exit code of a trainer seen to end (reaped by its parent)."""


def end_leftovers(sessions: dict[int, int | None], events: EventLog, attempt: int) -> bool:
    """End what stopped trainers left in their sessions (``sessions``: see
    :func:`~crashproof.supervisor._keeper.session_leaders`): a program started with an
    environment of its own, which no parent-death signal reaches, must not run on beside the
    next attempt (the keeper ends such programs only when the run ends). The warm forkserver,
    which leads its trainers' session, is spared. Returns whether every process is gone."""
    killed, ended = end_sessions(sessions, spare=[forkserver_pid()])
    if killed:
        log.warning("stopped %d process(es) the stopped trainers left: %s", len(killed), killed)
        events.emit("leftovers_stopped", attempt=attempt, pids=killed)
    return ended


def signal_trainers(pids: Iterable[int | None], *signals: signal.Signals) -> None:
    """Send ``signals``, in order, to each process of ``pids`` (None: not started yet). A
    process that is gone, or no longer ours, gets no more of them."""
    for pid in pids:
        if pid is None:
            continue
        for sig in signals:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                break


def dump_stacks(pids: Mapping[int, int], paths: Mapping[int, str], wait_s: float) -> dict[int, str]:
    """Ask the trainers ``pids`` (by global rank) for their Python stacks, into their files
    ``paths``, and wait up to ``wait_s`` for them; returns the files written, by global rank."""
    sizes = {rank: _size(path) for rank, path in paths.items()}
    # SIGCONT after the dump signal: a stopped process handles it once it runs again.
    signal_trainers(pids.values(), STACK_DUMP_SIGNAL, signal.SIGCONT)
    deadline = time.monotonic() + wait_s
    written: dict[int, str] = {}
    while time.monotonic() < deadline and len(written) < len(paths):
        time.sleep(_DUMP_POLL_S)
        for rank, path in paths.items():
            if rank not in written and _size(path) > sizes[rank]:
                written[rank] = path
    time.sleep(_DUMP_POLL_S)  # let the last dumps finish their few lines
    return written


def remove_empty_stack_dumps(layout: RunDir, session: str, attempt: int) -> None:
    """Each trainer opens its stack file at start: keep only those that hold a dump (and the
    attempt's folder only if one does). Only in the agent's own session's folder, only empty
    regular files (never a link's target)."""
    for path in glob.glob(layout.stack_dump(session, attempt, "*")):
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_size == 0:
                os.remove(path)
    with contextlib.suppress(OSError):
        os.rmdir(layout.stack_dir(session, attempt))  # only if empty


def exit_code(pcontext: Any, local_rank: int) -> int | None:
    """A trainer's exit code from torch's process context (negative: the signal); None while it
    runs or if unknown."""
    try:
        if hasattr(pcontext, "subprocess_handlers"):  # exec'd trainers
            code: int | None = pcontext.subprocess_handlers[local_rank].proc.poll()
            return code
        mp_code: int | None = pcontext._pc.processes[local_rank].exitcode
        return mp_code
    except (AttributeError, IndexError, KeyError):
        return None


def exit_codes(
    pcontext: Any, workers: list[Worker], exited: Collection[int]
) -> dict[int, int | None]:
    """Every trainer's exit code by local rank (None: running). A trainer seen to end (its pid in
    ``exited``) has a code a moment later, once its parent (the agent or the forkserver) has
    reaped it: wait that moment (briefly; past it, the next look will tell)."""
    deadline = time.monotonic() + _EXIT_CODE_WAIT_S
    while True:
        codes = {w.local_rank: exit_code(pcontext, w.local_rank) for w in workers}
        unknown = [w for w in workers if w.id in exited and codes[w.local_rank] is None]
        if not unknown or time.monotonic() > deadline:
            return codes
        time.sleep(0.002)


def settle_clean_exits(pcontext: Any, codes: Mapping[int, int | None]) -> None:
    """Count as finished the warm-started trainers that exited 0 without handing torch a result
    (``os._exit(0)``, often used to skip a hanging teardown, or ``sys.exit(256)``): as under
    ``python script.py`` or ``--cold-start``, exit 0 is success. torch's process context waits
    for every trainer's result, so without one it would wait for ever and the run never end."""
    results = getattr(pcontext, "_return_values", None)
    queues = getattr(pcontext, "_ret_vals", None)
    if not isinstance(results, dict) or not isinstance(queues, Mapping):
        return  # exec'd trainers: exit 0 is torch's success already
    for local_rank, code in codes.items():
        if code != 0 or local_rank in results:
            continue
        queue = queues.get(local_rank)
        if queue is not None and not queue.empty():
            continue  # its result is there: torch reads it at its next look
        results[local_rank] = None


def wait_for_exit_codes(
    pcontext: Any, workers: Iterable[Worker], pids: Collection[int], timeout_s: float
) -> None:
    """Wait up to ``timeout_s`` until the trainers ``pids`` (SIGKILLed a moment ago) have an
    exit code: their parent must reap them first, which a loaded machine may take a while to
    do, and a failure's report must name them as stopped rather than leave them out."""
    waiting = [w for w in workers if w.id in pids]
    deadline = time.monotonic() + timeout_s
    while any(exit_code(pcontext, w.local_rank) is None for w in waiting):
        if time.monotonic() > deadline:
            return
        time.sleep(0.005)


def last_error(pcontext: Any, local_rank: int, failure: ProcessFailure | None) -> str | None:
    """A failed trainer's own error: its error file, or the last line of its stderr log."""
    message: Any = failure.message if failure is not None else None
    while isinstance(message, dict):  # error files nest {"message": {"message": ...}}
        message = message.get("message")
    if isinstance(message, str) and message and not message.startswith("To enable traceback"):
        return message.strip().splitlines()[-1][:500]
    stderr = pcontext.stderrs.get(local_rank) if pcontext is not None else None
    if stderr and os.path.isfile(stderr):
        with open(stderr, "rb") as f:
            f.seek(max(0, os.path.getsize(stderr) - 8192))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        if lines:
            return _exception_line(lines)[:500]
    return None


def _exception_line(lines: list[str]) -> str:
    """The error a log's tail shows: the exception line of its last traceback (what follows the
    frames; lines logged after it, such as an exit-time warning, are not the error), or else
    its last line."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call")]
    if starts:
        for line in lines[starts[-1] + 1 :]:
            if not line.startswith((" ", "\t")):
                return line
    return lines[-1]


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R running, S sleeping, T stopped, D disk ...)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1
