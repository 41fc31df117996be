"""FSDP2 (``fully_shard``) on CPU with gloo, ranks forked from a warm process
(:mod:`tests.warm_ranks`, torchrun's environment): sharded model and optimizer state
saved by one number of ranks and restored by another (4 -> 2 -> 3 -> 2 -> 1: 4 -> 2, 2 -> 3 and
2 -> 1 each directly) holds the same whole tensors; resuming on the same number of ranks is
bit-exact; a corrupt piece makes the restore fall back to the checkpoint before;
exports (safetensors, and a ``torch.distributed.checkpoint`` directory loaded back with
``dcp.load``) put the pieces back together."""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.conftest import run_python
from tests.warm_ranks import WarmRanks

TRAINER = Path(__file__).with_name("fsdp2_trainer.py")


def _launch(ranks: WarmRanks, root: Path, nproc: int, *args: str) -> int:
    """Runs the trainer on ``nproc`` ranks; returns the step it restored."""
    result = ranks.run(TRAINER, ["--root", str(root), *args], nproc=nproc, timeout=180)
    assert result.returncode == 0, result.output[-3000:]
    starts = set(re.findall(r"rank \d+: starting at step (\d+)", result.output))
    assert len(starts) == 1, result.output[-3000:]
    return int(starts.pop())


def _assert_same(a: Path, b: Path) -> None:
    left, right = load_file(a), load_file(b)
    assert sorted(left) == sorted(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name


def test_sharded_state_restores_on_other_world_sizes_with_equal_tensors(
    tmp_path: Path, warm_ranks: WarmRanks
) -> None:
    root = tmp_path / "ckpt"
    assert _launch(warm_ranks, root, 4, "--train", "3", "--dump", str(tmp_path / "saved0.st")) == 0
    # (ranks, step restored, steps to train): 4 -> 2, 2 -> 3, 3 -> 2 and 2 -> 1, each restoring
    # what the world size before saved (steps 3, 5, 6 and 7).
    plan = [(2, 3, "2"), (3, 5, "1"), (2, 6, "1"), (1, 7, "0")]
    for run, (nproc, restored_step, train) in enumerate(plan, start=1):
        restored = tmp_path / f"restored{run}.st"
        step = _launch(
            warm_ranks, root, nproc, "--dump-restored", str(restored), "--train", train,
            "--dump", str(tmp_path / f"saved{run}.st"),
        )  # fmt: skip
        assert step == restored_step
        _assert_same(tmp_path / f"saved{run - 1}.st", restored)  # what W ranks saved, W' hold

    # Exports put every rank's pieces back together.
    exported = tmp_path / "model.safetensors"
    result = run_python(
        [
            "-m",
            "crashproof.cli",
            "export",
            str(root),
            "--format",
            "safetensors",
            "-o",
            str(exported),
        ]
    )
    assert "step 7" in result.stdout
    whole = load_file(tmp_path / "saved3.st")  # step 7, as 2 ranks saved it
    weights = load_file(exported)
    assert sorted(weights) == sorted(
        k.removeprefix("model/") for k in whole if k.startswith("model/")
    )
    for name, tensor in weights.items():
        assert torch.equal(tensor, whole[f"model/{name}"]), name

    # As a torch.distributed.checkpoint directory: step 3, saved by 4 ranks in uneven pieces
    # (7 rows as 2 + 2 + 2 + 1, 3 as 1 + 1 + 1 + 0), read back whole in this process alone.
    out = tmp_path / "dcp"
    result = run_python(
        ["-m", "crashproof.cli", "export", str(root), "--step", "3", "--format", "dcp",
         "-o", str(out)]
    )  # fmt: skip
    assert "step 3" in result.stdout
    _assert_dcp_export_is(out, load_file(tmp_path / "saved0.st"), step=3)

    # A corrupt piece of the newest checkpoint: the restore falls back to the one before.
    newest = root / "step_0000000007" / "rank_00001.safetensors"
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0x01
    newest.write_bytes(data)
    assert _launch(warm_ranks, root, 3, "--dump-restored", str(tmp_path / "fallback.st")) == 6
    _assert_same(tmp_path / "saved2.st", tmp_path / "fallback.st")


def _assert_dcp_export_is(out: Path, whole: dict[str, torch.Tensor], *, step: int) -> None:
    """``dcp.load`` of the export ``out``, in one process into whole tensors (NaN until loaded),
    gives the model and optimizer tensors of ``whole`` (a trainer's ``--dump``) and ``step``."""
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in whole.items():
        part, rest = key.split("/", 1)
        if part == "model":
            model[rest] = torch.full_like(tensor, float("nan"))
        else:
            fqn, name = rest.rsplit("/", 1)
            moments.setdefault(fqn, {})[name] = torch.full_like(tensor, float("nan"))
    assert model and moments and all(len(entry) == 3 for entry in moments.values())
    target = {"model": model, "optimizer": {"state": moments}, "step": torch.tensor(0)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert int(target["step"]) == step
    for name, tensor in model.items():
        assert torch.equal(tensor, whole[f"model/{name}"]), name
    for fqn, entry in moments.items():
        for name, tensor in entry.items():
            assert torch.equal(tensor, whole[f"optimizer/{fqn}/{name}"]), (fqn, name)


def test_sharded_resume_on_the_same_world_size_is_bit_exact(
    tmp_path: Path, warm_ranks: WarmRanks
) -> None:
    _launch(
        warm_ranks,
        tmp_path / "straight",
        2,
        "--train",
        "5",
        "--dump",
        str(tmp_path / "straight.st"),
    )
    # Saving before the first step (torch's state-dict helper steps an optimizer without state
    # to create it) must not change the run: the resumed run still ends like the straight one.
    resumed = tmp_path / "resumed"
    _launch(warm_ranks, resumed, 2, "--save-first", "--train", "3")
    assert (
        _launch(warm_ranks, resumed, 2, "--train", "2", "--dump", str(tmp_path / "resumed.st")) == 3
    )
    _assert_same(tmp_path / "straight.st", tmp_path / "resumed.st")

    # Nor does restoring that step-0 checkpoint: its optimizer has no state, as it had then.
    for later in ("step_0000000003", "step_0000000005"):
        shutil.rmtree(resumed / later)
    assert (
        _launch(warm_ranks, resumed, 2, "--train", "5", "--dump", str(tmp_path / "again.st")) == 0
    )
    _assert_same(tmp_path / "straight.st", tmp_path / "again.st")
