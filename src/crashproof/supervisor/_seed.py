"""The trainers' warm forkserver, forked from the agent rather than started as a new interpreter.

multiprocessing starts a forkserver as a fresh ``python -c ...``, which imports torch again: 2 to
2.5 s of CPU on a small machine, paid by every ``crashproof run`` a second time, since the agent
imported torch already. So the agent forks a *seed* as soon as its own imports are done, before
it starts a thread, configures logging or touches a device: a process holding torch, which
imports what the trainers need while the agent meets the other nodes, then waits.
When the first trainer is to start, multiprocessing's ``ensure_running`` (replaced here) hands
the seed what a fresh forkserver would have been given at that moment: the environment, the
working directory, the listening socket, the alive pipe and the modules to preload. The seed takes
them, closes everything else it inherited, and runs multiprocessing's own forkserver loop; from
then on nothing tells the two apart.

What a fresh interpreter reads from its environment at start-up, and a forked one read earlier
(OpenMP's thread count, which libgomp takes when torch loads), is set again from the environment
handed over. MKL reads its settings at its first call, which the agent never makes.

No seed (the forkserver starts fresh, as multiprocessing starts it) when the agent has a thread
of its own or has initialized CUDA already, where this Python's forkserver takes other arguments,
and for a forkserver started again after the first one died.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["plant_forkserver_seed", "python_default"]

_HEADER = struct.Struct("!Q")  # the length of the hand-over (JSON) that follows it
_FORKSERVER_MAIN = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def plant_forkserver_seed() -> int | None:
    """Fork the seed and have multiprocessing's forkserver start from it; its pid, or None where
    the forkserver will start fresh (see the module's docstring)."""
    import multiprocessing.forkserver

    import torch

    main = multiprocessing.forkserver.main
    if list(inspect.signature(main).parameters) != _FORKSERVER_MAIN:
        return None  # another Python's forkserver: it is started as that Python starts it
    cuda_in_use = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if threading.active_count() > 1 or cuda_in_use:
        return None  # a fork would copy a lock another thread holds, or a CUDA context
    agent_side, seed_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env_at_fork = dict(os.environ)
    for stream in (sys.stdout, sys.stderr):  # what is buffered is the agent's to write, once
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    pid = os.fork()
    if pid == 0:  # the seed
        code = 1
        try:
            agent_side.close()
            code = _grow(seed_side, env_at_fork)
        except KeyboardInterrupt:  # (a Ctrl-C to the agent's process group, while it waits)
            pass
        except BaseException:  # a failure of its own, on the agent's stderr; started fresh
            traceback.print_exc()
        finally:
            os._exit(code)  # never the agent's exit handlers
    seed_side.close()
    _start_forkservers_from(_Seed(agent_side, pid))
    return pid


class _Seed:
    """The agent's end of one seed: used once, for the first forkserver."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock: socket.socket | None = sock
        self.pid = pid

    def hand_over(self, what: dict[str, Any], fds: list[int]) -> bool:
        """Send the seed what it needs to become the forkserver; False if it cannot take it
        (gone, or used already)."""
        sock, self._sock = self._sock, None
        if sock is None:
            return False
        try:
            payload = json.dumps(what).encode()
            message = _HEADER.pack(len(payload)) + payload
            with sock:  # (the descriptors go with the first part)
                sent = socket.send_fds(sock, [message], fds)
                if sent < len(message):
                    # (Never ``sendall(b"")``: it still sends, and fails with EPIPE if the seed
                    # took the whole hand-over and closed its end meanwhile.)
                    sock.sendall(message[sent:])
        except (OSError, TypeError, ValueError) as exc:  # (a path JSON cannot hold: started fresh)
            log.info("the forkserver starts fresh: its seed could not be handed its start: %s", exc)
            return False
        return True


def _start_forkservers_from(seed: _Seed) -> None:
    """Replace multiprocessing's ``ensure_running`` (the method and the module's name for it) with
    one that makes the seed the forkserver when none runs yet."""
    import multiprocessing.forkserver as forkserver

    server: Any = forkserver._forkserver  # its private state: what its own methods set
    started_fresh = server.ensure_running

    def ensure_running() -> None:
        with server._lock:
            if server._forkserver_pid is None and _from_seed(server, seed):
                return
        started_fresh()

    server.ensure_running = ensure_running
    forkserver.ensure_running = ensure_running


def _from_seed(server: Any, seed: _Seed) -> bool:
    """What multiprocessing's ``ensure_running`` does to start a forkserver, the exec aside."""
    from multiprocessing import connection, resource_tracker, spawn, util

    resource_tracker.ensure_running()
    preload = list(server._preload_modules)
    data: dict[str, Any] = {}
    if preload:
        found = spawn.get_preparation_data("ignore")
        data = {key: found[key] for key in ("main_path", "sys_path") if key in found}
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        what = {"env": dict(os.environ), "cwd": os.getcwd(), "preload": preload, "data": data,
                "signals": _signals_an_exec_keeps()}  # fmt: skip
        try:
            handed = seed.hand_over(what, [listener.fileno(), alive_r])
        finally:
            os.close(alive_r)
        if not handed:
            os.close(alive_w)
            if not util.is_abstract_socket_namespace(address):
                with contextlib.suppress(OSError):
                    os.unlink(address)
            return False
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = seed.pid
    return True


# --- in the seed ------------------------------------------------------------------------------


def _grow(sock: socket.socket, env_at_fork: dict[str, str]) -> int:
    """Wait for the hand-over and become the forkserver; 0 when the agent ends without one."""
    from crashproof.link import die_with_parent

    die_with_parent(os.getppid())  # the agent
    # The trainers' own imports (torch._dynamo: a second of CPU) while the agent meets the other
    # nodes; none of them reads the environment the hand-over may still change.
    with contextlib.suppress(ImportError):  # (as the forkserver's preload: tried, not required)
        import crashproof.supervisor._entry  # noqa: F401
    received = _receive(sock)
    if received is None:
        return 0
    what, (listener_fd, alive_r) = received
    sock.close()
    _close_all_but(0, 1, 2, listener_fd, alive_r)
    os.environ.clear()
    os.environ.update(what["env"])
    os.chdir(what["cwd"])
    _take_signals(what["signals"])
    threads = what["env"].get("OMP_NUM_THREADS")
    if threads != env_at_fork.get("OMP_NUM_THREADS") and threads and threads.isdigit():
        import torch

        torch.set_num_threads(max(1, int(threads)))  # what libgomp read at start-up, anew
    from multiprocessing.forkserver import main

    try:
        main(listener_fd, alive_r, what["preload"], **what["data"])
    except SystemExit as exc:  # its end: the agent closed the alive pipe
        return exc.code if isinstance(exc.code, int) else 0
    return 0


def _signals_an_exec_keeps() -> dict[str, list[int]]:
    """What of this process's signal state a program it started now would inherit: the signals
    it ignores (an exec keeps those ignored, and resets the handled ones to their default) and
    the signals it blocks. A shell starts a background job with SIGINT ignored, for instance, and
    the agent then handles SIGINT: a fresh forkserver would start with Python's own SIGINT
    handler, while the seed, forked before, still ignores it."""
    ignored = []
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if signal.getsignal(sig) == signal.SIG_IGN:
                ignored.append(int(sig))
    blocked = [int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, [])]
    return {"ignored": ignored, "blocked": blocked}


def _take_signals(state: dict[str, list[int]]) -> None:
    """Give the seed the signal state a fresh interpreter exec'd by the agent now would have:
    the signals the agent ignores now, ignored; those the seed ignores only because the agent
    did at the fork, back to their default (python's own handler for SIGINT); python's own
    ignores kept (SIGPIPE, SIGXFSZ), and what the seed's imports set left as they set it. Then
    the agent's blocked signals blocked."""
    ignored = set(state["ignored"])
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):  # (one a process may not set: left)
            if sig in ignored:
                signal.signal(sig, signal.SIG_IGN)
            elif sig not in _PYTHON_IGNORES and signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, python_default(sig))
    signal.pthread_sigmask(signal.SIG_SETMASK, [signal.Signals(s) for s in state["blocked"]])


def python_default(sig: signal.Signals) -> Any:
    """The disposition a fresh interpreter starts ``sig`` with, when it did not inherit it
    ignored: python's own handler for SIGINT (KeyboardInterrupt), the system's default else."""
    return signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL


_PYTHON_IGNORES = {
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name)
}
"""What python ignores at its start, whatever it inherited."""


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The hand-over and its two descriptors; None at the end of the stream (the agent is done)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 2)
    if not data:
        return None
    while len(data) < _HEADER.size:
        more = sock.recv(1 << 16)
        if not more:
            return None
        data += more
    (size,) = _HEADER.unpack_from(data)
    payload = bytearray(data[_HEADER.size :])
    while len(payload) < size:
        more = sock.recv(size - len(payload))
        if not more:
            return None
        payload += more
    if len(fds) != 2:
        return None
    return json.loads(payload), fds


def _close_all_but(*keep: int) -> None:
    """Close every descriptor the agent had open at the fork but ``keep``, as the exec of a fresh
    forkserver would (multiprocessing passes it only these)."""
    kept = sorted(set(keep))
    low = 0
    for fd in kept:
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
