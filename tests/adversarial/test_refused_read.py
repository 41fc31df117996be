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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crashproof import CheckpointManager, CheckpointReadError, Delta, Tier
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
