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

The token alone misses a program a trainer starts with an environment of its own
(``subprocess.Popen(cmd, env={...})``), which also gets no parent-death signal. So the trainers
run in sessions of the run's own: the warm forkserver's (it calls ``setsid`` when it starts, and
its trainers share it), or, cold-started, each trainer's (torch starts exec'd trainers so). The
agent tells the keeper the leaders' pids, the sessions' ids, as it starts each group (a line
``session <pid>`` on the keeper's stdin). At the end the keeper also kills every
process of those sessions, and every descendant of what it kills that is still linked to it by
its parent. A session is checked before it is used: one whose leader's pid now belongs to
another process (started later) is not the run's, and sessions of past attempts that hold no
process any more are forgotten when a new attempt starts, so a pid reused long after never
matches. What escapes: a process that leaves its session (``setsid``) *and* clears its
environment.

A run that ends normally tells the keeper first (a line ``end`` on its stdin): the run's
processes then get a moment to exit by themselves (the forkserver and multiprocessing's resource
tracker do, on their own pipes' end; a trainer may still be on its way out) before the keeper
ends what is left.

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
import stat
import subprocess
import sys
import time
from collections.abc import Collection, Iterable
from typing import IO, NamedTuple

__all__ = ["ENV_AGENT_TOKEN", "Keeper", "end_sessions", "session_leaders"]

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

    def watch_sessions(self, pids: Iterable[int | None]) -> None:
        """The processes ``pids`` lead the trainers' sessions (the forkserver, cold-started
        trainers; a pid that leads none matches nothing): the keeper ends what is left of those
        sessions too."""
        self._tell("".join(f"session {pid}\n" for pid in pids if pid))

    def release(self) -> None:
        """The run is ending normally: let the agent's processes exit before ending them."""
        self._tell("end\n")
        self._proc = None

    def _tell(self, lines: str) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or not lines:
            return
        try:
            proc.stdin.write(lines.encode())
            proc.stdin.flush()
        except OSError:
            pass  # the keeper is gone already: nothing to tell


def forkserver_pid() -> int | None:
    """The warm forkserver's pid, the leader of its trainers' session (None: none runs)."""
    import multiprocessing.forkserver

    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def session_leaders(pids: Iterable[int | None]) -> dict[int, int | None]:
    """The sessions led by ``pids`` (a session's id is its leader's pid), each with its leader's
    start time now: what :func:`end_sessions` checks a session against later."""
    leaders: dict[int, int | None] = {}
    for pid in pids:
        if pid:
            proc = _stat(pid)
            leaders[pid] = proc.start if proc is not None else None
    return leaders


def end_sessions(
    leaders: dict[int, int | None], spare: Iterable[int | None]
) -> tuple[list[int], bool]:
    """SIGKILL what is left in the trainers' sessions ``leaders`` (see :func:`session_leaders`)
    and its descendants, but ``spare`` (the warm forkserver, which leads its trainers' session
    and outlives them): between two attempts, what the failed attempt's trainers started must
    not run on beside the next one. Returns the pids killed, and whether every one is gone
    (False: some survived every SIGKILL for a while, stuck in the kernel)."""
    me, keep = os.getpid(), {pid for pid in spare if pid}
    sessions = _Sessions(leaders)
    killed: list[int] = []
    deadline = time.monotonic() + _KILL_ROUNDS_S
    while time.monotonic() < deadline:
        found = _marked(None, me, sessions, spare=keep)
        if not found:
            return killed, True
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.01)
    return killed, False


# -- the keeper process ---------------------------------------------------------------------------


class _Proc(NamedTuple):
    """What the keeper reads of a live process in ``/proc/<pid>/stat``."""

    ppid: int
    session: int
    start: int
    """Its start time (clock ticks since boot): a pid with another start time is another process."""


def _stat(pid: int | str) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None  # gone, or not readable
    if fields[0] in (b"Z", b"X"):
        return None  # a zombie is done
    return _Proc(ppid=int(fields[1]), session=int(fields[3]), start=int(fields[19]))


class _Sessions:
    """The trainers' sessions the agent named, each with its leader's start time when named."""

    def __init__(self, leaders: dict[int, int | None] | None = None) -> None:
        self._leaders: dict[int, int | None] = dict(leaders or {})
        self._batch: set[int] = set()
        self._partial = ""  # a line not yet complete

    def add(self, text: str) -> bool:
        """Take the agent's lines; returns whether one said the run ended normally."""
        *lines, self._partial = (self._partial + text).split("\n")
        words = [line.split() for line in lines]
        named = [int(w[1]) for w in words if len(w) == 2 and w[0] == "session" and w[1].isdigit()]
        if named:
            self._forget_empty(keep=set(named))
        for pid in named:
            proc = _stat(pid)
            self._leaders[pid] = proc.start if proc is not None else None
        return ["end"] in words

    def _forget_empty(self, keep: set[int]) -> None:
        """Forget the sessions of earlier batches that no process is in any more: their ids
        are free for the system to reuse. (The last batch's leaders may not have called setsid
        yet.)"""
        old = set(self._leaders) - self._batch
        if old:
            alive = {proc.session for proc in _processes(os.getpid()).values()}
            for sid in old - alive:
                del self._leaders[sid]
        self._batch = keep

    def ours(self, procs: dict[int, _Proc]) -> set[int]:
        """The sessions of ``procs`` that are still the ones the agent named: not a session
        whose leader's pid is now another process's."""
        found = set()
        for sid, start in self._leaders.items():
            leader = procs.get(sid)
            if leader is None or start is None or leader.start == start:
                found.add(sid)
        return found


def _processes(me: int) -> dict[int, _Proc]:
    """Every live process but ``me``."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            proc = _stat(name)
            if proc is not None:
                found[int(name)] = proc
    return found


def _carries(pid: int, token: bytes) -> bool:
    needle = b"\0" + ENV_AGENT_TOKEN.encode() + b"=" + token + b"\0"
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in b"\0" + f.read()
    except OSError:  # gone, or not ours
        return False


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _marked(
    token: bytes | None,
    me: int,
    sessions: _Sessions | None = None,
    spare: Collection[int] = (),
) -> dict[int, bytes]:
    """Live processes of the run, with their command lines: those whose environment carries
    ``token`` (if given), those in one of the trainers' ``sessions``, and every descendant of
    these; never ``spare`` (nor, through it, its descendants)."""
    procs = _processes(me)
    ours = sessions.ours(procs) if sessions is not None else set()
    found = {
        pid
        for pid, proc in procs.items()
        if proc.session in ours or (token is not None and _carries(pid, token))
    } - set(spare)
    children: dict[int, list[int]] = {}
    for pid, proc in procs.items():
        children.setdefault(proc.ppid, []).append(pid)
    todo = list(found)
    while todo:  # descendants still linked by their parent (a new session, a cleared environment)
        for child in children.get(todo.pop(), ()):
            if child not in found and child not in spare:
                found.add(child)
                todo.append(child)
    return {pid: _cmdline(pid) for pid in found}


def _wait_for(agent: int, stdin: IO[bytes], sessions: _Sessions) -> bool:
    """Return when process ``agent`` (this process's parent) has exited, taking in what it
    says meanwhile; returns whether it said the run ended normally."""
    try:
        pidfd = os.pidfd_open(agent)
    except (AttributeError, OSError):
        pidfd = -1
    fd = stdin.fileno()
    os.set_blocking(fd, False)
    ended, listening = False, True
    while os.getppid() == agent:
        watch = [f for f, on in ((pidfd, pidfd >= 0), (fd, listening)) if on]
        # without pidfds (Linux < 5.3) the parent is looked at every 50 ms
        ready, _, _ = select.select(watch, [], [], None if pidfd >= 0 else 0.05)
        if fd in ready:
            said, listening = _read(fd)
            ended = sessions.add(said) or ended
        if pidfd in ready:
            break
    return sessions.add(_read(fd)[0]) or ended  # what it wrote just before it went


def _read(fd: int) -> tuple[str, bool]:
    """What the agent wrote to this process's stdin since the last call, and whether the pipe
    is still open."""
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # nothing more for now (or a broken pipe)
            return b"".join(chunks).decode(errors="replace"), True
        if not chunk:
            return b"".join(chunks).decode(errors="replace"), False
        chunks.append(chunk)


def _stop(token: bytes, polite: bool, sessions: _Sessions | None = None) -> list[dict[str, object]]:
    """SIGKILL every process of the run until none is left; returns what was killed."""
    me = os.getpid()
    started = time.monotonic()
    helpers_wait_until = started + (_POLITE_WAIT_S if polite else 0.5)
    # After a normal end, the run's processes get a moment to exit by themselves: those that
    # carry the token, and those of the trainers' sessions (a trainer still on its way out
    # reads as neither once the kernel has released its memory: killing it would report it).
    while polite and _marked(token, me, sessions) and time.monotonic() < started + _POLITE_WAIT_S:
        time.sleep(0.05)
    killed: dict[int, bytes] = {}
    while time.monotonic() < started + _POLITE_WAIT_S + _KILL_ROUNDS_S:
        found = _marked(token, me, sessions)
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
        # as every writer of the log: appended to, never through a link or into a FIFO (the agent
        # checked it is its log when it started)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(events_path, flags, 0o644)
    except OSError:
        return
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
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
    sessions = _Sessions()
    polite = _wait_for(agent, sys.stdin.buffer, sessions)
    killed = _stop(token, polite, sessions)
    if killed:
        _report(events_path, agent, polite, killed)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
