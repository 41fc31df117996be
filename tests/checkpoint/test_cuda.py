"""CUDA paths: pinned staging on a side stream, snapshot isolation on the device, CUDA RNG.

Skipped on machines without a GPU (as the CI machine is); run them where one is present.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import crashproof as cp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_state() -> cp.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(32, 256, device="cuda")).sum().backward()
    opt.step()
    return cp.TrainState(model=model, optimizer=opt)


def test_async_save_of_cuda_tensors_holds_the_values_of_the_saved_step(tmp_path: Path) -> None:
    state = _cuda_state()
    assert state.model is not None
    expected = {k: v.detach().cpu().clone() for k, v in state.model.state_dict().items()}
    ckpt = cp.CheckpointManager(str(tmp_path))
    ckpt.save(1, state)
    with torch.no_grad():  # kernels queued right after save() returns must not race the copies
        for p in state.model.parameters():
            p.mul_(-3.0).add_(1.0)
    ckpt.close()
    staging = ckpt._pipeline._stagings[0]
    assert all(b.is_pinned() for b in staging._buffers.values() if b.numel() > 64)
    fresh = _cuda_state()
    assert cp.CheckpointManager(str(tmp_path)).restore(fresh) == 1
    assert fresh.model is not None
    for k, v in fresh.model.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), expected[k]), k


def test_cuda_rng_state_is_saved_and_restored(tmp_path: Path) -> None:
    state = _cuda_state()
    ckpt = cp.CheckpointManager(str(tmp_path), async_save=False)
    ckpt.save(1, state)
    after_save = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")  # move the generator on
    assert ckpt.restore(_cuda_state()) == 1
    assert torch.equal(torch.rand(4, device="cuda"), after_save)
