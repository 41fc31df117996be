"""Restore's fan-out: rank 0 reads the manifest once and hands each rank only the part it reads,
so a restore's aggregate reading grows linearly with the number of ranks, not as its square;
what rank 0 meets on the way (corruption, a refused read, state that cannot be redistributed) is
every rank's outcome, and a rank never reads another rank's index or the manifest itself."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import crashproof as cp
from crashproof.checkpoint.format import MANIFEST_NAME, checkpoint_dir_name
from crashproof.checkpoint.restore import plan_restore
from tests.checkpoint.test_distributed import _two_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import coordination  # (the benchmark's simulated checkpoints, at test size)


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
            raise _Unpicklable()

        _fan_out.read_manifest = failing  # type: ignore[assignment]
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        try:
            outcome = str(ckpt.restore(cp.TrainState(model=model)))
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    out.put((rank, outcome))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("case", ["refused", "unpicklable"])
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
    else:
        assert all(said[r].startswith("RuntimeError") for r in (0, 1)), said
        assert all("a storage library's own error" in said[r] for r in (0, 1)), said
