"""Sharded pieces as the restore reads them: the pieces of a tensor must cover it (a gap would
leave part of a restored tensor uninitialised), and saved tensors that do not fit the live ones
are a mismatch to report, not a corrupt checkpoint to skip. FSDP2 on one rank, in process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import crashproof as cp
from crashproof.checkpoint.format._fields import dumps
from crashproof.checkpoint.format._hashing import digest
from crashproof.checkpoint.format._manifest import seal_manifest
from crashproof.checkpoint.restore._dcp_reader import CrashproofReader, load_sharded
from crashproof.checkpoint.restore._read_manifest import read_manifest
from crashproof.storage import LocalStorage
from tests.conftest import free_port

INDEX = "rank_00000.json"


def _sharded_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Iterator[Path]:
    """The directory of a committed FSDP2 checkpoint (model and AdamW, one step trained)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model, optimizer = _sharded_model()
        model(torch.randn(4, 5)).pow(2).mean().backward()
        optimizer.step()
        state = cp.TrainState(model=model, optimizer=optimizer)
        with cp.CheckpointManager(tmp_path / "ckpt", async_save=False, handle_signals=False) as m:
            m.save(1, state)
        yield tmp_path / "ckpt" / "step_0000000001"
    finally:
        dist.destroy_process_group()


def _edit_index(ckpt_dir: Path, mutate: Any) -> None:
    """Rewrite rank 0's index and list its new size and checksum in the manifest, so that only
    the checks of the pieces stand between the edit and a restore."""
    index = json.loads((ckpt_dir / INDEX).read_bytes())
    mutate(index)
    data = dumps(index)
    (ckpt_dir / INDEX).write_bytes(data)
    manifest = json.loads((ckpt_dir / "manifest.json").read_bytes())
    manifest["files"][INDEX] = {"size": len(data), "checksum": digest(data)}
    (ckpt_dir / "manifest.json").write_bytes(seal_manifest(manifest))


def test_pieces_that_leave_a_gap_in_their_tensor_are_refused(checkpoint: Path) -> None:
    def widen(index: dict[str, Any]) -> None:
        entry = next(t for t in index["tensors"] if t["name"] == "model/0.weight")
        assert entry["global"] == {"shape": [7, 5], "offset": [0, 0]}
        entry["global"] = {"shape": [14, 5], "offset": [0, 0]}  # 35 of 70 elements saved

    _edit_index(checkpoint, widen)
    with pytest.raises(cp.CorruptCheckpointError, match=r"hold 35 of its 70 elements"):
        CrashproofReader(checkpoint)


def test_saved_pieces_that_do_not_fit_the_live_tensors_are_a_mismatch(checkpoint: Path) -> None:
    storage = LocalStorage()
    manifest = read_manifest(storage, str(checkpoint))
    with pytest.raises(
        cp.StateMismatchError, match=r"does not fit the tensors it is restored into"
    ):
        load_sharded(storage, str(checkpoint), manifest, {"model/0.weight": torch.empty(8, 5)})
    # A corrupt piece is still corruption: the restore skips it for an older checkpoint.
    index = json.loads((checkpoint / INDEX).read_bytes())
    offset = next(t["offset"] for t in index["tensors"] if t["name"] == "model/2.bias")
    shard = checkpoint / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(cp.CorruptCheckpointError, match=r"checksum"):
        load_sharded(storage, str(checkpoint), manifest, {"model/2.bias": torch.empty(3)})
