"""A full disk that retention could have freed does not stop checkpointing.

The review's case: ``KeepLast(2)`` on a disk that holds exactly two checkpoints; retention ran
only after a commit, so the third save never committed, nor any after it. Here the disk is a real
tmpfs of that size where the test may mount one, and a storage with a byte quota otherwise; then
the attacker's variants: a policy that keeps everything, a disk too small for even one more, a
delta whose base retention must keep, a disk that stays full after the retry.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import crashproof as cp
from crashproof.checkpoint.format._names import checkpoint_dir_name
from crashproof.storage import MemoryStorage
from crashproof.storage._memory import _MemoryWriteStream


def _state(seed: int, n: int = 64) -> cp.TrainState:
    torch.manual_seed(seed)
    return cp.TrainState(model=torch.nn.Linear(n, n))


class _Disk(MemoryStorage):
    """Memory with a byte quota (a disk of that size), and ``fail`` writes failing with ENOSPC
    however much room there is (a disk another process fills)."""

    def __init__(self, quota: int | None = None, code: int = errno.ENOSPC) -> None:
        super().__init__()
        self.quota, self.fail, self.code = quota, 0, code

    def used(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._files.values())

    def create(self, path: str) -> _MemoryWriteStream:
        stream = super().create(path)
        disk = self

        class Stream(_MemoryWriteStream):
            def write(self, data: bytes | memoryview, /) -> None:
                if disk.fail > 0:
                    disk.fail -= 1
                    raise OSError(disk.code, os.strerror(disk.code), path)
                size = len(memoryview(data).cast("B"))
                if disk.quota is not None and disk.used() + len(self._buf) + size > disk.quota:
                    raise OSError(disk.code, os.strerror(disk.code), path)
                super().write(data)

        s = Stream(self, path)
        s._buf = stream._buf
        return s


def _steps(storage: MemoryStorage, root: str = "/ck") -> list[int]:
    return sorted(int(n[5:]) for n in storage.list(root) if n.startswith("step_"))


def _manager(storage: MemoryStorage, **kw: Any) -> cp.CheckpointManager:
    return cp.CheckpointManager(
        "/ck", storage=storage, async_save=False, handle_signals=False, **kw
    )


def _checkpoint_bytes() -> int:
    probe = _Disk()
    with _manager(probe) as m:
        m.save(1, _state(1))
    return probe.used()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["full-disk", "full-quota"])
def test_keep_last_2_on_a_disk_of_two_checkpoints_keeps_saving(
    caplog: pytest.LogCaptureFixture, code: int
) -> None:
    """A full quota (EDQUOT: the usual "disk full" on a shared cluster file system) too."""
    disk = _Disk(quota=2 * _checkpoint_bytes() + 512, code=code)
    with caplog.at_level(logging.WARNING), _manager(disk, keep=cp.KeepLast(2)) as m:
        for step in range(1, 9):
            m.save(step, _state(step))
            assert _steps(disk)[-1] == step, f"step {step} did not commit"
        stats = m.stats
    assert _steps(disk) == [7, 8]
    assert stats.saves_committed == 8 and stats.failures == 0
    assert stats.disk_full_retries == 6 and stats.removed_for_space == 6
    assert sum("disk full" in r.getMessage() for r in caplog.records) >= 6


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["full-disk", "full-quota"])
def test_retention_that_keeps_everything_frees_nothing_and_the_save_fails_once_retried(
    code: int,
) -> None:
    disk = _Disk(quota=2 * _checkpoint_bytes() + 512, code=code)
    with _manager(disk) as m:  # KeepAll
        m.save(1, _state(1))
        m.save(2, _state(2))
        m.save(3, _state(3))  # on_disk_full="continue": logged, counted, training goes on
        stats = m.stats
    assert _steps(disk) == [1, 2]
    assert stats.disk_full == 1 and stats.disk_full_retries == 1 and stats.removed_for_space == 0


def test_the_newest_valid_checkpoint_is_never_removed_to_make_room() -> None:
    disk = _Disk(quota=_checkpoint_bytes() + 512)  # room for one: the next save cannot fit
    with _manager(disk, keep=cp.KeepLast(1)) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
        stats = m.stats
    assert _steps(disk) == [1], "the only valid checkpoint was removed for a save that failed"
    assert stats.disk_full_retries == 1 and stats.failures == 1


def test_a_fresh_manager_finds_the_newest_valid_checkpoint_before_removing_anything() -> None:
    """Nothing restored nor saved by this manager yet: it must not trust the newest name."""
    disk = _Disk()
    with _manager(disk) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step))
    shard = f"/ck/{checkpoint_dir_name(3)}/rank_00000.safetensors"
    data = bytearray(disk.get_bytes(shard))
    data[-1] ^= 1
    disk.put_bytes(shard, bytes(data))  # step 3 is corrupt: step 2 is the newest valid
    disk.fail = 1
    with _manager(disk, keep=cp.KeepLast(1)) as m:
        m.save(4, _state(4))
    assert 4 in _steps(disk)
    disk_steps = _steps(disk)
    assert 2 in disk_steps or disk_steps == [4], "step 2 was removed before step 4 committed"


def test_a_base_that_a_kept_delta_needs_is_not_removed_to_make_room() -> None:
    disk = _Disk()
    with _manager(disk, keep=cp.KeepLast(2), delta=cp.Delta(full_every=10)) as m:
        for step in (1, 2, 3):  # 1 full, 2 and 3 deltas on 1
            m.save(step, _state(step))
        disk.fail = 1
        m.save(4, _state(4))  # a delta on 1: after it, KeepLast(2) keeps 3 and 4, and 1
        stats = m.stats
    assert _steps(disk) == [1, 3, 4]
    assert stats.disk_full_retries == 1 and stats.removed_for_space == 1
    fresh = _state(0)
    with cp.CheckpointManager("/ck", storage=disk, read_only=True, handle_signals=False) as r:
        assert r.restore(fresh) == 4


def test_a_disk_still_full_after_the_retry_is_retried_only_once() -> None:
    disk = _Disk()
    with _manager(disk, keep=cp.KeepLast(1)) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
        disk.fail = 2  # the first try and the retry
        m.save(3, _state(3))
        stats = m.stats
        disk.fail = 0
        m.save(4, _state(4))  # and the next save works as usual
    assert stats.disk_full_retries == 1 and stats.failures == 1
    assert _steps(disk) == [4]


def test_on_disk_full_raise_still_raises_after_the_retry() -> None:
    disk = _Disk()
    with _manager(disk, keep=cp.KeepLast(1), on_disk_full="raise") as m:
        m.save(1, _state(1))
        disk.fail = 2
        with pytest.raises(cp.CheckpointWriteError) as info:
            m.save(2, _state(2))
        assert info.value.errno == errno.ENOSPC


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A real filesystem that holds two checkpoints and a little (root only: skipped else)."""
    probe = tmp_path / "probe"
    with cp.CheckpointManager(str(probe), async_save=False, handle_signals=False) as m:
        m.save(1, _state(1, 256))
    size = sum(
        (os.lstat(os.path.join(d, f)).st_size + 4095) // 4096 * 4096
        for d, _, fs in os.walk(probe)
        for f in fs
    )
    mount = tmp_path / "disk"
    mount.mkdir()
    quota = 2 * size + size // 2
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={quota}", "tmpfs", str(mount)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount, size
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_filesystem_with_keep_last_2_keeps_saving(tmpfs: tuple[Path, int]) -> None:
    mount, _ = tmpfs
    root = mount / "ck"
    with cp.CheckpointManager(
        str(root), keep=cp.KeepLast(2), async_save=False, handle_signals=False
    ) as m:
        for step in range(1, 7):
            m.save(step, _state(step, 256))
            assert checkpoint_dir_name(step) in os.listdir(root), f"step {step} did not commit"
        stats = m.stats
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == [
        checkpoint_dir_name(5),
        checkpoint_dir_name(6),
    ]
    assert stats.failures == 0 and stats.disk_full_retries >= 1


# -- a checkpoint the run found corrupt is not one of the kept, and goes first when full ------


def _rot(disk: MemoryStorage, step: int) -> None:
    """A same-size bit flip in the shard: the checkpoint still lists as valid, fails checksums."""
    shard = f"/ck/{checkpoint_dir_name(step)}/rank_00000.safetensors"
    data = bytearray(disk.get_bytes(shard))
    data[-1] ^= 1
    disk.put_bytes(shard, bytes(data))


def test_a_full_disk_after_a_fallback_past_a_corrupt_checkpoint_keeps_saving() -> None:
    """The attack: the newest checkpoint rots, the run restarts and falls back; KeepLast(2)
    counted the corrupt copy as kept and spared it as "the step being saved", so no save ever
    committed again."""
    disk = _Disk(quota=2 * _checkpoint_bytes() + 512)
    with _manager(disk, keep=cp.KeepLast(2)) as m:
        for step in range(1, 6):
            m.save(step, _state(step))
    _rot(disk, 5)
    with _manager(disk, keep=cp.KeepLast(2)) as m:
        assert m.restore(_state(0)) == 4
        for step in range(5, 10):
            m.save(step, _state(step))
            assert _steps(disk)[-1] == step, f"step {step} did not commit"
        stats = m.stats
    assert _steps(disk) == [8, 9]
    assert stats.failures == 0 and stats.removed_for_space == 5
    with cp.CheckpointManager("/ck", storage=disk, read_only=True, handle_signals=False) as r:
        assert r.restore(_state(0)) == 9


def test_two_corrupt_checkpoints_are_not_counted_among_the_newest_kept() -> None:
    disk = _Disk(quota=3 * _checkpoint_bytes() + 512)
    with _manager(disk, keep=cp.KeepLast(3)) as m:
        for step in range(1, 6):
            m.save(step, _state(step))
    _rot(disk, 4)
    _rot(disk, 5)
    with _manager(disk, keep=cp.KeepLast(3)) as m:
        assert m.restore(_state(0)) == 3
        m.save(6, _state(6))  # room made from the two corrupt copies, never from step 3
        assert _steps(disk) == [3, 6]
        m.save(7, _state(7))
        m.save(8, _state(8))
        stats = m.stats
    assert _steps(disk) == [6, 7, 8]
    assert stats.failures == 0 and stats.removed_for_space >= 2


def test_the_newest_valid_checkpoint_stays_while_a_corrupt_one_makes_room() -> None:
    disk = _Disk(quota=2 * _checkpoint_bytes() + 512)
    with _manager(disk, keep=cp.KeepLast(2)) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step))
    _rot(disk, 3)
    removed: list[int] = []
    real_remove = disk.remove

    def remove(path: str) -> None:
        name = path.rsplit("/", 1)[1]
        if name.startswith("step_") and path.count("/") == 2:
            removed.append(int(name[5:]))
            assert 2 in _steps(disk) or removed[-1] != 2, "the newest valid one went first"
        real_remove(path)

    disk.remove = remove  # type: ignore[method-assign]
    with _manager(disk, keep=cp.KeepLast(1)) as m:
        assert m.restore(_state(0)) == 2
        m.save(3, _state(3))  # a full disk: the corrupt old copy of 3 goes, never 2
        assert removed[0] == 3, removed  # the corrupt old copy made the room
        m.save(4, _state(4))
    assert _steps(disk) == [4]


def test_a_checkpoint_the_storage_could_not_read_is_not_taken_for_corrupt() -> None:
    """A read refused (EIO, permissions) says nothing of the checkpoint: the restore stops
    there (tests/adversarial/test_refused_read.py), and a save made all the same does not
    remove it to make room, nor uncount it."""
    disk = _Disk(quota=2 * _checkpoint_bytes() + 512)
    with _manager(disk, keep=cp.KeepLast(2)) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step))
    refused = f"/ck/{checkpoint_dir_name(3)}/rank_00000.safetensors"
    real_open = disk.open

    def open_(path: str) -> Any:
        if path == refused and refuse:
            raise OSError(errno.EIO, "I/O error", path)
        return real_open(path)

    refuse = True
    disk.open = open_  # type: ignore[method-assign]
    with _manager(disk, keep=cp.KeepLast(2)) as m:
        with pytest.raises(cp.CheckpointReadError, match="step 3"):
            m.restore(_state(0))
        # Saved all the same, 3 still refused: KeepLast(2) keeps 3 and 4, and 2 is the newest
        # that reads: no room. Were 3 taken for corrupt, it would have been removed for 4.
        m.save(4, _state(4))
        stats = m.stats
    assert _steps(disk) == [2, 3] and stats.removed_for_space == 0 and stats.failures == 1


def test_a_real_full_filesystem_after_a_fallback_keeps_saving(tmpfs: tuple[Path, int]) -> None:
    mount, _ = tmpfs
    root = mount / "ck"
    kw: dict[str, Any] = {"keep": cp.KeepLast(2), "async_save": False, "handle_signals": False}
    with cp.CheckpointManager(str(root), **kw) as m:
        for step in range(1, 6):
            m.save(step, _state(step, 256))
    shard = root / checkpoint_dir_name(5) / "rank_00000.safetensors"
    with open(shard, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with cp.CheckpointManager(str(root), **kw) as m:
        assert m.restore(_state(0, 256)) == 4
        for step in range(5, 9):
            m.save(step, _state(step, 256))
            assert checkpoint_dir_name(step) in os.listdir(root), f"step {step} did not commit"
        stats = m.stats
    assert stats.failures == 0 and stats.removed_for_space >= 4
