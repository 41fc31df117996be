"""A small but complete training script with crashproof: copy it as a starting point.

It uses everything that makes exact resumption hard: dropout, NumPy and Python randomness in the
batch, a DataLoader with worker processes, an LR scheduler, an AMP GradScaler and an EMA model,
and it crosses epoch boundaries. Run it twice into the same ``--run-dir`` with a crash in between
and the second run ends bit for bit where an uninterrupted run ends.

    python examples/train_tiny.py --run-dir runs/tiny --steps 60
    python examples/train_tiny.py --run-dir runs/tiny --steps 60 --crash-at 37   # dies at step 37
    python examples/train_tiny.py --run-dir runs/tiny --steps 60                 # resumes, finishes

``--step-log`` writes one JSON line per step (step, sample ids, loss) so runs can be compared.
``--nan-sample ID`` makes every batch holding sample ID produce a NaN loss: the NumericsGuard
rolls back to the checkpoint before it and skips that data, and the run finishes with finite
weights.

Launched by ``torchrun`` (or ``crashproof run``) with several processes, it trains with DDP over
gloo; each rank logs to ``LOG.rank<r>`` and rank 0 writes the dump.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import crashproof as cp


class SyntheticRegression(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Samples computed from their index: the same on every run and in every worker."""

    def __init__(self, n: int, dim: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=generator)
        self.w = torch.randn(dim, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[i]
        return x, torch.tanh(x @ self.w), i


def build_model(dim: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(0.2),
        nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, 1),
    )  # fmt: skip


class EMA:
    """An exponential moving average of the weights: extra state with state_dict()."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self, model: nn.Module) -> None:
        with torch.no_grad():
            for k, v in cp.state.unwrap_model(model).state_dict().items():
                self.shadow[k].mul_(self.decay).add_(v, alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = state["decay"]
        for k, v in state["shadow"].items():
            self.shadow[k].copy_(v)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, help="checkpoints go to RUN_DIR/checkpoints")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--keep", type=int, default=3, help="keep the last N checkpoints")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per micro-batch")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per optimizer step for the whole job, whatever the world size: each rank "
        "accumulates gradients over global / (batch size x world size) micro-batches",
    )
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument(
        "--crash-at",
        type=int,
        default=None,
        help="simulate a crash: os._exit after this step (in the first attempt only: a trainer "
        "crashproof run restarts goes on)",
    )
    p.add_argument("--step-log", default=None, help="append one JSON line per step to this file")
    p.add_argument(
        "--dump", default=None, help="at the end, write model+optimizer tensors here (safetensors)"
    )
    p.add_argument(
        "--dump-restored",
        default=None,
        help="right after the restore, write this rank's model, optimizer and EMA tensors here "
        "(safetensors; DUMP.rank<r> on several ranks)",
    )
    p.add_argument("--sync", action="store_true", help="synchronous saves (default: asynchronous)")
    p.add_argument(
        "--memory-every",
        type=int,
        default=0,
        help="under crashproof run, also snapshot into the agent's memory every N steps",
    )
    p.add_argument(
        "--staging-buffers",
        type=int,
        default=1,
        help="1, or 2 (up to 4) to double-buffer the saves",
    )
    p.add_argument(
        "--root-scope",
        choices=("shared", "node", "auto"),
        default="shared",
        help="who shares RUN_DIR/checkpoints: every rank (shared), or each node its own (node)",
    )
    p.add_argument(
        "--step-s", type=float, default=0.0, help="sleep this long in each step (a slower job)"
    )
    p.add_argument(
        "--full-every", type=int, default=0, help="deltas between full checkpoints (0: all full)"
    )
    p.add_argument(
        "--remote",
        action="append",
        default=[],
        metavar="URI",
        help="also keep checkpoints in this durable tier (s3://bucket/prefix, ...); repeatable",
    )
    p.add_argument(
        "--nan-sample", type=int, default=None, help="a batch holding this sample id has a NaN loss"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # Seed once at the start; on resume the checkpoint's RNG state replaces this.
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world_size > 1:
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
        if args.step_log:
            args.step_log = f"{args.step_log}.rank{rank}"

    dim = 16
    dataset = SyntheticRegression(args.samples, dim)
    sampler = cp.ResumableSampler(len(dataset), shuffle=True, seed=0)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, drop_last=True,
        persistent_workers=args.workers > 0,
    )  # fmt: skip
    model = build_model(dim, args.hidden)
    ema = EMA(model)
    if world_size > 1:
        # DDP regroups its gradient buckets after a process's first step; from three ranks on
        # that changes the order of the first step's sums after a resume, unless it keeps its
        # first grouping, as it does looking for unused parameters (docs/exactness.md).
        model = nn.parallel.DistributedDataParallel(model, find_unused_parameters=world_size >= 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=args.steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=5)
    state = cp.TrainState(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, data=loader,
        extra={"ema": ema, "samples_seen": 0},
    )  # fmt: skip
    ckpt = cp.CheckpointManager(
        os.path.join(args.run_dir, "checkpoints"),
        every=cp.EverySteps(args.every),
        keep=cp.KeepLast(args.keep),
        async_save=not args.sync,
        delta=cp.Delta(full_every=args.full_every) if args.full_every else None,
        remote=args.remote or None,
        memory_every=cp.EverySteps(args.memory_every) if args.memory_every else None,
        staging_buffers=args.staging_buffers,
        root_scope=args.root_scope,
    )
    # Before each update: a NaN loss rolls back to the checkpoint before it and skips that data.
    # In the state, so a resumed run judges loss spikes with the same history.
    guard = cp.NumericsGuard(on_nonfinite="rollback", checkpoints=ckpt, state=state)
    state.extra["guard"] = guard
    start = ckpt.restore(state)
    print(f"starting at step {start}", flush=True)
    if args.dump_restored:
        where = args.dump_restored if world_size == 1 else f"{args.dump_restored}.rank{rank}"
        dump_state(where, model, optimizer, ema)
    log_file = open(args.step_log, "a") if args.step_log else None  # noqa: SIM115 - closed below
    batches = iter(loader)
    accumulate = (
        cp.accumulation_steps(args.global_batch, args.batch_size, world_size)
        if args.global_batch
        else 1
    )

    def next_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:  # end of an epoch: the sampler moves on to the next one
            batches = iter(loader)
            return next(batches)

    for step in guard.steps(start, args.steps):  # range() that goes back after a rollback
        optimizer.zero_grad(set_to_none=True)
        losses, step_ids = [], []
        for micro in range(accumulate):
            x, y, ids = next_batch()
            with ckpt.compute_section():  # this rank's own work: how a straggler is found
                # Randomness from three generators in the batch itself.
                x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
                x = x * (1.0 + 0.05 * random.random())
                model.train()
                micro_loss = nn.functional.mse_loss(model(x), y)
            if args.nan_sample is not None and args.nan_sample in ids.tolist():
                micro_loss = micro_loss * float("nan")
            last = micro == accumulate - 1  # DDP averages gradients over ranks only then
            sync = contextlib.nullcontext() if last or world_size == 1 else model.no_sync()
            with sync:
                scaler.scale(micro_loss / accumulate).backward()
            losses.append(micro_loss)
            step_ids += ids.tolist()
        loss = losses[0] if accumulate == 1 else torch.stack(losses).mean()
        # False: skipped or rolled back, and then nothing else may change the state.
        if guard.check(step + 1, loss, model, optimizer=optimizer, scaler=scaler):
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            ema.update(model)
            state.extra["samples_seen"] += len(step_ids)
            if log_file:
                record = {"step": step + 1, "ids": step_ids, "loss": loss.item()}
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
        ckpt.maybe_save(step + 1, state)
        if args.step_s:
            time.sleep(args.step_s)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if args.crash_at is not None and step + 1 == args.crash_at and first_attempt:
            print(f"simulated crash after step {step + 1}", flush=True)
            os._exit(17)
    ckpt.close()
    if args.memory_every:
        taken, skipped = ckpt.stats.memory_snapshots, ckpt.stats.memory_skipped_busy
        print(f"memory snapshots: {taken} taken, {skipped} skipped (buffers busy)", flush=True)
    if log_file:
        log_file.close()
    if args.dump and rank == 0:
        dump_state(args.dump, model, optimizer, ema)
    if world_size > 1:
        torch.distributed.destroy_process_group()
    print(f"finished at step {args.steps}", flush=True)
    return 0


def dump_state(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA) -> None:
    """Every tensor of model, optimizer and EMA, by name, for bit-for-bit comparison."""
    from safetensors.torch import save_file

    tensors = {
        f"model/{k}": v.contiguous() for k, v in cp.state.unwrap_model(model).state_dict().items()
    }
    for pid, pstate in optimizer.state_dict()["state"].items():
        for name, value in pstate.items():
            tensors[f"optimizer/{pid}/{name}"] = value.contiguous()
    tensors.update({f"ema/{k}": v for k, v in ema.shadow.items()})
    save_file(tensors, path)


if __name__ == "__main__":
    sys.exit(main())
