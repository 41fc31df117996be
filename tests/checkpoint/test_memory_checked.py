"""The agent checks the snapshots in its memory once its trainers have stopped, and a restarted
trainer copies a checked snapshot without hashing it again (it maps it read-only until it writes).

Each test plays the agent's memory host in this process and trainers as managers: one saves and
is closed (its trainer "died"), the host is told its trainers stopped, and the next restores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import crashproof as cp
from crashproof.checkpoint.format import _shard_file
from crashproof.supervisor._memory_host import MemoryHost
from crashproof.supervisor._segment_holders import other_holders
from tests.checkpoint.test_manager import _equal, _state, _tensors


def _hashing_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes every restore's read hashes from now on (both ways it hashes)."""
    hashed: list[int] = []
    digest, hash_range = _shard_file.digest, _shard_file.hash_range

    def counted_digest(data: Any) -> str:
        hashed.append(memoryview(data).nbytes)
        return digest(data)

    def counted_range(stream: Any, offset: int, nbytes: int) -> str:
        hashed.append(nbytes)
        return hash_range(stream, offset, nbytes)

    monkeypatch.setattr(_shard_file, "digest", counted_digest)
    monkeypatch.setattr(_shard_file, "hash_range", counted_range)
    return hashed


def _checked(host: MemoryHost) -> None:
    """What the agent does once its trainers are stopped, waited for."""
    host.trainers_stopped()
    assert host.checks_done(30)


def _events(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    lines = (tmp_path / "memory-events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == kind]


def _saved(root: Path, step: int) -> tuple[cp.TrainState, dict[str, Any]]:
    state = _state()
    with cp.CheckpointManager(root, every=cp.EverySteps(1)) as ckpt:
        ckpt.save(step, state)
        ckpt.wait()
    return state, _tensors(state)


def test_a_snapshot_the_agent_checked_is_copied_without_a_second_hash(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ck"
    _, expected = _saved(root, 4)
    hashed = _hashing_counted(monkeypatch)
    # Not checked by the agent (its trainer never stopped): the restore hashes every tensor.
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as unchecked:
        assert unchecked.restore(fresh) == 4
        assert unchecked._restorer.last_kind == "memory"
        assert unchecked._restorer.last_verified_by == "restore"
    every_byte = sum(hashed)
    assert every_byte >= sum(t.numel() * t.element_size() for t in expected.values())
    assert _equal(_tensors(fresh), expected)

    _checked(memory_host)  # (in this process: what it hashes is not the restore's)
    [event] = _events(tmp_path, "memory_checked")
    assert event["snapshots"] == 1 and event["bytes"] > 0
    hashed.clear()
    fresh = _state(seed=2)
    with cp.CheckpointManager(root) as restarted:
        memory = restarted._pipeline._memory
        assert memory is not None and memory.verified(4)
        assert restarted.restore(fresh) == 4
        assert restarted._restorer.last_kind == "memory"
        assert restarted._restorer.last_verified_by == "agent"
    assert sum(hashed) == 0
    assert _equal(_tensors(fresh), expected)


def test_a_checked_snapshot_is_read_only_until_its_trainer_writes_and_then_unchecked(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ck"
    state, _ = _saved(root, 3)
    _checked(memory_host)
    with cp.CheckpointManager(root, every=cp.EverySteps(1)) as restarted:
        memory = restarted._pipeline._memory
        assert memory is not None
        slot = memory.slots[memory.steps()[3]]
        assert slot.verified
        with pytest.raises(TypeError, match="read-only"):
            slot.view()[0] ^= 0xFF  # a stray write of the new trainer's
        token = memory_host.token  # the kernel's mapping too, not only Python's view of it
        maps = Path("/proc/self/maps").read_text().splitlines()
        mapped = [line.split()[1] for line in maps if token in line]
        assert mapped and all(perms == "r--s" for perms in mapped), mapped
        assert restarted.restore(state) == 3
        restarted.save(4, state)  # stages into a segment, mapped writable first
        restarted.save(5, state)
        restarted.wait()
        assert not any(s.verified for s in memory.slots)
        expected = _tensors(state)
    hashed = _hashing_counted(monkeypatch)
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as again:  # no stop, no check: written since, unverified
        memory = again._pipeline._memory
        assert memory is not None and max(memory.steps()) == 5
        assert not any(s.verified for s in memory.slots)
        assert again.restore(fresh) == 5
        assert again._restorer.last_verified_by == "restore"
    assert sum(hashed) > 0
    assert _equal(_tensors(fresh), expected)


def _segment_of(host: MemoryHost, step: int) -> Any:
    [segment] = [s for s in host._segments.values() if s.step == step]
    return segment


def test_a_snapshot_a_leftover_process_could_write_is_left_to_the_restore(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    """A leftover of the dead trainer the agent could not stop (one that left its session and
    its parent) still maps the segment writable: the agent does not vouch for what it holds,
    and the restore hashes what the leftover wrote."""
    root = tmp_path / "ck"
    _, expected = _saved(root, 6)
    segment = _segment_of(memory_host, 6)
    start, size = segment.files["shard"]
    fd = os.dup(segment.fd)
    leftover = subprocess.Popen(
        [sys.executable, "-c", _LEFTOVER, str(fd), str(segment.nbytes), str(start + size - 3)],
        pass_fds=[fd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(fd)
    try:
        assert leftover.stdout is not None and leftover.stdout.readline() == "mapped\n"
        _checked(memory_host)
        assert segment.checked_gen is None and not _events(tmp_path, "memory_checked")
        leftover.communicate("write\n", timeout=30)  # written after the agent looked
    finally:
        leftover.kill()
        leftover.wait()
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 6
        assert again._restorer.last_kind == "local"  # the damage found: from the disk
    assert _equal(_tensors(fresh), expected)
    _checked(memory_host)  # the leftover gone: what is left is checked (nothing: dropped)
    assert segment.step is None


_LEFTOVER = """
import mmap, sys
fd, nbytes, at = map(int, sys.argv[1:])
mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
print("mapped", flush=True)
sys.stdin.readline()
mm[at] ^= 0xFF
"""


def test_the_agent_looks_for_other_holders_of_its_segments(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    _saved(tmp_path / "ck", 2)
    segment = _segment_of(memory_host, 2)
    inode = os.fstat(segment.fd).st_ino
    assert other_holders(memory_host.token, {inode}) == {}  # (this process, the agent, is none)
    fd = os.dup(segment.fd)
    holder = subprocess.Popen(  # holds the descriptor only: it could map it, or write it
        [sys.executable, "-c", "import sys; sys.stdin.readline()"],
        pass_fds=[fd], stdin=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(fd)
    try:
        deadline = time.monotonic() + 10
        while other_holders(memory_host.token, {inode}) != {inode: [holder.pid]}:
            assert time.monotonic() < deadline, other_holders(memory_host.token, {inode})
            time.sleep(0.05)
        assert other_holders(memory_host.token, {inode + 1}) == {}  # (only the ones asked for)
    finally:
        holder.communicate("\n", timeout=30)
    assert other_holders(memory_host.token, {inode}) == {}


def test_a_hello_waits_for_its_own_ranks_check_only_and_not_for_long(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crashproof.supervisor import _memory_host

    _saved(tmp_path / "fast", 1)
    _saved(tmp_path / "slow", 1)
    release = threading.Event()
    check_held = _memory_host.check_held

    def slow_for_one_root(fd: int, nbytes: int, slot: Any, *args: Any) -> None:
        if slot[0] == slow_key:
            release.wait(30)
        check_held(fd, nbytes, slot, *args)

    monkeypatch.setattr(_memory_host, "check_held", slow_for_one_root)
    monkeypatch.setattr(_memory_host, "_CHECK_WAIT_S", 4.0)
    with cp.CheckpointManager(tmp_path / "slow") as probe:  # (the root's key, as the host has it)
        assert probe._pipeline._memory is not None
        slow_key = probe._pipeline._memory._key
    memory_host.trainers_stopped()
    try:
        began = time.monotonic()
        with cp.CheckpointManager(tmp_path / "fast") as fast:
            assert fast._pipeline._memory is not None and fast._pipeline._memory.verified(1)
        assert time.monotonic() - began < 3.5  # (not held up by the other root's check)
        began = time.monotonic()
        with cp.CheckpointManager(tmp_path / "slow") as slow:
            assert slow._pipeline._memory is not None
            assert not slow._pipeline._memory.verified(1)  # not checked in time: hashed
            assert time.monotonic() - began >= 4.0
            assert slow.restore(_state(seed=1)) == 1
            assert slow._restorer.last_verified_by == "restore"
    finally:
        release.set()
    assert memory_host.checks_done(30)


def test_a_check_vouches_for_one_hand_out_and_is_made_again_after_its_holder_stopped(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer a checked snapshot is handed to could write it, or fork a process that
    outlives it: the next trainer gets it unverified, until the agent checks it again."""
    root = tmp_path / "ck"
    _, expected = _saved(root, 3)
    _checked(memory_host)
    with cp.CheckpointManager(root) as first:
        assert first._pipeline._memory is not None and first._pipeline._memory.verified(3)
    with cp.CheckpointManager(root) as second:  # (no stop, no check in between)
        assert second._pipeline._memory is not None and not second._pipeline._memory.verified(3)
    segment = _segment_of(memory_host, 3)
    fd = os.dup(segment.fd)  # the second trainer's leftover keeps it
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"],
        pass_fds=[fd], stdin=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(fd)
    try:
        _checked(memory_host)
        assert segment.checked_gen is None  # held back
    finally:
        leftover.communicate("\n", timeout=30)
    _checked(memory_host)  # gone: checked again
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as third:
        assert third._pipeline._memory is not None and third._pipeline._memory.verified(3)
        assert third.restore(fresh) == 3 and third._restorer.last_verified_by == "agent"
    assert _equal(_tensors(fresh), expected)


def test_a_process_that_only_maps_a_segment_is_a_holder_too(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    """Mapped read-only and its descriptor closed, a mapping can still be made writable
    (mprotect: the descriptor it came from was): the agent counts it."""
    _saved(tmp_path / "ck", 2)
    segment = _segment_of(memory_host, 2)
    inode = os.fstat(segment.fd).st_ino
    fd = os.dup(segment.fd)
    mapper = subprocess.Popen(
        [sys.executable, "-c", _MAP_AND_CLOSE, str(fd), str(segment.nbytes)],
        pass_fds=[fd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(fd)
    try:
        assert mapper.stdout is not None and mapper.stdout.readline() == "mapped\n"
        links = [os.readlink(f.path) for f in os.scandir(f"/proc/{mapper.pid}/fd")]
        assert not any(memory_host.token in link for link in links)  # (no descriptor left)
        assert other_holders(memory_host.token, {inode}) == {inode: [mapper.pid]}
    finally:
        mapper.communicate("\n", timeout=30)


_MAP_AND_CLOSE = """
import ctypes, os, sys
fd, nbytes = map(int, sys.argv[1:])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
address = libc.mmap(None, nbytes, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
assert address not in (None, ctypes.c_void_p(-1).value)
os.close(fd)
print("mapped", flush=True)
sys.stdin.readline()
"""


def test_a_check_that_fails_lets_every_hello_go_on_and_the_restore_hashes(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crashproof.supervisor import _memory_host

    roots = [tmp_path / f"ck{i}" for i in range(3)]
    for root in roots:
        _saved(root, 1)

    def broken(*args: Any) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_memory_host, "check_held", broken)
    _checked(memory_host)
    assert not memory_host._unsure and not memory_host._checks
    monkeypatch.setattr(_memory_host, "other_holders", broken)
    _checked(memory_host)
    assert not memory_host._unsure and not memory_host._checks
    for root in roots:
        began = time.monotonic()
        with cp.CheckpointManager(root) as again:
            assert time.monotonic() - began < 5  # (no hello waits out the cap)
            assert again.restore(_state(seed=1)) == 1
            assert again._restorer.last_verified_by == "restore"
