"""Helpers the benchmark scripts share (run from ``benchmarks/``: the scripts import it by name)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

__all__ = ["free_port", "start_moto_server"]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
