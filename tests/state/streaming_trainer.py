"""A tiny training run (a model with dropout) over one of three data sources, for the kill tests
of :mod:`tests.state.test_streaming_data`:

- ``hf-map``: a Hugging Face map-style ``datasets.Dataset`` (torch format) through a DataLoader
  over ``crashproof.ResumableSampler(shuffle=True)``, two worker processes;
- ``hf-stream``: the same rows as a streaming ``datasets.IterableDataset`` of 4 shards, through
  torchdata's ``StatefulDataLoader`` with two worker processes;
- ``iterable``: a plain torch ``IterableDataset`` keeping each worker's position
  (``state_dict``/``load_state_dict``), through ``StatefulDataLoader`` with two workers.

Each step appends ``{"step", "ids"}`` (the sample ids it trained on) to ``OUT/SOURCE.jsonl``;
the final weights go to ``OUT/SOURCE.pt``. ``--kill-after K`` SIGKILLs the process right after
step K (and its save, every ``EVERY`` steps); a run resumes from the newest checkpoint in
``ROOT/SOURCE``. Usage::

    python streaming_trainer.py ROOT OUT SOURCE[,SOURCE...] [--kill-after K]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import crashproof as cp

N = 64  # samples an epoch: 16 batches of 4
BATCH = 4
STEPS = 20  # into the second epoch
EVERY = 4
SOURCES = ("hf-map", "hf-stream", "iterable")


def features(index: int) -> torch.Tensor:
    return torch.randn(4, generator=torch.Generator().manual_seed(index))


class Stream(torch.utils.data.IterableDataset[dict[str, Any]]):
    """N samples an epoch, split between the workers (worker ``w`` of ``n`` yields ``w``,
    ``w + n``, ...). Its state is this worker's count of samples handed over, counted before
    each is handed over (docs/checkpointing.md, the protocol)."""

    def __init__(self) -> None:
        self.produced = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        while (index := self.produced * workers + worker) < N:
            self.produced += 1
            yield {"id": index, "x": features(index)}

    def state_dict(self) -> dict[str, int]:
        return {"produced": self.produced}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.produced = state["produced"]


def hf_rows() -> Any:
    import datasets

    return datasets.Dataset.from_dict(
        {"id": list(range(N)), "x": [features(i).tolist() for i in range(N)]}
    )


def loader(source: str) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    if source == "hf-map":
        rows = hf_rows().with_format("torch")
        sampler = cp.ResumableSampler(len(rows), shuffle=True, seed=7)
        return torch.utils.data.DataLoader(rows, batch_size=BATCH, sampler=sampler, num_workers=2)
    if source == "hf-stream":
        stream = hf_rows().to_iterable_dataset(num_shards=4).with_format("torch")
        return StatefulDataLoader(stream, batch_size=BATCH, num_workers=2)
    assert source == "iterable", source
    return StatefulDataLoader(Stream(), batch_size=BATCH, num_workers=2)


def train(root: Path, out: Path, source: str, kill_after: int | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = loader(source)
    state = cp.TrainState(model=model, optimizer=optimizer, data=data)
    with (
        cp.CheckpointManager(
            root / source, every=cp.EverySteps(EVERY), async_save=False, handle_signals=False
        ) as ckpt,
        (out / f"{source}.jsonl").open("a") as log,
    ):
        start = ckpt.restore(state)
        print(f"{source}: resumed at step {start}", flush=True)
        batches = iter(data)
        for step in range(start, STEPS):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(data)
                batch = next(batches)
            x = batch["x"]
            nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            optimizer.step()
            optimizer.zero_grad()
            log.write(json.dumps({"step": step + 1, "ids": batch["id"].tolist()}) + "\n")
            log.flush()
            ckpt.maybe_save(step + 1, state)
            if kill_after == step + 1:
                os.kill(os.getpid(), signal.SIGKILL)
    torch.save(model.state_dict(), out / f"{source}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("sources")
    parser.add_argument("--kill-after", type=int)
    args = parser.parse_args()
    for source in args.sources.split(","):
        train(args.root, args.out, source, args.kill_after)


if __name__ == "__main__":
    main()
