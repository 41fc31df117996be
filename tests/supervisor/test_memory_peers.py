"""A lost node's snapshots come back from its peers' memory: two ``crashproof run`` agents on
this machine as two nodes (c10d on loopback), each copying its trainers' snapshots to the other.

Node B (its agent and its trainer) is SIGKILLed mid-run and a new agent takes its place. No
checkpoint was ever written to disk: the run can only go on from the copies of B's snapshots that
A's agent holds. It must, and end bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from crashproof.telemetry import read_events
from tests.conftest import EXAMPLES, free_port
from tests.integrations.launch import finish, start

TRAIN = ["--steps", "60", "--workers", "0", "--batch-size", "8", "--every", "100000",
         "--memory-every", "5", "--staging-buffers", "2"]  # fmt: skip


def _node(
    run_dir: Path,
    port: int,
    ckpt: Path,
    dump: Path,
    nodes: int,
    *options: str,
    step_s: float = 0.1,
    train: list[str] = TRAIN,
) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nnodes", str(nodes), "--nproc-per-node", "1",
        *options,
        "--max-restarts", "5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "peers-test", "--run-dir", str(run_dir), "--metrics-port", "-1",
        str(EXAMPLES / "train_tiny.py"), "--run-dir", str(ckpt), *train, "--step-s", str(step_s),
        "--dump", str(dump),
    ]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - the process keeps it
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def _started(first: subprocess.Popen[str], run_dir: Path) -> None:
    """Wait for node 0's agent to start: it hosts the rendezvous store (c10d), which the other
    nodes join and which must outlive them."""
    deadline = time.monotonic() + 60
    while not _events(run_dir):
        assert time.monotonic() < deadline and first.poll() is None, "node 0 did not start"
        time.sleep(0.1)


def _kill(nodes: list[subprocess.Popen[str]]) -> None:
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(30)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return list(read_events(path)) if path.exists() else []


def _has(run_dir: Path, event: str) -> bool:
    return any(e["event"] == event for e in _events(run_dir))


def _wait_for(done: Any, nodes: list[subprocess.Popen[str]], what: str) -> None:
    deadline = time.monotonic() + 150
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(n.poll() is None for n in nodes), f"a node ended early, waiting for {what}"
        time.sleep(0.1)


def _step_reached(*run_dirs: Path) -> int:
    steps = [e.get("step", 0) for d in run_dirs for e in _events(d) if e["event"] == "progress"]
    return max(steps, default=0)


@pytest.mark.parametrize(
    ("nodes", "spare"),
    # (Two nodes with a new node after the loss: the 3-node case's path with the spare's copies.)
    [(3, False), (2, True)],
    ids=["3-nodes-parity-new-node", "2-nodes-copies-hot-spare"],
)
def test_a_lost_node_resumes_from_its_peers_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: int, spare: bool
) -> None:
    """Two nodes keep a whole copy of each other's snapshots; three keep XOR parity (the
    default from three nodes on), and the lost node's are rebuilt from it. The node that takes
    the lost one's place is started after the loss, or was waiting as a hot spare.

    With the spare, each node also writes checkpoints to a disk of its own (node-local roots),
    and the spare comes with an empty one (the lost node's disk went with it): the restore still
    reads nothing from disk, and the checkpoints after it commit on every node's disk again."""
    # One thread per trainer in both runs (torchrun gives one only to several trainers per
    # node): the same kernels' reduction order, so the runs may be compared bit for bit.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port = free_port()
    ckpt, dump = tmp_path / "ckpt", tmp_path / "b.st"
    dirs = [tmp_path / f"node{i}" for i in range(nodes)]
    replacement = tmp_path / "replacement"
    clean = start("train_tiny.py", tmp_path / "clean", "--run-dir", str(tmp_path / "clean"),
                  *TRAIN, "--dump", str(tmp_path / "a.st"),
                  options=["--nproc-per-node", str(nodes)])  # fmt: skip
    pool = ["--standby", "1"] if spare else []
    step_s = 0.3 if spare else 0.1  # (time for a spare to start, under a loaded test machine)
    # With the spare: --every 10 (disk checkpoints), each node on its own disk.
    train = [*TRAIN[:-5], "10", *TRAIN[-4:], "--root-scope", "node"] if spare else TRAIN
    assert TRAIN[-6:-4] == ["--every", "100000"]  # (the option the spare's run changes)

    def disk(where: Path) -> Path:  # the spare's run: one disk per node; else one shared root
        return tmp_path / f"disk-{where.name}" if spare else ckpt

    def node(where: Path, *options: str) -> subprocess.Popen[str]:
        return _node(where, port, disk(where), dump, nodes, *options, step_s=step_s, train=train)

    started = [node(dirs[0], *pool)]
    try:
        _started(started[0], dirs[0])
        started += [node(d, *pool) for d in dirs[1:]]
        if spare:  # once the round is full (every node's trainer started), a spare waits beside
            _wait_for(lambda: all(_has(d, "rank_start") for d in dirs), started, "training")
            started.append(node(replacement, *pool))
            _wait_for(lambda: _has(replacement, "standby"), started, "the spare to wait")
        _wait_for(lambda: _step_reached(*dirs) >= 25, started, "the nodes to train")
        assert _step_reached(*dirs) < 55, "the run nearly ended before the loss"
        os.killpg(started[1].pid, signal.SIGKILL)  # node 1: its agent and its trainer at once
        started[1].wait(30)
        if not spare:  # a new node in its place
            started.append(node(replacement))
        for node, where in [*zip(started, dirs, strict=False), (started[-1], replacement)]:
            if node is not started[1]:
                assert node.wait(180) == 0, (where.with_suffix(".log")).read_text()[-3000:]
    finally:
        _kill(started)
    code, _, output = finish(clean)
    assert code == 0, output[-3000:]
    survivors = [d for d in dirs if d != dirs[1]]
    if spare:  # the newest checkpoint on every node's own disk, the new node's too
        manifests = {
            (disk(d) / "checkpoints" / "step_0000000060" / "manifest.json").read_bytes()
            for d in (*survivors, replacement)
        }
        assert len(manifests) == 1
    else:
        assert not any(p.name.startswith("step_") for p in (ckpt / "checkpoints").iterdir())
    restores = [e for d in (*survivors, replacement) for e in _events(d) if e["event"] == "restore"]
    assert [e["kind"] for e in restores] == ["peer"], restores
    assert restores[0]["step"] >= 20 and restores[0]["bytes"] > 0
    # The survivor's agent checked its own snapshots once its trainer had stopped; the new
    # node's, the copies it fetched (when it fetched them ahead of its trainer's hello).
    assert restores[0]["verified_by"] == "agent", restores
    fetched_checks = [e for e in _events(replacement) if e["event"] == "memory_checked"]
    assert all(e["snapshots"] >= 1 for e in fetched_checks), fetched_checks
    assert "does not check out" not in replacement.with_suffix(".log").read_text()
    if spare:
        assert "standby_promoted" in [e["event"] for e in _events(replacement)]
        # The survivor saw the pool of spares used up (and said how many to start).
        pools = [e for e in _events(dirs[0]) if e["event"] == "standby_pool"]
        assert pools and pools[-1]["waiting"] == 0 and pools[-1]["wanted"] == 1, pools
    expected, got = load_file(tmp_path / "a.st"), load_file(dump)
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not different, f"differs from the uninterrupted run: {different}"


def test_two_nodes_each_with_its_own_disk_resume_from_their_disks_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node-local roots under ``crashproof run``: each node's agent and trainer write checkpoint
    parts into that node's own directory (found node-local, not shared, by itself). Every
    trainer crashes at step 23 and its agent restarts it without memory snapshots: both resume
    from step 20 (saved synchronously: committed before step 21), each read from its own
    node's disk (deltas on a full base there), and the run ends bit for bit where the
    uninterrupted one does. Each node's agent copies its node's part to its own prefix of the
    tier."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tier = tmp_path / "tier"
    common = ["--steps", "40", "--workers", "0", "--batch-size", "8", "--every", "5", "--sync",
              "--full-every", "2"]  # fmt: skip
    train = [*common, "--crash-at", "23", "--remote", str(tier), "--root-scope", "node"]
    clean = start("train_tiny.py", tmp_path / "clean", "--run-dir", str(tmp_path / "clean"),
                  *common, "--dump", str(tmp_path / "a.st"))  # fmt: skip
    port, dump = free_port(), tmp_path / "b.st"
    dirs = [tmp_path / f"node{i}" for i in range(2)]
    disks = [tmp_path / f"disk{i}" for i in range(2)]
    started = [_node(dirs[0], port, disks[0], dump, 2, "--no-memory", step_s=0, train=train)]
    try:
        _started(started[0], dirs[0])
        started.append(
            _node(dirs[1], port, disks[1], dump, 2, "--no-memory", step_s=0, train=train)
        )
        for node, where in zip(started, dirs, strict=True):
            assert node.wait(180) == 0, (where.with_suffix(".log")).read_text()[-3000:]
    finally:
        _kill(started)
    code, _, output = finish(clean)
    assert code == 0, output[-3000:]
    restores = [e for d in dirs for e in _events(d) if e["event"] == "restore"]
    assert [(e["kind"], e["step"]) for e in restores] == [("local", 20)], restores  # (rank 0's)
    # Each disk holds its node's rank's files and the one manifest both share.
    ranks = set()
    for disk in disks:
        newest = sorted((disk / "checkpoints").glob("step_*"))[-1]
        assert newest.name == "step_0000000040"
        names = sorted(p.name for p in newest.iterdir())
        assert len(names) == 3 and "manifest.json" in names, names
        ranks.add(names[1])  # (after manifest.json)
    assert ranks == {"rank_00000.json", "rank_00001.json"}
    # Each node's agent copied its own part to its prefix of the tier, the newest included.
    for rank in (0, 1):
        copied = tier / f"node-{rank:05d}" / "step_0000000040"
        assert sorted(p.name for p in copied.iterdir()) == [
            "manifest.json", f"rank_{rank:05d}.json", f"rank_{rank:05d}.safetensors"
        ]  # fmt: skip
    expected, got = load_file(tmp_path / "a.st"), load_file(dump)
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not different, f"differs from the uninterrupted run: {different}"


# -- the copies between agents, in one process: hosts as the agents run them, a real TCP store --


def _hosts(tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Any]]:
    from datetime import timedelta

    import torch.distributed as dist

    from crashproof.supervisor._memory_host import MemoryHost
    from crashproof.telemetry import EventLog

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=20))  # fmt: skip
    hosts = [MemoryHost(EventLog(tmp_path / f"events{i}.jsonl")) for i in range(n)]
    for host in hosts:
        host.replicate_to_peers(1, "127.0.0.1")
    _round(store, hosts, 0)
    return store, hosts


def _round(
    store: Any, hosts: list[Any], number: int, ranks: int | None = None, *, prefetch: bool = False
) -> None:
    """A rendezvous round: every host joins at once, each through a store client of its own
    (as each agent has); with ``ranks`` per node, node i's global ranks follow from it, and with
    ``prefetch`` the world size too, as the agent gives it (the hosts then fetch ahead)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    def join(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               timeout=timedelta(seconds=20))  # fmt: skip
        mine = None if ranks is None else list(range(rank * ranks, (rank + 1) * ranks))
        world_size = len(hosts) * ranks if prefetch and ranks is not None else None
        hosts[rank].peers.join_round(
            dist.PrefixStore(f"round{number}", client), rank, len(hosts), mine, None, world_size
        )

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def _snapshot_on(host: Any, monkeypatch: pytest.MonkeyPatch, root: Path, steps: int) -> Any:
    """Snapshots of a one-rank state taken through ``host`` (its trainer); returns the state."""
    import crashproof as cp
    from crashproof.link import ENV_MEMORY_SOCKET

    monkeypatch.setenv(ENV_MEMORY_SOCKET, host.address)
    state = cp.TrainState(model=torch.nn.Linear(64, 64))
    with cp.CheckpointManager(root, every=cp.EverySteps(10**6), memory_every=cp.EverySteps(1),
                              staging_buffers=2, handle_signals=False) as ckpt:  # fmt: skip
        for step in range(1, steps + 1):
            with torch.no_grad():
                state.model.weight.add_(1.0)  # type: ignore[union-attr]
            ckpt.maybe_save(step, state)
            ckpt.wait()
    return state


def _restore_through(
    host: Any, monkeypatch: pytest.MonkeyPatch, root: Path
) -> tuple[int, str, Any]:
    import crashproof as cp
    from crashproof.link import ENV_MEMORY_SOCKET

    monkeypatch.setenv(ENV_MEMORY_SOCKET, host.address)
    fresh = cp.TrainState(model=torch.nn.Linear(64, 64))
    with cp.CheckpointManager(root, every=cp.EverySteps(10**6), handle_signals=False) as ckpt:
        step = ckpt.restore(fresh)
        return step, ckpt._restorer.last_kind, fresh


def _wait_replicated(host: Any, step: int) -> None:
    deadline = time.monotonic() + 20
    while not any(s.step == step for s in host._replicas.values()):
        assert time.monotonic() < deadline, "the snapshot was not copied to the peer"
        time.sleep(0.02)


def test_of_three_nodes_the_lost_ones_snapshots_come_from_the_next_in_the_ring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, hosts = _hosts(tmp_path, 3, monkeypatch)
    try:
        state = _snapshot_on(hosts[1], monkeypatch, tmp_path / "ck", 4)  # node 1's trainer
        _wait_replicated(hosts[2], 4)  # its copy: on node 2, the next in the ring
        assert not hosts[0]._replicas
        hosts[1].close()  # node 1 is lost; a new node takes its place
        hosts[1] = type(hosts[0])(hosts[0]._events)
        hosts[1].replicate_to_peers(1, "127.0.0.1")
        _round(store, hosts, 1)
        step, kind, fresh = _restore_through(hosts[1], monkeypatch, tmp_path / "ck")
        assert (step, kind) == (4, "peer")
        assert torch.equal(fresh.model.weight, state.model.weight)
    finally:
        for host in hosts:
            host.close()


def test_a_copy_damaged_in_the_peers_memory_is_caught_and_not_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mmap

    store, hosts = _hosts(tmp_path, 2, monkeypatch)
    try:
        _snapshot_on(hosts[1], monkeypatch, tmp_path / "ck", 3)
        _wait_replicated(hosts[0], 3)
        for copy in hosts[0]._replicas.values():  # a bad DIMM on node 0, in every copy
            with mmap.mmap(copy.fd, copy.nbytes) as mm:
                start, size = copy.files["shard"]
                mm[start + size - 3] ^= 0xFF
        hosts[1].close()
        hosts[1] = type(hosts[0])(hosts[0]._events)
        hosts[1].replicate_to_peers(1, "127.0.0.1")
        _round(store, hosts, 1)
        step, _, _ = _restore_through(hosts[1], monkeypatch, tmp_path / "ck")
        assert step == 0  # nothing on disk either: starts over rather than load damaged state
    finally:
        for host in hosts:
            host.close()


def test_copies_being_received_count_against_the_limit(tmp_path: Path) -> None:
    from crashproof.supervisor._memory_host import MemoryHost
    from crashproof.telemetry import EventLog

    host = MemoryHost(EventLog(tmp_path / "events.jsonl"), limit_bytes=1 << 20)
    meta = {"nbytes": 600 << 10, "world_size": 1, "step": 1, "contents": {}}
    refusals: list[str | None] = []

    def fill_while_another_arrives(view: memoryview) -> None:  # two peers send at once
        refusals.append(
            host.store_copy(("k", 1, 0), meta, lambda v: None, "peer:b", as_replica=True)
        )

    try:
        kept = host.store_copy(
            ("k", 0, 0), meta, fill_while_another_arrives, "peer:a", as_replica=True
        )
        assert kept is None and refusals[0] is not None and "no memory" in refusals[0]
        assert host.held_bytes == 600 << 10  # the one kept; nothing counted twice or left over
    finally:
        host.close()


def test_a_trainer_failure_beside_a_waiting_spare_restarts_once_and_finishes(
    tmp_path: Path,
) -> None:
    """A trainer fails while a hot spare waits: the two nodes and the spare race into the next
    round, and one of the three is left waiting. torch's rendezvous can leave it in the round's
    wait list rather than among the spares, and the nodes in the round, seeing a node waiting,
    restart to take it in, which leaves out another: a run that restarted forever. The node left
    out waits as a spare instead, and the run goes on to its end."""
    port = free_port()
    dirs = [tmp_path / f"node{i}" for i in range(3)]
    train = ["--steps", "40", "--workers", "0", "--batch-size", "8", "--every", "10"]

    def node(where: Path, *options: str) -> subprocess.Popen[str]:
        return _node(where, port, tmp_path / "ckpt", tmp_path / "d.st", 2, *options, train=train)

    started = [node(dirs[0], "--standby", "1")]
    try:
        _started(started[0], dirs[0])
        started.append(node(dirs[1], "--standby", "1"))
        _wait_for(lambda: all(_has(d, "rank_start") for d in dirs[:2]), started, "training")
        started.append(node(dirs[2], "--standby", "1"))
        _wait_for(lambda: _has(dirs[2], "standby"), started, "the spare to wait")
        _wait_for(lambda: _step_reached(*dirs) >= 10, started, "the nodes to train")
        trainer = [e["pid"] for e in _events(dirs[1]) if e["event"] == "rank_start"][-1]
        os.kill(trainer, signal.SIGKILL)
        # Every node ends well, the one left waiting as a spare at the end too (node 0's agent,
        # which hosts the rendezvous, may be gone before it sees the rendezvous closed).
        for proc, where in zip(started, dirs, strict=True):
            assert proc.wait(120) == 0, where.with_suffix(".log").read_text()[-3000:]
    finally:
        _kill(started)
    restarts = [e for d in dirs for e in _events(d) if e["event"] == "restart"]
    changes = [e for e in restarts if e["reason"] == "membership change"]
    assert len(changes) <= 4, f"the nodes restarted {len(changes)} times for the spare"
