"""A restore reads each byte of a checkpoint once when host memory allows, and in bounded memory
reads the live tensors' bytes a second time instead; either way nothing live changes before the
whole checkpoint verified, and the restored state is the saved one, bit for bit."""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import crashproof as cp
from _support import CountingStorage, CountingStream  # (benchmarks/: tests/conftest.py)
from crashproof.errors import ConfigError
from crashproof.storage import LocalStorage, ReadStream


def _state(seed: int) -> cp.TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return cp.TrainState(model=model, optimizer=optimizer)


def _model_bytes(state: cp.TrainState) -> int:
    assert state.model is not None
    return sum(t.numel() * t.element_size() for t in state.model.state_dict().values())


def _shard_reads(storage: CountingStorage, root: Path) -> tuple[int, int]:
    """(bytes read from the step's tensor files, their size on disk)."""
    files = sorted((root / "step_0000000002").glob("*.safetensors"))
    assert files
    read = sum(storage.counts[str(f)] for f in files)
    return read, sum(f.stat().st_size for f in files)


def _save(root: Path) -> cp.TrainState:
    saved = _state(0)
    with cp.CheckpointManager(root, async_save=False, handle_signals=False) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, saved)
    return saved


def _restore(root: Path, **options: object) -> tuple[cp.TrainState, CountingStorage]:
    storage = CountingStorage()
    fresh = _state(5)
    with cp.CheckpointManager(
        str(root),
        storage=storage,
        read_only=True,
        **options,  # type: ignore[arg-type]
    ) as ckpt:
        assert ckpt.restore(fresh) == 2
    return fresh, storage


def _same(a: cp.TrainState, b: cp.TrainState) -> bool:
    assert a.model is not None and b.model is not None
    assert a.optimizer is not None and b.optimizer is not None
    models = zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True)
    moments = [
        (x[k], y[k])
        for x, y in zip(
            a.optimizer.state_dict()["state"].values(),
            b.optimizer.state_dict()["state"].values(),
            strict=True,
        )
        for k in x
    ]
    return all(torch.equal(x, y) for x, y in [*models, *moments])


def test_with_memory_to_spare_every_byte_is_read_once(tmp_path: Path) -> None:
    saved = _save(tmp_path)
    restored, storage = _restore(tmp_path)
    read, size = _shard_reads(storage, tmp_path)
    assert read == size, f"read {read} bytes of {size}: some twice"
    assert _same(restored, saved)


def test_without_a_buffer_the_live_tensors_bytes_are_read_twice(tmp_path: Path) -> None:
    saved = _save(tmp_path)
    restored, storage = _restore(tmp_path, restore_memory_bytes=0)
    read, size = _shard_reads(storage, tmp_path)
    assert read == size + _model_bytes(saved)  # verified by hashing, then read into the model
    assert _same(restored, saved)


def _optimizer_bytes(state: cp.TrainState) -> int:
    assert state.optimizer is not None
    moments = state.optimizer.state_dict()["state"].values()
    return sum(v.numel() * v.element_size() for s in moments for v in s.values() if v.dim())


def test_a_buffer_smaller_than_the_model_reads_the_rest_twice(tmp_path: Path) -> None:
    """The optimizer's moments (no live destination in a fresh optimizer) are read into memory
    either way and count first: what is left of the allowance buffers half the model."""
    saved = _save(tmp_path)
    model = _model_bytes(saved)
    allowance = _optimizer_bytes(saved) + model // 2
    restored, storage = _restore(tmp_path, restore_memory_bytes=allowance)
    read, size = _shard_reads(storage, tmp_path)
    assert size < read < size + model
    assert read - size >= model - model // 2  # what did not fit was read again, no more
    assert _same(restored, saved)


def test_an_allowance_the_optimizer_state_fills_buffers_nothing(tmp_path: Path) -> None:
    saved = _save(tmp_path)
    restored, storage = _restore(tmp_path, restore_memory_bytes=_optimizer_bytes(saved))
    read, size = _shard_reads(storage, tmp_path)
    assert read == size + _model_bytes(saved)
    assert _same(restored, saved)


def test_a_corrupt_tensor_changes_nothing_live_with_the_buffer(tmp_path: Path) -> None:
    """The buffered bytes are checked before any is copied: a flipped bit in the last tensor of
    the newest checkpoint leaves the live model as it was until the fallback restores step 1."""
    _save(tmp_path)
    shard = next((tmp_path / "step_0000000002").glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x10
    shard.write_bytes(bytes(raw))
    fresh = _state(5)
    storage = CountingStorage()
    with cp.CheckpointManager(str(tmp_path), storage=storage, read_only=True) as ckpt:
        assert ckpt.restore(fresh) == 1
    assert _same(fresh, _state(1))


@pytest.mark.parametrize("value", [-1, 1.5, "1GB", True])
def test_a_restore_memory_that_is_no_byte_count_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match="restore_memory_bytes"):
        cp.CheckpointManager(tmp_path, restore_memory_bytes=value)  # type: ignore[arg-type]


class _RemovedBeforeTheSecondRead(LocalStorage):
    """Local files; the step's directory is removed (a writer's retention) the moment the
    restore first reads a file again after verifying it."""

    def __init__(self, step_dir: Path) -> None:
        super().__init__()
        self.step_dir, self.removed = step_dir, False
        self.lock = threading.Lock()

    def open(self, path: str) -> ReadStream:
        stream = super().open(path)
        storage = self

        class _Stream(CountingStream):
            def readinto(self, offset: int, buf: memoryview, /) -> None:
                with storage.lock:  # (read on several threads: removed once)
                    if storage.verified and not storage.removed and offset > 0:
                        shutil.rmtree(storage.step_dir)
                        storage.removed = True
                super().readinto(offset, buf)

        return _Stream(stream, path, Counter())

    verified = False


def test_a_checkpoint_removed_between_its_verification_and_the_second_read_restores_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a local file system the files a restore opened stay readable after they are removed:
    the second read of the live tensors' bytes reads the verified checkpoint, whole."""
    from crashproof.checkpoint.restore import RankRead

    saved = _save(tmp_path)
    storage = _RemovedBeforeTheSecondRead(tmp_path / "step_0000000002")
    real_finish = RankRead.finish

    def finish(self: RankRead, *args: object) -> object:
        storage.verified = True
        return real_finish(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(RankRead, "finish", finish)
    fresh = _state(5)
    with cp.CheckpointManager(
        str(tmp_path), storage=storage, read_only=True, restore_memory_bytes=0
    ) as ckpt:
        assert ckpt.restore(fresh) == 2
    assert storage.removed and _same(fresh, saved)


def test_an_object_store_checkpoint_removed_before_the_second_read_says_the_state_is_mixed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An object store reads each range anew: a checkpoint removed after it verified cannot be
    read a second time. The live tensors are then partly written; the error says so (a bare
    read error would let a caller carry on with a mixed model)."""
    import fsspec

    from crashproof.checkpoint.restore import RankRead

    uri = "memory://one-pass-removed/ck"
    with cp.CheckpointManager(uri, async_save=False, handle_signals=False) as ckpt:
        ckpt.save(2, _state(0))
    real_finish = RankRead.finish

    def finish(self: RankRead, *args: object) -> object:
        fsspec.filesystem("memory").rm("/one-pass-removed/ck/step_0000000002", recursive=True)
        return real_finish(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(RankRead, "finish", finish)
    try:
        with (
            cp.CheckpointManager(uri, read_only=True, restore_memory_bytes=0) as ckpt,
            pytest.raises(cp.CorruptCheckpointError, match="may now hold a mix"),
        ):
            ckpt.restore(_state(5))
    finally:
        fsspec.filesystem("memory").rm("/one-pass-removed", recursive=True)
