"""The pause an asynchronous save costs a small model's training loop, on a busy host.

For large models the blocking part of a save is the copy of the state (``async_save.py``
measures it against a memcpy). For the small, fast-stepping models of the goodput campaigns
(``chaos_ettr.py``: a save every 50 steps of ~10 ms) the fixed costs decide: encoding the state's
tree, capturing the RNG, and how the copies behave when the two cores are shared with a
DataLoader worker, the writer thread and other jobs. This script measures, on the demo model
(``examples/train_tiny.py``: an MLP with hidden width 256, AdamW, EMA, the numerics guard's
history, one DataLoader worker):

* ``save()`` of a ``CheckpointManager(async_save=True)`` (buffers reused, write waited for
  between saves so that only the pause is timed);
* the floors: ``copy_`` of the same tensors into preallocated buffers (torch's own copy, which
  splits tensors over 32768 elements across its intra-op threads), and a single-threaded memcpy
  (numpy) of the same bytes;

each alone and with a competing CPU-bound process on the machine (``--load``), as medians and
90th percentiles over many saves, in one run::

    .venv/bin/python benchmarks/save_pause.py --saves 300 --markdown
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

import crashproof as cp  # noqa: E402
import train_tiny  # noqa: E402


def _burn() -> None:  # a competing job: one core's worth of BLAS work, forever
    a = np.ones((300, 300))
    while True:
        a @ a


class Demo:
    """train_tiny's model and state, stepped the way the demo steps it."""

    def __init__(self, root: str) -> None:
        torch.manual_seed(0)
        dataset = train_tiny.SyntheticRegression(400, 16)
        sampler = cp.ResumableSampler(len(dataset), shuffle=True, seed=0)
        self.loader = DataLoader(
            dataset, batch_size=16, sampler=sampler, num_workers=1, drop_last=True,
            persistent_workers=True,
        )  # fmt: skip
        self.model = train_tiny.build_model(16, 256)
        self.ema = train_tiny.EMA(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.state = cp.TrainState(
            model=self.model, optimizer=self.optimizer, data=self.loader,
            extra={"ema": self.ema, "samples_seen": 0},
        )  # fmt: skip
        self.ckpt = cp.CheckpointManager(root, every=cp.EverySteps(1), keep=cp.KeepLast(2))
        guard = cp.NumericsGuard(on_nonfinite="rollback", checkpoints=self.ckpt, state=self.state)
        self.state.extra["guard"] = guard
        self.guard = guard
        self.batches = iter(self.loader)
        self.step_n = 0

    def step(self) -> None:
        try:
            x, y, _ = next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            x, y, _ = next(self.batches)
        self.optimizer.zero_grad()
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.step_n += 1
        if self.guard.check(self.step_n, loss, self.model):
            self.optimizer.step()
            self.ema.update(self.model)

    def tensors(self) -> list[torch.Tensor]:
        tensors = [t.detach() for t in self.model.state_dict().values()]
        for state in self.optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        return tensors + list(self.ema.shadow.values())


def measure(demo: Demo, saves: int) -> dict[str, list[float]]:
    """Per method, the seconds of each pause; the methods take turns after every step."""
    live = demo.tensors()
    buffers = [torch.empty_like(t) for t in live]

    def copy_() -> None:
        for b, t in zip(buffers, live, strict=True):
            b.copy_(t)

    def memcpy() -> None:
        for b, t in zip(buffers, live, strict=True):
            np.copyto(b.view(-1).view(torch.uint8).numpy(), t.reshape(-1).view(torch.uint8).numpy())

    def save() -> None:
        demo.ckpt.save(demo.step_n, demo.state)

    methods: dict[str, Callable[[], None]] = {
        "crashproof save() pause": save,
        "copy_ into buffers": copy_,
        "memcpy into buffers (1 thread)": memcpy,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for i in range(saves + 10):
        for name, method in methods.items():
            demo.step()
            demo.ckpt.wait()  # time the pause alone, not a wait for the previous write
            started = time.perf_counter()
            method()
            if i >= 10:  # the first saves allocate buffers and warm up
                times[name].append(time.perf_counter() - started)
    return times


def summary(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=300, help="pauses timed per method and setting")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    rows = []
    state_mb = 0.0
    with tempfile.TemporaryDirectory(
        dir=REPO / ".bench-tmp" if (REPO / ".bench-tmp").is_dir() else None
    ) as tmp:
        for load in (False, True):
            burner = None
            if load:
                burner = mp.get_context("fork").Process(target=_burn, daemon=True)
                burner.start()
            demo = Demo(os.path.join(tmp, f"load{int(load)}"))
            demo.step()  # AdamW's moments exist from the first step on
            state_mb = sum(t.numel() * t.element_size() for t in demo.tensors()) / 1e6
            try:
                for name, times in measure(demo, args.saves).items():
                    median, p90 = summary(times)
                    rows.append((load, name, median, p90))
            finally:
                demo.ckpt.close()
                if burner is not None:
                    burner.kill()
                    burner.join()
    print(
        f"demo model (train_tiny, hidden 256) + AdamW + EMA, {state_mb:.2f} MB of tensors; "
        f"{args.saves} pauses per row; "
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {os.cpu_count()} CPUs"
    )
    header = "| competing process | method | median ms | p90 ms | median vs memcpy |"
    print(header if args.markdown else header.replace("|", " "))
    if args.markdown:
        print("|---|---|---:|---:|---:|")
    floor = {load: m for load, name, m, _ in rows if name.startswith("memcpy")}
    for load, name, median, p90 in rows:
        cells = [
            "yes" if load else "no", name, f"{median * 1e3:.2f}", f"{p90 * 1e3:.2f}",
            f"{median / floor[load]:.2f}x",
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(cells))


if __name__ == "__main__":
    main()
