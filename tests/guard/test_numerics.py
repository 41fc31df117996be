"""NumericsGuard: non-finite and spiking steps are caught before they are applied, every rank
agrees, and the configured action is taken."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import crashproof as cp
from crashproof.errors import ConfigError, NumericsError
from tests.conftest import free_port


def _train(
    guard: cp.NumericsGuard,
    steps: int,
    poison: dict[int, float],
    *,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, list[int]]:
    """A small regression; ``poison[step]`` multiplies that step's loss (inf, nan, 1e6 ...)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    applied = []
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean() * poison.get(step + 1, 1.0)
        (scaler.scale(loss) if scaler else loss).backward()
        if guard.check(step + 1, loss, model, optimizer=optimizer, scaler=scaler):
            applied.append(step + 1)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, applied


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_nonfinite_loss_is_skipped_and_the_weights_stay_finite(poison: float) -> None:
    guard = cp.NumericsGuard()
    model, _, applied = _train(guard, 40, {12: poison})
    assert 12 not in applied and len(applied) == 39
    assert _finite(model)
    [verdict] = guard.anomalies
    assert verdict.step == 12 and verdict.kind == "nonfinite" and verdict.action == "skip"


def test_without_the_guard_the_same_nan_would_have_ruined_the_weights() -> None:
    class Blind(cp.NumericsGuard):
        def check(self, *args: object, **kwargs: object) -> bool:
            return True

    model, _, _ = _train(Blind(), 40, {12: float("nan")})
    assert not _finite(model)  # proves the poison reaches the weights when nothing stops it


def test_a_loss_spike_is_detected_against_the_rolling_median() -> None:
    guard = cp.NumericsGuard(min_history=10, spike_factor=10)
    _, _, applied = _train(guard, 40, {30: 1e4})
    assert 30 not in applied
    assert [(v.step, v.kind) for v in guard.anomalies] == [(30, "spike")]


def test_reduce_lr_cuts_the_rate_for_a_while_then_restores_it() -> None:
    guard = cp.NumericsGuard(on_spike="reduce_lr", lr_factor=0.5, lr_steps=5, min_history=10)
    _, optimizer, _ = _train(guard, 33, {30: 1e4})
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)  # steps 31-33: still cut
    guard2 = cp.NumericsGuard(on_spike="reduce_lr", lr_factor=0.5, lr_steps=5, min_history=10)
    _, optimizer2, _ = _train(guard2, 40, {30: 1e4})
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(0.05)  # back after 5 steps


def test_stop_raises_a_report_naming_the_step() -> None:
    guard = cp.NumericsGuard(on_nonfinite="stop")
    with pytest.raises(NumericsError, match="step 7: nonfinite loss nan"):
        _train(guard, 20, {7: float("nan")})


def test_too_many_anomalies_in_a_row_stop_whatever_the_action() -> None:
    guard = cp.NumericsGuard(max_in_a_row=3)
    with pytest.raises(NumericsError, match="3 anomalies in a row"):
        _train(guard, 20, {5: float("nan"), 6: float("nan"), 7: float("nan")})


def test_with_a_grad_scaler_overflowing_gradients_are_the_scalers_business() -> None:
    # An absurd initial scale makes the first gradients overflow: the scaler skips those steps
    # and lowers its scale. That is AMP working, not an anomaly.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    guard = cp.NumericsGuard()
    model, _, applied = _train(guard, 30, {}, scaler=scaler)
    assert guard.anomalies == [] and len(applied) == 30
    assert scaler.get_scale() < 2.0**127 and _finite(model)


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError, match="on_spike"):
        cp.NumericsGuard(on_spike="rewind")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="spike_factor"):
        cp.NumericsGuard(spike_factor=0.5)


def _rank_main(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    guard = cp.NumericsGuard()
    # only rank 1 sees the NaN; rank 0 must skip the same step
    _, _, applied = _train(guard, 20, {9: float("nan")} if rank == 1 else {})
    Path(f"{out}.{rank}").write_text(",".join(map(str, applied)))
    dist.destroy_process_group()


def test_every_rank_skips_the_step_any_rank_found_bad(tmp_path: Path) -> None:
    mp.start_processes(
        _rank_main, args=(free_port(), str(tmp_path / "applied")), nprocs=2,
        start_method="forkserver",
    )  # fmt: skip
    applied = [(tmp_path / f"applied.{r}").read_text() for r in (0, 1)]
    assert applied[0] == applied[1]
    assert "9" not in applied[0].split(",") and len(applied[0].split(",")) == 19
