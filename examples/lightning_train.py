"""A Lightning fit that survives crashes and resumes bit for bit: copy it as a starting point.

The crashproof parts are the ``CrashproofCallback`` in the Trainer's callbacks (and its import);
the rest is a plain Lightning script: a module with dropout, AdamW and a step LR schedule,
hyper-parameters saved as an ``argparse.Namespace`` and a dataclass, a datamodule with a state of
its own, shuffled data and validation.

    python examples/lightning_train.py --root runs/lit             # trains, checkpoints
    python examples/lightning_train.py --root runs/lit --epochs 6  # goes on from the newest one
    crashproof run --nproc-per-node 1 examples/lightning_train.py --root runs/lit  # restarts it

Launched with several processes (``crashproof run --nproc-per-node 2 ... --devices 2``) it
trains with DDP over gloo. It prints the step it resumed from and a digest of the final weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import crashproof as cp
from crashproof.integrations.lightning import CrashproofCallback


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 0.01
    weight_decay: float = 0.01
    lr_halves_every: int = 10


class Regressor(L.LightningModule):
    def __init__(
        self,
        hidden: int = 32,
        optim: OptimizerConfig | None = None,
        args: argparse.Namespace | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # a Namespace and a dataclass among them: stored safely
        self.optim = optim or OptimizerConfig()
        self.net = nn.Sequential(
            nn.Linear(8, hidden), nn.GELU(), nn.Dropout(0.2), nn.Linear(hidden, 1)
        )

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.optim.lr, weight_decay=self.optim.weight_decay
        )
        halve = torch.optim.lr_scheduler.StepLR(optimizer, self.optim.lr_halves_every, 0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halve, "interval": "step"}}


class Data(L.LightningDataModule):
    """Samples made from a fixed seed; it counts the epochs it served (saved and restored)."""

    def __init__(self, samples: int = 96, batch_size: int = 8, workers: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1234)
        x = torch.randn(samples + 32, 8, generator=generator)
        y = torch.tanh(x @ torch.randn(8, 1, generator=generator))
        self.train_set = TensorDataset(x[:samples], y[:samples])
        self.val_set = TensorDataset(x[samples:], y[samples:])
        self.batch_size, self.workers = batch_size, workers
        self.served = 0

    def train_dataloader(self) -> DataLoader[Any]:
        self.served += 1
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.workers
        )

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.served = state["served"]


def digest(module: nn.Module) -> str:
    """A short hash of every parameter's bytes: equal digests, bit-identical weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode() + tensor.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main(
    argv: Sequence[str] | None = None, callbacks: Sequence[L.Callback] = ()
) -> tuple[L.Trainer, Regressor]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="crashproof's checkpoint root")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--every", type=int, default=5, help="save every N optimizer steps")
    parser.add_argument("--devices", type=int, default=1, help="2: DDP over gloo")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = parser.parse_args(argv)

    L.seed_everything(0)  # the model's initial weights, and the data order's seed
    model = Regressor(optim=OptimizerConfig(), args=args)
    crashproof = CrashproofCallback(args.root, every=cp.EverySteps(args.every), keep=cp.KeepLast(3))
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        callbacks=[crashproof, *callbacks],
        enable_checkpointing=False,  # crashproof's checkpoints are the ones fit resumes from
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, Data(workers=args.workers))
    if trainer.is_global_zero:
        print(f"resumed from step {crashproof.restored_step}", flush=True)
        print(f"step {trainer.global_step}, weights {digest(model)}", flush=True)
    return trainer, model


if __name__ == "__main__":
    main()
