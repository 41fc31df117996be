"""A lost node is taken out of torch's rendezvous as soon as a neighbour finds its agent gone.

Two real ``DynamicRendezvousHandler``s over a real TCPStore (the c10d backend) meet in a round;
then one node's agent goes away (its port closed): the other's fence finds the port refusing,
and the lost node is out of the rendezvous state at once, where its keep-alives (set here to a
minute) would have kept it for a minute. A node whose agent still listens is never taken out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _BackendRendezvousStateHolder,
    create_handler,
)

from crashproof.supervisor._fence import Fence, expire_nodes, poll_faster
from crashproof.supervisor._rendezvous_state import update_state
from crashproof.telemetry import EventLog, read_events


def _handlers(store: TCPStore, n: int) -> list[Any]:
    params = RendezvousParameters(
        backend="c10d", endpoint="", run_id="fence-test", min_nodes=n, max_nodes=n,
        keep_alive_interval=20, keep_alive_max_attempt=3, last_call_timeout=1,
    )  # fmt: skip
    handlers = []
    for _ in range(n):  # a client each, as each node's agent has (a client serves one call at once)
        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
        handlers.append(create_handler(client, C10dRendezvousBackend(client, "fence-test"), params))
    return handlers


def _meet(handlers: list[Any]) -> list[Any]:
    """Every handler's next round, at once (each in a thread); their rendezvous infos."""
    infos: list[Any] = [None] * len(handlers)

    def join(i: int) -> None:
        infos[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(info is not None for info in infos), "the round was not completed"
    return infos


def _participants(handler: Any) -> set[Any]:
    holder = _BackendRendezvousStateHolder(
        handler._state_holder._backend, handler._settings, cache_duration=0
    )
    holder.sync()
    return set(holder.state.participants)


@pytest.fixture
def store() -> Iterator[TCPStore]:
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    yield server


def test_a_neighbour_whose_agent_is_gone_is_out_of_the_rendezvous_at_once(
    store: TCPStore, tmp_path: Path
) -> None:
    handlers = _handlers(store, 3)
    infos = _meet(handlers)
    events = [EventLog(str(tmp_path / f"events{i}.jsonl")) for i in range(3)]
    fences = [Fence(events[i], "127.0.0.1") for i in range(3)]
    try:
        for fence, handler, info in zip(fences, handlers, infos, strict=True):
            fence.join_round(handler, info.store, info.rank, info.world_size)
        lost = infos[1].rank
        nodes = {info.rank: h._this_node for h, info in zip(handlers, infos, strict=True)}
        assert _participants(handlers[0]) == set(nodes.values())

        # Nobody is gone: nothing is fenced (a live agent always answers).
        survivor = 0
        _reached(fences[survivor], 2)
        assert fences[survivor].fence_lost(handlers[survivor]) == []
        assert _participants(handlers[0]) == set(nodes.values())

        # The next round: every neighbour reached again; then node 1's agent goes, and its port
        # refuses connections.
        fences[survivor].join_round(handlers[survivor], infos[0].store, infos[0].rank, 3)
        _reached(fences[survivor], 2)
        fences[1].close()
        fenced = fences[survivor].fence_lost(handlers[survivor])
        assert fenced == [repr(handlers[1]._this_node)]
        assert _participants(handlers[2]) == {nodes[infos[0].rank], nodes[infos[2].rank]}
        assert infos[1].rank == lost
        [event] = [
            e for e in read_events(tmp_path / "events0.jsonl") if e["event"] == "node_fenced"
        ]
        assert event["nodes"] == fenced
        # Expiring it again changes nothing (already gone).
        key = (
            handlers[1]._this_node.addr,
            handlers[1]._this_node.pid,
            handlers[1]._this_node.local_id,
        )
        assert expire_nodes(handlers[0], {key}) == []
    finally:
        _close(fences, handlers)


def test_a_neighbour_never_reached_is_never_fenced(store: TCPStore, tmp_path: Path) -> None:
    """A port that refused from the start (a firewall, an address that leads elsewhere) says
    nothing about the node: it is left to its keep-alives."""
    handlers = _handlers(store, 2)
    infos = _meet(handlers)
    fences = [Fence(EventLog(str(tmp_path / f"events{i}.jsonl")), "127.0.0.1") for i in range(2)]
    try:
        fences[1].close()  # before anyone reached it
        for fence, handler, info in zip(fences, handlers, infos, strict=True):
            fence.join_round(handler, info.store, info.rank, info.world_size)
        time.sleep(1.0)  # (time for the neighbour to be looked for, and refuse)
        assert fences[0].fence_lost(handlers[0]) == []
        assert len(_participants(handlers[0])) == 2
    finally:
        _close(fences, handlers)


def _close(fences: list[Fence], handlers: list[Any]) -> None:
    for fence in fences:
        fence.close()
    for handler in handlers:
        handler.shutdown()


def _reached(fence: Fence, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(fence._reached) < count:
        assert time.monotonic() < deadline, f"{count} neighbour(s) not reached in 30 s"
        time.sleep(0.02)


def test_no_dynamic_rendezvous_no_fencing() -> None:
    assert expire_nodes(object(), {("host", 1, 0)}) == []
    assert not poll_faster(object(), 2)


def test_a_node_polling_faster_sees_a_change_of_the_round_within_its_poll(
    store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch serves a node's looks at the rendezvous from the state it read last for a second,
    whatever their pace: a node waiting on a round saw the others' moves up to a second late.
    Here a node added to the wait list is seen by the other node's next look 0.25 s later."""
    monkeypatch.setattr(dynamic_rendezvous, "_delay", dynamic_rendezvous._delay)  # (put back)
    handlers = _handlers(store, 2)
    try:
        _meet(handlers)
        assert poll_faster(handlers[0], max_nodes=2)
        time.sleep(1.05)  # (torch's own cache of the state read in the round is stale now)
        assert handlers[0].num_nodes_waiting() == 0  # read now: the next look's cache starts
        newcomer = next(iter(_participants(handlers[1])))
        assert update_state(handlers[1], lambda state: state.wait_list.add(newcomer) is None)
        time.sleep(0.25)
        assert handlers[0].num_nodes_waiting() == 1
        started = time.monotonic()
        dynamic_rendezvous._delay(seconds=1)  # a look's pause
        assert time.monotonic() - started < 0.9
        assert not poll_faster(handlers[0], max_nodes=65)  # beyond 64 nodes torch's pace stays
    finally:
        _close([], handlers)
