"""Checkpoints straight on an S3-protocol server (moto's, a real process on loopback): save,
restore bit for bit, fall back past a corrupt object, retention, and the CLI on ``s3://`` URIs."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import crashproof as cp
from crashproof.storage import storage_for, write_all
from tests.warm_ranks import crashproof_cli

pytestmark = pytest.mark.usefixtures("s3_server")


def _state(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, cp.TrainState]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, cp.TrainState(model=model, optimizer=optimizer)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _root() -> str:
    return f"s3://ckpt-{uuid.uuid4().hex[:12]}/runs/exp1"


def _values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    values = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        values.update({f"optimizer/{i}/{k}": v.clone() for k, v in s.items()})
    return values


@pytest.mark.parametrize("delta", [None, cp.Delta(full_every=3)])
def test_saves_to_a_bucket_and_restores_bit_for_bit(delta: cp.Delta | None) -> None:
    root = _root()
    model, optimizer, state = _state(0)
    saved = {}
    with cp.CheckpointManager(root, keep=cp.KeepLast(3), delta=delta, handle_signals=False) as ckpt:
        for step in range(1, 6):
            _train(model, optimizer, step)
            ckpt.save(step, state)
            saved[step] = _values(model, optimizer)
        listed = [i.step for i in ckpt.list()]
    # With deltas (full at 1 and 4), retention also keeps 1: the base of the kept delta 3.
    assert listed == ([5, 4, 3] if delta is None else [5, 4, 3, 1])
    for step in (5, 3):
        model2, optimizer2, state2 = _state(1)
        with cp.CheckpointManager(root, handle_signals=False) as ckpt:
            assert ckpt.restore(state2, step) == step
        restored = _values(model2, optimizer2)
        assert restored.keys() == saved[step].keys()
        assert all(torch.equal(restored[k], saved[step][k]) for k in restored)


def test_a_corrupt_object_in_the_bucket_is_detected_and_restore_falls_back() -> None:
    root = _root()
    model, optimizer, state = _state(0)
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        for step in (1, 2):
            _train(model, optimizer, step)
            ckpt.save(step, state)
    _, storage = storage_for(root)
    shard = storage.join(root, "step_0000000002", "rank_00000.safetensors")
    stream = storage.open(shard)
    data = bytearray(stream.size())
    stream.readinto(0, memoryview(data))
    data[-5] ^= 0xFF  # one flipped bit in the object, as bit rot or a bad upload would leave
    storage.remove(shard)
    write_all(storage, shard, bytes(data))
    _, _, state2 = _state(1)
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        assert ckpt.restore(state2) == 1


def test_the_cli_lists_and_verifies_checkpoints_in_a_bucket() -> None:
    root = _root()
    model, optimizer, state = _state(0)
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        _train(model, optimizer, 1)
        ckpt.save(1, state)
    listed = crashproof_cli("ls", root, "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert row["step"] == 1 and row["valid"] and row["path"].startswith("s3://")
    verified = crashproof_cli("verify", root)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_the_cli_inspects_exports_and_prunes_checkpoints_in_a_bucket(tmp_path: Path) -> None:
    root = _root()
    model, optimizer, state = _state(0)
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        for step, loss in ((1, 0.5), (2, 0.2), (3, 0.4)):
            _train(model, optimizer, step)
            ckpt.save(step, state, metadata={"val_loss": loss})

    cli = crashproof_cli

    inspected = cli("inspect", root, "--step", "2", "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["manifest"]["metadata"] == {"val_loss": 0.2}
    exported = cli("export", root, "--format", "safetensors", "-o", str(tmp_path / "w.st"))
    assert exported.returncode == 0, exported.stderr
    weights = load_file(tmp_path / "w.st")
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    pruned = cli("prune", root, "--keep-best", "val_loss")
    assert pruned.returncode == 0, pruned.stderr
    listed = cli("ls", root, "--json")
    assert [row["step"] for row in json.loads(listed.stdout)] == [3, 2]  # newest + best
