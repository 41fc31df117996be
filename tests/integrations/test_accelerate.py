"""A loop written with Hugging Face Accelerate: killed under crashproof run, resumed bit for bit.

``examples/accelerate_train.py`` prepares the model (DDP over gloo on two ranks), the optimizer
and a OneCycle scheduler with ``accelerator.prepare``, and leaves its DataLoader to crashproof's
``ResumableSampler``; dropout is on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import crashproof as cp
from crashproof.errors import ConfigError
from crashproof.telemetry import read_events
from tests.conftest import EXAMPLES

pytest.importorskip("accelerate")


def _run(run_dir: Path, *script_args: str) -> tuple[int, list[dict[str, object]], str]:
    command = [sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2"]
    command += ["--run-dir", str(run_dir), "--metrics-port", "-1", "--cold-start"]
    command += [str(EXAMPLES / "accelerate_train.py"), *script_args]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return proc.returncode, list(read_events(run_dir / "events.jsonl")), proc.stdout + proc.stderr


def test_an_accelerate_loop_killed_under_crashproof_run_resumes_bit_identical(
    tmp_path: Path,
) -> None:
    expected, actual = tmp_path / "expected.st", tmp_path / "actual.st"
    code, _, output = _run(
        tmp_path / "run-a", "--root", str(tmp_path / "a"), "--dump", str(expected)
    )
    assert code == 0, output
    code, events, output = _run(
        tmp_path / "run-b", "--root", str(tmp_path / "b"), "--kill-at", "13", "--dump", str(actual)
    )
    assert code == 0, output
    assert len([e for e in events if e["event"] == "restart"]) == 1, output
    assert {e["step"] for e in events if e["event"] == "restore"} == {10}, output
    a, b = load_file(expected), load_file(actual)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_loader_prepared_by_accelerate_is_refused_saying_what_to_do() -> None:
    from accelerate import Accelerator
    from accelerate.data_loader import prepare_data_loader

    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    loader = torch.utils.data.DataLoader(
        data, batch_size=2, sampler=cp.ResumableSampler(len(data), rank=0, world_size=1)
    )
    # On one process Accelerate keeps the sampler; on two it deals batches out itself (what
    # rank 0 of two gets is made here directly): refused either way, so the one-process run
    # that works cannot turn into a multi-process run that silently does not.
    one = Accelerator(cpu=True).prepare(loader)
    two = prepare_data_loader(loader, num_processes=2, process_index=0)
    for prepared in (one, two):
        with pytest.raises(ConfigError, match=r"Leave the DataLoader out of accelerator\.prepare"):
            cp.TrainState(data=prepared)
