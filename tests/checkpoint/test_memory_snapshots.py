"""Snapshots in the agent's memory, in one process: the agent's memory host runs in the test (as
``crashproof run`` starts it), and a second manager on the same root plays the restarted trainer.

What a snapshot must be: this rank's part of a checkpoint, byte for byte what the disk holds,
verified like it on restore; offered only once complete; never offered again once found corrupt
or abandoned by a rollback; and never more memory than the host allows."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import crashproof as cp
from crashproof.checkpoint.format import _shard_file, checkpoint_dir_name, index_name
from crashproof.checkpoint.memory._slot_storage import SlotStorage
from crashproof.checkpoint.restore._rank_read import verify_checkpoint
from crashproof.checkpoint.save import SharedChecksums
from crashproof.link import ENV_MEMORY_SOCKET
from crashproof.storage import LocalStorage
from crashproof.supervisor._memory_host import MemoryHost
from crashproof.telemetry import EventLog
from tests.checkpoint.test_manager import _equal, _state, _tensors


def _train(state: cp.TrainState) -> None:
    assert state.model is not None and state.optimizer is not None
    state.optimizer.zero_grad()
    state.model(torch.randn(4, 6)).sum().backward()
    state.optimizer.step()


def test_a_restarted_trainer_resumes_from_the_newest_memory_snapshot(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(root, every=cp.EverySteps(10), memory_every=cp.EverySteps(3)) as ckpt:
        values = {}
        for step in range(1, 15):
            _train(state)
            ckpt.maybe_save(step, state)
            values[step] = _tensors(state)
            ckpt.wait()  # (a memory snapshot never waits: one due while a save runs is skipped)
        ckpt.wait()
        assert ckpt.stats.memory_snapshots == 5  # 3, 6, 9, 10 (the disk save's), 12
        assert ckpt.stats.saves_committed == 1  # step 10 only, on disk
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_0000000010"
    ]
    fresh = _state(seed=1)
    with cp.CheckpointManager(
        root, every=cp.EverySteps(10), memory_every=cp.EverySteps(3)
    ) as again:
        assert again.restore(fresh) == 12
        assert again._restorer.last_kind == "memory"
        assert again._restorer.last_bytes > 0
    assert _equal(_tensors(fresh), values[12])


def test_the_memory_part_is_the_disk_part_byte_for_byte(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(root, every=cp.EverySteps(1)) as ckpt:
        ckpt.save(5, state)
        ckpt.wait()
        memory = ckpt._pipeline._memory
        assert memory is not None
        storage, path = memory.storage(5)
        files = memory.slots[memory.steps()[5]].files()
        shard = storage.open(f"{path}/rank_00000.safetensors")
        data = bytearray(shard.size())
        shard.readinto(0, memoryview(data))
    disk = root / "step_0000000005"
    assert files[index_name(0)] == (disk / index_name(0)).read_bytes()
    assert bytes(data) == (disk / "rank_00000.safetensors").read_bytes()


def test_memory_ranks_first_at_its_step_and_disk_wins_when_newer(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(root, every=cp.EverySteps(1)) as ckpt:
        ckpt.save(4, state)
        ckpt.wait()
    with cp.CheckpointManager(root, every=cp.EverySteps(1), memory=False) as disk_only:
        disk_only.save(6, state)  # newer, on disk only
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 6
        assert again._restorer.last_kind == "local"


def test_a_corrupt_memory_snapshot_falls_back_to_the_same_step_on_disk(
    memory_host: MemoryHost, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    state = _state()
    expected = _tensors(state)
    with cp.CheckpointManager(root, every=cp.EverySteps(1)) as ckpt:
        ckpt.save(7, state)
        ckpt.wait()
        memory = ckpt._pipeline._memory
        assert memory is not None
        slot = memory.slots[memory.steps()[7]]
        start, size = slot.contents["shard"]
        slot.view()[start + size - 5] ^= 0xFF  # a flipped bit in RAM
    fresh = _state(seed=1)
    with caplog.at_level(logging.WARNING), cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 7
        assert again._restorer.last_kind == "local"
        assert again._pipeline._memory is not None and again._pipeline._memory.steps() == {}
    assert "memory of crashproof run's agent" in caplog.text
    assert _equal(_tensors(fresh), expected)


def test_a_snapshot_being_overwritten_is_never_offered(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(root, every=cp.EverySteps(1)) as ckpt:
        ckpt.save(3, state)
        ckpt.wait()
        memory = ckpt._pipeline._memory
        assert memory is not None
        memory.slots[0].overwriting()  # a trainer killed mid-copy got this far
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 3
        assert again._restorer.last_kind == "local"


def test_a_rollback_retracts_the_newer_memory_snapshots(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(
        root, every=cp.EverySteps(5), memory_every=cp.EverySteps(1), staging_buffers=2
    ) as ckpt:
        for step in range(1, 8):
            _train(state)
            ckpt.maybe_save(step, state)
        ckpt.wait()
        assert ckpt.rollback(state, before=6, anomaly_step=7) == 5
        memory = ckpt._pipeline._memory
        assert memory is not None and max(memory.steps(), default=0) <= 5
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 5


def test_a_refusal_names_staging_buffers_1_only_for_a_manager_with_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    host = MemoryHost(EventLog(tmp_path / "events.jsonl"), limit_bytes=64 * 1024)
    monkeypatch.setenv(ENV_MEMORY_SOCKET, host.address)
    try:
        big = cp.TrainState(model=nn.Linear(512, 512, bias=False))  # 1 MiB, over the limit
        with (
            caplog.at_level(logging.ERROR),
            cp.CheckpointManager(
                tmp_path / "ck", every=cp.EverySteps(1), memory_every=cp.EverySteps(1),
                staging_buffers=2,
            ) as ckpt,
        ):  # fmt: skip
            ckpt.save(1, big)
            assert ckpt.wait() is not None
        assert "need 1.01 MiB" in caplog.text and "or use staging_buffers=1" in caplog.text
    finally:
        host.close()


def test_refused_shared_memory_names_the_amount_and_the_checkpoint_still_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    host = MemoryHost(EventLog(tmp_path / "events.jsonl"), limit_bytes=64 * 1024)
    monkeypatch.setenv(ENV_MEMORY_SOCKET, host.address)
    before = _segments_open()
    try:
        big = cp.TrainState(model=nn.Linear(512, 512, bias=False))  # 1 MiB, over the limit
        with (
            caplog.at_level(logging.ERROR),
            cp.CheckpointManager(
                tmp_path / "ck", every=cp.EverySteps(1), memory_every=cp.EverySteps(1)
            ) as ckpt,
        ):
            ckpt.save(1, big)  # refused memory: staged in buffers of its own, to disk
            ckpt.maybe_save(2, big)  # memory snapshots are off: a disk save only
            assert ckpt.wait() is not None and ckpt.stats.saves_committed == 2
            assert ckpt.stats.memory_snapshots == 0
        assert "need 1.01 MiB" in caplog.text and "--memory-limit 64 KiB" in caplog.text
        assert "memory snapshots are off" in caplog.text
        assert "staging_buffers" not in caplog.text  # (one buffer already: no advice to take one)
        assert host.held_bytes == 0
        assert _segments_open() <= before
    finally:
        host.close()


def _segments_open() -> set[str]:
    """The memory segments this process has open (the host runs in it here)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:crashproof:" in link:
            found.add(fd)
    return found


def test_without_crashproof_run_memory_every_only_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV_MEMORY_SOCKET, raising=False)
    state = _state()
    with (
        caplog.at_level(logging.INFO),
        cp.CheckpointManager(
            tmp_path / "ck", every=cp.EverySteps(10), memory_every=cp.EverySteps(2)
        ) as ckpt,
    ):
        for step in range(1, 5):
            ckpt.maybe_save(step, state)
        assert ckpt.stats.memory_snapshots == 0
    assert "crashproof run's agent" in caplog.text


def test_synchronous_saves_take_memory_snapshots_in_an_area_of_their_own(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(
        root, every=cp.EverySteps(4), memory_every=cp.EverySteps(1), async_save=False
    ) as ckpt:
        for step in range(1, 7):
            _train(state)
            ckpt.maybe_save(step, state)
            ckpt.wait()
        expected = _tensors(state)
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 6
        assert again._restorer.last_kind == "memory"
    assert _equal(_tensors(fresh), expected)


def test_memory_every_refuses_clock_policies_with_several_ranks_and_read_only() -> None:
    with pytest.raises(cp.ConfigError, match="read_only"):
        cp.CheckpointManager("/nowhere", memory_every=cp.EverySteps(2), read_only=True)


def test_non_finite_state_is_refused_once_and_never_offered_from_memory(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(
        root, every=cp.EverySteps(3), memory_every=cp.EverySteps(1), staging_buffers=2
    ) as ckpt:
        ckpt.maybe_save(1, state)
        ckpt.wait()
        assert state.model is not None
        with torch.no_grad():
            next(state.model.parameters())[0, 0] = float("nan")
        ckpt.maybe_save(2, state)  # memory only: refused on the snapshot thread, ...
        with pytest.raises(cp.NonFiniteStateError, match="step 2"):
            ckpt.wait()  # ... and raised at the next call
        ckpt.maybe_save(3, state)  # a disk save, its snapshot a memory one too
        with pytest.raises(cp.NonFiniteStateError, match="step 3"):
            ckpt.wait()
        ckpt.wait()  # once: not a second time for its memory copy
        memory = ckpt._pipeline._memory
        assert memory is not None and set(memory.steps()) == {1}


@pytest.mark.parametrize("buffers", [2, 3])
def test_a_third_staging_buffer_snapshots_on_while_one_is_covered_and_one_is_copied(
    memory_host: MemoryHost, tmp_path: Path, buffers: int
) -> None:
    """On several nodes, one slot holds the step the other nodes cover and another may be on its
    way to them (slowly, with --peer-bandwidth): with two buffers, every snapshot due meanwhile
    is skipped; a third takes them."""
    state = _state()
    with cp.CheckpointManager(
        tmp_path / "ck", every=cp.EverySteps(10**6), memory_every=cp.EverySteps(1),
        staging_buffers=buffers,
    ) as ckpt:  # fmt: skip
        for step in (1, 2):
            ckpt.maybe_save(step, state)
            ckpt.wait()
        memory = ckpt._pipeline._memory
        assert memory is not None
        slot_of = {s.step: s.index for s in memory.slots if s.step is not None}
        memory_host.pin(memory._key, 1)  # the agent: step 1 is covered, step 2 is being sent
        memory_host.sending([(memory._key, 0, slot_of[2])], True)
        for step in (3, 4, 5):
            _train(state)
            ckpt.maybe_save(step, state)
            ckpt.wait()
        taken = ckpt.stats.memory_snapshots
        held = {s.step for s in memory.slots}
    if buffers == 3:
        assert (taken, held) == (5, {1, 2, 5})
    else:
        assert (taken, held) == (2, {1, 2})


def _bytes_hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every chunk the shard writers hash from now on."""
    hashed: list[int] = []
    hash_chunk = _shard_file._hash_chunk

    def counting(hasher: object, chunk: memoryview, index: int, inspect: object) -> None:
        hashed.append(len(chunk))
        hash_chunk(hasher, chunk, index, inspect)  # type: ignore[arg-type]

    monkeypatch.setattr(_shard_file, "_hash_chunk", counting)
    return hashed


def _hashed_without_an_agent(
    state: cp.TrainState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed: list[int]
) -> int:
    """The bytes the same save of ``state`` hashes without an agent (``hashed`` is emptied)."""
    with monkeypatch.context() as alone:
        alone.delenv(ENV_MEMORY_SOCKET)
        with cp.CheckpointManager(tmp_path / "alone", async_save=True) as ckpt:
            ckpt.save(1, state)
    once, hashed[:] = sum(hashed), []
    assert once > 0
    return once


def _restored_from_disk(root: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """The newest checkpoint on disk, verified as ``crashproof verify`` does and restored by a
    trainer with no agent (so no memory snapshot can stand in for it)."""
    step = max(int(p.name.removeprefix("step_")) for p in root.glob("step_*"))
    verify_checkpoint(LocalStorage(), str(root / checkpoint_dir_name(step)))
    with monkeypatch.context() as alone:
        alone.delenv(ENV_MEMORY_SOCKET)
        fresh = _state(seed=1)
        with cp.CheckpointManager(root) as again:
            assert again.restore(fresh) == step
            assert again._restorer.last_kind != "memory"
    return _tensors(fresh)


@pytest.mark.parametrize("buffers", [1, 2])
def test_a_disk_save_takes_the_checksums_its_memory_snapshot_worked_out(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffers: int
) -> None:
    """The staged bytes of a save under crashproof run are both the memory snapshot and the
    disk checkpoint's source: hashed (and checked finite) once, by the memory snapshot's writer,
    not once by each writer."""
    hashed = _bytes_hashed(monkeypatch)
    state = _state()
    once = _hashed_without_an_agent(state, tmp_path, monkeypatch, hashed)
    root = tmp_path / "ck"
    with cp.CheckpointManager(root, async_save=True, staging_buffers=buffers) as ckpt:
        for step in (1, 2, 3):
            _train(state)
            hashed.clear()
            ckpt.save(step, state)
            ckpt.wait()
            assert sum(hashed) == once, f"step {step}: {sum(hashed)} bytes hashed, {once} staged"
        assert ckpt.stats.memory_snapshots == 3 and ckpt.stats.saves_committed == 3
        values = _tensors(state)
    assert _equal(_restored_from_disk(root, monkeypatch), values)


def test_a_delta_save_hashes_what_it_stores_and_restores_exactly(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delta stores other bytes under the tensors' names than the memory snapshot hashed: it
    hashes its own, and both restore exactly."""
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(root, delta=cp.Delta(full_every=3)) as ckpt:
        for step in (1, 2):
            _train(state)
            ckpt.save(step, state)
        ckpt.wait()
        values = _tensors(state)
    assert (root / checkpoint_dir_name(2) / "manifest.json").read_text().count('"delta"') >= 1
    assert _equal(_restored_from_disk(root, monkeypatch), values)
    fresh = _state(seed=1)
    with cp.CheckpointManager(root) as again:
        assert again.restore(fresh) == 2 and again._restorer.last_kind == "memory"
    assert _equal(_tensors(fresh), values)


@pytest.mark.parametrize("where", ["before hashing", "at the commit"])
def test_a_memory_snapshot_that_fails_never_holds_up_or_spoils_the_disk_save(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Whether the memory snapshot's writer fails before it hashed the bytes (the disk writer
    then hashes them itself) or after (its checksums stand: the bytes are the same), the disk
    checkpoint commits, verifies and restores exactly."""

    def segment_gone(self: SlotStorage, path: str) -> None:
        raise OSError(errno.EIO, "the segment is gone")

    def agent_gone(self: SlotStorage, tmp_dir: str, final_dir: str, **_: object) -> None:
        raise OSError(errno.ECONNRESET, "crashproof run's agent is gone")

    if where == "before hashing":
        monkeypatch.setattr(SlotStorage, "create", segment_gone)
    else:
        monkeypatch.setattr(SlotStorage, "publish", agent_gone)
    hashed = _bytes_hashed(monkeypatch)
    root = tmp_path / "ck"
    state = _state()
    once = _hashed_without_an_agent(state, tmp_path, monkeypatch, hashed)
    with cp.CheckpointManager(root, async_save=True) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        assert ckpt.stats.saves_committed == 1 and ckpt.stats.memory_failures == 1
        values = _tensors(state)
    assert sum(hashed) == once  # by the disk writer, or by the memory one before it failed
    assert _equal(_restored_from_disk(root, monkeypatch), values)


def test_a_hand_over_is_waited_for_only_once_its_hashing_has_begun() -> None:
    """The disk writer waits for checksums being worked out (CPU only), for a memory write due
    to begin at once (a few seconds at most), never for one queued behind another commit (its
    thread may be held by an agent that stopped answering); only the first hand-over counts."""
    queued = SharedChecksums(begins_at_once=False)
    assert queued.take() == {}  # at once
    queued.begin()
    queued.give({"w": "1"})  # (the write that began late keeps its checksums for itself)

    due = SharedChecksums(begins_at_once=True)
    threading.Timer(0.2, due.begin).start()
    threading.Timer(0.4, due.give, args=({"w": "abc"},)).start()
    assert due.take() == {"w": "abc"}
    due.give({})  # too late to count
    assert due.take() == {"w": "abc"}

    failed = SharedChecksums(begins_at_once=True)
    failed.begin()
    failed.give({})
    assert failed.take() == {}


def test_a_hand_over_that_never_begins_is_waited_for_once_and_briefly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(SharedChecksums, "BEGIN_WITHIN_S", 0.3)
    never = SharedChecksums(begins_at_once=True)
    started = time.monotonic()
    assert never.take() == {}
    assert 0.3 <= time.monotonic() - started < 5
    started = time.monotonic()
    assert never.take() == {}  # (asked again: the same answer, at once)
    assert time.monotonic() - started < 0.2
    never.begin()
    never.give({"w": "late"})
    assert never.take() == {}


def test_a_memory_snapshot_failing_before_it_hashes_lets_the_disk_save_go_on_at_once(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory snapshot's commit fails before its writer began to hash (here as a CUDA
    event or the agent's segment could make it fail): its end hands over nothing, so the disk
    writer, which waits for a memory write due at once, hashes for itself right away."""
    from crashproof.checkpoint.memory import _snapshots

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the snapshot could not be read")

    monkeypatch.setattr(_snapshots, "persist", failing)
    monkeypatch.setattr(SharedChecksums, "BEGIN_WITHIN_S", 30.0)
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(root, async_save=True) as ckpt:
        started = time.monotonic()
        ckpt.save(1, state)
        assert ckpt._pipeline.wait_commit() is not None
        assert time.monotonic() - started < 15, "the disk save waited for the memory snapshot"
        ckpt.wait()
        assert ckpt.stats.memory_failures == 1 and ckpt.stats.saves_committed == 1
        values = _tensors(state)
    assert _equal(_restored_from_disk(root, monkeypatch), values)


def test_a_disk_save_never_waits_for_a_memory_snapshot_queued_behind_another(
    memory_host: MemoryHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory snapshots' thread is held by an earlier commit (to an agent that does not
    answer, here held by the test) when a checkpoint is saved: the save stages into the other
    buffer, and the disk writer hashes and checks the bytes itself instead of waiting; both
    snapshots and the checkpoint commit once the thread is let go."""
    from crashproof.checkpoint.memory import _snapshots

    released = threading.Event()
    held_up: list[bool] = []
    persist = _snapshots.persist

    def held_first(*args: Any, **kwargs: Any) -> Any:
        if not held_up:
            held_up.append(not released.wait(30))
        return persist(*args, **kwargs)

    monkeypatch.setattr(_snapshots, "persist", held_first)
    root = tmp_path / "ck"
    state = _state()
    with cp.CheckpointManager(
        root, every=cp.EverySteps(2), memory_every=cp.EverySteps(1), staging_buffers=2
    ) as ckpt:
        ckpt.maybe_save(1, state)  # memory only: its commit is held
        _train(state)
        ckpt.maybe_save(2, state)  # a checkpoint, and a memory snapshot behind the held one
        committed = ckpt._pipeline.wait_commit()
        assert committed is not None and committed.step == 2
        released.set()
        ckpt.wait()
        assert held_up == [False], "the checkpoint waited for the held memory snapshot"
        assert ckpt.stats.memory_snapshots == 2 and ckpt.stats.saves_committed == 1
        values = _tensors(state)
    assert _equal(_restored_from_disk(root, monkeypatch), values)
