"""Shared fixtures: paths to the repository's examples and a helper to run them as real processes."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
# The benchmarks' scripts import their helpers by name (they run from benchmarks/); tests that
# use a benchmark at test size, or its helpers, import them the same way.
sys.path.insert(0, str(REPO / "benchmarks"))


def run_python(
    args: list[str], *, timeout: float = 120, check: bool = True, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` as a process of its own (forked from a warm interpreter,
    :func:`tests.warm_ranks.python`); fails the test with its output if it does."""
    from tests.warm_ranks import python

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = python(args, env=env, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(
            f"python {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def step_records(log: Path) -> dict[int, Any]:
    """The last record of each step in a step log (``train_tiny.py --step-log``): a resumed run
    recomputes the steps after its checkpoint, and its later record is the one that counts."""
    records: dict[int, Any] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return records


@pytest.fixture(autouse=True)
def _no_crashproof_environment_leaks() -> Iterator[None]:
    """A test must leave no ``CRASHPROOF_*`` variable behind in this process: the processes
    later tests start inherit it (an agent's memory socket, a node's name) and would act on it."""
    before = {k: v for k, v in os.environ.items() if k.startswith("CRASHPROOF_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("CRASHPROOF_")}
    if after != before:
        for key in after.keys() - before.keys():
            del os.environ[key]
        os.environ.update(before)
        pytest.fail(f"the test left crashproof's environment changed: {before} -> {after}")


@pytest.fixture
def memory_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The memory host ``crashproof run``'s agent runs, in this process, its address set for
    the managers the test makes (as it is for a supervised trainer)."""
    from crashproof.link import ENV_MEMORY_SOCKET
    from crashproof.supervisor._memory_host import MemoryHost
    from crashproof.telemetry import EventLog

    host = MemoryHost(EventLog(tmp_path / "memory-events.jsonl"))
    monkeypatch.setenv(ENV_MEMORY_SOCKET, host.address)
    yield host
    host.close()


@pytest.fixture
def metadata(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A local server answering like the AWS, GCP and Azure metadata services, used by
    crashproof through ``CRASHPROOF_METADATA_URL``."""
    from tests.metadata_server import MetadataServer

    server = MetadataServer(lead_s=90)
    monkeypatch.setenv("CRASHPROOF_METADATA_URL", server.url)
    yield server
    server.close()


def warm_context() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver, preloaded with torch and crashproof: the processes a test
    starts with it are forked from one server per test worker that imported them once, instead
    of importing torch again each (as "spawn" does, 1.5 to 2 s of CPU per process). Like spawn,
    a child runs only what it is given, in a fresh state; unlike spawn, it inherits the
    environment the server started with, not the test's: pass what a child needs as arguments.
    (Started without crashproof's own variables, whatever the test that starts it has set.)"""
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "crashproof"])
    context = multiprocessing.get_context("forkserver")
    ours = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("CRASHPROOF_")}
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.update(ours)
    return context


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_server(s3_server_process: subprocess.Popen[bytes]) -> str:
    """A real S3-protocol server on loopback (moto's standalone server, its own process), set up
    the way a user points tools at S3: ``AWS_ENDPOINT_URL`` and credentials in the environment."""
    return os.environ["AWS_ENDPOINT_URL"]


@pytest.fixture(scope="session")
def s3_server_process() -> Iterator[subprocess.Popen[bytes]]:
    """The process behind :func:`s3_server` (to freeze it with SIGSTOP, as a hung store)."""
    import time

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"moto's S3 server did not start on {url}")
            time.sleep(0.1)
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    os.environ.update(
        AWS_ENDPOINT_URL=url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        yield proc
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


_S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@pytest.fixture(scope="session")
def warm_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Ranks of gloo jobs forked from one process that imported torch once
    (:mod:`tests.warm_ranks`); one per test worker, ended with the session."""
    from tests.warm_ranks import WarmRanks

    launcher = WarmRanks(tmp_path_factory.mktemp("warm_ranks"))
    yield launcher
    launcher.close()
