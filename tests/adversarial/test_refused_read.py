"""Promise: a checkpoint the storage refuses to read is never fallen back past.

A permission or an I/O error says nothing against a checkpoint. Falling back past it would resume
from an older step and, once training saved that step again, replace a checkpoint that may be
perfectly good: its steps would be lost for a passing error. So a restore stops with
:class:`CheckpointReadError` naming the file, changes nothing live, and restores that checkpoint
once the storage reads it again. A durable tier's copy of the same step is tried before giving up.
Written as an attacker: every file of a checkpoint, each way the storage refuses it.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crashproof import CheckpointManager, CheckpointReadError, Delta, KeepAll, KeepLast, Tier
from crashproof.checkpoint.format import checkpoint_dir_name
from tests.adversarial.test_restore_all_or_nothing import (
    _assert_unchanged,
    _run,
    _save,
    _snapshot,
)

REFUSALS = [errno.EACCES, errno.EPERM, errno.EIO, errno.ESTALE]
FILES = ["manifest.json", "rank_00000.json", "rank_00000.safetensors"]


@pytest.fixture
def refuse(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``refuse(path, err_no)``: every open of the file now at ``path`` fails with ``err_no``
    until ``refuse(None)``. By identity (device, inode), not by name: a copy published later at
    the same path is another file and reads."""
    real_open = os.open
    refused: dict[tuple[int, int], int] = {}

    def opener(path: Any, flags: int, *args: Any, dir_fd: int | None = None, **kw: Any) -> int:
        try:
            found = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            found = None
        if found is not None and (found.st_dev, found.st_ino) in refused:
            err_no = refused[found.st_dev, found.st_ino]
            raise OSError(err_no, os.strerror(err_no), os.fsdecode(path))
        return real_open(path, flags, *args, dir_fd=dir_fd, **kw)

    def arm(path: Path | None, err_no: int = errno.EACCES) -> None:
        refused.clear()
        if path is not None:
            found = os.stat(path)
            refused[found.st_dev, found.st_ino] = err_no

    monkeypatch.setattr(os, "open", opener)
    yield arm


@pytest.mark.parametrize("err_no", REFUSALS, ids=errno.errorcode.get)
@pytest.mark.parametrize("name", FILES)
def test_a_refused_read_stops_the_restore_and_changes_nothing(
    tmp_path: Path, refuse: Any, name: str, err_no: int
) -> None:
    root = tmp_path / "ck"
    _save(root, _run(1), 1, 2)
    state = _run(7)
    before = _snapshot(state)
    refuse(root / checkpoint_dir_name(2) / name, err_no)
    with CheckpointManager(root, handle_signals=False) as manager:
        with pytest.raises(CheckpointReadError) as info:
            manager.restore(state)
        message = str(info.value)
        assert "step 2" in message and name in message and os.strerror(err_no) in message
        assert "did not fall back" in message, message
        _assert_unchanged(state, before)
        # Nothing was judged against it: still listed, and restored once it reads again.
        assert [i.step for i in manager.list()] == [2, 1]
        refuse(None)
        assert manager.restore(state) == 2
    assert {checkpoint_dir_name(1), checkpoint_dir_name(2)} <= set(os.listdir(root))


@pytest.mark.parametrize("name", FILES)
def test_an_explicit_step_the_storage_refuses_is_a_read_error_not_corrupt(
    tmp_path: Path, refuse: Any, name: str
) -> None:
    root = tmp_path / "ck"
    _save(root, _run(1), 1, 2)
    state = _run(7)
    before = _snapshot(state)
    refuse(root / checkpoint_dir_name(2) / name, errno.EIO)
    with (
        CheckpointManager(root, handle_signals=False, read_only=True) as manager,
        pytest.raises(CheckpointReadError, match="step 2"),
    ):
        manager.restore(state, step=2)
    _assert_unchanged(state, before)


def test_an_older_refused_checkpoint_is_never_reached_when_a_newer_one_restores(
    tmp_path: Path, refuse: Any
) -> None:
    root = tmp_path / "ck"
    _save(root, _run(1), 1, 2)
    refuse(root / checkpoint_dir_name(1) / "rank_00000.safetensors", errno.EIO)
    with CheckpointManager(root, handle_signals=False) as manager:
        assert manager.restore(_run(7)) == 2


def test_a_corrupt_newest_checkpoint_still_falls_back(tmp_path: Path) -> None:
    """The other side of the line: corruption is known against a checkpoint, so restore falls
    back past it as before."""
    root = tmp_path / "ck"
    _save(root, _run(1), 1, 2)
    shard = root / checkpoint_dir_name(2) / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    with CheckpointManager(root, handle_signals=False) as manager:
        assert manager.restore(_run(7)) == 1


def test_a_tiers_copy_of_a_refused_step_is_restored_instead(tmp_path: Path, refuse: Any) -> None:
    """The local copy of the newest step cannot be read; the durable tier's copy of that same
    step can: it is brought back and restored, and nothing older is considered."""
    root, remote = tmp_path / "ck", tmp_path / "remote"
    with CheckpointManager(
        root, async_save=False, handle_signals=False, remote=Tier(str(remote))
    ) as manager:
        for step in (1, 2):
            manager.save(step, _run(1))
    assert checkpoint_dir_name(2) in os.listdir(remote)
    refuse(root / checkpoint_dir_name(2) / "rank_00000.safetensors", errno.EIO)
    state = _run(7)
    with CheckpointManager(root, handle_signals=False, remote=Tier(str(remote))) as manager:
        # The local copy is refused, the tier's is downloaded over it (a new file: readable).
        assert manager.restore(state) == 2


def test_an_io_error_in_the_middle_of_a_read_stops_the_restore_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file opens, then the disk fails under a read (EIO from ``preadv``)."""
    root = tmp_path / "ck"
    _save(root, _run(1), 1, 2)
    shard = os.path.realpath(root / checkpoint_dir_name(2) / "rank_00000.safetensors")
    real_preadv = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if offset > 0 and os.readlink(f"/proc/self/fd/{fd}") == shard:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", preadv)
    state = _run(7)
    before = _snapshot(state)
    with (
        CheckpointManager(root, handle_signals=False) as manager,
        pytest.raises(CheckpointReadError) as info,
    ):
        manager.restore(state)
    assert shard in str(info.value) and os.strerror(errno.EIO) in str(info.value)
    _assert_unchanged(state, before)


@pytest.mark.parametrize("name", FILES)
def test_a_delta_whose_base_the_storage_refuses_is_not_fallen_back_past(
    tmp_path: Path, refuse: Any, name: str
) -> None:
    """Steps 1 (full) and 2 (a delta on 1), the base unreadable: the delta cannot be rebuilt
    for now, which says nothing against either. A fallback would reach nothing newer anyway,
    and must not start the run over."""
    root = tmp_path / "ck"
    options: dict[str, Any] = {"async_save": False, "handle_signals": False}
    with CheckpointManager(root, delta=Delta(full_every=4), **options) as manager:
        for step in (1, 2):
            manager.save(step, _run(step))
    assert [i.kind for i in CheckpointManager(root, read_only=True).list()] == ["delta", "full"]
    refuse(root / checkpoint_dir_name(1) / name, errno.EIO)
    state = _run(7)
    before = _snapshot(state)
    with CheckpointManager(root, **options) as manager:
        with pytest.raises(CheckpointReadError, match="step 2"):
            manager.restore(state)
        _assert_unchanged(state, before)
        refuse(None)
        assert manager.restore(state) == 2


def _with_tier(tmp_path: Path, **tier: Any) -> tuple[Path, Path]:
    root, remote = tmp_path / "ck", tmp_path / "remote"
    with CheckpointManager(
        root, async_save=False, handle_signals=False, remote=Tier(str(remote), **tier),
        keep=KeepLast(2),
    ) as manager:  # fmt: skip
        for step in (1, 2, 3, 4):
            manager.save(step, _run(step))
    return root, remote


def test_a_step_only_a_tier_holds_that_the_tier_refuses_is_not_fallen_back_past(
    tmp_path: Path, refuse: Any
) -> None:
    """A replaced node: the local copy is gone, the tier's copy refuses a read (EIO)."""
    root, remote = _with_tier(tmp_path)
    shutil.rmtree(root / checkpoint_dir_name(4))
    refuse(remote / checkpoint_dir_name(4) / "rank_00000.safetensors", errno.EIO)
    state = _run(7)
    before = _snapshot(state)
    with CheckpointManager(root, handle_signals=False, remote=Tier(str(remote))) as manager:
        with pytest.raises(CheckpointReadError, match="step 4"):
            manager.restore(state)
        _assert_unchanged(state, before)
        refuse(None)
        assert manager.restore(state) == 4


def test_a_rollback_never_removes_a_checkpoint_it_could_not_read(
    tmp_path: Path, refuse: Any
) -> None:
    """Local KeepLast(2) holds 3 and 4, the tier (KeepAll) 1 to 4; the tier's 2 refuses a read.
    A rollback before 3 must stop there, not restore 1 and remove 2, 3 and 4 everywhere."""
    root, remote = _with_tier(tmp_path, keep=KeepAll())
    assert {checkpoint_dir_name(s) for s in (1, 2, 3, 4)} <= set(os.listdir(remote))
    refuse(remote / checkpoint_dir_name(2) / "rank_00000.safetensors", errno.EIO)
    tier = Tier(str(remote), keep=KeepAll())
    with (
        CheckpointManager(root, handle_signals=False, remote=tier) as manager,
        pytest.raises(CheckpointReadError, match="step 2"),
    ):
        manager.rollback(_run(7), before=3, anomaly_step=5)
    assert {checkpoint_dir_name(s) for s in (1, 2, 3, 4)} <= set(os.listdir(remote))
    assert {checkpoint_dir_name(s) for s in (3, 4)} <= set(os.listdir(root))


def test_a_root_that_cannot_be_listed_either_is_a_read_error_never_step_0(
    tmp_path: Path, refuse: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flaky disk: the newest manifest refuses a read and every other listing of the root
    fails. That is no proof the checkpoint vanished: restore must not relist until it gives up
    and starts from step 0."""
    root = tmp_path / "ck"
    _save(root, _run(1), 1, 2)
    refuse(root / checkpoint_dir_name(2) / "manifest.json", errno.EIO)
    real_scandir, calls = os.scandir, [0]

    def scandir(path: Any = ".") -> Any:
        if os.fspath(path).rstrip("/") == str(root):
            calls[0] += 1
            if calls[0] % 2 == 0:
                raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with (
        CheckpointManager(root, handle_signals=False, read_only=True) as manager,
        pytest.raises(CheckpointReadError, match="step 2"),
    ):
        manager.restore(_run(7))


_TWO_RANKS = """
import errno, os, sys, torch, torch.distributed as dist
import crashproof as cp
from crashproof.checkpoint.format import checkpoint_dir_name
from crashproof.checkpoint.restore import RankRead

root, rank = sys.argv[1], int(os.environ["RANK"])
dist.init_process_group("gloo")
def state(seed):
    torch.manual_seed(seed)
    return cp.TrainState(model=torch.nn.Linear(64, 64))
opts = dict(handle_signals=False, dedup_replicated=False)
with cp.CheckpointManager(root, async_save=False, **opts) as m:
    m.save(1, state(10 + rank))
dist.barrier()
if rank == 1:  # an I/O error under the second read of this rank only (restore_memory_bytes=0)
    real_finish, real_preadv = RankRead.finish, os.preadv
    armed = []
    def finish(self, *args):
        armed.append(1)
        return real_finish(self, *args)
    def preadv(fd, buffers, offset, *args):
        if armed:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset, *args)
    RankRead.finish, os.preadv = finish, preadv
try:
    with cp.CheckpointManager(root, restore_memory_bytes=0, read_only=True, **opts) as m:
        m.restore(state(99))
    print(f"rank {rank}: restored", flush=True)
except cp.CorruptCheckpointError as exc:
    print(f"rank {rank}: refused: {exc}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_load_failing_on_one_rank_fails_on_every_rank(tmp_path: Path, warm_ranks: Any) -> None:
    """The second read (tensors beyond the read buffer) fails on rank 1 only: rank 0 must not
    train on alone with a state its peer does not hold."""
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    launch = warm_ranks.run(script, [str(tmp_path / "ck")], nproc=2, timeout=120)
    assert launch.exit_codes == [0, 0], launch.output
    assert "rank 0: refused" in launch.output and "another rank failed" in launch.output
    assert "rank 1: refused" in launch.output and "may now hold a mix" in launch.output
    assert "restored" not in launch.output, launch.output
