"""An epoch loop in the shape of PyTorch's DDP tutorial (a ``Trainer`` with ``_run_epoch`` and
``train(max_epochs)``), made resumable with crashproof. The changes from the tutorial are marked
``# crashproof``; there are a dozen.

    python examples/train_epochs.py --dir runs/epochs --epochs 4
    python examples/train_epochs.py --dir runs/epochs --epochs 4 --crash-at 23   # dies
    python examples/train_epochs.py --dir runs/epochs --epochs 4                 # resumes

Also under ``torchrun``/``crashproof run`` with several processes (DDP over gloo). What the
tutorial does that a resumable loop must not, and what this one does instead:

- it saves on rank 0 only (``if self.gpu_id == 0``): saves are collective, every rank saves;
- it peeks ``next(iter(train_data))`` to learn the batch size: that consumes a batch (crashproof
  warns); the batch size is the loader's ``batch_size``;
- it resumes from ``epochs_run`` alone: a checkpoint can be mid-epoch; the epoch to resume from
  is ``state.epoch``, and the loader goes on from the batch it had reached.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset

import crashproof as cp


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader[tuple[torch.Tensor, ...]],
        optimizer: torch.optim.Optimizer,
        ckpt_dir: str,
        save_every: int,
    ) -> None:
        self.model = DDP(model) if dist.is_initialized() else model
        self.train_data = train_data
        self.optimizer = optimizer
        self.state = cp.TrainState(
            model=self.model, optimizer=optimizer, data=train_data
        )  # crashproof
        self.ckpt = cp.CheckpointManager(ckpt_dir, every=cp.EverySteps(save_every))  # crashproof
        self.step = self.ckpt.restore(self.state)  # crashproof: 0 on a fresh start
        self.epochs_run = self.state.epoch or 0  # crashproof: the epoch the checkpoint is in

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int, crash_at: int | None) -> None:
        sampler = self.train_data.sampler
        assert isinstance(sampler, cp.ResumableSampler)
        sampler.set_epoch(epoch)  # the same epoch after a restore: keeps the position
        for source, targets in self.train_data:
            self._run_batch(source, targets)
            self.step += 1
            if self.step == crash_at:
                os._exit(3)  # a crash, mid-epoch, without any goodbye
            self.ckpt.maybe_save(self.step, self.state)  # crashproof: every rank, every step

    def train(self, max_epochs: int, crash_at: int | None = None) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch, crash_at)
        self.ckpt.save(self.step, self.state)  # crashproof: the final state, on every rank
        self.ckpt.close()  # crashproof: waits for the save in flight


def load_train_objs() -> tuple[
    Dataset[tuple[torch.Tensor, ...]], torch.nn.Module, torch.optim.Optimizer
]:
    generator = torch.Generator().manual_seed(0)
    train_set = TensorDataset(
        torch.randn(2048, 20, generator=generator), torch.randn(2048, 1, generator=generator)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(
    dataset: Dataset[tuple[torch.Tensor, ...]], batch_size: int
) -> DataLoader[tuple[torch.Tensor, ...]]:
    # crashproof: a ResumableSampler in place of DistributedSampler (it shards across ranks too)
    sampler = cp.ResumableSampler(len(dataset), shuffle=True, seed=0)  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, pin_memory=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoints and the final weights")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--crash-at", type=int, default=None, help="die after this step")
    args = parser.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    dataset, model, optimizer = load_train_objs()
    trainer = Trainer(
        model,
        prepare_dataloader(dataset, args.batch_size),
        optimizer,
        os.path.join(args.dir, "checkpoints"),
        args.save_every,
    )
    trainer.train(args.epochs, args.crash_at)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(
            cp.state.unwrap_model(trainer.model).state_dict(), os.path.join(args.dir, "final.pt")
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
