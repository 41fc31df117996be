"""NumericsGuard's ``rollback``: back to the newest checkpoint before the trouble began, the bad
data left out (or replayed once), no committed checkpoint ever holding NaN, and no loops."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset

import crashproof as cp
from crashproof.errors import ConfigError, NumericsError
from tests.conftest import free_port

N_SAMPLES, BATCH = 64, 2


class Numbers(Dataset[tuple[torch.Tensor, int]]):
    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.randn(4, generator=torch.Generator().manual_seed(i)), i


@dataclass
class Run:
    model: nn.Module
    state: cp.TrainState
    ckpt: cp.CheckpointManager
    guard: cp.NumericsGuard
    applied: dict[int, list[int]] = field(default_factory=dict)  # step -> sample ids applied
    checks: list[int] = field(default_factory=list)  # every step number checked, in order


def _run(
    root: Path,
    steps: int,
    loss_factor: Callable[[int, list[int]], float],
    *,
    every: int = 4,
    shuffle: bool = True,
    with_data: bool = True,
    stop_after: int | None = None,
    guard_in_state: bool = False,
    **guard_args: object,
) -> Run:
    """Train a small model for ``steps`` steps; ``loss_factor(step, ids)`` multiplies each loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 1))
    if dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = cp.ResumableSampler(N_SAMPLES, shuffle=shuffle, seed=3)
    loader = DataLoader(Numbers(), batch_size=BATCH, sampler=sampler, drop_last=True)
    state = cp.TrainState(model=model, optimizer=optimizer, data=loader if with_data else None)
    ckpt = cp.CheckpointManager(
        root, every=cp.EverySteps(every), keep=cp.KeepAll(), handle_signals=False
    )
    guard_args = {"on_nonfinite": "rollback", "min_history": 5} | guard_args
    guard = cp.NumericsGuard(checkpoints=ckpt, state=state, **guard_args)  # type: ignore[arg-type]
    if guard_in_state:
        state.extra["guard"] = guard
    run = Run(model, state, ckpt, guard)
    start = ckpt.restore(state)
    batches = iter(loader)
    for step in guard.steps(start, steps):
        try:
            x, ids = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, ids = next(batches)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        loss = loss * loss_factor(step + 1, ids.tolist())
        loss.backward()
        run.checks.append(step + 1)
        if guard.check(step + 1, loss, model, optimizer=optimizer):
            optimizer.step()
            run.applied[step + 1] = ids.tolist()
        optimizer.zero_grad()
        ckpt.maybe_save(step + 1, state)
        if stop_after is not None and step + 1 == stop_after:
            break
    ckpt.close()
    return run


def _weights(run: Run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


def _every_checkpoint_is_finite(root: Path) -> bool:
    """Restore each committed checkpoint into a fresh state and look at every value."""
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = cp.TrainState(model=model, optimizer=optimizer)
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        steps = [info.step for info in ckpt.list()]
        assert steps
        for step in steps:
            ckpt.restore(state, step)
            tensors = list(model.parameters()) + [
                v for s in optimizer.state.values() for v in s.values() if v.is_floating_point()
            ]
            if not all(bool(torch.isfinite(t).all()) for t in tensors):
                return False
    return True


def _poisoned(bad_id: int, factor: float = float("nan")) -> Callable[[int, list[int]], float]:
    return lambda step, ids: factor if bad_id in ids else 1.0


def test_a_nan_from_bad_data_rolls_back_skips_that_data_and_the_run_finishes(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path, 24, _poisoned(bad_id=17))
    [anomaly] = run.guard.anomalies
    [skipped] = run.guard.skipped
    assert anomaly.action == "rollback" and skipped.anomaly_step == anomaly.step
    # Back to the newest checkpoint before the anomaly, then on from the step after it.
    assert skipped.rolled_back_to == (anomaly.step - 1) // 4 * 4
    assert run.checks.count(skipped.rolled_back_to + 1) == 2
    assert all(17 not in ids for ids in run.applied.values())  # never trained on
    assert all(bool(torch.isfinite(p).all()) for p in run.model.parameters())
    assert sorted(run.applied) == list(range(1, 25))  # every step number trained, once
    assert _every_checkpoint_is_finite(tmp_path)


def test_replay_first_replays_once_and_skips_the_same_data_the_second_time(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path, 24, _poisoned(bad_id=17), replay_first=True)
    first, second = run.guard.anomalies
    assert first.step == second.step  # the replay met the same data at the same step
    [skipped] = run.guard.skipped  # recorded once, then never seen again: no loop
    assert skipped.anomaly_step == first.step
    assert all(17 not in ids for ids in run.applied.values())
    assert sorted(run.applied) == list(range(1, 25))


def test_a_transient_nan_replayed_ends_bit_for_bit_where_a_clean_run_ends(tmp_path: Path) -> None:
    struck: list[int] = []

    def once(step: int, ids: list[int]) -> float:  # a fault that does not come back
        if step == 11 and not struck:
            struck.append(step)
            return float("nan")
        return 1.0

    faulty = _run(tmp_path / "faulty", 24, once, replay_first=True)
    clean = _run(tmp_path / "clean", 24, lambda step, ids: 1.0, replay_first=True)
    assert [v.step for v in faulty.guard.anomalies] == [11] and faulty.guard.skipped == []
    assert faulty.applied == clean.applied
    for a, b in zip(_weights(faulty), _weights(clean), strict=True):
        assert torch.equal(a, b)


def test_a_spike_rolls_back_before_it_began_and_removes_the_checkpoints_inside_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Without shuffling, step s reads samples 2s-2 and 2s-1: steps 13 and 14 raise the loss
    # (below the spike threshold), step 15 spikes. Checkpoints every 2 steps: 14 is inside.
    raised = {24: 10.0, 25: 10.0, 26: 20.0, 27: 20.0, 28: 1e5, 29: 1e5}

    def spike(step: int, ids: list[int]) -> float:
        return max(raised.get(i, 1.0) for i in ids)

    run = _run(
        tmp_path, 20, spike, every=2, shuffle=False, on_spike="rollback", spike_factor=100,
        onset_factor=4,
    )  # fmt: skip
    [anomaly] = run.guard.anomalies
    [skipped] = run.guard.skipped
    assert (anomaly.step, anomaly.kind) == (15, "spike")
    assert skipped.first_step == 13 and skipped.rolled_back_to == 12
    assert skipped.windows == ((0, 24, 30),)
    assert all(not set(ids) & set(raised) for step, ids in run.applied.items() if step > 12)
    removed = [r.getMessage() for r in caplog.records if "rollback: removing" in r.getMessage()]
    assert removed == ["rollback: removing checkpoint step 14 (after the anomaly)"]
    assert sorted(run.applied) == list(range(1, 21))
    with cp.CheckpointManager(tmp_path, handle_signals=False) as ckpt:  # 14 again, from the redo
        assert sorted(info.step for info in ckpt.list()) == list(range(2, 21, 2))


def test_a_run_resumed_after_a_rollback_skips_the_same_data(tmp_path: Path) -> None:
    whole = _run(tmp_path / "whole", 24, _poisoned(bad_id=17))
    cut = _run(tmp_path / "cut", 24, _poisoned(bad_id=17), stop_after=20)
    assert cut.guard.skipped == whole.guard.skipped
    resumed = _run(tmp_path / "cut", 24, _poisoned(bad_id=17))  # a new process, a new guard
    assert resumed.guard.anomalies == []  # the skipped window came back with the checkpoint
    for a, b in zip(_weights(whole), _weights(resumed), strict=True):
        assert torch.equal(a, b)


def test_without_a_sampler_a_repeated_nan_stops_instead_of_looping(tmp_path: Path) -> None:
    with pytest.raises(NumericsError, match="cannot be skipped"):
        _run(tmp_path, 24, lambda step, ids: float("nan") if step == 10 else 1.0, with_data=False)


def test_a_nan_before_any_checkpoint_skips_the_step_instead(tmp_path: Path) -> None:
    run = _run(tmp_path, 24, lambda step, ids: float("nan") if step == 3 else 1.0)
    [anomaly] = run.guard.anomalies
    assert (anomaly.step, anomaly.action) == (3, "rollback") and run.guard.skipped == []
    assert 3 not in run.applied and len(run.applied) == 23 and run.checks == list(range(1, 25))


def test_a_loop_that_ignores_the_rollback_is_stopped(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = cp.TrainState(model=model, optimizer=optimizer)
    with cp.CheckpointManager(tmp_path, every=cp.EverySteps(2), handle_signals=False) as ckpt:
        guard = cp.NumericsGuard(on_nonfinite="rollback", checkpoints=ckpt, state=state)
        with pytest.raises(ConfigError, match=r"guard\.steps"):
            for step in range(10):  # plain range(): goes on with step 6 after rolling back to 4
                loss = model(torch.ones(1, 4)).sum() * (float("nan") if step + 1 == 5 else 1.0)
                loss.backward()
                if guard.check(step + 1, loss, model):
                    optimizer.step()
                optimizer.zero_grad()
                ckpt.maybe_save(step + 1, state)


def test_rollback_needs_the_checkpoints_and_the_state() -> None:
    with pytest.raises(ConfigError, match="checkpoints="):
        cp.NumericsGuard(on_nonfinite="rollback")


def _rank_main(rank: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # Sample 10 (position 30: step 8) poisons whichever rank receives it; both must roll back
    # and skip together.
    run = _run(Path(root), 16, _poisoned(bad_id=10))
    torch.save(
        {"weights": _weights(run), "skipped": [s.windows for s in run.guard.skipped]},
        f"{out}.{rank}",
    )
    dist.destroy_process_group()


def test_every_rank_rolls_back_to_the_same_checkpoint_and_skips_the_same_data(
    tmp_path: Path,
) -> None:
    out = str(tmp_path / "result")
    mp.start_processes(
        _rank_main, args=(free_port(), str(tmp_path / "ckpt"), out), nprocs=2,
        start_method="forkserver",
    )  # fmt: skip
    results = [torch.load(f"{out}.{r}") for r in (0, 1)]
    assert results[0]["skipped"] == results[1]["skipped"] and len(results[0]["skipped"]) == 1
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


@pytest.mark.parametrize("saved", [True, False])
def test_the_guard_in_the_state_judges_a_resumed_run_as_the_uninterrupted_one(
    tmp_path: Path, saved: bool
) -> None:
    def spike(step: int, ids: list[int]) -> float:  # no shuffling: step 30 reads samples 58, 59
        return 1e4 if 58 in ids else 1.0

    args: dict[str, object] = dict(on_spike="skip", min_history=10, guard_in_state=saved)
    whole = _run(tmp_path / "whole", 32, spike, every=5, shuffle=False, **args)
    _run(tmp_path / "cut", 32, spike, every=5, shuffle=False, stop_after=25, **args)
    resumed = _run(tmp_path / "cut", 32, spike, every=5, shuffle=False, **args)
    assert [v.step for v in whole.guard.anomalies] == [30]
    # Saved, the loss history comes back and step 30 is judged the same; without it, the resumed
    # guard has seen only 5 losses (fewer than min_history) and lets the spike through.
    assert [v.step for v in resumed.guard.anomalies] == ([30] if saved else [])
