"""The agent's keeper: when ``crashproof run`` dies, every process it started dies with it.

A SIGKILLed agent runs no code of its own, and the kernel's parent-death signal only reaches its
*children*: the trainers forked from the warm forkserver are the forkserver's children, a cold
trainer may be killed before it asks the kernel (it does so at ``import crashproof``), and a
DataLoader worker or any helper a trainer starts is further down still. Trainers left behind
train on alone, and a relaunched agent would start a second set writing the same root.

So the agent starts this small process first (this script run with ``python -I -S``, handed
over as an open file so that its command line names neither crashproof nor the run: it imports
nothing of crashproof or torch and is up in milliseconds), in a session of its own so that a
signal to the agent's process group does not reach it. Every process the agent starts after it
inherits a token in its environment (``CRASHPROOF_AGENT_TOKEN``; the kernel keeps a process's
initial environment in ``/proc/<pid>/environ``, and forked children share their parent's). The
keeper waits on a pidfd of the agent; when the agent is gone, it SIGKILLs every process that
carries the token, until none is left, and appends an ``orphans_stopped`` event naming them.

A run that ends normally tells the keeper first (a line on its stdin): the processes then get a
moment to exit by themselves (the forkserver and multiprocessing's resource tracker do, on their
own pipes' end) before the keeper ends what is left.

The parent-death signals set along the way (the forkserver with the agent, trainers with the
forkserver, a trainer's forked children with the trainer) stay: they also hold when the keeper
itself is killed together with the agent (``kill -9 -- -PGID``), but only for processes forked
from a Python process of the run: a program a trainer starts by exec (``subprocess``, a DataLoader
with the ``spawn`` start method) gets no parent-death signal, and only the keeper ends it. What
escapes both: such a program when the keeper is killed too, and a process that clears its
environment and moves out from under its parent (``env -i`` and ``setsid``).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from typing import IO

__all__ = ["ENV_AGENT_TOKEN", "Keeper"]

ENV_AGENT_TOKEN = "CRASHPROOF_AGENT_TOKEN"
"""Set by ``crashproof run`` for every process it starts: the processes its keeper ends."""

_ENV_EVENTS = "CRASHPROOF_KEEPER_EVENTS"
"""The keeper's own: where it appends its ``orphans_stopped`` event."""
_POLITE_WAIT_S = 2.0
"""After a normal end, how long the agent's processes get to exit by themselves."""
_KILL_ROUNDS_S = 5.0
"""How long the keeper keeps finding and killing (a process may fork while it is being killed)."""
_HELPERS = (b"multiprocessing.resource_tracker",)
"""Processes that exit by themselves once every holder of their pipe is gone (after cleaning
up shared memory): ended last, after a moment."""


class Keeper:
    """The agent's side: start the keeper (before any other process), release it at the end."""

    def __init__(self, events_path: str) -> None:
        self.token = secrets.token_hex(8)
        os.environ[ENV_AGENT_TOKEN] = self.token
        # The script is handed over as an open file (/dev/fd/N) and the events path in the
        # environment, so the keeper's command line names neither crashproof nor the run: a
        # `pkill -f crashproof` meant for the job leaves the keeper to end what it started.
        script = os.open(__file__, os.O_RDONLY)
        try:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-I", "-S", f"/dev/fd/{script}", str(os.getpid()), self.token],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(script,),
                env={**os.environ, _ENV_EVENTS: events_path},
            )
        finally:
            os.close(script)

    def release(self) -> None:
        """The run is ending normally: let the agent's processes exit before ending them."""
        proc, self._proc = self._proc, None
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(b"end\n")
            proc.stdin.flush()
        except OSError:
            pass  # the keeper is gone already: nothing to tell


# -- the keeper process ---------------------------------------------------------------------------


def _marked(token: bytes, me: int) -> dict[int, bytes]:
    """Live processes whose environment carries ``token``, with their command lines."""
    needle = b"\0" + ENV_AGENT_TOKEN.encode() + b"=" + token + b"\0"
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # gone, or not ours
            continue
        if needle in b"\0" + environ:  # a zombie's environment reads empty: it is done
            found[int(name)] = cmdline
    return found


def _wait_for(agent: int) -> None:
    """Return when process ``agent`` (this process's parent) has exited."""
    try:
        pidfd = os.pidfd_open(agent)
    except (AttributeError, OSError):
        pidfd = -1
    if os.getppid() != agent:
        return  # gone already (perhaps before the pidfd was opened)
    if pidfd >= 0:
        select.select([pidfd], [], [])
        return
    while os.getppid() == agent:  # no pidfds (Linux < 5.3): look every 50 ms
        time.sleep(0.05)


def _told_to_end(stdin: IO[bytes]) -> bool:
    """Whether the agent said, before it went, that the run ended normally."""
    os.set_blocking(stdin.fileno(), False)
    try:
        return bool(stdin.read())  # None: nothing written; b"": closed without a word
    except OSError:
        return False


def _stop(token: bytes, polite: bool) -> list[dict[str, object]]:
    """SIGKILL every process carrying ``token`` until none is left; returns what was killed."""
    me = os.getpid()
    started = time.monotonic()
    helpers_wait_until = started + (_POLITE_WAIT_S if polite else 0.5)
    if polite:
        while _marked(token, me) and time.monotonic() < started + _POLITE_WAIT_S:
            time.sleep(0.05)
    killed: dict[int, bytes] = {}
    while time.monotonic() < started + _POLITE_WAIT_S + _KILL_ROUNDS_S:
        found = _marked(token, me)
        if not found:
            break
        for pid, cmd in found.items():
            if any(h in cmd for h in _HELPERS) and time.monotonic() < helpers_wait_until:
                continue  # it exits by itself (cleaning up) once the others are gone
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
            killed.setdefault(pid, cmd)
        time.sleep(0.01)
    return [
        {"pid": pid, "cmd": cmd.replace(b"\0", b" ").decode(errors="replace").strip()[:200]}
        for pid, cmd in killed.items()
    ]


def _report(events_path: str, agent: int, polite: bool, killed: list[dict[str, object]]) -> None:
    record = {
        "ts": round(time.time(), 6),
        "event": "orphans_stopped",
        "node": os.uname().nodename,
        "agent_pid": agent,
        "agent_ended": "normally" if polite else "died",
        "processes": killed,
    }
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    try:
        fd = os.open(events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _main(argv: list[str]) -> int:
    agent, token, events_path = int(argv[1]), argv[2].encode(), os.environ[_ENV_EVENTS]
    # Signals meant for the run (a terminal's Ctrl-C, a scheduler's SIGTERM to the session) are
    # the agent's to handle; the keeper's work starts when the agent is gone.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGPIPE):  # fmt: skip
        signal.signal(sig, signal.SIG_IGN)
    _wait_for(agent)
    polite = _told_to_end(sys.stdin.buffer)
    killed = _stop(token, polite)
    if killed:
        _report(events_path, agent, polite, killed)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
