"""A NaN in real multi-process training under ``crashproof run``: every rank rolls back together,
the bad data is skipped wherever it comes back, and no committed checkpoint holds a NaN."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from crashproof.checkpoint.restore._rank_read import load_rank_state
from crashproof.checkpoint.restore._read_manifest import read_manifest
from crashproof.checkpoint.root._catalog import committed_steps
from crashproof.storage import LocalStorage
from crashproof.telemetry import read_events
from tests.conftest import EXAMPLES, step_records

BAD_SAMPLE = 5


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def test_a_nan_sample_is_rolled_back_and_skipped_by_every_rank(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2",
        "--run-dir", str(tmp_path / "supervisor"), str(EXAMPLES / "train_tiny.py"),
        "--run-dir", str(tmp_path / "run"), "--steps", "40", "--every", "5", "--keep", "100",
        "--workers", "1", "--nan-sample", str(BAD_SAMPLE),
        "--step-log", str(tmp_path / "steps.jsonl"), "--dump", str(tmp_path / "final.safetensors"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # The sample is in every epoch (6 steps each): each time, one rollback on every rank, to the
    # same checkpoint (the first time, before any checkpoint, the step is skipped instead).
    events = list(read_events(tmp_path / "supervisor" / "events.jsonl"))
    rollbacks = {
        rank: [(e["step"], e["rolled_back_to"], e["skipped"]) for e in events
               if e["event"] == "numerics_rollback" and e.get("rank") == rank]
        for rank in (0, 1)
    }  # fmt: skip
    assert rollbacks[0] == rollbacks[1] and len(rollbacks[0]) >= 5
    assert sum(to is not None for _, to, _ in rollbacks[0]) >= 4

    # Training never applied a step holding the sample, and went on to the end.
    for rank in (0, 1):
        records = step_records(tmp_path / f"steps.jsonl.rank{rank}")
        assert max(records) == 40
        assert all(BAD_SAMPLE not in r["ids"] for r in records.values())
    assert all(
        bool(torch.isfinite(t).all()) for t in load_file(tmp_path / "final.safetensors").values()
    )

    # No committed checkpoint holds a NaN or an infinity, on any rank.
    storage = LocalStorage()
    root = str(tmp_path / "run" / "checkpoints")
    found = committed_steps(storage, root)
    assert len(found) >= 7
    for _, path in found:
        manifest = read_manifest(storage, path)
        for rank in range(manifest.world_size):
            tree = load_rank_state(storage, path, manifest, rank)
            state = [t for key in ("model", "optimizer") for t in _tensors(tree[key])]
            assert all(bool(torch.isfinite(t).all()) for t in state if t.is_floating_point())
