"""The agent checks the snapshots in its memory once its trainers have stopped, and a restarted
trainer copies a checked snapshot without hashing it again (it maps it read-only until it writes).

Each test plays the agent's memory host in this process and trainers as managers: one saves and
is closed (its trainer "died"), the host is told its trainers stopped, and the next restores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import crashproof as cp
from crashproof.checkpoint.format import _shard_file
from crashproof.supervisor._memory_host import MemoryHost
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
    if host._checking is not None:
        host._checking.join(30)


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
