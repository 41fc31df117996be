"""torchdata's ``StatefulDataLoader`` as ``TrainState(data=...)``, with worker processes, over a
map-style dataset and over an ``IterableDataset`` that keeps its own position (the protocol in
docs/checkpointing.md): a run resumed from any step, mid-epoch or at an epoch's end, ends
bit-identical to one that never stopped (the re-made iterator draws nothing from torch's global
RNG, which dropout uses)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import crashproof as cp

stateful = pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.filterwarnings(
    "ignore:.set_vital. is deprecated"
)  # torchdata on torch 2.13

STEPS = 40  # 25 batches an epoch: the runs cross into a second epoch


class Samples(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


class Stream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An endless stream, split between the workers (worker ``w`` of ``n`` yields samples
    ``w``, ``w + n``, ...); its state is how many samples this worker has yielded, counted
    before each one is handed over, so a snapshot taken after a sample has it counted."""

    def __init__(self) -> None:
        self.produced = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        while True:
            index = self.produced * workers + worker
            self.produced += 1
            yield Samples()[index % 200]

    def state_dict(self) -> dict[str, int]:
        return {"produced": self.produced}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.produced = state["produced"]


def _loader(kind: str) -> Any:
    if kind == "iterable":
        return stateful.StatefulDataLoader(Stream(), batch_size=8, num_workers=2)
    return stateful.StatefulDataLoader(Samples(), batch_size=8, shuffle=True, num_workers=2)


def _train(
    root: Path, *, stop_after: int | None = None, kind: str = "map"
) -> dict[str, torch.Tensor] | None:
    """Train to STEPS (saving every 5 steps), or stop after ``stop_after`` steps as a crash
    would; a run resumes from the newest checkpoint in ``root``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = _loader(kind)
    state = cp.TrainState(model=model, optimizer=optimizer, data=loader)
    with cp.CheckpointManager(
        root, every=cp.EverySteps(5), async_save=False, handle_signals=False
    ) as ckpt:
        start = ckpt.restore(state)
        batches = iter(loader)
        for step in range(start, STEPS):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.maybe_save(step + 1, state)
            if stop_after == step + 1:
                return None
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("kind", "stop_after"),
    [("map", 17), ("map", 25), ("map", 33), ("iterable", 17)],  # mid-epoch, an epoch's end, ...
)
def test_a_resumed_run_ends_bit_identical(tmp_path: Path, kind: str, stop_after: int) -> None:
    expected = _train(tmp_path / "uninterrupted", kind=kind)
    assert _train(tmp_path / "run", stop_after=stop_after, kind=kind) is None
    resumed = _train(tmp_path / "run", kind=kind)
    assert expected is not None and resumed is not None
    assert [k for k in expected if not torch.equal(expected[k], resumed[k])] == []
