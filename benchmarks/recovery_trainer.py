"""The trainer that ``recovery.py`` launches and kills: a tiny gloo DDP run that restores itself.

Launched with two ranks by ``torchrun`` or ``crashproof run``. It trains a 2-layer MLP with AdamW
on random data, pads every step to ``--step-s`` with a sleep (the model itself takes ~1 ms), saves
a crashproof checkpoint every ``--every`` steps (asynchronously, the default) and, on every start,
restores the newest one, so a restarted rank resumes where the last checkpoint left off. It runs
until it is killed (``--steps`` is large by default).

For the benchmark each rank appends JSON lines to ``TIMELINE/rank<R>.jsonl``, each written with
one ``write`` (so a reader never sees half a line while the trainer lives) and stamped with
``time.time()``, with ``pid``, ``rank`` and ``restart`` (``TORCHELASTIC_RESTART_COUNT``):

* ``process_start``: the first statement of the script, before ``import torch``. Under
  ``crashproof run``'s warm start the script runs in a process forked from one that already
  imported torch, so from here to ``imported`` is near zero: that is what warm start buys;
* ``imported``: torch and crashproof imported;
* ``pg_ready``: ``init_process_group`` returned (rendezvous of the trainers through the store);
* ``ddp_ready``: the model built and wrapped in DDP. DDP's constructor broadcasts the weights
  and, in torch 2.x, imports ``torch._dynamo`` on first use (about a second of imports);
* ``restored``: the checkpoint manager built and ``restore`` returned, with the restored ``step``
  (0: no checkpoint yet);
* ``step``: the first step finished after this start, with its number;
* ``error``: the exception that ended the trainer, if one did (a SIGKILL leaves no mark).

On ``SIGUSR1`` a trainer writes every thread's Python stack to its stderr.
"""

from __future__ import annotations

import time

# The first thing the script does: everything before this line is the launcher's.
_PROCESS_START = time.time()

import argparse  # noqa: E402 - after the timestamp on purpose
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402


class Timeline:
    """Appends this rank's marks to ``DIR/rank<R>.jsonl``."""

    def __init__(self, directory: str) -> None:
        self.rank = int(os.environ.get("RANK", "-1"))
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank{self.rank}.jsonl")
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def mark(self, event: str, ts: float | None = None, **fields: Any) -> None:
        record = {
            "ts": time.time() if ts is None else ts,
            "event": event,
            "pid": os.getpid(),
            "rank": self.rank,
            "restart": self.restart,
            **fields,
        }
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--timeline", required=True, help="directory of the per-rank timeline files")
    p.add_argument("--ckpt", required=True, help="checkpoint root")
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--step-s", type=float, default=0.05, help="pad every step to this long")
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument(
        "--saver",
        choices=("crashproof", "torch"),
        default="crashproof",
        help="crashproof: CheckpointManager (async); torch: rank 0 torch.save()s model, "
        "optimizer and step every --every steps (to a temporary file, then renamed), every rank "
        "torch.load()s it on start: the usual hand-written resume",
    )
    p.add_argument(
        "--progress-every", type=int, default=0, help="mark 'progress' every N steps (0: never)"
    )
    return p.parse_args()


def main() -> int:
    args = parse_args()
    timeline = Timeline(args.timeline)
    timeline.mark("process_start", ts=_PROCESS_START)
    # The driver asks a stalled trainer for its Python stack with SIGUSR1 (crashproof's own dumps
    # use SIGUSR2, and plain torchrun has none).
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    try:
        train(args, timeline)
    except BaseException as exc:
        # torchrun's survivors die of a gloo error when their peer is killed; a restart that
        # fails (e.g. a stale store address) shows up here too, which the driver reports.
        timeline.mark("error", error=f"{type(exc).__name__}: {exc}"[:400])
        raise
    return 0


def train(args: argparse.Namespace, timeline: Timeline) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import crashproof as cp

    timeline.mark("imported")
    dist.init_process_group("gloo")
    timeline.mark("pg_ready")

    torch.manual_seed(0)  # the same initial weights on every rank, before any restore
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.dim))
    )
    timeline.mark("ddp_ready")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saver = (
        TorchSaver(args, model, optimizer)
        if args.saver == "torch"
        else CrashproofSaver(args, cp.TrainState(model=model, optimizer=optimizer))
    )
    start = saver.restore()
    timeline.mark("restored", step=start)

    first = True
    for step in range(start, args.steps):
        began = time.perf_counter()
        x = torch.randn(32, args.dim)
        loss = (model(x) - x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here: a dead peer fails this call
        optimizer.step()
        time.sleep(max(0.0, args.step_s - (time.perf_counter() - began)))
        if first:
            timeline.mark("step", step=step + 1)
            first = False
        if args.progress_every and (step + 1) % args.progress_every == 0:
            timeline.mark("progress", step=step + 1)
        saver.maybe_save(step + 1)
    saver.close()
    dist.destroy_process_group()


class CrashproofSaver:
    def __init__(self, args: argparse.Namespace, state: Any) -> None:
        import crashproof as cp

        self.state = state
        self.ckpt = cp.CheckpointManager(
            args.ckpt, every=cp.EverySteps(args.every), keep=cp.KeepLast(2)
        )

    def restore(self) -> int:
        return int(self.ckpt.restore(self.state))

    def maybe_save(self, step: int) -> None:
        self.ckpt.maybe_save(step, self.state)

    def close(self) -> None:
        self.ckpt.close()


class TorchSaver:
    """The hand-written baseline: one file, written by rank 0, read by every rank."""

    def __init__(self, args: argparse.Namespace, model: Any, optimizer: Any) -> None:
        import torch.distributed as dist

        self.model, self.optimizer, self.every = model, optimizer, args.every
        self.path = os.path.join(args.ckpt, "latest.pt")
        self.rank = dist.get_rank()
        os.makedirs(args.ckpt, exist_ok=True)

    def restore(self) -> int:
        import torch

        if not os.path.exists(self.path):
            return 0
        saved = torch.load(self.path, weights_only=True)
        self.model.module.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        return int(saved["step"])

    def maybe_save(self, step: int) -> None:
        import torch

        if step % self.every or self.rank != 0:
            return
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": step,
        }
        torch.save(state, self.path + ".tmp")
        os.replace(self.path + ".tmp", self.path)

    def close(self) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
