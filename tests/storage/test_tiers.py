"""Durable tiers against a real S3-protocol server (moto's standalone server, its own process on
loopback, reached through ``AWS_ENDPOINT_URL`` as real S3 would be): checkpoints commit locally and
are replicated to the bucket in the background; a run whose local disk is lost resumes from the
bucket bit for bit; a frozen server does not slow training and the bucket catches up; corruption
in the bucket is caught; each tier has its own retention."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

import crashproof as cp
from crashproof.checkpoint import committed_steps, verify_checkpoint
from crashproof.storage import storage_for

pytestmark = pytest.mark.usefixtures("s3_server")

# A store that stops answering must fail fast in a test: short timeouts, no SDK-level retries
# (crashproof retries on its own, with backoff).
FAST_FAIL = {
    "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"total_max_attempts": 1}}
}


def _bucket() -> str:
    return f"s3://tier-{uuid.uuid4().hex[:12]}/runs/exp1"


def _state(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, cp.TrainState]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, cp.TrainState(model=model, optimizer=optimizer)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    # Draws from the global RNG, which the checkpoint captures: a resume must restore it too.
    x = torch.randn(8, 16)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _remote_steps(uri: str) -> list[int]:
    root, storage = storage_for(uri)
    return sorted(
        step
        for step, path in committed_steps(storage, root)
        if "manifest.json" in storage.list(path)
    )


def test_close_waits_until_the_newest_checkpoint_is_in_the_bucket_and_a_lost_disk_resumes_from_it(
    tmp_path: Path,
) -> None:
    total = 8
    model, optimizer, _ = _state()
    for _ in range(total):
        _train(model, optimizer)
    uninterrupted = _weights(model)

    bucket, local = _bucket(), tmp_path / "local"
    model, optimizer, state = _state()
    with cp.CheckpointManager(
        local, every=cp.EverySteps(1), remote=bucket, handle_signals=False
    ) as ckpt:
        for step in range(ckpt.restore(state), 5):
            _train(model, optimizer)
            ckpt.maybe_save(step + 1, state)
    # close() returned: the newest checkpoint is complete and verified in the bucket.
    assert 5 in _remote_steps(bucket)
    root, storage = storage_for(bucket)
    assert verify_checkpoint(storage, storage.join(root, "step_0000000005")).step == 5

    shutil.rmtree(local)  # the machine and its disk are gone
    model, optimizer, state = _state(seed=123)  # a fresh process: other weights, other RNG
    with cp.CheckpointManager(
        local, every=cp.EverySteps(1), remote=bucket, handle_signals=False
    ) as ckpt:
        start = ckpt.restore(state)
        assert start == 5
        for step in range(start, total):
            _train(model, optimizer)
            ckpt.maybe_save(step + 1, state)
    resumed = _weights(model)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    # The downloaded checkpoint became a local one again.
    assert (local / "step_0000000005" / "manifest.json").exists()


@pytest.mark.serial  # asserts training kept its pace: needs the cores to itself
def test_a_frozen_server_does_not_slow_training_and_the_bucket_catches_up(
    tmp_path: Path,
    s3_server_process: subprocess.Popen[bytes],
) -> None:
    bucket = _bucket()
    model, optimizer, state = _state()
    tier = cp.Tier(bucket, storage_options=FAST_FAIL)
    ckpt = cp.CheckpointManager(
        tmp_path / "local", every=cp.EverySteps(5), remote=tier, handle_signals=False
    )
    try:
        for step in range(10):
            _train(model, optimizer)
            ckpt.maybe_save(step + 1, state)
        ckpt.wait()
        deadline = time.monotonic() + 30
        while ckpt.replication_status()[0].newest_durable != 10:
            assert time.monotonic() < deadline, ckpt.replication_status()
            time.sleep(0.05)

        step_s = []
        os.kill(s3_server_process.pid, signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            step = 10
            while time.monotonic() - frozen_at < 5.0:  # several seconds of training, frozen store
                started = time.perf_counter()
                _train(model, optimizer)
                time.sleep(0.05)  # a step of real work
                ckpt.maybe_save(step + 1, state)
                step_s.append(time.perf_counter() - started)
                step += 1
            ckpt.wait()  # every local save committed while the store was frozen
            during = ckpt.replication_status()[0]
        finally:
            os.kill(s3_server_process.pid, signal.SIGCONT)
        newest = step

        # Training kept its pace: no step waited for the store (a step is ~50 ms; the store's
        # timeouts are 1-2 s, so one blocked step would show).
        assert max(step_s) < 0.5, sorted(step_s)[-5:]
        assert len(step_s) >= 40
        assert during.newest_durable == 10
        assert during.pending and max(during.pending) == newest - newest % 5
        assert len(during.pending) <= tier.max_backlog
        # The store hung, and it shows: a transfer in progress for seconds, or failed attempts.
        assert during.failing_since is not None or (
            during.uploading is not None and time.time() - during.uploading[1] > 2
        ), during
        # Retention (KeepAll locally) plus the backlog protection kept the pending ones here.
        assert all((tmp_path / "local" / f"step_{s:010d}").exists() for s in during.pending)
    finally:
        ckpt.close()  # waits until the newest is durable, now that the store answers again
    status = ckpt.replication_status()[0]
    assert status.newest_durable == newest - newest % 5
    assert status.pending == []
    assert status.failing_since is None
    assert newest - newest % 5 in _remote_steps(bucket)


def test_a_corrupt_checkpoint_in_the_bucket_is_detected_and_restore_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket, local = _bucket(), tmp_path / "local"
    model, optimizer, state = _state()
    saved = {}
    with cp.CheckpointManager(local, remote=bucket, handle_signals=False) as ckpt:
        for step in (1, 2, 3):
            _train(model, optimizer)
            ckpt.save(step, state)
            saved[step] = _weights(model)
    root, storage = storage_for(bucket)
    shard = storage.join(root, "step_0000000003", "rank_00000.safetensors")
    stream = storage.open(shard)
    data = bytearray(stream.size())
    stream.readinto(0, memoryview(data))
    stream.close()
    data[-7] ^= 0x10  # bit rot in the bucket
    storage.fs.pipe_file(storage._key(shard), bytes(data))  # type: ignore[attr-defined]

    shutil.rmtree(local)
    model, optimizer, state = _state(seed=5)
    caplog.set_level(logging.WARNING)
    with cp.CheckpointManager(local, remote=bucket, handle_signals=False) as ckpt:
        assert ckpt.restore(state) == 2
    restored = _weights(model)
    assert all(torch.equal(restored[k], saved[2][k]) for k in restored)
    assert "step 3" in caplog.text and "checksum" in caplog.text
    # The corrupt download was never published into the local root.
    assert not (local / "step_0000000003").exists()


def test_a_corrupt_local_checkpoint_is_replaced_by_the_tier_copy_of_the_same_step(
    tmp_path: Path,
) -> None:
    bucket, local = _bucket(), tmp_path / "local"
    model, optimizer, state = _state()
    with cp.CheckpointManager(local, remote=bucket, handle_signals=False) as ckpt:
        for step in (1, 2):
            _train(model, optimizer)
            ckpt.save(step, state)
    expected = _weights(model)
    shard = local / "step_0000000002" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))

    model, optimizer, state = _state(seed=9)
    with cp.CheckpointManager(local, remote=bucket, handle_signals=False) as ckpt:
        assert ckpt.restore(state) == 2  # not 1: the bucket still has a good step 2
    restored = _weights(model)
    assert all(torch.equal(restored[k], expected[k]) for k in restored)
    assert verify_checkpoint(cp.LocalStorage(), str(local / "step_0000000002")).step == 2


def test_each_tier_applies_its_own_retention(tmp_path: Path) -> None:
    recent, milestones = _bucket(), _bucket()
    model, optimizer, state = _state()
    with cp.CheckpointManager(
        tmp_path / "local",
        keep=cp.KeepLast(1),
        remote=[cp.Tier(recent, keep=cp.KeepLast(3)), cp.Tier(milestones, keep=cp.KeepEvery(2))],
        handle_signals=False,
    ) as ckpt:
        for step in range(1, 8):
            _train(model, optimizer)
            ckpt.save(step, state)
    assert sorted(int(p.name[5:]) for p in (tmp_path / "local").glob("step_*")) == [7]
    assert _remote_steps(recent) == [5, 6, 7]
    # Milestones, and the newest: a tier never loses its newest checkpoint.
    assert _remote_steps(milestones) == [2, 4, 6, 7]


def test_a_rollback_removes_the_abandoned_checkpoints_from_the_tier_too(tmp_path: Path) -> None:
    bucket = _bucket()
    model, optimizer, state = _state()
    with cp.CheckpointManager(tmp_path / "local", remote=bucket, handle_signals=False) as ckpt:
        for step in (1, 2, 3, 4):
            _train(model, optimizer)
            ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.rollback(state, before=3, anomaly_step=4) == 2
    assert _remote_steps(bucket) == [1, 2]


def test_an_unreachable_tier_at_restore_falls_back_to_the_local_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer, state = _state()
    with cp.CheckpointManager(tmp_path / "local", handle_signals=False) as ckpt:
        _train(model, optimizer)
        ckpt.save(1, state)
    dead = cp.Tier(
        "s3://bucket/run",
        storage_options=FAST_FAIL | {"endpoint_url": "http://127.0.0.1:9"},  # nothing listens
    )
    caplog.set_level(logging.ERROR)
    ckpt = cp.CheckpointManager(
        tmp_path / "local", remote=dead, remote_timeout_s=1, handle_signals=False
    )
    assert ckpt.restore(_state(seed=3)[2]) == 1
    ckpt.close()
    assert "cannot list s3://bucket/run" in caplog.text
    assert "not durable in s3://bucket/run" in caplog.text


def test_s3_storage_leaves_the_global_python_rng_alone() -> None:
    # The training's random stream is part of its checkpoints: an SDK drawing from it (at import,
    # or for retry jitter in a background upload) would make resumed runs diverge.
    import random

    random.seed(1234)
    expected = random.getstate()
    root, storage = storage_for(_bucket())
    storage.make_dirs(root)
    storage.list(root)
    assert random.getstate() == expected


def test_a_checkpoint_a_rollback_abandoned_is_never_restored_from_a_tier(tmp_path: Path) -> None:
    # The tier still holds steps 3 and 4 (say the rollback's removal failed: the tier was down),
    # but the local root remembers the rollback: a restore must not resume into them.
    from crashproof.checkpoint.root._rollbacks import record_rollback

    bucket, local = _bucket(), tmp_path / "local"
    model, optimizer, state = _state()
    with cp.CheckpointManager(local, remote=bucket, handle_signals=False) as ckpt:
        for step in (1, 2, 3, 4):
            _train(model, optimizer)
            ckpt.save(step, state)
    assert _remote_steps(bucket) == [1, 2, 3, 4]
    record_rollback(cp.LocalStorage(), str(local), 2)
    for step in (3, 4):
        shutil.rmtree(local / f"step_{step:010d}")

    # An evaluation process: restores from the tiers, never writes to them.
    reader = cp.CheckpointManager(local, remote=bucket, replicate=False, handle_signals=False)
    assert reader.restore(_state(seed=4)[2]) == 2
    reader.close()
    assert _remote_steps(bucket) == [1, 2, 3, 4]  # replicate=False: the tier was not touched

    # A writing manager removes them from the tier.
    with cp.CheckpointManager(local, remote=bucket, handle_signals=False) as ckpt:
        ckpt.restore(_state(seed=4)[2])
    assert _remote_steps(bucket) == [1, 2]
