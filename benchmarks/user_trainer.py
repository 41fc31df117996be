"""A training script as a user writes it from the README, for ``benchmarks/user_campaign.py``.

A small transformer trained with AdamW on synthetic token data through a ``DataLoader`` with
worker processes over crashproof's ``ResumableSampler``, DDP (gloo) when launched with several
ranks, an asynchronous checkpoint every ``--every`` steps. Nothing in the loop is padded or
timed by crashproof: each step is real compute (about 0.1 s on one core of the reference
machine at the defaults). ``--step-log`` appends one JSON line per step: the step, the wall
clock when it finished, and this process's id and restart count, from which the campaign
finds where each kill's time went; ``--dump`` writes the final weights (rank 0).

    crashproof run --nproc-per-node 2 benchmarks/user_trainer.py --run-dir runs/x --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

import crashproof as cp


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Deterministic synthetic sequences: sample ``i`` is the same in every run."""

    def __init__(self, samples: int, seq: int, vocab: int) -> None:
        self.samples, self.seq, self.vocab = samples, seq, vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(self.vocab, (self.seq + 1,), generator=g)
        return tokens[:-1], tokens[1:]


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--step-log", default=None)
    p.add_argument("--dump", default=None, help="at the end, rank 0 writes the model here")
    args = p.parse_args()

    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    vocab = 2048
    model: nn.Module = TinyTransformer(vocab, args.width, args.layers)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dataset = Tokens(10_000, args.seq, vocab)
    sampler = cp.ResumableSampler(len(dataset), shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers)
    state = cp.TrainState(model=model, optimizer=optimizer, data=loader)
    ckpt = cp.CheckpointManager(
        os.path.join(args.run_dir, "checkpoints"), every=cp.EverySteps(args.every)
    )
    start = ckpt.restore(state)
    log = open(f"{args.step_log}.rank{rank}", "a") if args.step_log else None  # noqa: SIM115
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    batches = iter(loader)
    for step in range(start, args.steps):
        try:
            tokens, targets = next(batches)
        except StopIteration:
            batches = iter(loader)
            tokens, targets = next(batches)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ckpt.maybe_save(step + 1, state)
        if log is not None:
            record = {"step": step + 1, "t": time.time(), "pid": os.getpid(), "restarts": restarts,
                      "threads": torch.get_num_threads()}  # fmt: skip
            log.write(json.dumps(record) + "\n")
            log.flush()
    ckpt.close()
    if log is not None:
        log.close()
    if args.dump and rank == 0:
        weights = (model.module if distributed else model).state_dict()
        save_file({k: v.contiguous() for k, v in weights.items()}, args.dump)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
