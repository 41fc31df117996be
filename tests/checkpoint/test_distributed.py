"""Two real ranks under torchrun (gloo, DDP): parallel per-rank saves, one commit, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

import crashproof as cp
from tests.conftest import EXAMPLES, run_python

STEPS = 30


def _torchrun(run_dir: Path, log: Path, *extra: str, check: bool = True) -> int:
    args = [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(EXAMPLES / "train_tiny.py"), "--run-dir", str(run_dir), "--steps", str(STEPS),
        "--every", "5", "--workers", "1", "--step-log", str(log), *extra,
    ]  # fmt: skip
    return run_python(args, check=check, timeout=240).returncode


def test_two_ranks_resume_bit_identical_after_a_crash(tmp_path: Path) -> None:
    _torchrun(tmp_path / "ref", tmp_path / "ref.log", "--dump", str(tmp_path / "ref.safetensors"))
    assert _torchrun(tmp_path / "run", tmp_path / "run.log", "--crash-at", "17", check=False) != 0
    _torchrun(tmp_path / "run", tmp_path / "run.log", "--dump", str(tmp_path / "run.safetensors"))

    expected, resumed = (
        load_file(tmp_path / "ref.safetensors"),
        load_file(tmp_path / "run.safetensors"),
    )
    assert expected.keys() == resumed.keys()
    assert [k for k in expected if not torch.equal(expected[k], resumed[k])] == []
    for rank in (0, 1):  # each rank saw the same samples at every step as in the reference run
        ref = {
            r["step"]: r
            for r in map(json.loads, (tmp_path / f"ref.log.rank{rank}").read_text().splitlines())
        }
        run = {
            r["step"]: r
            for r in map(json.loads, (tmp_path / f"run.log.rank{rank}").read_text().splitlines())
        }
        assert run == ref

    # One checkpoint per step, holding both ranks' files, committed by one manifest.
    checkpoints = cp.CheckpointManager(str(tmp_path / "run" / "checkpoints")).list()
    assert [c.step for c in checkpoints] == [30, 25, 20]
    assert all(c.valid and c.world_size == 2 for c in checkpoints)
    newest = tmp_path / "run" / "checkpoints" / "step_0000000030"
    assert sorted(p.name for p in newest.iterdir()) == [
        "manifest.json", "rank_00000.json", "rank_00000.safetensors", "rank_00001.json", "rank_00001.safetensors",
    ]  # fmt: skip
    cp.checkpoint.verify_checkpoint(cp.LocalStorage(), str(newest))
