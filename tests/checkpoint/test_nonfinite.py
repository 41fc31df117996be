"""A checkpoint never commits NaN or inf in parameters or optimizer state."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import crashproof as cp


class Masked(nn.Module):
    """A model with a buffer that holds -inf by design (an attention mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("mask", torch.triu(torch.full((8, 8), float("-inf")), diagonal=1))


def _state() -> tuple[Masked, torch.optim.Optimizer, cp.TrainState]:
    torch.manual_seed(0)
    model = Masked()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.linear(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer, cp.TrainState(model=model, optimizer=optimizer)


@pytest.mark.parametrize("async_save", [True, False])
def test_nan_in_a_parameter_is_refused_and_earlier_checkpoints_stay(
    tmp_path: Path, async_save: bool
) -> None:
    model, _, state = _state()
    with cp.CheckpointManager(tmp_path, async_save=async_save, handle_signals=False) as ckpt:
        ckpt.save(10, state)  # the -inf mask is a buffer: allowed
        ckpt.wait()
        with torch.no_grad():
            model.linear.weight[3, 5] = float("nan")
        with pytest.raises(cp.NonFiniteStateError) as caught:
            ckpt.save(20, state)
            ckpt.wait()
        assert "'model/linear.weight' holds 1 NaN or infinite value(s) of 64 at step 20" in str(
            caught.value
        )
        assert [info.step for info in ckpt.list()] == [10]
        assert ckpt.stats.failures == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000000010"]


def test_inf_in_the_optimizer_state_is_refused(tmp_path: Path) -> None:
    model, optimizer, state = _state()
    optimizer.state[model.linear.bias]["exp_avg_sq"][0] = float("inf")
    with cp.CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        ckpt.save(1, state)
        with pytest.raises(cp.NonFiniteStateError, match=r"optimizer/state/1/exp_avg_sq"):
            ckpt.wait()


def test_the_check_can_be_turned_off(tmp_path: Path) -> None:
    model, _, state = _state()
    with torch.no_grad():
        model.linear.weight.fill_(float("inf"))
    with cp.CheckpointManager(tmp_path, check_finite=False, handle_signals=False) as ckpt:
        ckpt.save(1, state)
        assert ckpt.wait() is not None


def test_large_finite_values_whose_sum_overflows_are_not_refused(tmp_path: Path) -> None:
    model, _, state = _state()
    with torch.no_grad():
        model.linear.weight.fill_(3e38)  # finite, but their sum is inf
    with cp.CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        ckpt.save(1, state)
        assert ckpt.wait() is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.complex64])
def test_every_float_format_is_checked(tmp_path: Path, dtype: torch.dtype) -> None:
    with warnings.catch_warnings():  # complex modules are "a new feature": not what is tested
        warnings.simplefilter("ignore", UserWarning)
        model = nn.Linear(64, 64).to(dtype)
    state = cp.TrainState(model=model)
    with cp.CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        ckpt.save(1, state)
        assert ckpt.wait() is not None
        with torch.no_grad():
            model.weight.view(-1)[777] = float("inf")
        ckpt.save(2, state)
        with pytest.raises(cp.NonFiniteStateError, match="holds 1 NaN"):
            ckpt.wait()


def test_a_delta_holding_nan_is_refused_too(tmp_path: Path) -> None:
    model, _, state = _state()
    with cp.CheckpointManager(tmp_path, delta=cp.Delta(full_every=5), handle_signals=False) as c:
        c.save(1, state)
        c.wait()
        with torch.no_grad():
            model.linear.weight.add_(0.01)  # changed: stored as an encoded delta
            model.linear.weight[0, 0] = float("nan")
        c.save(2, state)
        with pytest.raises(cp.NonFiniteStateError, match=r"'model/linear\.weight' holds 1 NaN"):
            c.wait()
        assert [info.step for info in c.list()] == [1]
