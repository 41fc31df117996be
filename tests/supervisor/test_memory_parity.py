"""XOR parity between agents: a lost node's snapshots rebuilt byte for byte from the parity its
group holds and the survivors' own snapshots, in one process with real memory hosts and a real
TCP store (the ``crashproof run`` end to end is in ``test_memory_peers.py``).

The "trainers" here commit raw segments straight to their host, as the wire allows: the bytes
are what the test compares, and a restore's checks are another test's business."""

from __future__ import annotations

import itertools
import mmap
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from crashproof.link import MemoryClient
from crashproof.supervisor._memory_parity import ParityPlan, parity_groups, piece_span
from crashproof.telemetry import read_events
from tests.supervisor.test_memory_peers import _round

KEY = "0123456789abcdef"


def _hosts(tmp_path: Path, n: int, ranks: int = 1, **scheme: Any) -> tuple[Any, list[Any]]:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=20))  # fmt: skip
    hosts = [_host(tmp_path, i, **scheme) for i in range(n)]
    _round(store, hosts, 0, ranks)
    return store, hosts


def _host(tmp_path: Path, i: int, **scheme: Any) -> Any:
    from crashproof.supervisor._memory_host import MemoryHost
    from crashproof.telemetry import EventLog

    host = MemoryHost(EventLog(tmp_path / f"events{i}-{time.monotonic_ns()}.jsonl"))
    host.replicate_to_peers(
        scheme.get("replicas"),
        "127.0.0.1",
        parity=scheme.get("parity"),
        bandwidth=scheme.get("bandwidth"),
    )
    return host


class _Trainer:
    """A rank's side of the wire: segments allocated, filled and committed by hand."""

    def __init__(self, host: Any, rank: int, world_size: int) -> None:
        self.client = MemoryClient(host.address)
        self.rank, self.world_size = rank, world_size
        self.maps: dict[int, mmap.mmap] = {}

    def _ids(self, slot: int) -> dict[str, Any]:
        return {"key": KEY, "rank": self.rank, "world_size": self.world_size, "slot": slot}

    def commit(self, slot: int, step: int, data: bytes) -> None:
        if slot not in self.maps or len(self.maps[slot]) != len(data):
            reply, fds = self.client.request(
                {"op": "allocate", **self._ids(slot), "nbytes": len(data)}
            )
            assert "error" not in reply, reply
            self.maps[slot] = mmap.mmap(fds[0], len(data))
            os.close(fds[0])
        assert "error" not in self.client.request({"op": "invalidate", **self._ids(slot)})[0]
        self.maps[slot][:] = data
        files = {"files": {}, "shard": [0, len(data)], "path": f"step_{step}"}
        reply, _ = self.client.request({"op": "commit", **self._ids(slot), "step": step,
                                        "files": files})  # fmt: skip
        assert "error" not in reply, reply

    def close(self) -> None:
        for mm in self.maps.values():
            mm.close()
        self.client.close()


def _wait_covered(hosts: list[Any], step: int) -> None:
    deadline = time.monotonic() + 30
    while not all(h._pinned.get(KEY) == step for h in hosts):
        assert time.monotonic() < deadline, [h._pinned for h in hosts]
        time.sleep(0.02)


def _covered_at_10(hosts: list[Any], size: int, ranks: int = 1) -> None:
    """Each node's ``ranks`` trainers commit step 10 (``size`` bytes each, slot 0) and are gone
    once every node covers it."""
    world_size = len(hosts) * ranks
    trainers = [_Trainer(hosts[r // ranks], r, world_size) for r in range(world_size)]
    try:
        for r, trainer in enumerate(trainers):
            trainer.commit(0, 10, _data(r, 10, size))
        _wait_covered(hosts, 10)
    finally:
        for trainer in trainers:
            trainer.close()


def _held(host: Any, rank: int, world_size: int) -> dict[int, tuple[int, bytes, str]]:
    """What a trainer of ``rank`` starting on ``host`` is offered: slot -> (step, bytes, origin)."""
    reply, fds = host._hello(KEY, rank, world_size)
    offered = {}
    for info, fd in zip(reply["slots"], fds, strict=True):
        if info["step"] is not None:
            with mmap.mmap(fd, info["nbytes"], mmap.MAP_SHARED, mmap.PROT_READ) as mm:
                offered[info["slot"]] = (info["step"], bytes(mm), info["origin"])
        os.close(fd)  # (the trainer's copy of the descriptor)
    return offered


def _data(rank: int, step: int, size: int) -> bytes:
    return random.Random(rank * 1000 + step).randbytes(size)


def _replace(
    tmp_path: Path, store: Any, hosts: list[Any], lost: list[int], number: int, ranks: int = 1
) -> None:
    for i in lost:
        hosts[i].close()
        hosts[i] = _host(tmp_path, i)
    _round(store, hosts, number, ranks)


def test_groups_and_pieces() -> None:
    assert parity_groups(3, 4) == [[0, 1, 2]]
    assert parity_groups(10, 4) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert parity_groups(7, 2) == [[0, 1, 2, 3], [4, 5, 6]]  # never a group of one
    assert all(len(g) >= 2 for n in range(2, 40) for k in range(1, 9) for g in parity_groups(n, k))
    for length in (0, 1, 63, 64, 1000, 12345):
        for pieces in (1, 2, 3, 7):
            spans = [piece_span(length, pieces, p) for p in range(pieces)]
            assert sum(size for _, size in spans) == length
            assert all(a + s == b for (a, s), (b, _) in itertools.pairwise(spans))
    plan = ParityPlan.of(1, 3, 4)
    assert plan is not None and [plan.holder(p) for p in range(plan.pieces)] == [2, 0]


def test_of_three_nodes_the_lost_ones_snapshots_are_rebuilt_from_parity(tmp_path: Path) -> None:
    store, hosts = _hosts(tmp_path, 3)  # three nodes: parity by default, two pieces each
    sizes = {0: 100_000, 1: 70_001, 2: 123_457}  # (unequal parts, none a multiple of 64)
    trainers = [_Trainer(hosts[r], r, 3) for r in range(3)]
    try:
        assert all(h.peers.scheme == ("parity", 2) for h in hosts)
        for r, trainer in enumerate(trainers):
            trainer.commit(0, 10, _data(r, 10, sizes[r]))
        _wait_covered(hosts, 10)
        parity = [h.peers.holder.nbytes for h in hosts]
        assert all(p <= max(sizes.values()) // 2 + 64 for p in parity), parity  # 1/k, not 1
        for trainer in trainers:
            trainer.close()
        _replace(tmp_path, store, hosts, [1], 1)
        offered = _held(hosts[1], 1, 3)
        assert offered[0][:2] == (10, _data(1, 10, sizes[1])), "not rebuilt byte for byte"
        assert offered[0][2].endswith("(parity)")
        fetched = [e for e in read_events(hosts[1]._events.path) if e["event"] == "memory_fetched"]
        assert fetched and fetched[0]["peer"].startswith("parity on")
    finally:
        for host in hosts:
            host.close()
    # host 0 sent its payload as two pieces (one to each other member), half of it each
    sent = [e for e in read_events(hosts[0]._events.path) if e["event"] == "memory_copies"]
    assert [(e["copies"], e["pieces"], e["bytes"], e["covered"], e["newest_covered"])
            for e in sent] == [(0, 2, sizes[0], 1, 10)]  # fmt: skip


@pytest.mark.parametrize("nodes", [2, 3], ids=["copies", "parity"])
def test_a_new_node_fetches_its_ranks_snapshots_as_the_round_forms(
    tmp_path: Path, nodes: int
) -> None:
    """The agent in a lost node's place fetches (or rebuilds) its ranks' snapshots as soon as
    the round forms, before any trainer asks; the trainer's hello then finds them there."""
    store, hosts = _hosts(tmp_path, nodes)
    try:
        _covered_at_10(hosts, 50_000)
        hosts[1].close()
        hosts[1] = _host(tmp_path, 1)
        _round(store, hosts, 1, 1, prefetch=True)
        deadline = time.monotonic() + 20
        while hosts[1]._newest(KEY, 1) != 10:  # (no trainer has said hello)
            assert time.monotonic() < deadline, "the new node did not fetch ahead of its trainer"
            time.sleep(0.02)
        assert [(s, d) for s, d, _ in _held(hosts[1], 1, nodes).values()] == [
            (10, _data(1, 10, 50_000))
        ]
        fetched = [e for e in read_events(hosts[1]._events.path) if e["event"] == "memory_fetched"]
        assert len(fetched) == 1, fetched  # (the hello fetched nothing more)
        # A prefetch that comes after the trainer's hello leaves the trainer's segments alone,
        # even one it has just made again and holds no step yet.
        trainer = _Trainer(hosts[1], 1, nodes)
        reply, fds = trainer.client.request({"op": "allocate", **trainer._ids(0), "nbytes": 60_000})
        assert "error" not in reply, reply
        os.close(fds[0])
        hosts[1].prepare(KEY, 1, nodes, ahead_of_round=hosts[1].peers.round_serial)
        segment = hosts[1]._segments[(KEY, 1, 0)]
        assert (segment.step, segment.nbytes) == (None, 60_000), "the trainer's segment replaced"
        trainer.close()
    finally:
        for host in hosts:
            host.close()


def test_two_ranks_a_node_and_a_newer_step_the_lost_node_never_finished(tmp_path: Path) -> None:
    """Four nodes, two ranks each, two slots: every node commits step 10 (covered), then the
    survivors step 20 while node 2 dies before its own: it is rebuilt at step 10, which the
    survivors kept (pinned) rather than overwrite it with a step nobody could rebuild."""
    store, hosts = _hosts(tmp_path, 4, ranks=2, parity=3)
    trainers = [_Trainer(hosts[r // 2], r, 8) for r in range(8)]
    try:
        for r, trainer in enumerate(trainers):
            trainer.commit(0, 10, _data(r, 10, 40_000 + 999 * r))
        _wait_covered(hosts, 10)
        for r, trainer in enumerate(trainers):
            if r // 2 != 2:
                trainer.commit(1, 20, _data(r, 20, 40_000 + 999 * r))
        pinned = hosts[0]._answer({"op": "pinned", "key": KEY, "rank": 0, "world_size": 8})[0]
        assert pinned["step"] == 10
        for trainer in trainers:
            trainer.close()
        _replace(tmp_path, store, hosts, [2], 1, ranks=2)
        for rank in (4, 5):
            offered = _held(hosts[2], rank, 8)
            assert [(s, d) for s, d, _ in offered.values()] == [
                (10, _data(rank, 10, 40_000 + 999 * rank))
            ]
    finally:
        for host in hosts:
            host.close()


def test_a_rebuild_the_new_nodes_memory_cannot_hold_keeps_nothing_and_says_so(
    tmp_path: Path,
) -> None:
    """A lost node's snapshots are rebuilt straight into segments counted against the new
    node's memory (``--memory-limit``), not in a buffer beside them: with room for one of its
    two ranks' segments and not both, neither is kept (one rank restored from memory and the
    other from disk could not resume together), every byte is given back, and the agent says
    why."""
    from crashproof.supervisor._memory_host import MemoryHost
    from crashproof.telemetry import EventLog

    store, hosts = _hosts(tmp_path, 3, ranks=2)
    try:
        _covered_at_10(hosts, 60_000, ranks=2)
        hosts[1].close()
        hosts[1] = MemoryHost(EventLog(tmp_path / "limited.jsonl"), limit_bytes=90_000)
        hosts[1].replicate_to_peers(None, "127.0.0.1")
        _round(store, hosts, 1, 2)
        assert _held(hosts[1], 2, 6) == {}  # nothing offered: the restore goes to storage
        assert hosts[1].held_bytes == 0
        events = list(read_events(hosts[1]._events.path))
        missing = [e for e in events if e["event"] == "memory_missing"]
        assert missing and "no memory for a 60000-byte copy" in missing[0]["why"], missing
        assert [e["need"] for e in events if e["event"] == "memory_refused"] == [60_000]
    finally:
        for host in hosts:
            host.close()


@pytest.mark.parametrize(
    ("lost", "damage", "why"),
    [
        ([1, 2], "", "more nodes were lost than the parity covers"),
        # A bad DIMM on node 0 after it sent its pieces, in the one the rebuild uses (its first
        # piece went to node 1, lost with it).
        ([1], "dimm", "no longer holds the same snapshot of step 10"),
        # Node 2 dies after the new round met, before the rebuild reads from it.
        ([1], "second-loss", "more nodes were lost than the parity covers"),
    ],
    ids=["two-nodes-of-a-group-lost", "a-survivors-snapshot-damaged", "a-survivor-lost-after"],
)
def test_what_parity_cannot_rebuild_falls_back_to_storage_and_says_why(
    tmp_path: Path, lost: list[int], damage: str, why: str
) -> None:
    store, hosts = _hosts(tmp_path, 3)
    trainers = [_Trainer(hosts[r], r, 3) for r in range(3)]
    try:
        for r, trainer in enumerate(trainers):
            trainer.commit(0, 10, _data(r, 10, 50_000))
        _wait_covered(hosts, 10)
        if damage == "dimm":
            trainers[0].maps[0][40_000] ^= 0x01
        for trainer in trainers:
            trainer.close()
        _replace(tmp_path, store, hosts, lost, 1)
        if damage == "second-loss":
            hosts[2].close()
        assert _held(hosts[1], 1, 3) == {}  # nothing offered: the restore goes to storage
        missing = [e for e in read_events(hosts[1]._events.path) if e["event"] == "memory_missing"]
        assert missing and why in missing[0]["why"], missing
    finally:
        for host in hosts:
            host.close()


@pytest.mark.parametrize("nodes", [2, 5])
def test_full_copies_cover_and_pin_too(tmp_path: Path, nodes: int) -> None:
    store, hosts = _hosts(tmp_path, nodes, replicas=1)
    try:
        assert all(h.peers.scheme == ("replicas", 1) for h in hosts)
        _covered_at_10(hosts, 30_000)
        _replace(tmp_path, store, hosts, [1], 1)
        assert [(s, d) for s, d, _ in _held(hosts[1], 1, nodes).values()] == [
            (10, _data(1, 10, 30_000))
        ]
    finally:
        for host in hosts:
            host.close()
    # what host 0 sent, over both rounds: one copy of its rank's snapshot, covered everywhere
    sent = [e for e in read_events(hosts[0]._events.path) if e["event"] == "memory_copies"]
    assert [(e["copies"], e["pieces"], e["bytes"], e["covered"], e["newest_covered"])
            for e in sent] == [(1, 0, 30_000, 1, 10)]  # fmt: skip


def test_a_holder_keeps_a_bounded_number_of_parities_and_drops_older_than_covered() -> None:
    """Steps that are never covered (a node that never reports) must not pile up in memory; a
    piece sent twice, or from an agent not of the group, is refused before it is XORed in."""
    from crashproof.supervisor._memory_parity import ParityHolder

    holder = ParityHolder()
    record = {"segments": [{"rank": 1, "slot": 0, "nbytes": 64}]}
    for step in range(10, 200, 10):
        for agent in ("a", "b"):
            assert holder.open_piece(KEY, step, 3, agent, ["a", "b"], 64)
            assert not holder.open_piece(KEY, step, 3, agent, ["a", "b"], 64)  # (twice)
            holder.xor_in(KEY, step, 0, memoryview(bytearray([step % 251]) * 64))
            holder.close_piece(KEY, step, agent, {**record, "piece": 0})
    assert not holder.open_piece(KEY, 500, 3, "c", ["a", "b"], 64)
    steps = [r["step"] for r in holder.records(KEY, 1, 3)]
    assert steps == [190, 180, 170, 160] and holder.nbytes == 4 * 64
    assert holder.read(KEY, 190) is not None and not any(holder.read(KEY, 190))  # x ^ x = 0
    holder.covered(KEY, 180)
    assert [r["step"] for r in holder.records(KEY, 1, 3)] == [190, 180]
    assert not holder.open_piece(KEY, 170, 3, "a", ["a", "b"], 64)  # older than covered


def test_a_bandwidth_cap_paces_the_copies_and_a_slot_being_sent_is_left_alone(
    tmp_path: Path,
) -> None:
    """Backpressure: while its snapshot is on its way, the trainer is told to leave that slot
    alone (its next memory snapshot is skipped, never waited for); the copies keep to the cap."""
    _store, hosts = _hosts(tmp_path, 2, replicas=1, bandwidth=4 << 20)  # 4 MiB/s
    trainers = [_Trainer(hosts[r], r, 2) for r in range(2)]
    try:
        started = time.monotonic()
        for r, trainer in enumerate(trainers):
            trainer.commit(0, 10, _data(r, 10, 2 << 20))
        # The send starts when the push thread takes it up (later on a loaded machine) and
        # lasts ~0.45 s: asked until it is seen, or the step is covered (the send missed).
        deadline, seen = time.monotonic() + 30, []
        while not seen or (seen[-1]["sending"] != [0] and seen[-1]["step"] is None):
            assert time.monotonic() < deadline, seen[-1]
            seen.append(hosts[0]._answer({"op": "pinned", "key": KEY, "rank": 0,
                                          "world_size": 2})[0])  # fmt: skip
        assert seen[-1]["sending"] == [0] and seen[-1]["step"] is None, seen[-1]
        _wait_covered(hosts, 10)
        assert time.monotonic() - started >= 0.3  # 2 MiB at 4 MiB/s, less the burst allowed
        reply = hosts[0]._answer({"op": "pinned", "key": KEY, "rank": 0, "world_size": 2})[0]
        assert reply == {"ok": True, "step": 10, "sending": []}
    finally:
        for trainer in trainers:
            trainer.close()
        for host in hosts:
            host.close()


def test_a_spare_taken_in_for_a_rank_it_holds_old_copies_of_takes_a_peers_newer_ones(
    tmp_path: Path,
) -> None:
    """A node keeps the copies it held while it waits as a spare; the round that takes it in
    may give it the rank those copies are of, which trained on meanwhile. A peer's newer copies
    must replace them: offered the old step, the rank has no step in common with the others,
    and every rank restores from storage."""
    store, hosts = _hosts(tmp_path, 3, replicas=1)  # (a round of all three, then of two)
    a, b, c = hosts
    try:
        _round(store, [a, b], 1)  # rank 0 on A, rank 1 on B: each holds the other's copy
        old = [_Trainer(a, 0, 2), _Trainer(b, 1, 2)]
        for r, trainer in enumerate(old):
            trainer.commit(0, 10, _data(r, 10, 30_000))
        _wait_covered([a, b], 10)
        _round(store, [a, c], 2)  # B waits as a spare; C takes rank 1
        new = [_Trainer(a, 0, 2), _Trainer(c, 1, 2)]
        for r, trainer in enumerate(new):
            trainer.commit(1, 20, _data(r, 20, 30_000))
        _wait_covered([a, c], 20)
        _round(store, [b, c], 3)  # A's trainer failed, and the spare B is taken in as rank 0
        offered = _held(b, 0, 2)
        # (the old step is offered too: a restore takes the newest every rank holds)
        newest = max(offered.values())
        assert newest[:2] == (20, _data(0, 20, 30_000))
        assert newest[2].startswith("peer:")
        for trainer in old + new:
            trainer.close()
    finally:
        for host in hosts:
            host.close()
