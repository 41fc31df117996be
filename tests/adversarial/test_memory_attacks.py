"""Attacks on the promises of memory snapshots (docs/recovery.md): whole or absent, verified like
a checkpoint, all ranks or none, bounded, no leaks; and on the agent's memory host itself.

The memory host runs in the test process (as ``crashproof run``'s agent runs it), with real
segments and a real abstract Unix socket; hostile clients speak to it with raw sockets, and real
managers save to it and restore from it."""

from __future__ import annotations

import base64
import gc
import json
import logging
import os
import re
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import crashproof as cp
from crashproof.link import ENV_MEMORY_SOCKET, MemoryClient
from crashproof.supervisor._memory_host import MemoryHost
from crashproof.telemetry import EventLog
from tests.checkpoint.test_manager import _equal, _state, _tensors

_HEADER = struct.Struct("<II")


# -- helpers ---------------------------------------------------------------------------------


def _raw(host: MemoryHost) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect("\0" + host.address[1:])
    return sock


def _frame(payload: bytes, count: int | None = None) -> bytes:
    return _HEADER.pack(len(payload), 0 if count is None else count) + payload


def _reply(sock: socket.socket) -> dict[str, Any] | None:
    """The host's next reply, or None when it closed the connection instead."""
    try:
        return _read_reply(sock)
    except ConnectionError:
        return None


def _send(sock: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    """Send, the host having hung up meanwhile being no error (it may, on a bad header)."""
    try:
        if fds:
            socket.send_fds(sock, [data], fds)
        else:
            sock.sendall(data)
    except ConnectionError:
        pass


def _read_reply(sock: socket.socket) -> dict[str, Any] | None:
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 64)
    for fd in fds:
        os.close(fd)
    if not header:
        return None
    while len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            return None
        header += more
    size, _ = _HEADER.unpack(header)
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None
        data += more
    reply = json.loads(data)
    assert isinstance(reply, dict)
    return reply


def _ask(host: MemoryHost, payload: bytes) -> dict[str, Any] | None:
    with _raw(host) as sock:
        sock.sendall(_frame(payload))
        return _reply(sock)


def _open_fds() -> set[str]:
    """This process's descriptors (the host runs in it), less the one listing them."""
    return {fd for fd in os.listdir("/proc/self/fd") if _link(fd) != "?"}


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _settled_fds(before: set[str], timeout_s: float = 3.0) -> set[str]:
    """The descriptors opened since ``before`` once the host's connection threads are done."""
    deadline = time.monotonic() + timeout_s
    while True:
        extra = _open_fds() - before
        if not extra or time.monotonic() > deadline:
            return {f"{fd}:{_link(fd)}" for fd in extra}
        time.sleep(0.02)


def _still_serves(host: MemoryHost) -> None:
    """A legitimate trainer's hello is answered."""
    client = MemoryClient(host.address, timeout_s=5)
    try:
        reply, fds = client.request({"op": "hello", "key": "legit", "rank": 0, "world_size": 1})
        for fd in fds:
            os.close(fd)
        assert reply.get("ok") is True, reply
    finally:
        client.close()
    assert host._thread.is_alive()


def _train(state: cp.TrainState) -> None:
    assert state.model is not None and state.optimizer is not None
    state.optimizer.zero_grad()
    state.model(torch.randn(4, 6)).sum().backward()
    state.optimizer.step()


def _memory(ckpt: cp.CheckpointManager) -> Any:
    memory = ckpt._pipeline._memory
    assert memory is not None
    return memory


def _host_segment(host: MemoryHost, ckpt: cp.CheckpointManager, step: int) -> Any:
    memory = _memory(ckpt)
    slot = memory.slots[memory.steps()[step]]
    return host._segments[(slot.key, slot.rank, slot.index)]


# -- a hostile client on the memory socket ---------------------------------------------------

_GARBAGE = [
    b"not json at all",
    b"[1, 2, 3]",
    b'"a string"',
    b"{}",
    b'{"op": "hello"}',
    b'{"op": "hello", "key": "k", "rank": "zero", "world_size": 1}',
    b'{"op": "hello", "key": "k", "rank": [0], "world_size": 1}',
    b'{"op": "hello", "key": "k", "rank": 0, "world_size": null}',
    b'{"op": "launch_missiles", "key": "k", "rank": 0, "slot": 0}',
    b'{"op": "commit", "key": "k", "rank": 0, "slot": 0, "step": 1, "files": {}}',
    b'{"op": "invalidate", "key": "k", "rank": 0, "slot": "x"}',
    b'{"op": "allocate", "key": "k", "rank": 0, "slot": 0, "world_size": 1, "nbytes": -4096}',
    b'{"op": "allocate", "key": "k", "rank": 0, "slot": 0, "world_size": 1, "nbytes": 0}',
    b'{"op": "allocate", "key": "k", "rank": 0, "slot": 0, "world_size": 1, "nbytes": "big"}',
    b'{"op": "allocate", "key": "k", "rank": 0, "slot": 0, "world_size": 1, "nbytes": 1e30}',
    b'{"op": "allocate", "key": "k", "rank": 0, "slot": 0, "world_size": 1, "nbytes": '
    + str(2**200).encode()
    + b"}",
    '{"op": "h\u00e9llo"}'.encode("latin-1"),  # not UTF-8
]


@pytest.mark.parametrize("payload", _GARBAGE, ids=range(len(_GARBAGE)))
def test_malformed_requests_are_refused_and_the_host_serves_on(
    memory_host: MemoryHost, payload: bytes
) -> None:
    before = _open_fds()
    reply = _ask(memory_host, payload)
    assert reply is None or "error" in reply, reply  # refused, or hung up on: never "ok"
    assert memory_host.held_bytes == 0
    assert not memory_host._segments
    _still_serves(memory_host)
    assert _settled_fds(before) == set()


@pytest.mark.parametrize(
    "bad",
    [{"files": ["index"]}, {"step": "7"}, {"step": -1}, {"step": 7.0}, {"files": None}],
    ids=["files-a-list", "step-a-string", "step-negative", "step-a-float", "files-null"],
)
def test_a_malformed_commit_leaves_the_snapshot_committed_before_it_whole(
    memory_host: MemoryHost, bad: dict[str, Any]
) -> None:
    """The commit used to change the segment's world size before it read the rest: a commit
    that failed halfway left the earlier snapshot offered under another world size."""
    client = MemoryClient(memory_host.address, timeout_s=5)
    ids = {"key": "k", "rank": 0, "world_size": 2, "slot": 0}
    try:
        reply, fds = client.request({"op": "allocate", **ids, "nbytes": 4096})
        for fd in fds:
            os.close(fd)
        assert "error" not in reply, reply
        good = {"op": "commit", **ids, "step": 5, "files": {"path": "step_5"}}
        assert client.request(good)[0] == {"ok": True}
        reply, _ = client.request({**good, "world_size": 3, **bad})
        assert reply["error"].startswith("malformed request"), reply
    finally:
        client.close()
    [segment] = memory_host._segments.values()
    assert (segment.step, segment.world_size, segment.files) == (5, 2, {"path": "step_5"})
    _still_serves(memory_host)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_non_finite_numbers_get_an_error_reply_not_a_dead_connection_thread(
    memory_host: MemoryHost,
) -> None:
    """JSON's ``Infinity`` parses (Python's json accepts it) and ``int(inf)`` raises
    OverflowError, which ``_answer`` does not catch: the connection thread dies with an
    unhandled exception instead of answering "malformed request" like every other bad value."""
    payload = b'{"op": "hello", "key": "k", "rank": Infinity, "world_size": 1}'
    reply = _ask(memory_host, payload)
    _still_serves(memory_host)
    assert reply is not None and "malformed" in reply.get("error", ""), reply


def test_a_huge_announced_length_is_refused_without_reading_it(memory_host: MemoryHost) -> None:
    before = _open_fds()
    with _raw(memory_host) as sock:
        _send(sock, _HEADER.pack(2**32 - 1, 0) + b"{")
        assert _reply(sock) is None  # hung up on: nothing buffered
    _still_serves(memory_host)
    assert _settled_fds(before) == set()


def test_a_client_closing_mid_frame_does_not_stop_the_host(memory_host: MemoryHost) -> None:
    before = _open_fds()
    for cut in (1, 5, _HEADER.size, _HEADER.size + 3):
        frame = _frame(b'{"op": "hello", "key": "k", "rank": 0, "world_size": 1}')
        with _raw(memory_host) as sock:
            sock.sendall(frame[:cut])
    _still_serves(memory_host)
    assert _settled_fds(before) == set()


def test_a_silent_client_does_not_block_the_others(memory_host: MemoryHost) -> None:
    with _raw(memory_host) as silent, _raw(memory_host) as half:
        half.sendall(_HEADER.pack(100, 0) + b"{")  # and never the rest
        _still_serves(memory_host)
        silent.sendall(b"")


def test_descriptors_sent_to_the_host_are_closed_not_kept(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    before = _open_fds()
    victims = [os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_RDWR) for i in range(3)]
    try:
        payload = b'{"op": "hello", "key": "k", "rank": 0, "world_size": 1}'
        with _raw(memory_host) as sock:
            # With a well-formed request: answered, the descriptors closed.
            _send(sock, _HEADER.pack(len(payload), len(victims)), victims)
            _send(sock, payload)
            assert (_reply(sock) or {}).get("ok") is True
            # Announcing fewer than it sends: hung up on.
            _send(sock, _HEADER.pack(len(payload), 1), victims)
            _send(sock, payload)
            assert _reply(sock) is None
        with _raw(memory_host) as sock:  # more than MAX_FDS: the rest are dropped by the kernel
            many = victims * 30
            _send(sock, _HEADER.pack(len(payload), len(many)), many)
            _send(sock, payload)
            assert _reply(sock) is None
        with _raw(memory_host) as sock:  # descriptors riding on the payload's bytes
            _send(sock, _HEADER.pack(len(payload), 0))
            _send(sock, payload, victims)
            assert (_reply(sock) or {}).get("ok") is True
    finally:
        for fd in victims:
            os.close(fd)
    _still_serves(memory_host)
    assert _settled_fds(before) == set()


def test_a_huge_rank_or_slot_does_not_kill_the_host(memory_host: MemoryHost) -> None:
    before = _open_fds()
    big = str(10**300)
    for field in ("rank", "slot"):
        message = {"op": "allocate", "key": "k", "rank": 0, "slot": 0, "world_size": 1}
        message["nbytes"] = 4096
        payload = json.dumps(message).replace(f'"{field}": 0', f'"{field}": {big}').encode()
        reply = _ask(memory_host, payload)
        assert reply is None or "error" in reply, reply
    assert memory_host.held_bytes == 0
    _still_serves(memory_host)
    assert _settled_fds(before) == set()


def test_many_hostile_connections_at_once(memory_host: MemoryHost) -> None:
    before = _open_fds()
    socks = [_raw(memory_host) for _ in range(50)]
    try:
        for i, sock in enumerate(socks):
            sock.sendall(_frame(_GARBAGE[i % len(_GARBAGE)])[: 3 + i % 20])
        _still_serves(memory_host)
    finally:
        for sock in socks:
            sock.close()
    _still_serves(memory_host)
    assert _settled_fds(before) == set()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_deeply_nested_payload_is_refused_cleanly(memory_host: MemoryHost) -> None:
    import threading

    died: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: died.append(args.exc_value)  # type: ignore[assignment,arg-type]
    try:
        reply = _ask(memory_host, b"[" * 100_000 + b"]" * 100_000)
        _still_serves(memory_host)
        time.sleep(0.2)
    finally:
        threading.excepthook = previous
    assert reply is None or "error" in reply
    assert not died, f"the host's connection thread died: {died!r}"


# -- verified like a checkpoint: corrupt what the agent holds ---------------------------------


def _corruptible(
    host: MemoryHost, tmp_path: Path
) -> tuple[Path, dict[str, torch.Tensor], Any, Any]:
    """A root with step 7 on disk and in the agent's memory; the expected values, the host's
    segment holding it and the (closed) manager's slot."""
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(root, every=cp.EverySteps(1)) as ckpt:
        ckpt.save(7, state)
        ckpt.wait()
        segment = _host_segment(host, ckpt, 7)
        memory = _memory(ckpt)
        slot = memory.slots[memory.steps()[7]]
    return root, _tensors(state), segment, slot


@pytest.fixture(params=["restore checks", "agent checks first"])
def checker(request: pytest.FixtureRequest, memory_host: MemoryHost) -> MemoryHost | None:
    """Who finds the damage: the restore, or the agent before it (as it does once its trainers
    have stopped, see MemoryHost.trainers_stopped): either way it is never restored."""
    return memory_host if request.param == "agent checks first" else None


def _restores_from_disk(
    root: Path,
    expected: dict[str, torch.Tensor],
    caplog: pytest.LogCaptureFixture,
    checker: MemoryHost | None = None,
) -> None:
    if checker is not None:
        with caplog.at_level(logging.WARNING):
            checker.trainers_stopped()
            assert checker.checks_done(30)
        assert "is corrupt and is not offered" in caplog.text
        lines = Path(checker._events.path).read_text().splitlines()
        [corrupt] = [e for e in map(json.loads, lines) if e["event"] == "memory_corrupt"]
        assert corrupt["step"] == 7 and "memory of crashproof run's agent" in corrupt["error"]
    fresh = _state(seed=1)
    with caplog.at_level(logging.WARNING), cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 7
        assert again._restorer.last_kind == "local"
        assert 7 not in _memory(again).steps()  # found wanting: never offered again
    assert "memory of crashproof run's agent" in caplog.text
    assert _equal(_tensors(fresh), expected)


def _segment_bytes(host: MemoryHost, segment: Any) -> memoryview:
    import mmap

    mm = mmap.mmap(segment.fd, segment.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return memoryview(mm)


@pytest.mark.parametrize("where", ["header_first", "header_last", "tensor_first", "tensor_last"])
def test_a_flipped_byte_in_the_shard_falls_back_to_disk(
    memory_host: MemoryHost,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    where: str,
    checker: MemoryHost | None,
) -> None:
    root, expected, segment, _ = _corruptible(memory_host, tmp_path)
    start, size = segment.files["shard"]
    data = _segment_bytes(memory_host, segment)
    header_len = int.from_bytes(data[start : start + 8], "little") + 8
    at = {
        "header_first": start + 8,
        "header_last": start + header_len - 1,
        "tensor_first": start + header_len,
        "tensor_last": start + size - 1,
    }[where]
    data[at] ^= 0x01
    data.release()
    _restores_from_disk(root, expected, caplog, checker)


def test_bytes_outside_the_shard_are_not_its_business(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root, expected, segment, _ = _corruptible(memory_host, tmp_path)
    start, size = segment.files["shard"]
    data = _segment_bytes(memory_host, segment)
    if start > 0:
        data[0] ^= 0xFF
    if start + size < len(data):
        data[len(data) - 1] ^= 0xFF
    data.release()
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 7
        assert again._restorer.last_kind == "memory"
    assert _equal(_tensors(fresh), expected)


def _flip_b64(text: str) -> str:
    raw = bytearray(base64.b64decode(text))
    raw[len(raw) // 2] ^= 0x01
    return base64.b64encode(bytes(raw)).decode()


@pytest.mark.parametrize("which", ["index", "manifest"])
def test_a_flipped_bit_in_the_index_or_manifest_the_agent_holds_falls_back_to_disk(
    memory_host: MemoryHost,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    which: str,
    checker: MemoryHost | None,
) -> None:
    root, expected, segment, _ = _corruptible(memory_host, tmp_path)
    (name,) = [n for n in segment.files["files"] if ("manifest" in n) == (which == "manifest")]
    segment.files["files"][name] = _flip_b64(segment.files["files"][name])
    _restores_from_disk(root, expected, caplog, checker)


def test_a_manifest_of_another_step_is_refused(
    memory_host: MemoryHost,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    checker: MemoryHost | None,
) -> None:
    root, expected, segment, _ = _corruptible(memory_host, tmp_path)
    name = next(n for n in segment.files["files"] if "manifest" in n)
    manifest = json.loads(base64.b64decode(segment.files["files"][name]))
    manifest["step"] = 9
    segment.files["files"][name] = base64.b64encode(json.dumps(manifest).encode()).decode()
    _restores_from_disk(root, expected, caplog, checker)


@pytest.mark.parametrize("span", ["one_short", "one_long", "past_the_end", "shifted"])
def test_a_wrong_shard_span_falls_back_to_disk(
    memory_host: MemoryHost,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    span: str,
    checker: MemoryHost | None,
) -> None:
    root, expected, segment, _ = _corruptible(memory_host, tmp_path)
    start, size = segment.files["shard"]
    segment.files["shard"] = {
        "one_short": [start, size - 1],
        "one_long": [start, size + 1],
        "past_the_end": [start, 10**12],
        "shifted": [start + 1, size],
    }[span]
    _restores_from_disk(root, expected, caplog, checker)


@pytest.mark.parametrize("change", ["negative_span", "other_directory_name"])
def test_odd_but_harmless_records_never_load_wrong_values(
    memory_host: MemoryHost, tmp_path: Path, change: str
) -> None:
    """A negative offset slices the same bytes from the end (Python's slicing), and the
    directory's name is only a name: whatever the restore makes of them, it loads step 7's
    values exactly."""
    root, expected, segment, _ = _corruptible(memory_host, tmp_path)
    start, size = segment.files["shard"]
    if change == "negative_span":
        segment.files["shard"] = [start - segment.nbytes, size]
    else:
        segment.files["path"] = "step_0000000006"
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 7
    assert _equal(_tensors(fresh), expected)


def test_a_snapshot_claiming_another_step_is_refused(
    memory_host: MemoryHost, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, expected, segment, _ = _corruptible(memory_host, tmp_path)
    segment.step = 8  # the host's record says 8; every file inside says 7
    fresh = _state(seed=1)
    with caplog.at_level(logging.WARNING), cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 7
        assert again._restorer.last_kind == "local"
    assert _equal(_tensors(fresh), expected)


def test_undecodable_files_held_by_the_agent_fall_back_to_disk(
    memory_host: MemoryHost, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, expected, segment, _ = _corruptible(memory_host, tmp_path)
    name = next(n for n in segment.files["files"] if "manifest" in n)
    segment.files["files"][name] = segment.files["files"][name][:-1]  # bad padding
    _restores_from_disk(root, expected, caplog)


def test_a_missing_shard_entry_falls_back_to_disk(
    memory_host: MemoryHost, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, expected, segment, _ = _corruptible(memory_host, tmp_path)
    del segment.files["shard"]
    _restores_from_disk(root, expected, caplog)


# -- all ranks or none, and another world size (real gloo ranks, the host in the test) --------

_RANKS = """
import os, sys, torch, torch.distributed as dist
import crashproof as cp

address, root, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.environ["CRASHPROOF_MEMORY_SOCKET"] = address  # as crashproof run sets it for its trainers
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
model = torch.nn.Linear(8, 8)
state = cp.TrainState(model=model)
with cp.CheckpointManager(
    root, every=cp.EverySteps(10**9), memory_every=cp.EverySteps(1), staging_buffers=2,
    handle_signals=False,
) as m:
    got = m.restore(state)
    value = model.weight[0, 0].item()
    print(f"rank {rank}: restored {got} from {m._restorer.last_kind} value {value:g}", flush=True)
    assert got == 0 or all(bool((p == got * 10 + rank).all()) for p in model.parameters())
    for step in range(first, last + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step * 10 + rank)  # every value says its step and rank
        m.maybe_save(step, state)
        m.wait()  # (a snapshot never waits: one due while the last is committed is skipped)
dist.barrier()
dist.destroy_process_group()
"""


def _launch(
    warm_ranks: Any, tmp_path: Path, host: MemoryHost, nproc: int, first: int, last: int
) -> str:
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    args = [host.address, str(tmp_path / "ck"), str(first), str(last)]
    launch = warm_ranks.run(script, args, nproc=nproc, timeout=60)
    assert launch.exit_codes == [0] * nproc, launch.output
    return str(launch.output)


def test_a_step_one_rank_lost_is_not_taken_from_memory(
    memory_host: MemoryHost, tmp_path: Path, warm_ranks: Any
) -> None:
    _launch(warm_ranks, tmp_path, memory_host, 2, 1, 4)
    # Rank 1 was killed as it began to overwrite step 4 (its "invalidate" reached the agent).
    ((key, rank, slot),) = [
        k for k, s in memory_host._segments.items() if k[1] == 1 and s.step == 4
    ]
    client = MemoryClient(memory_host.address, timeout_s=5)
    try:
        reply, _ = client.request(
            {"op": "invalidate", "key": key, "rank": rank, "slot": slot, "world_size": 2}
        )
        assert reply == {"ok": True}
    finally:
        client.close()
    output = _launch(warm_ranks, tmp_path, memory_host, 2, 0, -1)
    assert "rank 0: restored 3 from memory value 30" in output, output
    assert "rank 1: restored 3 from memory value 31" in output, output
    # Rank 0's step 4 is retracted: a later crash cannot resume into it either.
    assert all(s.step != 4 for s in memory_host._segments.values())


def test_after_a_resize_the_new_world_sizes_snapshots_are_offered(
    memory_host: MemoryHost, tmp_path: Path, warm_ranks: Any
) -> None:
    _launch(warm_ranks, tmp_path, memory_host, 1, 1, 3)  # one rank
    output = _launch(warm_ranks, tmp_path, memory_host, 2, 11, 13)  # resized to two
    assert "rank 0: restored 0" in output, output  # another world: nothing from memory (doc'd)
    output = _launch(warm_ranks, tmp_path, memory_host, 2, 0, -1)  # two ranks, restarted
    assert "rank 0: restored 13 from memory value 130" in output, output
    assert "rank 1: restored 13 from memory value 131" in output, output


# -- whole or absent, with managers ----------------------------------------------------------


def test_a_restored_state_does_not_alias_the_agents_segment(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    expected = _tensors(state)
    with cp.CheckpointManager(root, every=cp.EverySteps(10**9), memory_every=cp.EverySteps(1)) as a:
        a.maybe_save(1, state)
        a.wait()
    fresh = _state(seed=1)
    with cp.CheckpointManager(root, every=cp.EverySteps(10**9)) as again:
        assert again.restore(fresh) == 1
        assert again._restorer.last_kind == "memory"
        for slot in _memory(again).slots:  # the segment is scribbled over (the next snapshot)
            if slot.nbytes:
                view = slot.reserve(slot.nbytes, pin=False)  # (mapped read-only until then)
                view[:] = b"\xa5" * len(view)
                view.release()
        assert _equal(_tensors(fresh), expected)


class _Shifting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({"a": nn.Linear(6, 12)})


def _reshape(model: _Shifting, phase: int) -> None:
    """Phase 0: one layer; 1: one added; 2: the first resized; 3: the second's dtype changed;
    4: the first removed."""
    parts = model.parts
    if phase == 1:
        parts["b"] = nn.Linear(4, 4)
    elif phase == 2:
        parts["a"] = nn.Linear(6, 40)
    elif phase == 3:
        parts["b"] = parts["b"].double()
    elif phase == 4:
        del parts["a"]


def _fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 0.001 + value + i)


@pytest.mark.parametrize("buffers", [1, 2])
def test_a_state_that_changes_shape_between_snapshots_restores_the_last_whole_step(
    memory_host: MemoryHost, tmp_path: Path, buffers: int
) -> None:
    """Each phase is a restarted trainer: it restores (from memory, the previous phase's last
    step, in the previous phase's shapes), changes the state's shape and snapshots twice."""
    root = tmp_path / "ck"
    step, last_values = 0, None
    options = dict(every=cp.EverySteps(10**9), memory_every=cp.EverySteps(1))
    for phase in range(5):
        model = _Shifting()
        for earlier in range(phase):
            _reshape(model, earlier)
        state = cp.TrainState(model=model)
        with cp.CheckpointManager(root, staging_buffers=buffers, **options) as ckpt:  # type: ignore[arg-type]
            assert ckpt.restore(state) == step
            if last_values is not None:
                assert ckpt._restorer.last_kind == "memory"
                assert _equal(dict(model.state_dict()), last_values)
            _reshape(model, phase)
            for _ in range(2):
                step += 1
                _fill(model, float(step))
                ckpt.maybe_save(step, state)
                ckpt.wait()
            last_values = {k: v.clone() for k, v in model.state_dict().items()}


def test_two_managers_on_two_roots_never_mix_their_snapshots(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    """A model and its EMA, in one trainer, snapshotted at interleaved steps."""
    roots = [tmp_path / "model", tmp_path / "ema"]
    states = [_state(seed=0), _state(seed=5)]
    expected: list[dict[str, torch.Tensor]] = [{}, {}]
    managers = [
        cp.CheckpointManager(r, every=cp.EverySteps(10**9), memory_every=cp.EverySteps(1),
                             staging_buffers=2)
        for r in roots
    ]  # fmt: skip
    try:
        for step in range(1, 6):
            for i, (ckpt, state) in enumerate(zip(managers, states, strict=True)):
                _train(state)
                ckpt.maybe_save(step * 2 + i, state)
                ckpt.wait()
                expected[i] = _tensors(state)
    finally:
        for ckpt in managers:
            ckpt.close()
    for i, root in enumerate(roots):
        fresh = _state(seed=9)
        with cp.CheckpointManager(root) as again:
            assert again.restore(fresh) == 10 + i
            assert again._restorer.last_kind == "memory"
        assert _equal(_tensors(fresh), expected[i])


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_manager_restarted_with_other_staging_buffers(
    memory_host: MemoryHost, tmp_path: Path, before: int, after: int
) -> None:
    root = tmp_path / "ck"
    state = _state()
    values = {}
    options: dict[str, Any] = dict(every=cp.EverySteps(10**9), memory_every=cp.EverySteps(1))
    with cp.CheckpointManager(root, staging_buffers=before, **options) as ckpt:
        for step in range(1, 5):
            _train(state)
            ckpt.maybe_save(step, state)
            ckpt.wait()
            values[step] = _tensors(state)
    fresh = _state(seed=1)
    with cp.CheckpointManager(root, staging_buffers=after, **options) as again:
        assert again.restore(fresh) == 4
        assert _equal(_tensors(fresh), values[4])
        for step in range(5, 8):  # goes on with its own number of buffers
            _train(fresh)
            again.maybe_save(step, fresh)
            again.wait()
            values[step] = _tensors(fresh)
    third = _state(seed=2)
    with cp.CheckpointManager(root, staging_buffers=before, **options) as last:
        assert last.restore(third) == 7
        assert last._restorer.last_kind == "memory"
    assert _equal(_tensors(third), values[7])
    held = {k: s.nbytes for k, s in memory_host._segments.items()}
    assert memory_host.held_bytes == sum(held.values())


def test_restore_of_an_older_step_retracts_the_newer_snapshots(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    values = {}
    options: dict[str, Any] = dict(
        every=cp.EverySteps(10**9), memory_every=cp.EverySteps(1), staging_buffers=2
    )
    with cp.CheckpointManager(root, **options) as ckpt:
        for step in range(1, 4):
            _train(state)
            ckpt.maybe_save(step, state)
            ckpt.wait()
            values[step] = _tensors(state)
        assert sorted(_memory(ckpt).steps()) == [2, 3]
        assert ckpt.restore(state, step=2) == 2  # from memory: only memory holds it
        assert ckpt._restorer.last_kind == "memory"
        assert _equal(_tensors(state), values[2])
        assert 3 not in _memory(ckpt).steps()
    fresh = _state(seed=1)
    with cp.CheckpointManager(root, **options) as again:
        assert again.restore(fresh) == 2  # never step 3, which the restore abandoned
    assert _equal(_tensors(fresh), values[2])


def test_a_rollback_then_a_crash_never_resumes_into_the_abandoned_stretch(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    values = {}
    options: dict[str, Any] = dict(
        every=cp.EverySteps(4), memory_every=cp.EverySteps(1), staging_buffers=2
    )
    with cp.CheckpointManager(root, **options) as ckpt:
        for step in range(1, 8):
            _train(state)
            ckpt.maybe_save(step, state)
            ckpt.wait()
            values[step] = _tensors(state)
        assert sorted(_memory(ckpt).steps()) == [6, 7]
        assert ckpt.rollback(state, before=6, anomaly_step=7) == 4  # the disk's
        assert _equal(_tensors(state), values[4])
        assert _memory(ckpt).steps() == {}  # 6 and 7 retracted
        ckpt.maybe_save(7, state)  # the loop's call for the anomaly's step: not this state's
        ckpt.wait()
        for step in range(5, 7):  # training goes on from 4 (a different path)
            _train(state)
            _train(state)
            ckpt.maybe_save(step, state)
            ckpt.wait()
            values[step] = _tensors(state)
    fresh = _state(seed=1)
    with cp.CheckpointManager(root, **options) as again:
        assert again.restore(fresh) == 6
    assert _equal(_tensors(fresh), values[6])


# -- bounded ---------------------------------------------------------------------------------


def test_a_limit_that_fits_one_buffer_of_two_refuses_the_second_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = cp.TrainState(model=nn.Linear(256, 256, bias=False))  # 256 KiB a snapshot
    host = MemoryHost(EventLog(tmp_path / "events.jsonl"), limit_bytes=400 * 1024)
    monkeypatch.setenv(ENV_MEMORY_SOCKET, host.address)
    before = _open_fds()
    try:
        with cp.CheckpointManager(
            tmp_path / "ck", every=cp.EverySteps(10**9), memory_every=cp.EverySteps(1),
            staging_buffers=2,
        ) as ckpt:  # fmt: skip
            ckpt.maybe_save(1, state)
            ckpt.wait()
            # The second buffer is refused: memory snapshots stop (said, counted), the one held
            # stays whole, and checkpoints would go on to disk from buffers of their own.
            ckpt.maybe_save(2, state)
            assert ckpt.stats.memory_failures == 1 and ckpt.stats.memory_snapshots == 1
            assert host.held_bytes <= 400 * 1024
            assert len(host._segments) == 1
            held_step = next(iter(host._segments.values())).step
            assert held_step == 1
        fresh = cp.TrainState(model=nn.Linear(256, 256, bias=False))
        with cp.CheckpointManager(tmp_path / "ck") as again:
            assert again.restore(fresh) == 1
            assert again._restorer.last_kind == "memory"
        assert state.model is not None and fresh.model is not None
        assert torch.equal(fresh.model.weight, state.model.weight)
        del ckpt, again  # (a closed manager's staging views keep its mapping, and fd, alive)
        gc.collect()
    finally:
        host.close()
    assert not {fd for fd in _settled_fds(before) if "memfd:crashproof" in fd}


def test_a_raw_allocation_over_the_limit_names_the_amount_and_holds_nothing(
    tmp_path: Path,
) -> None:
    host = MemoryHost(EventLog(tmp_path / "events.jsonl"), limit_bytes=1 << 20)
    before = _open_fds()
    try:
        base = {"op": "allocate", "key": "k", "rank": 0, "world_size": 1}
        for slot, nbytes in enumerate([(1 << 20) + 1, 2**62, 2**200]):
            message = json.dumps({**base, "slot": slot, "nbytes": nbytes}).encode()
            reply = _ask(host, message)
            # Refused for want of memory, or (past any machine's size) as malformed.
            assert reply is not None and "error" in reply, reply
            assert reply["error"] == "insufficient" or nbytes > 1 << 50, reply
            if reply["error"] == "insufficient":
                assert reply["need"] == nbytes and reply["available"] <= 1 << 20
        assert host.held_bytes == 0 and not host._segments
        exact = json.dumps({**base, "slot": 9, "nbytes": 1 << 20}).encode()
        with _raw(host) as sock:
            sock.sendall(_frame(exact))
            _, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
            assert len(fds) == 1 and os.fstat(fds[0]).st_size == 1 << 20
            os.close(fds[0])
        assert host.held_bytes == 1 << 20
    finally:
        host.close()
    assert not {fd for fd in _settled_fds(before) if "memfd:crashproof" in fd}


def test_a_refusal_under_a_small_limit_names_real_amounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = cp.TrainState(model=nn.Linear(256, 256, bias=False))  # 256 KiB a snapshot
    host = MemoryHost(EventLog(tmp_path / "events.jsonl"), limit_bytes=400 * 1024)
    monkeypatch.setenv(ENV_MEMORY_SOCKET, host.address)
    try:
        with caplog.at_level(logging.ERROR), cp.CheckpointManager(
            tmp_path / "ck", every=cp.EverySteps(10**9), memory_every=cp.EverySteps(1),
            staging_buffers=2,
        ) as ckpt:  # fmt: skip
            ckpt.maybe_save(1, state)
            ckpt.wait()
            ckpt.maybe_save(2, state)  # the second buffer does not fit the limit
    finally:
        host.close()
    said = caplog.text
    found = re.search(r"need (\d+) KiB .* --memory-limit 400 KiB leaves (\d+) KiB", said)
    assert found is not None and " 0 MiB" not in said, said
    need, left = int(found.group(1)), int(found.group(2))
    assert need > 256 and need + left == 400, said  # (the weights, the RNG states, a header)
