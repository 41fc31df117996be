"""Promise: an agent that knows the run's secret (another version, or one with a bug) still
cannot make a peer's memory host allocate without bound, keep memory it should not, read past a
segment, or stop serving. Each hostile request is refused by name, holds no memory and no
descriptor afterwards, and the host goes on answering the next agent.

Found reading the server: a ``push`` whose record could not be kept (its ``contents`` not an
object) was read only after its segment was made and filled, so the segment and its accounting
stayed taken for the rest of the run."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from crashproof.link import recv_exactly, recv_message, send_message
from crashproof.supervisor._peer_fetch import Members, PeerFetch
from crashproof.supervisor._peer_links import PeerLinks
from crashproof.supervisor._peer_requests import MAX_ROOTS, MAX_SLOTS, Malformed, checked
from tests.supervisor.test_memory_parity import _host
from tests.supervisor.test_memory_peers import _round

PUSH = {"op": "push", "key": "k" * 16, "rank": 0, "world_size": 2, "slot": 0, "step": 10,
        "nbytes": 4096, "contents": {}, "node": "n1"}  # fmt: skip
PIECE = {"op": "piece", "key": "k" * 16, "step": 10, "world_size": 2, "agent": "a",
         "expected": ["a"], "record": {"size": 64}}  # fmt: skip
PIECE_FETCH = {"op": "piece_fetch", "key": "k" * 16, "step": 10, "world_size": 2,
               "segments": [{"rank": 1, "slot": 0}], "offset": 0, "size": 64}  # fmt: skip
HELD = {"op": "held", "ranks": [0, 1], "world_size": 2}

HOSTILE = [
    ({"op": "drop_everything", "key": "k"}, "unknown request 'drop_everything'"),
    ({"op": 7, "key": "k"}, "unknown request 7"),
    ({**PUSH, "nbytes": 0}, "nbytes 0 is outside"),
    ({**PUSH, "nbytes": -4096}, "nbytes -4096 is outside"),
    ({**PUSH, "nbytes": 1 << 62}, "nbytes 4611686018427387904 is outside"),
    ({**PUSH, "nbytes": "4096"}, "nbytes must be an integer, not str"),
    ({**PUSH, "nbytes": True}, "nbytes must be an integer, not bool"),
    ({**PUSH, "nbytes": 4096.0}, "nbytes must be an integer, not float"),
    ({**PUSH, "contents": ["index"]}, "contents must be an object"),
    ({**PUSH, "rank": 2}, "rank 2 of a world of 2"),
    ({**PUSH, "slot": MAX_SLOTS}, f"slot {MAX_SLOTS} is outside"),
    ({**PUSH, "step": -1}, "step -1 is outside"),
    ({**PUSH, "world_size": 0}, "world_size 0 is outside"),
    ({k: v for k, v in PUSH.items() if k != "step"}, "step must be an integer, not NoneType"),
    ({**PUSH, "key": ""}, "key must be a string"),
    ({**PUSH, "key": "k" * 10_000}, "key must be a string"),
    ({**PIECE, "record": {"size": -1}}, "record.size -1 is outside"),
    ({**PIECE, "record": "all of it"}, "record must be an object"),
    ({**PIECE, "expected": "a"}, "expected must be a list"),
    ({**PIECE, "expected": [None]}, "expected[0] must be a string"),
    ({**PIECE_FETCH, "offset": -1}, "offset -1 is outside"),
    ({**PIECE_FETCH, "segments": []}, "segments must be a list"),
    ({**PIECE_FETCH, "segments": [{"rank": 5, "slot": 0}]}, "rank 5 of a world of 2"),
    ({**PIECE_FETCH, "segments": [{"rank": 0}]}, "segments[0].slot must be an integer"),
    ({"op": "have", "key": "k", "rank": 0, "world_size": -3}, "world_size -3 is outside"),
    ({"op": "covered", "key": "k", "step": "latest", "agent": "a"}, "step must be an integer"),
    ({"op": "parity_fetch", "key": "k", "step": -5}, "step -5 is outside"),
    ({**HELD, "ranks": []}, "ranks must be a list of ranks"),
    ({**HELD, "ranks": "0,1"}, "ranks must be a list of ranks"),
    ({**HELD, "ranks": list(range(MAX_SLOTS * 16 + 1))}, "ranks must be a list of ranks"),
    ({**HELD, "ranks": [0, 2]}, "rank 2 of a world of 2"),
    ({**HELD, "ranks": [-1]}, "ranks[0] -1 is outside"),
    ({**HELD, "ranks": [True]}, "ranks[0] must be an integer, not bool"),
    ({**HELD, "world_size": None}, "world_size must be an integer, not NoneType"),
]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=20))  # fmt: skip
    host = _host(tmp_path_factory.mktemp("peer"), 0, replicas=1)
    _round(store, [host], 0, 1)
    yield host
    host.close()


def _dial(host: Any) -> socket.socket:
    """A connection that proved it knows the run's secret, as one of the run's agents."""
    connection = socket.create_connection(("127.0.0.1", host.peers.port), timeout=10)
    challenge = recv_exactly(connection, 32)
    connection.sendall(hmac.new(host.peers._links._secret, challenge, hashlib.sha256).digest())
    return connection


def _footprint(host: Any) -> tuple[int, int, int]:
    """What the host holds: bytes, segments kept, and this process's open descriptors."""
    with host._lock:
        held, kept = host._held(), len(host._segments) + len(host._replicas)
    return held, kept, len(os.listdir("/proc/self/fd"))


def _settled(host: Any, before: tuple[int, int, int]) -> None:
    """Nothing held beyond ``before`` (descriptors: no more, the host may close some of its own)."""

    def holds() -> bool:
        held, kept, fds = _footprint(host)
        return (held, kept) == before[:2] and fds <= before[2]

    deadline = time.monotonic() + 5  # the serving thread closes its side a moment later
    while not holds() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert holds(), (_footprint(host), before)


def _still_serves(host: Any) -> None:
    with _dial(host) as connection:
        send_message(connection, {"op": "have", "key": "k" * 16, "rank": 0, "world_size": 2})
        assert recv_message(connection)[0] == {"slots": []}


@pytest.mark.parametrize(("request_", "why"), HOSTILE, ids=[w for _, w in HOSTILE])
def test_a_malformed_request_is_refused_by_name_and_holds_nothing(
    host: Any, request_: dict[str, Any], why: str
) -> None:
    before = _footprint(host)
    with _dial(host) as connection:
        send_message(connection, request_)
        reply, _ = recv_message(connection)
        assert reply["error"].startswith(f"malformed request: {why}"), reply
        assert connection.recv(1) == b""  # and the connection is closed
    _settled(host, before)
    _still_serves(host)


def _push(host: Any, nbytes: int, body: bytes, trailer: dict[str, Any] | None) -> dict[str, Any]:
    with _dial(host) as connection:
        send_message(connection, {**PUSH, "nbytes": nbytes})
        connection.sendall(body)
        if trailer is None:  # cut off mid-copy
            connection.shutdown(socket.SHUT_WR)
            return {"closed": connection.recv(1) == b""}
        send_message(connection, trailer)
        return recv_message(connection)[0]


def test_a_copy_cut_off_or_damaged_on_the_way_is_not_kept(host: Any) -> None:
    before = _footprint(host)
    assert _push(host, 1 << 20, b"x" * 1000, None) == {"closed": True}
    _settled(host, before)
    body = os.urandom(4096)
    reply = _push(host, 4096, body, {"whole": True, "checksum": "0" * 16})
    assert reply == {"error": "overwritten while it was sent, or damaged on the way"}
    reply = _push(host, 4096, body, {"whole": False, "checksum": "0" * 16})
    assert "error" in reply
    _settled(host, before)
    _still_serves(host)


def test_a_message_announcing_more_than_any_message_holds_is_not_read(host: Any) -> None:
    before = _footprint(host)
    with _dial(host) as connection:
        connection.sendall(struct.pack("<II", 0xFFFFFFFF, 0))  # a header: size, descriptors
        assert connection.recv(1) == b""
    with _dial(host) as connection:
        body = b"[1, 2, 3]"  # JSON, but not an object
        connection.sendall(struct.pack("<II", len(body), 0) + body)
        assert connection.recv(1) == b""
    _settled(host, before)
    _still_serves(host)


def test_an_unauthenticated_connection_is_never_answered(host: Any) -> None:
    with socket.create_connection(("127.0.0.1", host.peers.port), timeout=10) as connection:
        recv_exactly(connection, 32)
        connection.sendall(b"\0" * 32)
        try:
            send_message(connection, {"op": "have", "key": "k", "rank": 0, "world_size": 1})
            assert connection.recv(1) == b""
        except ConnectionResetError:
            pass  # closed with the request unread: as good
    _still_serves(host)


def test_every_request_the_agents_send_passes_the_checks() -> None:
    for message in (PUSH, PIECE, PIECE_FETCH, HELD):
        assert checked(dict(message)) == message
    with pytest.raises(Malformed):
        checked(json.loads('{"op": "push"}'))


# -- a peer that lies in its answers -------------------------------------------------------------

_GOOD_META = {"world_size": 2, "slot": 0, "step": 10, "nbytes": 4096, "contents": {}}
LIES = {
    "a billion copies": [{"count": 10**9}],
    "a copy of no bytes": [{"count": 1}, {**_GOOD_META, "nbytes": 0}],
    "a copy larger than memory": [{"count": 1}, {**_GOOD_META, "nbytes": 1 << 60}],
    "contents not an object": [{"count": 1}, {**_GOOD_META, "contents": "index"}],
    "a step that is text": [{"count": 1}, {**_GOOD_META, "step": "10"}],
    "bytes cut short": [{"count": 1}, _GOOD_META, b"x" * 100],
    "a wrong checksum": [{"count": 1}, _GOOD_META, b"x" * 4096, {"whole": True, "checksum": "0"}],
}


class _Liar:
    """An agent that knows the run's secret, offers a snapshot, and answers a fetch with
    ``answers`` (messages, and raw bytes), then hangs up."""

    def __init__(self, secret: bytes, answers: list[Any]) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.secret, self.answers = secret, answers
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            with connection:
                challenge = os.urandom(32)
                connection.sendall(challenge)
                recv_exactly(connection, 32)  # (the host proves itself; not checked here)
                try:
                    message, _ = recv_message(connection)
                    if message["op"] == "held":
                        send_message(connection, self.answers[0])
                    elif message["op"] == "have":
                        send_message(connection, {"slots": [{"slot": 0, "step": 10}]})
                    elif message["op"] == "fetch":
                        for answer in self.answers:
                            if isinstance(answer, bytes):
                                connection.sendall(answer)
                            else:
                                send_message(connection, answer)
                except OSError:
                    pass


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_peer_leaves_nothing_offered_nor_held(host: Any, lie: str) -> None:
    liar = _Liar(host.peers._links._secret, LIES[lie])
    peers = host.peers._peers
    peers[1] = {"host": "127.0.0.1", "port": liar.server.getsockname()[1], "node": "liar",
                "agent": "liar-agent"}  # fmt: skip
    before = _footprint(host)
    try:
        reply, fds = host._hello("k" * 16, 1, 2)  # a rank this node holds nothing of
        for fd in fds:
            os.close(fd)
    finally:
        del peers[1]
        liar.server.close()
    assert all(slot["step"] is None for slot in reply["slots"]), reply
    with host._lock:
        assert not host._replicas and not host._filling
    _settled(host, before)
    _still_serves(host)


HELD_LIES = {
    "not a list": ({"keys": "0123456789abcdef"}, set()),
    "more roots than any run has": (
        {"keys": [f"{i:016x}" for i in range(10_000)]},
        {f"{i:016x}" for i in range(MAX_ROOTS)},  # (the trainers ask for any other themselves)
    ),
    "names that are not names": (
        {"keys": [1, None, {"k": 1}, "", "k" * 300, "0123456789abcdef"]},
        {"0123456789abcdef"},
    ),
    "no keys at all": ({"error": "malformed request"}, set()),
}


@pytest.mark.parametrize("lie", list(HELD_LIES))
def test_a_lying_answer_to_held_fetches_only_what_is_named_well_and_at_once(
    host: Any, lie: str
) -> None:
    """A new node asks its peers which roots they hold its ranks' snapshots for (to fetch them
    ahead): an answer that is no list of names is passed over at once (a peer that refuses the
    connection is asked again for seconds; one that answers nonsense is not), and of more roots
    than any run has, only the first are fetched ahead."""
    answer, named = HELD_LIES[lie]
    liar = _Liar(host.peers._links._secret, [answer])
    peer = {"host": "127.0.0.1", "port": liar.server.getsockname()[1], "node": "liar",
            "agent": "liar-agent"}  # fmt: skip
    fetch = PeerFetch(host, host._events, host.peers._links)
    prepared: list[tuple[str, int]] = []
    started = time.monotonic()
    try:
        fetch.ahead(Members(others=[peer], everyone=[peer]), [0, 1], 2,
                    lambda key, rank: prepared.append((key, rank)), lambda: True)  # fmt: skip
    finally:
        liar.server.close()
    assert time.monotonic() - started < 2.0
    assert prepared == [(key, rank) for key in sorted(named) for rank in (0, 1)]


def test_a_peer_that_never_answers_never_holds_up_the_agents_exit(host: Any) -> None:
    """The asks of a prefetch run on daemon threads: one blocked on a peer that accepted the
    connection and says nothing (for up to a minute) must not keep the agent from exiting."""
    silent = socket.create_server(("127.0.0.1", 0))  # (connections queue; none is answered)
    peer = {"host": "127.0.0.1", "port": silent.getsockname()[1], "node": "silent",
            "agent": "silent-agent"}  # fmt: skip
    fetch = PeerFetch(host, host._events, host.peers._links)
    members = Members(others=[peer], everyone=[peer])
    prefetch = threading.Thread(
        target=fetch.ahead, args=(members, [0], 1, lambda key, rank: None, lambda: True),
        daemon=True,
    )  # fmt: skip
    prefetch.start()
    try:
        deadline = time.monotonic() + 10
        while not (askers := [t for t in threading.enumerate() if t.name == "crashproof-held"]):
            assert time.monotonic() < deadline, "the prefetch asked nobody"
            time.sleep(0.01)
        assert all(t.daemon for t in askers)
    finally:
        silent.close()
        prefetch.join(30)


def test_a_kept_connection_follows_the_agent_not_the_group_rank(host: Any) -> None:
    """A new round may give a group rank to another agent: the connection kept for that rank
    is not reused for it."""
    accepted: dict[str, int] = {"a": 0, "b": 0}
    servers = []

    def serve(name: str, server: socket.socket) -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            accepted[name] += 1
            connection.sendall(os.urandom(32))
            servers.append(connection)  # (kept open: closed with the test)

    for name in accepted:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)
        threading.Thread(target=serve, args=(name, server), daemon=True).start()
    a, b = ({"host": "127.0.0.1", "port": s.getsockname()[1], "node": n, "agent": f"agent-{n}"}
            for n, s in zip(accepted, servers, strict=False))  # fmt: skip
    links = PeerLinks()
    links.new_round(b"secret")
    try:
        first = links.kept(1, a)
        assert links.kept(1, a) is first  # the same agent: the same connection
        other = links.kept(1, b)  # another agent at that rank now
        assert other is not first and first.fileno() == -1  # the old one closed
        assert accepted == {"a": 1, "b": 1}
    finally:
        links.close()
        for s in servers:
            s.close()
