"""Helpers the benchmark scripts share (run from ``benchmarks/``: the scripts import it by name)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

import crashproof as cp
from crashproof.storage import LocalStorage, ReadStream

if TYPE_CHECKING:
    from crashproof.supervisor._memory_host import MemoryHost

__all__ = [
    "CountingStorage",
    "CountingStream",
    "agent_memory",
    "busy_cpu_s",
    "draw_kills",
    "free_port",
    "gib_of_weights",
    "gib_of_weights_arguments",
    "print_result",
    "start_moto_server",
    "wait_until",
]


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy since boot (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``condition`` every 50 ms until it holds; RuntimeError naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_moto_server() -> subprocess.Popen[bytes]:
    """moto's standalone S3 server on loopback, in its own process, reached the way a user
    reaches S3: ``AWS_ENDPOINT_URL`` and credentials in this process's environment."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit("moto's S3 server did not start") from None
            time.sleep(0.1)
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return proc


def draw_kills(rng: random.Random, mtbf_s: float, horizon_s: float) -> list[tuple[float, int]]:
    """(seconds after launch, rank of 2) of each SIGKILL before ``horizon_s``: exponential gaps
    of mean ``mtbf_s``, drawn from ``rng``."""
    at, kills = 0.0, []
    while True:
        at += rng.expovariate(1.0 / mtbf_s)
        if at >= horizon_s:
            return kills
        kills.append((at, rng.randrange(2)))


class CountingStream:
    def __init__(self, stream: ReadStream, path: str, counts: Counter[str]) -> None:
        self._stream, self._path, self._counts = stream, path, counts

    def size(self) -> int:
        return self._stream.size()

    def readinto(self, offset: int, buf: memoryview, /) -> None:
        self._stream.readinto(offset, buf)
        self._counts[self._path] += buf.nbytes

    def close(self) -> None:
        self._stream.close()


class CountingStorage(LocalStorage):
    """Local files, counting the bytes read from each (``counts``, by path)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def open(self, path: str) -> ReadStream:
        return CountingStream(super().open(path), path, self.counts)


def gib_of_weights(gib: float, tensors: int) -> tuple[cp.TrainState, int]:
    """A model of ``gib`` GiB of float32 weights in ``tensors`` square layers, and its bytes."""
    side = int((gib * 2**30 / 4 / tensors) ** 0.5)
    layers = [nn.Linear(side, side, bias=False) for _ in range(tensors)]
    return cp.TrainState(model=nn.Sequential(*layers)), tensors * side * side * 4


@contextlib.contextmanager
def agent_memory(prefix: str, directory: str) -> Iterator[tuple[Path, MemoryHost]]:
    """A scratch directory under ``directory`` and, in this process, the memory host that
    ``crashproof run``'s agent runs, its address set for the managers made meanwhile (as for a
    supervised trainer); the host closed and the directory removed at the end."""
    from crashproof.link import ENV_MEMORY_SOCKET
    from crashproof.supervisor._memory_host import MemoryHost
    from crashproof.telemetry import EventLog

    work = Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
    host = MemoryHost(EventLog(work / "events.jsonl"))
    os.environ[ENV_MEMORY_SOCKET] = host.address
    try:
        yield work, host
    finally:
        host.close()
        os.environ.pop(ENV_MEMORY_SOCKET, None)
        shutil.rmtree(work, ignore_errors=True)


def gib_of_weights_arguments(
    description: str,
    gib: float,
    extra: Sequence[tuple[str, str, str]] = (),
) -> argparse.Namespace:
    """The options of a benchmark over :func:`gib_of_weights`: ``--gib``, ``--tensors``,
    ``--runs``, and ``--json`` / ``--markdown`` for :func:`print_result`; ``extra``: more text
    options, as (name, default, help)."""
    p = argparse.ArgumentParser(description=description)
    for name, default, meaning in extra:
        p.add_argument(name, default=default, help=meaning)
    p.add_argument("--gib", type=float, default=gib)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    if args.runs < 1 or args.gib <= 0 or args.tensors < 1:
        p.error("--runs and --tensors must be at least 1, --gib above 0")
    return args


def print_result(
    result: dict[str, Any], args: argparse.Namespace, markdown: Callable[[dict[str, Any]], str]
) -> None:
    """The result as JSON (``--json``) and as markdown (``--markdown``, or when no JSON)."""
    if args.json:
        print(json.dumps(result, indent=2))
    if args.markdown or not args.json:
        print(markdown(result))
