"""The trainers' forkserver forked from the agent (:mod:`crashproof.supervisor._seed`) starts as
a fresh one would have at the moment it is needed.

Each case is a real program (an agent's stand-in) that plants the seed with a file open, then
changes what a forkserver started later would have seen (environment, working directory,
OpenMP's threads as torchrun sets them), then starts a real process through multiprocessing's
forkserver. That process reports what it found. The warm start of a whole ``crashproof run`` is
checked against a cold one in ``test_run.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from crashproof.supervisor._seed import _Seed
from tests.warm_ranks import python

PROBE = """
import os, signal, torch

def probe(queue):
    fds = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")}
    queue.put({"parent": os.getppid(), "late": os.environ.get("LATE"), "cwd": os.getcwd(),
               "threads": torch.get_num_threads(), "fds": sorted(fds),
               "big": sum(len(v) for k, v in os.environ.items() if k.startswith("BIG")),
               "sigquit": repr(signal.getsignal(signal.SIGQUIT)),
               "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))})
"""

AGENT = """
import atexit, json, multiprocessing, multiprocessing.forkserver, os, sys
sys.path.insert(0, sys.argv[1])
atexit.register(print, "the agent's exit handler")
from crashproof.supervisor._seed import plant_forkserver_seed

kept_open = open(os.path.join(sys.argv[1], "agent-file"), "w")  # open when the seed forks
seed = plant_forkserver_seed()
assert seed is not None
os.environ["LATE"] = "set after the fork"
for i in range(4):  # larger than the socket's buffer: the seed reads the hand-over in parts
    os.environ[f"BIG{i}"] = "x" * 100_000
os.environ["OMP_NUM_THREADS"] = "1"
os.chdir(sys.argv[2])
import signal
signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # ignored and blocked after the fork: an exec
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # would pass both on
multiprocessing.set_forkserver_preload(["json"])
context = multiprocessing.get_context("forkserver")
queue = context.Queue()
import probe
child = context.Process(target=probe.probe, args=(queue,))
child.start()
found = queue.get(timeout=60)
child.join(60)
found["seed"] = seed
found["forkserver"] = multiprocessing.forkserver._forkserver._forkserver_pid
print(json.dumps(found))
"""


def test_the_forkserver_grown_from_the_seed_sees_the_agent_as_it_is_when_the_trainers_start(
    tmp_path: Path,
) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    later = tmp_path / "later"
    later.mkdir()
    done = python(["-c", AGENT, str(tmp_path), str(later)], env={**os.environ}, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    found = json.loads(lines[0])
    # the forkserver is the seed, and the process came from it
    assert found["forkserver"] == found["seed"] == found["parent"]
    # what changed after the fork reached it: environment, directory, OpenMP's threads
    assert found["late"] == "set after the fork" and found["cwd"] == str(later)
    assert found["threads"] == 1 and found["big"] == 400_000
    # the signals the agent ignored and blocked by then, as a forkserver exec'd then would have
    assert found["sigquit"] == repr(signal.SIG_IGN) and int(signal.SIGUSR2) in found["blocked"]
    # a file the agent had open at the fork is closed, as it is in a fresh forkserver
    assert str(tmp_path / "agent-file") not in found["fds"]
    # the agent's exit handlers ran once: in the agent, never in the seed or the forkserver
    assert lines[1:] == ["the agent's exit handler"]


SPARE_SEED = """
import os, sys, threading, time
from crashproof.supervisor._seed import plant_forkserver_seed

seed = plant_forkserver_seed()
print(seed, flush=True)
stop = threading.Event()
threading.Thread(target=stop.wait).start()
print(plant_forkserver_seed(), flush=True)  # a thread runs: forking now could copy a held lock
stop.set()
"""


def test_a_seed_never_handed_a_start_ends_with_the_agent_and_none_is_planted_beside_a_thread() -> (
    None
):
    done = python(["-c", SPARE_SEED], timeout=120)
    assert done.returncode == 0, done.stderr
    seed, beside_a_thread = done.stdout.split()
    assert beside_a_thread == "None"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{seed}").exists() and _state(int(seed)) != "Z":
        assert time.monotonic() < deadline, f"the seed {seed} outlived its agent by 10 s"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


DEAD_SEED = """
import json, multiprocessing, multiprocessing.forkserver, os, signal, sys
from crashproof.supervisor._seed import plant_forkserver_seed

seed = plant_forkserver_seed()
os.kill(seed, signal.SIGKILL)
os.waitpid(seed, 0)
multiprocessing.set_forkserver_preload(["json"])
context = multiprocessing.get_context("forkserver")
child = context.Process(target=os.getpid)
child.start()
child.join(60)
print(json.dumps({"seed": seed, "exitcode": child.exitcode,
                  "forkserver": multiprocessing.forkserver._forkserver._forkserver_pid}))
"""


def test_a_seed_gone_before_its_hand_over_leaves_the_forkserver_to_start_fresh() -> None:
    done = python(["-c", DEAD_SEED], timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["exitcode"] == 0 and found["forkserver"] not in (None, found["seed"])


def test_a_hand_over_the_seed_took_whole_and_closed_at_once_was_handed() -> None:
    """A hand-over larger than the socket's buffer: the agent's send ends only as the seed reads
    the last part, and here the seed closes its end the moment it has it all. That close once made
    the agent take the hand-over for failed (a zero-length send after the whole message, refused
    with EPIPE): the forkserver started fresh while the seed, handed everything, ended. The race is
    made likely: both on one CPU, the agent at the lowest priority, so the seed runs first."""
    what = {"env": {f"BIG{i}": "x" * 100_000 for i in range(4)}, "cwd": "/", "preload": []}
    size = len(json.dumps(what)) + 8  # (and the length before it)
    cpu = min(os.sched_getaffinity(0))
    for attempt in range(20):
        agent_side, seed_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        seed = _forked(partial(_take_all, seed_side, size), cpu, close=agent_side)
        agent = _forked(partial(_hand_over, agent_side, seed, what), cpu, close=seed_side, nice=19)
        agent_side.close()
        seed_side.close()
        for pid, who in ((agent, "agent"), (seed, "seed")):
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            assert code == 0, f"attempt {attempt}: the {who} ended with {code}"


def _forked(run: Callable[[], bool], cpu: int, *, close: socket.socket, nice: int = 0) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            close.close()
            os.sched_setaffinity(0, {cpu})
            os.nice(nice)
            code = 0 if run() else 2
        finally:
            os._exit(code)
    return pid


def _take_all(sock: socket.socket, size: int) -> bool:
    """The seed: read the hand-over as fast as it comes, then close at once."""
    first, fds, _flags, _address = socket.recv_fds(sock, size, 2)
    left = size - len(first)
    while left > 0:
        left -= len(sock.recv(left)) or left
    sock.close()
    return len(fds) == 2


def _hand_over(sock: socket.socket, seed: int, what: dict[str, Any]) -> bool:
    read_end, write_end = os.pipe()
    return _Seed(sock, seed).hand_over(what, [read_end, write_end])
