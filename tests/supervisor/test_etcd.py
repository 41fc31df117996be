"""``crashproof run`` with an etcd rendezvous, against a real etcd server started by the test.

torch's etcd backends speak etcd's v2 API (through python-etcd): the server runs with
``--enable-v2`` (etcd 3.4/3.5; Debian's ``etcd-server``, which ``make test`` installs).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from crashproof.telemetry import read_events
from tests.conftest import free_port

TRAINER = Path(__file__).with_name("trainer.py")


@pytest.fixture(scope="module")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for the module: each test rendezvouses under its own ``--rdzv-id``."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no etcd binary: install Debian's etcd-server (make test does, as root)")
    pytest.importorskip("etcd", reason="python-etcd is needed by torch's etcd rendezvous")
    client, peer = free_port(), free_port()
    tmp_path = tmp_path_factory.mktemp("etcd")
    log = open(tmp_path / "etcd.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [
            binary,
            "--enable-v2",
            "--data-dir",
            str(tmp_path / "etcd-data"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{client}/v2/keys", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(
                        f"etcd did not start: {(tmp_path / 'etcd.log').read_text()[-2000:]}"
                    )
                time.sleep(0.2)
        yield f"127.0.0.1:{client}"
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd"])
def test_two_nodes_rendezvous_through_etcd_and_recover_from_a_failure(
    tmp_path: Path, etcd_endpoint: str, backend: str
) -> None:
    ckpt = tmp_path / "ckpt"
    nodes = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        command = [
            sys.executable, "-m", "crashproof.cli", "run",
            "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "3",
            "--rdzv-backend", backend, "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", f"job-{backend}",
            "--run-dir", str(run_dir),
            str(TRAINER), "--ckpt", str(ckpt), "--steps", "20", "--fail-at", "12", "--fail-attempts", "1",
        ]  # fmt: skip
        nodes.append(
            (
                run_dir,
                subprocess.Popen(
                    command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                ),
            )
        )
    outputs = []
    for _, proc in nodes:
        try:
            out, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        outputs.append(out)
        assert proc.returncode == 0, out
    events = [e for run_dir, _ in nodes for e in read_events(run_dir / "events.jsonl")]
    assert {e["world_size"] for e in events if e["event"] == "rank_start"} == {2}
    assert sorted(e["rank"] for e in events if e["event"] == "rank_start") == [0, 0, 1, 1]
    [restore] = [e for e in events if e["event"] == "restore"]
    assert restore["step"] == 10
    assert "rank 1 finished at step 20" in "".join(outputs)
