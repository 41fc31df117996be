"""CheckpointManager behaviour: sync and async saves, background failures, restore choices."""

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
from crashproof.storage import MemoryStorage
from crashproof.storage._memory import _MemoryWriteStream


def _state(seed: int = 0) -> cp.TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return cp.TrainState(model=model, optimizer=opt, extra={"tokens": 7})


def _tensors(state: cp.TrainState) -> dict[str, torch.Tensor]:
    assert state.model is not None and state.optimizer is not None
    out = {f"m/{k}": v.clone() for k, v in state.model.state_dict().items()}
    for pid, ps in state.optimizer.state_dict()["state"].items():
        out.update({f"o/{pid}/{k}": v.clone() for k, v in ps.items()})
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class FailingStorage(MemoryStorage):
    """MemoryStorage whose writes fail with ``error`` once ``armed`` (a fault-injection seam)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: OSError | None = None

    def create(self, path: str) -> _MemoryWriteStream:
        if self.armed is not None and path.endswith(".safetensors"):
            raise self.armed
        return super().create(path)


def test_async_save_holds_the_values_of_the_saved_step_while_training_changes_them() -> None:
    storage = MemoryStorage()
    state = _state()
    before = _tensors(state)
    with cp.CheckpointManager("/ck", storage=storage, async_save=True) as ckpt:
        ckpt.save(1, state)
        assert state.model is not None
        with torch.no_grad():  # the training loop goes on right after save() returns
            for p in state.model.parameters():
                p.add_(1.0)
        for ps in state.optimizer.state.values():  # type: ignore[union-attr]
            ps["exp_avg"].mul_(3.0)
    fresh = _state(seed=1)
    assert cp.CheckpointManager("/ck", storage=storage).restore(fresh) == 1
    assert _equal(_tensors(fresh), before)


def test_background_failure_surfaces_at_the_next_call_and_keeps_earlier_checkpoints(
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage = FailingStorage()
    state = _state()
    ckpt = cp.CheckpointManager(
        "/ck", storage=storage, async_save=True, every=cp.EverySteps(1), on_disk_full="raise"
    )
    ckpt.save(1, state)
    ckpt.wait()
    committed = {p: storage.get_bytes(p) for p in storage._files}
    storage.armed = OSError(errno.ENOSPC, "No space left on device")
    ckpt.save(2, state)  # returns: the failure happens in the background
    with pytest.raises(cp.CheckpointWriteError, match=r"step 2.*No space left") as info:
        ckpt.wait()
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert "intact" in str(info.value)
    # Nothing of the failed save is left, and step 1 is byte for byte what it was.
    assert {p: storage.get_bytes(p) for p in storage._files} == committed
    assert [i.step for i in ckpt.list()] == [1]
    # Once the disk has room again, training saves as before.
    storage.armed = None
    ckpt.save(3, state)
    ckpt.close()
    assert [i.step for i in ckpt.list()] == [3, 1]


def test_failure_of_an_async_save_is_raised_by_the_next_maybe_save() -> None:
    storage = FailingStorage()
    state = _state()
    ckpt = cp.CheckpointManager("/ck", storage=storage, async_save=True, every=cp.EverySteps(1))
    storage.armed = OSError(errno.EIO, "Input/output error")
    ckpt.save(1, state)
    for future, _ in ckpt._pipeline._inflight:
        future.exception()  # let the background write fail before the next call
    with pytest.raises(cp.CheckpointWriteError, match="Input/output error"):
        ckpt.maybe_save(2, state)


def test_sync_save_failure_raises_at_once() -> None:
    storage = FailingStorage()
    storage.armed = OSError(errno.EACCES, "Permission denied")
    ckpt = cp.CheckpointManager("/ck", storage=storage, async_save=False)
    with pytest.raises(cp.CheckpointWriteError, match="Permission denied"):
        ckpt.save(5, _state())
    assert storage.list("/ck") == []


def test_close_commits_the_save_in_flight(tmp_path: Path) -> None:
    state = _state()
    ckpt = cp.CheckpointManager(str(tmp_path), async_save=True)
    ckpt.save(4, state)
    ckpt.close()
    ckpt.close()  # idempotent
    assert [(i.step, i.valid) for i in cp.CheckpointManager(str(tmp_path)).list()] == [(4, True)]
    with pytest.raises(cp.ConfigError, match="closed"):
        ckpt.save(5, state)


def test_restore_of_an_explicit_step_and_of_a_missing_one(tmp_path: Path) -> None:
    state = _state()
    ckpt = cp.CheckpointManager(str(tmp_path))
    ckpt.save(1, state)
    saved = _tensors(state)
    assert state.model is not None
    with torch.no_grad():
        state.model[0].weight.add_(1)  # type: ignore[index]
    ckpt.save(2, state)
    fresh = _state(seed=3)
    assert ckpt.restore(fresh, step=1) == 1
    assert _equal(_tensors(fresh), saved)
    with pytest.raises(cp.CheckpointNotFoundError, match="step 9") as info:
        ckpt.restore(fresh, step=9)
    assert isinstance(info.value, FileNotFoundError)


def test_restore_returns_zero_on_an_empty_root_and_touches_nothing(tmp_path: Path) -> None:
    state = _state()
    before = _tensors(state)
    assert cp.CheckpointManager(str(tmp_path / "new")).restore(state) == 0
    assert _equal(_tensors(state), before)


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    state = _state()
    ckpt = cp.CheckpointManager(str(tmp_path))
    ckpt.save(3, state)
    state.extra["tokens"] = 99
    ckpt.save(3, state)
    fresh = _state()
    assert ckpt.restore(fresh) == 3
    assert fresh.extra["tokens"] == 99
    assert [i.step for i in ckpt.list()] == [3]


def test_unsupported_value_is_refused_at_save_naming_its_path(tmp_path: Path) -> None:
    class Weird:
        def state_dict(self) -> dict[str, object]:
            return {"fn": lambda x: x}

        def load_state_dict(self, state: object) -> None:
            pass

    state = cp.TrainState(extra={"weird": Weird()})
    with pytest.raises(cp.UnsupportedStateError, match="extra/weird/state_dict/fn") as info:
        cp.CheckpointManager(str(tmp_path)).save(1, state)
    assert isinstance(info.value, TypeError)


def test_metadata_and_environment_are_recorded(tmp_path: Path) -> None:
    ckpt = cp.CheckpointManager(str(tmp_path))
    ckpt.save(1, _state(), metadata={"val_loss": 0.25})
    ckpt.close()
    manifest = cp.checkpoint.read_manifest(cp.LocalStorage(), str(tmp_path / "step_0000000001"))
    assert manifest.metadata == {"val_loss": 0.25}
    assert (
        manifest.environment["deterministic_algorithms"]
        == torch.are_deterministic_algorithms_enabled()
    )


def test_maybe_save_follows_the_policy(tmp_path: Path) -> None:
    ckpt = cp.CheckpointManager(str(tmp_path), every=cp.EverySteps(3))
    state = _state()
    saved = [step for step in range(1, 10) if ckpt.maybe_save(step, state)]
    assert saved == [3, 6, 9]
    assert [i.step for i in ckpt.list()] == [9, 6, 3]


def test_restore_logs_each_skipped_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = cp.CheckpointManager(str(tmp_path))
    state = _state()
    ckpt.save(1, state)
    ckpt.save(2, state)
    ckpt.wait()
    (tmp_path / "step_0000000002" / "rank_00000.json").unlink()
    with caplog.at_level(logging.WARNING, logger="crashproof"):
        assert ckpt.restore(_state()) == 1
    assert "skipping checkpoint step 2" in caplog.text and "rank_00000.json" in caplog.text


def test_full_disk_is_logged_and_counted_and_training_goes_on_by_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage = FailingStorage()
    state = _state()
    ckpt = cp.CheckpointManager("/ck", storage=storage, every=cp.EverySteps(1))
    ckpt.save(1, state)
    ckpt.wait()
    storage.armed = OSError(errno.ENOSPC, "No space left on device")
    with caplog.at_level(logging.ERROR, logger="crashproof"):
        assert ckpt.save(2, state)
        ckpt.wait()  # no exception: the default is on_disk_full="continue"
    assert "No space left" in caplog.text and "step 2" in caplog.text
    assert ckpt.stats.failures == 1 and ckpt.stats.disk_full == 1
    assert [i.step for i in ckpt.list()] == [1]
    storage.armed = None
    ckpt.save(3, state)
    ckpt.close()
    assert [i.step for i in ckpt.list()] == [3, 1]
    assert ckpt.stats.saves_committed == 2


class SlowStorage(MemoryStorage):
    """Writes that block until released: a save stays in flight as long as the test wants."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def create(self, path: str) -> _MemoryWriteStream:
        self.release.wait(timeout=30)
        return super().create(path)


@pytest.mark.parametrize("on_busy", ["wait", "skip"])
def test_a_save_due_while_the_previous_is_in_flight_waits_or_skips(
    on_busy: str, caplog: pytest.LogCaptureFixture
) -> None:
    storage = SlowStorage()
    state = _state()
    ckpt = cp.CheckpointManager("/ck", storage=storage, on_busy=on_busy)  # type: ignore[arg-type]
    assert ckpt.save(1, state)
    threading.Timer(0.3, storage.release.set).start()
    with caplog.at_level(logging.INFO, logger="crashproof"):
        started = ckpt.save(2, state)
    ckpt.close()
    if on_busy == "skip":
        assert started is False and ckpt.stats.skipped_busy == 1
        assert "skipping the checkpoint of step 2" in caplog.text
        assert [i.step for i in ckpt.list()] == [1]
    else:
        assert started is True and ckpt.stats.waited_busy == 1
        assert ckpt.stats.waited_busy_s >= 0.2
        assert [i.step for i in ckpt.list()] == [2, 1]


def test_staging_buffers_are_reused_across_saves() -> None:
    storage = MemoryStorage()
    state = _state()
    ckpt = cp.CheckpointManager("/ck", storage=storage)
    ckpt.save(1, state)
    assert ckpt._pipeline._stagings
    first = {name: buf.data_ptr() for name, buf in ckpt._pipeline._stagings[0]._buffers.items()}
    ckpt.save(2, state)
    ckpt.close()
    assert {
        name: buf.data_ptr() for name, buf in ckpt._pipeline._stagings[0]._buffers.items()
    } == first
    assert (
        ckpt._pipeline._stagings[0].nbytes
        == sum(t.numel() * t.element_size() for t in _tensors(state).values())
        + state.capture()["rng"]["torch"].numel()
    )


def test_async_save_refuses_when_host_memory_is_short(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from crashproof import _host_memory

    monkeypatch.setattr(_host_memory, "available_memory_bytes", lambda: 1024)
    ckpt = cp.CheckpointManager(str(tmp_path))
    with pytest.raises(cp.InsufficientMemoryError, match="MiB of host memory") as info:
        ckpt.save(1, _state())
    assert isinstance(info.value, MemoryError)
    ckpt.close()
    assert cp.CheckpointManager(str(tmp_path), async_save=False).save(1, _state())


def test_restore_reads_the_model_straight_into_its_existing_storage(tmp_path: Path) -> None:
    state = _state()
    saved = _tensors(state)
    with cp.CheckpointManager(str(tmp_path)) as ckpt:
        ckpt.save(1, state)
    fresh = _state(seed=5)
    assert fresh.model is not None
    pointers = {k: v.data_ptr() for k, v in fresh.model.state_dict().items()}
    live = fresh.live_tensors()
    assert set(live) == {f"model/{k}" for k in pointers}
    assert cp.CheckpointManager(str(tmp_path)).restore(fresh) == 1
    assert {k: v.data_ptr() for k, v in fresh.model.state_dict().items()} == pointers
    assert _equal(_tensors(fresh), saved)


def test_a_corrupt_model_tensor_never_reaches_the_live_model(tmp_path: Path) -> None:
    state = _state()
    ckpt = cp.CheckpointManager(str(tmp_path), async_save=False)
    ckpt.save(1, state)
    shard = tmp_path / "step_0000000001" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0x01  # the last tensor; the model's come first and would be read before it
    shard.write_bytes(bytes(data))
    fresh = _state(seed=6)
    before = _tensors(fresh)
    assert cp.CheckpointManager(str(tmp_path), read_only=True).restore(fresh) == 0
    assert _equal(_tensors(fresh), before)


@pytest.mark.parametrize("buffers", [2, 3])
def test_double_buffering_snapshots_the_next_save_while_the_previous_is_written(
    buffers: int,
) -> None:
    storage = SlowStorage()
    state = _state()
    ckpt = cp.CheckpointManager(
        "/ck", storage=storage, staging_buffers=buffers, keep=cp.KeepLast(5)
    )
    values = []
    steps = range(1, buffers + 1)
    for step in steps:
        values.append(_tensors(state))
        assert ckpt.save(step, state)
        assert state.model is not None
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(1.0)
    assert ckpt.stats.waited_busy == 0  # none waited for the slow writes before it
    assert len({id(s) for s in ckpt._pipeline._stagings}) == buffers
    threading.Timer(0.3, storage.release.set).start()
    assert ckpt.save(buffers + 1, state)  # every buffer in use: it waits for the oldest save
    assert ckpt.stats.waited_busy == 1
    ckpt.close()
    for step, expected in zip(steps, values, strict=True):
        fresh = _state(seed=9)
        assert cp.CheckpointManager("/ck", storage=storage).restore(fresh, step=step) == step
        assert _equal(_tensors(fresh), expected)


@pytest.mark.parametrize(
    ("buffers", "async_save"),
    [
        (2, False),
        (3, False),
        (0, True),
        (5, True),
        (-1, True),
        (2.0, True),
        (True, True),
        ("2", True),
    ],
)
def test_staging_buffers_are_1_or_up_to_4_with_async_saves(
    buffers: object, async_save: bool
) -> None:
    with pytest.raises(cp.ConfigError, match="staging_buffers"):
        cp.CheckpointManager(
            "/ck",
            storage=MemoryStorage(),
            staging_buffers=buffers,
            async_save=async_save,  # type: ignore[arg-type]
        )


def test_a_state_of_many_mid_sized_tensors_is_staged_on_two_threads_exactly() -> None:
    """Past 64 MB of tensors between 128 KiB and 16 MiB (a transformer's weight matrices), half
    of them are copied by a helper thread: every byte still lands in its own buffer, of every
    dtype, and a process forked after it stages with a helper of its own."""
    import os

    from crashproof.checkpoint.save._staging import StagingArea

    torch.manual_seed(0)
    tensors = [(f"w{i}", torch.randn(512, 1024 + i)) for i in range(36)]  # ~2 MB each, 75 MB
    tensors += [("half", torch.randn(300_000).to(torch.bfloat16)), ("ints", torch.arange(70_000))]
    staging = StagingArea()
    staged, event = staging.stage(tensors)
    assert event is None
    assert [n for n, _ in staged] == [n for n, _ in tensors]
    assert all(torch.equal(b, t) for (_, b), (_, t) in zip(staged, tensors, strict=True))
    assert all(b.data_ptr() != t.data_ptr() for (_, b), (_, t) in zip(staged, tensors, strict=True))
    pid = os.fork()
    if pid == 0:  # the child stages again: it must not wait on its parent's helper thread
        code = 1
        try:  # (compared as bytes, in NumPy: a torch op here could wait on the parent's OpenMP)
            again, _ = StagingArea().stage(tensors)
            same = all(
                (b.view(-1).view(torch.uint8).numpy() == t.view(-1).view(torch.uint8).numpy()).all()
                for (_, b), (_, t) in zip(again, tensors, strict=True)
            )
            code = 0 if same else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_retention_takes_a_checkpoint_out_of_the_root_at_once_and_deletes_it_off_the_saves_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting gigabytes takes the file system a moment: retention renames the checkpoint aside
    (it is gone from the root when wait() returns) and deletes it on a thread of its own, so
    wait() does not include it; close() waits for it, and nothing is left behind."""
    import shutil

    real_rmtree, release, deleting = shutil.rmtree, threading.Event(), []

    def slow_rmtree(path: str, *args: object, **kwargs: object) -> None:
        deleting.append(path)
        assert release.wait(30), "never released"
        real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)  # what the local storage deletes with
    ckpt = cp.CheckpointManager(str(tmp_path), keep=cp.KeepLast(1), handle_signals=False)
    state = _state()
    ckpt.save(1, state)
    ckpt.wait()
    ckpt.save(2, state)
    started = time.monotonic()
    ckpt.wait()  # retention ran: step 1 is out of the root, its deletion still pending
    assert time.monotonic() - started < 10
    assert [i.step for i in ckpt.list()] == [2]
    assert len(deleting) == 1 and os.path.basename(deleting[0]).startswith(".trash-")
    closing = threading.Thread(target=ckpt.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive(), "close() must wait for the deletion it handed over"
    release.set()
    closing.join(30)
    assert not closing.is_alive()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".trash-")]


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("every", 500, r"every=500\): give a save policy, e.g. crashproof.EverySteps\(500\)"),
        ("memory_every", 10, r"memory_every=10\): give a save policy"),
        ("memory_every", cp.EverySteps, "give a save policy"),
        ("every", "500", "give a save policy"),
        ("keep", 3, r"keep=3\): give a retention policy, e.g. crashproof.KeepLast\(3\)"),
        ("keep", cp.EverySteps(3), "give a retention policy"),
        ("async_save", "no", r"async_save='no'\): use True or False"),
        ("memory", 2, "use True or False"),
        ("read_only", "yes", "use True or False"),
        ("check_finite", None, "use True or False"),
        ("timeout_s", "5", "positive, finite number of seconds"),
        ("timeout_s", 0, "positive, finite number of seconds"),
        ("remote_timeout_s", float("inf"), "finite number of seconds, or 0"),
        ("remote_timeout_s", -1, "finite number of seconds, or 0"),
        ("async_save", -1, "use True or False"),
    ],
)
def test_an_option_of_the_wrong_kind_is_refused_where_it_is_given(
    tmp_path: Path, option: str, value: Any, said: str
) -> None:
    """A number for a policy would fail at the first step (on one rank as an AttributeError), a
    string for a switch would be read as true: each is refused by the constructor, naming the
    option, and nothing is written."""
    with pytest.raises(cp.ConfigError, match=said):
        cp.CheckpointManager(tmp_path / "ck", handle_signals=False, **{option: value})
    assert not (tmp_path / "ck").exists()


def test_switches_and_numbers_of_other_kinds_that_mean_the_same_are_taken(tmp_path: Path) -> None:
    """A switch from an environment variable (``int(os.environ[...])``: 0 or 1) or numpy, and
    ``remote_timeout_s=0`` (do not wait for the tiers at close), mean what they say."""
    import numpy as np

    options = dict(async_save=np.bool_(False), check_finite=1, handle_signals=0, remote_timeout_s=0)
    with cp.CheckpointManager(tmp_path / "ck", **options) as ckpt:  # type: ignore[arg-type]
        ckpt.save(1, cp.TrainState(model=torch.nn.Linear(2, 2)))
    assert (tmp_path / "ck" / "step_0000000001").is_dir()
