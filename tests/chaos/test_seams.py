"""The two seams a campaign injects faults through from inside a trainer: the storage wrapper
(``CRASHPROOF_CHAOS_STORAGE``) and the NumericsGuard's loss (``CRASHPROOF_CHAOS_NAN``). Both are
inert without their environment variable, fire only on the rank they are armed for, and fire
once, however often the process restarts."""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from crashproof import NumericsGuard, _seams
from crashproof._seams import read_fired, write_control
from crashproof.storage import LocalStorage, Storage, read_all, storage_for, write_all
from crashproof.storage._faulty import FaultyStorage


@pytest.fixture(autouse=True)
def _fresh_process() -> Iterator[None]:
    """Each test starts as a new process would: no watcher remembers earlier firings."""
    _seams._watchers.clear()
    yield
    _seams._watchers.clear()


def _restart() -> None:
    """What a trainer restart does to the seams' memory: only the fired log survives."""
    _seams._watchers.clear()


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "storage.json"
    write_control(str(path), [])
    monkeypatch.setenv("CRASHPROOF_CHAOS_STORAGE", str(path))
    monkeypatch.setenv("RANK", "1")
    return path


def _write(storage: Storage, path: Path) -> None:
    write_all(storage, str(path), b"x" * 100)


def test_storage_for_wraps_the_backend_only_when_a_campaign_asks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CRASHPROOF_CHAOS_STORAGE", raising=False)
    assert type(storage_for(str(tmp_path))[1]) is LocalStorage
    monkeypatch.setenv("CRASHPROOF_CHAOS_STORAGE", str(tmp_path / "none.json"))
    _root, storage = storage_for(str(tmp_path))
    assert isinstance(storage, FaultyStorage) and isinstance(storage.inner, LocalStorage)
    # Nothing armed (not even a file): everything passes through unchanged.
    storage.make_dirs(str(tmp_path / "d"))
    write_all(storage, str(tmp_path / "d" / "f"), b"hello")
    assert read_all(storage, str(tmp_path / "d" / "f"), limit=10) == b"hello"
    storage.publish(str(tmp_path / "d"), str(tmp_path / "e"))
    assert storage.list(str(tmp_path / "e")) == ["f"]
    storage.remove(str(tmp_path / "e"))
    assert "e" not in storage.list(str(tmp_path))


def test_an_armed_enospc_fails_the_armed_rank_s_next_write_then_writes_work(
    tmp_path: Path, control: Path
) -> None:
    _, storage = storage_for(str(tmp_path))
    write_control(str(control), [{"id": "f1", "rank": 1, "error": "enospc", "files": 1}])
    with pytest.raises(OSError) as info:
        _write(storage, tmp_path / "a")
    assert info.value.errno == errno.ENOSPC
    assert "crashproof chaos fault f1" in str(info.value)
    assert not (tmp_path / "a").exists()  # write_all aborted the partial file
    _write(storage, tmp_path / "b")  # spent: the next write goes through
    assert (tmp_path / "b").read_bytes() == b"x" * 100
    assert [(r["id"], r["rank"], r["error"]) for r in read_fired(str(control))] == [
        ("f1", 1, "enospc")
    ]


def test_an_armed_eio_takes_the_next_n_files_across_restarts_and_spares_other_ranks(
    tmp_path: Path, control: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_control(
        str(control),
        [
            {"id": "f2", "rank": 1, "error": "eio", "files": 2},
            {"id": "f3", "rank": 0, "error": "enospc", "files": 5},
        ],
    )
    _, storage = storage_for(str(tmp_path))
    with pytest.raises(OSError) as info:
        _write(storage, tmp_path / "a")
    assert info.value.errno == errno.EIO
    _restart()  # the trainer restarts: the second file of the fault still fails, once
    _, storage = storage_for(str(tmp_path))
    with pytest.raises(OSError):
        storage.put_file(str(control), str(tmp_path / "b"))
    _write(storage, tmp_path / "c")
    assert [r["path"] for r in read_fired(str(control))] == [
        str(tmp_path / "a"),
        str(tmp_path / "b"),
    ]
    monkeypatch.setenv("RANK", "0")  # rank 0's fault is rank 0's
    _, other = storage_for(str(tmp_path))
    with pytest.raises(OSError) as info:
        _write(other, tmp_path / "d")
    assert info.value.errno == errno.ENOSPC


def test_an_armed_stall_holds_the_write_then_lets_it_through(tmp_path: Path, control: Path) -> None:
    write_control(str(control), [{"id": "f4", "rank": 1, "error": "hang", "hang_s": 0.5}])
    _, storage = storage_for(str(tmp_path))
    started = time.monotonic()
    _write(storage, tmp_path / "a")
    assert time.monotonic() - started >= 0.5
    assert (tmp_path / "a").read_bytes() == b"x" * 100
    started = time.monotonic()
    _write(storage, tmp_path / "b")
    assert time.monotonic() - started < 0.4


def _checks(guard: NumericsGuard, steps: range) -> list[bool]:
    return [guard.check(step, torch.tensor(0.5)) for step in steps]


def test_the_guard_sees_a_nan_loss_at_the_armed_step_of_the_armed_rank_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    control = tmp_path / "nan.json"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("CRASHPROOF_CHAOS_NAN", raising=False)
    assert all(_checks(NumericsGuard(), range(1, 6)))  # no variable: never
    monkeypatch.setenv("CRASHPROOF_CHAOS_NAN", str(control))
    assert all(_checks(NumericsGuard(), range(1, 6)))  # no file yet: nothing armed
    write_control(str(control), [{"id": "f1", "rank": 1, "step": 7}, {"id": "f2", "rank": 0}])
    guard = NumericsGuard()
    assert _checks(guard, range(1, 11)) == [True] * 6 + [False] + [True] * 3
    (anomaly,) = guard.anomalies
    assert (anomaly.step, anomaly.kind, anomaly.action) == (7, "nonfinite", "skip")
    _restart()  # a restarted trainer reaching step 7 again: it fired already
    assert all(_checks(NumericsGuard(), range(5, 10)))
    assert [(r["id"], r["rank"], r["step"]) for r in read_fired(str(control))] == [("f1", 1, 7)]


def test_a_nan_armed_for_a_step_already_passed_fires_at_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    control = tmp_path / "nan.json"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CRASHPROOF_CHAOS_NAN", str(control))
    guard = NumericsGuard()
    assert all(_checks(guard, range(1, 4)))
    write_control(str(control), [{"id": "f9", "rank": 0, "step": 2}])  # armed late
    assert _checks(guard, range(4, 7)) == [False, True, True]
