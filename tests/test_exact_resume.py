"""A run interrupted and resumed in a new process ends bit for bit where an uninterrupted run ends.

The training script (``examples/train_tiny.py``) uses dropout, NumPy and Python randomness in the
batch, a DataLoader with worker processes, a OneCycle LR schedule, a GradScaler and an EMA, and
crosses epoch boundaries. Each run logs the sample ids and loss of every step, so the test also
proves every step saw the same samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crashproof.checkpoint import committed_steps, describe_checkpoint
from crashproof.storage import LocalStorage
from tests.conftest import EXAMPLES, run_python, step_records

STEPS = 40  # 200 samples / batch 16 = 12 steps per epoch: the runs cross three epoch boundaries


def _train(run_dir: Path, log: Path, *extra: str, check: bool = True) -> int:
    proc = run_python(
        [
            str(EXAMPLES / "train_tiny.py"),
            "--run-dir",
            str(run_dir),
            "--steps",
            str(STEPS),
            "--step-log",
            str(log),
            *extra,
        ],
        check=check,
    )
    return proc.returncode


@pytest.fixture(scope="module")
def baseline(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, object]]]:
    base = tmp_path_factory.mktemp("baseline")
    _train(
        base / "run", base / "log.jsonl", "--every", "5", "--dump", str(base / "final.safetensors")
    )
    return load_file(base / "final.safetensors"), step_records(base / "log.jsonl")


@pytest.mark.parametrize(
    ("crash_at", "every", "extra"),
    [
        (23, "5", []),  # mid-epoch, 3 steps after the last checkpoint: they are recomputed
        (24, "6", []),  # exactly at an epoch boundary, right after a checkpoint
        (31, "4", ["--sync", "--workers", "0"]),  # synchronous saves, no worker processes
        (26, "3", ["--full-every", "4"]),  # resumes from a delta checkpoint (24, on base 15)
    ],
)
def test_resumed_run_is_bit_identical_to_uninterrupted_run(
    tmp_path: Path,
    baseline: tuple[dict[str, torch.Tensor], dict[int, dict[str, object]]],
    crash_at: int,
    every: str,
    extra: list[str],
) -> None:
    expected_tensors, expected_steps = baseline
    log = tmp_path / "log.jsonl"
    code = _train(
        tmp_path / "run", log, "--every", every, "--crash-at", str(crash_at), *extra, check=False
    )
    assert code == 17, "the first run should die at the simulated crash"
    assert len(step_records(log)) == crash_at
    if "--full-every" in extra:  # the newest checkpoint, the one resumed from, is a delta
        storage = LocalStorage()
        root = str(tmp_path / "run" / "checkpoints")
        step, path = committed_steps(storage, root)[0]
        assert describe_checkpoint(storage, step, path).kind == "delta"
    _train(
        tmp_path / "run",
        log,
        "--every",
        every,
        "--dump",
        str(tmp_path / "final.safetensors"),
        *extra,
    )

    resumed = load_file(tmp_path / "final.safetensors")
    assert resumed.keys() == expected_tensors.keys()
    assert any(k.startswith("optimizer/") for k in resumed) and any(
        k.startswith("ema/") for k in resumed
    )
    different = [k for k in expected_tensors if not torch.equal(resumed[k], expected_tensors[k])]
    assert not different, f"tensors differ from the uninterrupted run: {different}"
    # Same samples, in the same order, and the same loss at every step (sample ids and floats).
    assert step_records(log) == expected_steps


def test_resume_refuses_a_checkpoint_whose_data_order_no_longer_applies(tmp_path: Path) -> None:
    """A changed dataset would silently replay other samples: the restore must refuse, loudly."""
    log = tmp_path / "log.jsonl"
    assert (
        _train(
            tmp_path / "run", log, "--every", "5", "--crash-at", "12", "--workers", "0", check=False
        )
        == 17
    )
    proc = run_python(
        [
            str(EXAMPLES / "train_tiny.py"),
            "--run-dir",
            str(tmp_path / "run"),
            "--steps",
            str(STEPS),
            "--samples",
            "208",
        ],
        check=False,
    )
    assert proc.returncode != 0
    assert "StateMismatchError" in proc.stderr and "n=200" in proc.stderr and "n=208" in proc.stderr
