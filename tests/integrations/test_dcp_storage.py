"""crashproof.integrations.dcp: DCP's save, async_save and load writing and reading crashproof's
format, on one process and on two gloo ranks; a damaged file, a value that would need pickle, a
save killed before its commit, an existing checkpoint, and a CheckpointManager's checkpoint.

Run as a program, this file is the other processes the tests start: ``two-ranks DIR`` (each of
two gloo ranks saves and loads) and ``save-over DIR`` (a save that the test kills).
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import crashproof
from crashproof.checkpoint import read_manifest, verify_checkpoint
from crashproof.errors import CheckpointWriteError, CorruptCheckpointError, UnsupportedStateError
from crashproof.integrations.dcp import (
    StorageReader,
    StorageWriter,
    crashproof_error,
    load,
    save,
)
from crashproof.storage import LocalStorage

# DCP warns at every call without a process group ("assuming the intent is ... single process").
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

EXTRA = {"epoch": 3, "tags": ["a", "b"], "scale": 0.1, "done": False, "none": None, "nan": math.nan}


def _trained(seed: int, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):  # the optimizer's state (and its step counters) exists after a step
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": extra}


def _fresh() -> dict[str, Any]:
    """A live state of the same shapes and other values, to load into."""
    model, optimizer = _trained(seed=99, steps=1)
    return _state(model, optimizer, {k: None for k in EXTRA})


def _assert_same(saved: Any, loaded: Any, at: str = "") -> None:
    """Bit for bit, and of the same types (a tuple stays a tuple)."""
    if isinstance(saved, dict):  # a state dict may be an OrderedDict
        assert isinstance(loaded, dict), at
    else:
        assert type(saved) is type(loaded), at
    if isinstance(saved, torch.Tensor):
        assert saved.dtype == loaded.dtype and torch.equal(saved, loaded), at
    elif isinstance(saved, dict):
        assert saved.keys() == loaded.keys(), at
        for key in saved:
            _assert_same(saved[key], loaded[key], f"{at}/{key}")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(loaded), at
        for i, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            _assert_same(a, b, f"{at}/{i}")
    elif isinstance(saved, float) and math.isnan(saved):
        assert math.isnan(loaded), at
    else:
        assert saved == loaded, at


def _cli(*args: str | Path) -> tuple[int, str]:
    from tests.warm_ranks import crashproof_cli

    proc = crashproof_cli(*args)
    return proc.returncode, proc.stdout + proc.stderr


def _no_pickle(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("pickled or unpickled")


def test_save_verifies_with_the_cli_and_loads_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(*_trained(seed=0), EXTRA)
    with monkeypatch.context() as tripwires:  # DCP's own path for values is torch.save/load
        tripwires.setattr(torch, "save", _no_pickle)
        tripwires.setattr(torch, "load", _no_pickle)
        dcp.save(state, storage_writer=StorageWriter(tmp_path, step=3), no_dist=True)
        live = _fresh()
        dcp.load(live, storage_reader=StorageReader(tmp_path, step=3), no_dist=True)
    _assert_same(state, live)

    code, said = _cli("verify", tmp_path)
    assert code == 0 and "step 3: valid" in said, said
    code, said = _cli("inspect", tmp_path)
    assert code == 0 and "model.0.weight" in said and "optim.state.0.exp_avg" in said, said

    assert live["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple again
    assert live["optim"]["state"][0]["step"].item() == 2.0

    # The directory itself names the checkpoint too; a planner with a load_bytes of its own gets
    # the values as bytes (made from the JSON) and still ends with the same state.
    class Recording(DefaultLoadPlanner):
        seen: ClassVar[list[str]] = []

        def load_bytes(self, read_item: Any, value: Any) -> None:
            self.seen.append(read_item.dest_index.fqn)
            super().load_bytes(read_item, value)

    again = _fresh()
    reader = StorageReader(tmp_path / "step_0000000003")
    dcp.load(again, storage_reader=reader, planner=Recording(), no_dist=True)
    _assert_same(state, again)
    assert "extra.epoch" in Recording.seen


def test_async_save_writes_what_was_staged(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=1)
    state = _state(model, optimizer, EXTRA)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    future = dcp.async_save(state, storage_writer=StorageWriter(tmp_path / "ckpt"), no_dist=True)
    with torch.no_grad():  # training goes on: the save holds the state as it was staged
        for p in model.parameters():
            p.add_(1.0)
    future.result(timeout=60)

    storage = LocalStorage()
    assert verify_checkpoint(storage, str(tmp_path / "ckpt")).step == 0
    live = _fresh()
    load(live, tmp_path / "ckpt", no_dist=True)
    _assert_same(expected, live["model"])
    _assert_same(state["optim"], live["optim"])
    _assert_same(EXTRA, live["extra"])


def test_two_gloo_ranks_save_their_pieces_and_load_them_back(
    tmp_path: Path, warm_ranks: Any
) -> None:
    result = warm_ranks.run(Path(__file__), ["two-ranks", str(tmp_path)], nproc=2, timeout=120)
    assert result.returncode == 0, result.output[-3000:]
    assert result.output.count("loaded back: ok") == 2, result.output[-3000:]

    code, said = _cli("verify", tmp_path)
    assert code == 0 and "step 1: valid" in said and "step 2: valid" in said, said
    ckpt = tmp_path / "step_0000000001"
    manifest = read_manifest(LocalStorage(), str(ckpt))
    assert manifest.world_size == 2
    assert {"rank_00000.safetensors", "rank_00001.safetensors"} <= set(manifest.files)
    # One process reads what two wrote: the sharded tensor's pieces make up the whole.
    whole = {"sharded": torch.zeros(6, 4), "extra": {"world": 0}}
    load(whole, tmp_path, step=1, no_dist=True)
    assert torch.equal(whole["sharded"], torch.arange(24.0).reshape(6, 4))
    assert whole["extra"] == {"world": 2}


def _two_ranks(root: Path) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    model, optimizer = _trained(seed=0)  # the same on both ranks: replicated state
    sharded = distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)])
    state = _state(model, optimizer, {"world": dist.get_world_size()}) | {"sharded": sharded}
    dcp.save(state, storage_writer=StorageWriter(root, step=1))

    live = _fresh() | {"sharded": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])}
    live["extra"] = {"world": 0}
    dcp.load(live, storage_reader=StorageReader(root, step=1))
    _assert_same(state["model"], live["model"])
    _assert_same(state["optim"], live["optim"])
    assert torch.equal(live["sharded"].to_local(), sharded.to_local())
    assert live["extra"] == {"world": 2}

    # As torchtitan's async mode does: async_save over a gloo group of its own.
    group = dist.new_group(backend="gloo")
    writer = StorageWriter(root, step=2)
    dcp.async_save(state, storage_writer=writer, process_group=group).result(timeout=60)
    again = _fresh() | {"sharded": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])}
    again["extra"] = {"world": 0}
    dcp.load(again, storage_reader=StorageReader(root, step=2), process_group=group)
    _assert_same(state["optim"], again["optim"])
    assert torch.equal(again["sharded"].to_local(), sharded.to_local())
    print(f"rank {rank}: loaded back: ok", flush=True)
    dist.destroy_process_group()


def test_a_flipped_byte_is_corrupt_checkpoint_error_naming_the_file(tmp_path: Path) -> None:
    state = _state(*_trained(seed=2), EXTRA)
    save(state, tmp_path, step=1, no_dist=True)
    ckpt = tmp_path / "step_0000000001"
    index = json.loads((ckpt / "rank_00000.json").read_text())
    entry = next(t for t in index["tensors"] if t["name"] == "model.0.weight")
    shard = ckpt / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[entry["offset"] + 5] ^= 0x01
    shard.write_bytes(bytes(data))

    with pytest.raises(CorruptCheckpointError, match=r"rank_00000\.safetensors"):
        load(_fresh(), tmp_path, step=1, no_dist=True)
    with pytest.raises(CheckpointException) as raised:  # DCP wraps it; the cause is named
        dcp.load(_fresh(), storage_reader=StorageReader(ckpt), no_dist=True)
    assert isinstance(crashproof_error(raised.value), CorruptCheckpointError)
    with pytest.raises(CorruptCheckpointError, match=r"rank_00000\.safetensors"):
        verify_checkpoint(LocalStorage(), str(ckpt))

    # A damaged index is refused before DCP plans anything.
    (ckpt / "rank_00000.json").write_text(json.dumps(index | {"step": 7}))
    with pytest.raises(CorruptCheckpointError, match=r"rank_00000\.json"):
        StorageReader(ckpt)


@pytest.mark.parametrize(
    "value", [{1, 2}, object(), (torch.zeros(2),)], ids=["set", "object", "tensor-in-tuple"]
)
def test_a_value_that_would_need_pickle_is_refused_naming_its_key(
    tmp_path: Path, value: Any
) -> None:
    model, _ = _trained(seed=3, steps=0)
    with pytest.raises(UnsupportedStateError, match=r"'extra\.seen'"):
        save(
            {"model": model.state_dict(), "extra": {"seen": value}}, tmp_path, step=1, no_dist=True
        )
    assert not (tmp_path / "step_0000000001").exists()


def test_an_existing_checkpoint_is_replaced_only_when_asked(tmp_path: Path) -> None:
    first, second = _state(*_trained(seed=4), EXTRA), _state(*_trained(seed=5), EXTRA)
    save(first, tmp_path / "ckpt", no_dist=True)
    with pytest.raises(CheckpointWriteError, match="already holds a committed checkpoint"):
        save(second, tmp_path / "ckpt", no_dist=True)
    live = _fresh()
    load(live, tmp_path / "ckpt", no_dist=True)
    _assert_same(first["model"], live["model"])

    save(second, tmp_path / "ckpt", overwrite=True, no_dist=True)
    load(live, tmp_path / "ckpt", no_dist=True)
    _assert_same(second["model"], live["model"])

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / ".metadata").write_text("a FileSystemWriter checkpoint")
    with pytest.raises(CheckpointWriteError, match="not a crashproof checkpoint"):
        save(second, tmp_path / "other", overwrite=True, no_dist=True)
    assert (tmp_path / "other" / ".metadata").read_text() == "a FileSystemWriter checkpoint"


def test_a_save_killed_before_its_commit_leaves_the_earlier_checkpoint(tmp_path: Path) -> None:
    from tests.warm_ranks import python

    first = _state(*_trained(seed=6), EXTRA)
    save(first, tmp_path / "ckpt", no_dist=True)
    # Killed at the last moment: every file and the manifest written, not yet renamed into place.
    env = {**os.environ, "CRASHPROOF_CHAOS_PUBLISH_KILL": "publish:start"}
    proc = python([__file__, "save-over", str(tmp_path / "ckpt")], env=env, timeout=120)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    assert (tmp_path / ".tmp-ckpt-dcp" / "manifest.json").exists()  # it got that far

    verify_checkpoint(LocalStorage(), str(tmp_path / "ckpt"))
    live = _fresh()
    load(live, tmp_path / "ckpt", no_dist=True)
    _assert_same(first, live)

    # A save that fails while writing (here, the state dict raises) commits nothing either.
    class Failing(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            if write_item.index.fqn == "model.2.bias":
                raise OSError("the disk went away")
            return super().resolve_data(write_item)

    with pytest.raises(CheckpointException, match="the disk went away"):
        dcp.save(
            _state(*_trained(seed=7), EXTRA),
            storage_writer=StorageWriter(tmp_path / "ckpt", overwrite=True),
            planner=Failing(),
            no_dist=True,
        )
    load(live, tmp_path / "ckpt", no_dist=True)
    _assert_same(first, live)

    # The next save to it clears what the interrupted ones left, and commits.
    second = _state(*_trained(seed=8), EXTRA)
    save(second, tmp_path / "ckpt", overwrite=True, no_dist=True)
    assert not (tmp_path / ".tmp-ckpt-dcp").exists()
    load(live, tmp_path / "ckpt", no_dist=True)
    _assert_same(second, live)


def test_reads_a_checkpoint_manager_checkpoint(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=9)
    with crashproof.CheckpointManager(tmp_path, async_save=False, handle_signals=False) as manager:
        manager.save(2, crashproof.TrainState(model=model, optimizer=optimizer))
    live = {f"model/{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    live["optimizer/state/0/exp_avg"] = torch.zeros(6, 8)
    load(live, tmp_path, step=2, no_dist=True)
    for key, value in model.state_dict().items():
        assert torch.equal(live[f"model/{key}"], value), key
    assert torch.equal(
        live["optimizer/state/0/exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )


if __name__ == "__main__":
    warnings.simplefilter("ignore", UserWarning)
    mode, where = sys.argv[1], Path(sys.argv[2])
    if mode == "two-ranks":
        _two_ranks(where)
    elif mode == "save-over":
        save(_state(*_trained(seed=10), EXTRA), where, overwrite=True, no_dist=True)
        print("committed: the kill did not come", flush=True)
