"""A loop written with Hugging Face Accelerate: killed under crashproof run, resumed bit for bit.

``examples/accelerate_train.py`` prepares the model (DDP over gloo on two ranks), the optimizer
and a OneCycle scheduler with ``accelerator.prepare``, and leaves its DataLoader to crashproof's
``ResumableSampler``; dropout is on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import crashproof as cp
from crashproof.errors import ConfigError
from tests.integrations.launch import finish, start

pytest.importorskip("accelerate")


def test_an_accelerate_loop_killed_under_crashproof_run_resumes_bit_identical(
    tmp_path: Path,
) -> None:
    expected, actual = tmp_path / "expected.st", tmp_path / "actual.st"
    uninterrupted = start(
        "accelerate_train.py", tmp_path / "run-a", "--root", str(tmp_path / "a"),
        "--dump", str(expected),
    )  # fmt: skip
    killed = start(
        "accelerate_train.py", tmp_path / "run-b", "--root", str(tmp_path / "b"),
        "--kill-at", "13", "--dump", str(actual),
    )  # fmt: skip
    code, events, output = finish(killed)
    assert code == 0, output
    code, _, said = finish(uninterrupted)
    assert code == 0, said
    assert len([e for e in events if e["event"] == "restart"]) == 1, output
    # From step 10, or 5 where the asynchronous save of step 10 was still being written.
    assert {e["step"] for e in events if e["event"] == "restore"} in ({10}, {5}), output
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
