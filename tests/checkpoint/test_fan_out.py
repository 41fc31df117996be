"""Restore's fan-out: rank 0 reads the manifest once and hands each rank only the part it reads,
so a restore's aggregate reading grows linearly with the number of ranks, not as its square;
what rank 0 meets on the way (corruption, a refused read, state that cannot be redistributed) is
every rank's outcome, and a rank never reads another rank's index or the manifest itself."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import coordination  # (the benchmark's simulated checkpoints, at test size: tests/conftest.py)
import crashproof as cp
from crashproof.checkpoint.format import (
    MANIFEST_NAME,
    FileEntry,
    checkpoint_dir_name,
    digest,
    dumps,
    parse_rank_index,
    seal_manifest,
)
from crashproof.checkpoint.format._shard_file import shard_checksum
from crashproof.checkpoint.restore import (
    PartialManifest,
    RankRead,
    plan_restore,
    read_manifest,
    verify_checkpoint,
)
from tests.checkpoint.test_distributed import _two_ranks
from tests.conftest import free_port, warm_context


def _simulated(tmp_path: Path, world: int, **kwargs: Any) -> str:
    coordination.simulated_checkpoint(tmp_path, world, **kwargs)
    return str(tmp_path / checkpoint_dir_name(1000))


@pytest.mark.parametrize("world", [4, 64])
def test_each_rank_is_handed_only_its_own_files(tmp_path: Path, world: int) -> None:
    ckpt_dir = _simulated(tmp_path, world)
    plans = plan_restore(cp.LocalStorage(), ckpt_dir, world)
    assert [plan.source for plan in plans] == list(range(world))
    for rank, plan in enumerate(plans):
        own = {f"rank_{rank:05d}.json", f"rank_{rank:05d}.safetensors"}
        # (and rank 0's shard, which may hold replicated tensors rank 0 wrote for all)
        assert set(plan.manifest.files) == own | {"rank_00000.safetensors"}
        assert plan.manifest.world_size == world and plan.manifest.step == 1000
    # What each rank receives does not grow with the ranks (the rank's number aside).
    sizes = [len(pickle.dumps(plan)) for plan in plans]
    assert max(sizes[1:]) - min(sizes[1:]) <= 8 and max(sizes) < 1024, sizes


def test_what_each_rank_is_handed_does_not_grow_and_the_aggregate_is_linear(
    tmp_path: Path,
) -> None:
    small, large = (coordination.fan_out_costs(w, tmp_path) for w in (16, 512))
    assert abs(small["plan_kb_max"] - large["plan_kb_max"]) < 0.01
    per_rank = [r["after_aggregate_mb"] / r["world"] for r in (small, large)]
    assert per_rank[1] < 1.5 * per_rank[0], per_rank  # linear: bytes per rank stay put
    gain = [r["before_aggregate_mb"] / r["after_aggregate_mb"] for r in (small, large)]
    assert gain[1] > 5 * gain[0], gain  # before, each rank's share grew with the ranks
    changed = coordination.fan_out_costs(64, tmp_path, restore_on=32)
    assert changed["after_aggregate_mb"] * 10 < changed["before_aggregate_mb"]
    assert changed["plan_kb_max"] < 1.0  # on another world size too: no other rank's entries


def test_on_another_world_size_rank_0_checks_the_state_is_replicated_once(
    tmp_path: Path,
) -> None:
    same = _simulated(tmp_path / "same", 4)
    assert [p.source for p in plan_restore(cp.LocalStorage(), same, 3)] == [0, 1, 2]
    assert [p.source for p in plan_restore(cp.LocalStorage(), same, 6)] == [0, 1, 2, 3, 0, 1]
    split = _simulated(tmp_path / "split", 4, differ=2)
    with pytest.raises(cp.StateMismatchError, match="rank 0 and rank 2"):
        plan_restore(cp.LocalStorage(), split, 2)


def _save_two_steps(rank: int, root: str, port: int, out: Any) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    with cp.CheckpointManager(root, async_save=False, handle_signals=False) as ckpt:
        for step in (1, 2):
            with torch.no_grad():
                model.module.weight.add_(1.0)
            ckpt.save(step, cp.TrainState(model=model))
    out.put((rank, "saved"))
    torch.distributed.destroy_process_group()


def _restore_and_watch(rank: int, root: str, port: int, out: Any) -> None:
    """Restore, recording every file of the root this rank opens (an audit hook sees each
    ``open``, however the storage opens it)."""
    opened: list[str] = []

    def watch(event: str, args: tuple[Any, ...]) -> None:
        # (the local storage opens a checkpoint's files relative to its directory)
        if event == "open" and isinstance(args[0], str):
            name = Path(args[0]).name
            if name == MANIFEST_NAME or name.startswith("rank_"):
                opened.append(name)

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    torch.manual_seed(1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        sys.addaudithook(watch)
        try:
            step = ckpt.restore(cp.TrainState(model=model))
        except Exception as exc:
            step = f"{type(exc).__name__}: {exc}"
    weight = float(model.module.weight[0, 0].detach())
    out.put((rank, step, weight, opened))
    torch.distributed.destroy_process_group()


def _outcomes(root: Path) -> dict[int, tuple[Any, float, list[str]]]:
    outcomes, codes = _two_ranks(_restore_and_watch, str(root))
    assert codes == [0, 0], codes
    return {rank: rest for rank, *rest in outcomes}  # type: ignore[misc]


@pytest.fixture(scope="module")
def two_rank_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 saved by two gloo ranks (DDP: replicated tensors written once each); every
    test restores a copy of it."""
    root = tmp_path_factory.mktemp("fan_out") / "ckpt"
    outcomes, codes = _two_ranks(_save_two_steps, str(root))
    assert codes == [0, 0], (outcomes, codes)
    return root


def _copy(root: Path, tmp_path: Path) -> Path:
    shutil.copytree(root, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_rank_1_never_reads_the_manifest_or_rank_0s_index(
    two_rank_root: Path, tmp_path: Path
) -> None:
    intact = _outcomes(_copy(two_rank_root, tmp_path))
    assert {step for step, _, _ in intact.values()} == {2}
    opened_by_1 = intact[1][2]
    assert not any(MANIFEST_NAME in path for path in opened_by_1), opened_by_1
    assert not any("rank_00000.json" in path for path in opened_by_1), opened_by_1
    assert any("rank_00001.json" in path for path in opened_by_1), opened_by_1


@pytest.mark.parametrize("damaged", ["rank 1's index", "the manifest"])
def test_two_ranks_fall_back_together(two_rank_root: Path, tmp_path: Path, damaged: str) -> None:
    root = _copy(two_rank_root, tmp_path)
    newest = root / checkpoint_dir_name(2)
    if damaged == "the manifest":
        manifest = json.loads((newest / MANIFEST_NAME).read_text())
        manifest["step"] = 7  # sealed: the seal no longer holds
        (newest / MANIFEST_NAME).write_text(json.dumps(manifest))
    else:
        index = newest / "rank_00001.json"
        index.write_bytes(index.read_bytes().replace(b'"rank":1', b'"rank":3'))
    fell_back = _outcomes(root)
    assert {step for step, _, _ in fell_back.values()} == {1}, fell_back
    assert fell_back[0][1] == fell_back[1][1]  # step 1's weights on both


class _Unpicklable(Exception):
    """An error that cannot be sent to another rank as it is (it holds a lambda)."""

    def __init__(self) -> None:
        super().__init__("a storage library's own error")
        self.callback = lambda: None


def _rank0_meets(rank: int, where: str, port: int, out: Any) -> None:
    """Restore on two ranks, rank 0 meeting ``case`` when it reads the manifest."""
    root, case = where.split("|")
    if rank == 0:
        from crashproof.checkpoint.restore import _fan_out

        def failing(storage: Any, path: str) -> Any:
            if case == "refused":
                raise OSError(5, "Input/output error", path)
            if case == "interrupted":
                raise KeyboardInterrupt
            raise _Unpicklable()

        _fan_out.read_manifest = failing  # type: ignore[assignment]
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        try:
            outcome = str(ckpt.restore(cp.TrainState(model=model)))
        except BaseException as exc:  # (KeyboardInterrupt too)
            outcome = f"{type(exc).__name__}: {exc}"
    out.put((rank, outcome))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("case", ["refused", "unpicklable", "interrupted"])
def test_what_rank_0_meets_reading_the_manifest_every_rank_raises(
    two_rank_root: Path, tmp_path: Path, case: str
) -> None:
    root = _copy(two_rank_root, tmp_path)
    outcomes, codes = _two_ranks(_rank0_meets, f"{root}|{case}")
    assert codes == [0, 0], (outcomes, codes)  # nobody left waiting for rank 0
    said = dict(outcomes)
    if case == "refused":  # no verdict on the checkpoint: never fallen back past
        assert all(said[r].startswith("CheckpointReadError") for r in (0, 1)), said
        assert all("Input/output error" in said[r] for r in (0, 1)), said
    elif case == "interrupted":  # rank 0 unwinds; rank 1 is told at once, not at the timeout
        assert said[0].startswith("KeyboardInterrupt"), said
        assert said[1].startswith("RuntimeError") and "KeyboardInterrupt" in said[1], said
    else:
        assert all(said[r].startswith("RuntimeError") for r in (0, 1)), said
        assert all("a storage library's own error" in said[r] for r in (0, 1)), said


# A plan is an economy, never a narrower judgement than `crashproof verify`'s: checkpoints that
# crashproof does not write but that are valid (every checksum right) restore as they did when
# every rank read the whole manifest.


def _rewrite_index(ckpt_dir: Path, rank: int, change: Any) -> None:
    """Replace rank ``rank``'s index entries by ``change(entries, shard_header)`` (which returns
    the new entries and the tensors left in the rank's own shard), and reseal everything."""
    index_path = ckpt_dir / f"rank_{rank:05d}.json"
    index = parse_rank_index(index_path.read_bytes(), "test")
    tensors, own = change(index.tensors)
    data = dumps(dataclasses.replace(index, tensors=tensors).to_json())
    index_path.write_bytes(data)
    manifest = read_manifest(cp.LocalStorage(), str(ckpt_dir))
    files = dict(manifest.files)
    files[index_path.name] = FileEntry(len(data), digest(data))
    if own is not None:
        shard = ckpt_dir / f"rank_{rank:05d}.safetensors"
        header = shard.read_bytes()[: min(t.offset for t in own)]
        files[shard.name] = dataclasses.replace(
            files[shard.name], checksum=shard_checksum(header, [t.checksum for t in own])
        )
    sealed = seal_manifest(dataclasses.replace(manifest, files=files).to_json())
    (ckpt_dir / MANIFEST_NAME).write_bytes(sealed)
    verify_checkpoint(cp.LocalStorage(), str(ckpt_dir))  # valid, as crashproof verify sees it


def _points_into_rank_2s_shard(tensors: list[Any]) -> tuple[list[Any], list[Any]]:
    """The first tensor of rank 1's shard read from rank 2's (the same bytes there)."""
    first = min(range(len(tensors)), key=lambda i: tensors[i].offset)
    moved = [dataclasses.replace(t, file="rank_00002.safetensors") if i == first else t
             for i, t in enumerate(tensors)]  # fmt: skip
    return moved, sorted((t for i, t in enumerate(tensors) if i != first), key=lambda t: t.offset)


def _sharded_model(tensors: list[Any]) -> tuple[list[Any], None]:
    """Rank 1's model tensors recorded as whole-tensor pieces (rank 0's are not)."""
    return [
        dataclasses.replace(t, global_shape=t.shape, global_offset=(0,) * len(t.shape))
        if t.name.startswith("model/") else t
        for t in tensors
    ], None  # fmt: skip


@pytest.mark.parametrize(
    ("world", "change"),
    [(3, _points_into_rank_2s_shard), (2, _sharded_model)],
    ids=["a-shard-only-rank-1-points-into", "sharded-pieces-on-rank-1-only"],
)
def test_a_rank_whose_index_needs_more_than_its_plan_reads_the_whole_manifest(
    tmp_path: Path, world: int, change: Any
) -> None:
    ckpt_dir = Path(_simulated(tmp_path, world))
    _rewrite_index(ckpt_dir, 1, change)
    plan = plan_restore(cp.LocalStorage(), str(ckpt_dir), world)[1]
    with pytest.raises(PartialManifest):  # not "corrupt": the manifest on disk lists it all
        RankRead(cp.LocalStorage(), str(ckpt_dir), plan.manifest, 1)
    whole = read_manifest(cp.LocalStorage(), str(ckpt_dir))
    RankRead(cp.LocalStorage(), str(ckpt_dir), whole, 1).close()


def _restore_read_only(rank: int, where: str, port: int, out: Any) -> None:
    root, world = where.split("|")
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=int(world)
    )
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    with cp.CheckpointManager(root, handle_signals=False, read_only=True) as ckpt:
        out.put((rank, ckpt.restore(cp.TrainState(model=model))))
    torch.distributed.destroy_process_group()


def test_three_ranks_restore_a_checkpoint_whose_rank_1_points_where_rank_0_does_not(
    tmp_path: Path,
) -> None:
    ckpt_dir = Path(_simulated(tmp_path, 3))
    _rewrite_index(ckpt_dir, 1, _points_into_rank_2s_shard)
    ctx, port = warm_context(), free_port()
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_restore_read_only, args=(r, f"{tmp_path}|3", port, queue))
        for r in range(3)
    ]
    for p in procs:
        p.start()
    outcomes = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert outcomes == {0: 1000, 1: 1000, 2: 1000}  # (before: all three "no valid checkpoint")
