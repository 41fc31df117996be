"""FSDP2 (``fully_shard``) on CPU with gloo, under torchrun: sharded model and optimizer state
saved by one number of ranks and restored by another (2 -> 3 -> 1 -> 4 -> 2) holds the same
whole tensors; resuming on the same number of ranks is bit-exact; a corrupt piece makes the
restore fall back to the checkpoint before; exports put the pieces back together."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.conftest import run_python

TRAINER = Path(__file__).with_name("fsdp2_trainer.py")


def _torchrun(root: Path, nproc: int, *args: str) -> int:
    """Runs the trainer; returns the step it restored."""
    result = run_python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         str(TRAINER), "--root", str(root), *args],
        check=False, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    starts = set(re.findall(r"rank \d+: starting at step (\d+)", result.stdout))
    assert len(starts) == 1, result.stdout[-3000:]
    return int(starts.pop())


def _assert_same(a: Path, b: Path) -> None:
    left, right = load_file(a), load_file(b)
    assert sorted(left) == sorted(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name


def test_sharded_state_restores_on_other_world_sizes_with_equal_tensors(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert _torchrun(root, 2, "--train", "3", "--dump", str(tmp_path / "saved2.st")) == 0
    plan = [(3, 3, "2"), (1, 5, "1"), (4, 6, "1"), (2, 7, "0")]  # (ranks, restored, train)
    previous = tmp_path / "saved2.st"
    for nproc, restored_step, train in plan:
        restored = tmp_path / f"restored{nproc}.st"
        saved = tmp_path / f"saved{nproc}.st"
        step = _torchrun(
            root, nproc, "--dump-restored", str(restored), "--train", train, "--dump", str(saved)
        )
        assert step == restored_step
        _assert_same(previous, restored)  # what W ranks saved, W' ranks hold
        previous = saved

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
    whole = load_file(tmp_path / "saved4.st")  # step 7, as 4 ranks saved it
    weights = load_file(exported)
    assert sorted(weights) == sorted(
        k.removeprefix("model/") for k in whole if k.startswith("model/")
    )
    for name, tensor in weights.items():
        assert torch.equal(tensor, whole[f"model/{name}"]), name

    # A corrupt piece of the newest checkpoint: the restore falls back to the one before.
    newest = root / "step_0000000007" / "rank_00001.safetensors"
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0x01
    newest.write_bytes(data)
    assert _torchrun(root, 3, "--dump-restored", str(tmp_path / "fallback.st")) == 6
    _assert_same(tmp_path / "saved1.st", tmp_path / "fallback.st")


def test_sharded_resume_on_the_same_world_size_is_bit_exact(tmp_path: Path) -> None:
    _torchrun(tmp_path / "straight", 2, "--train", "5", "--dump", str(tmp_path / "straight.st"))
    # Saving before the first step (torch's state-dict helper steps an optimizer without state
    # to create it) must not change the run: the resumed run still ends like the straight one.
    resumed = tmp_path / "resumed"
    _torchrun(resumed, 2, "--save-first", "--train", "3")
    assert _torchrun(resumed, 2, "--train", "2", "--dump", str(tmp_path / "resumed.st")) == 3
    _assert_same(tmp_path / "straight.st", tmp_path / "resumed.st")

    # Nor does restoring that step-0 checkpoint: its optimizer has no state, as it had then.
    for later in ("step_0000000003", "step_0000000005"):
        shutil.rmtree(resumed / later)
    assert _torchrun(resumed, 2, "--train", "5", "--dump", str(tmp_path / "again.st")) == 0
    _assert_same(tmp_path / "straight.st", tmp_path / "again.st")
