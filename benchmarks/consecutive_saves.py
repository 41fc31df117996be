"""Consecutive saves as a training run makes them: how long from ``save()`` to committed?

``async_save.py`` times each save on its own, with the page cache dropped before it. A run does
something else: it saves again and again, with retention removing the checkpoint before last,
and never drops the cache, so each save meets the writeback of the one before. This benchmark
times that setting, in rounds; each round makes, in an order rotated from round to round:

* **crashproof**: ``CheckpointManager(async_save=True, keep=KeepLast(2))``, ``save()`` then
  ``wait()`` (the manager lives across rounds, as in a run: its staging buffers are warm);
* **DCP**: ``torch.distributed.checkpoint.async_save`` into a new directory, waited for, the
  directory fsynced, the directory before last removed (the same retention);
* **raw write**: the same bytes from one buffer into a new file, ``fsync``, the file before last
  removed: the disk's own speed in the same setting;
* **memcpy**: a copy of the state into preallocated buffers (the floor of the blocking part).

crashproof's ``wait()`` returns once retention has removed the checkpoint before last; the other
methods' times are given without and with (``with delete``) their removal of the one before last.
Per round it reports each method's time, and per round the ratios (raw write / crashproof's
save-to-committed, crashproof's blocking / memcpy), so the disk's drift between rounds cancels;
the medians over the counted rounds are the results. The state is ``save_speed.py``'s
transformer-shaped TinyLM with AdamW after one real step (no all-zero moments). Run from the
repository root (about 5 minutes at the defaults on a 2-vCPU VM)::

    .venv/bin/python benchmarks/consecutive_saves.py --size-mb 1700 --rounds 6 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async

import crashproof
from save_speed import (
    DEFAULT_DIR,
    MB,
    byte_views,
    choose_shape,
    dcp_state,
    flat_state,
    fsync_path,
    log,
    memcpy,
    raw_write,
    trained_state,
)

CP, DCP, RAW, MEMCPY = "crashproof async", "DCP async_save", "raw write + fsync", "memcpy"
KEPT = 2  # checkpoints (or files) kept, as KeepLast(2)


class Rotation:
    """The methods of one run, each keeping its last ``KEPT`` outputs like retention does."""

    def __init__(self, work: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.work = work
        self.model, self.optimizer = model, optimizer
        self.state = crashproof.TrainState(model=model, optimizer=optimizer)
        live = list(flat_state(model, optimizer).values())
        self.raw = torch.cat([t.reshape(-1).view(torch.uint8) for t in live])
        self.raw_view = byte_views([self.raw])
        self.pairs = [(torch.empty_like(t), t) for t in live]
        memcpy(self.pairs)  # fault the destination pages in once
        self.manager = crashproof.CheckpointManager(
            str(work / "crashproof"), async_save=True, keep=crashproof.KeepLast(KEPT),
            handle_signals=False,
        )  # fmt: skip
        self.step = 0
        self.outputs: dict[str, list[Path]] = {DCP: [], RAW: []}
        (work / "dcp").mkdir(parents=True, exist_ok=True)
        (work / "raw").mkdir(parents=True, exist_ok=True)

    def methods(self) -> dict[str, Callable[[], dict[str, float]]]:
        return {CP: self.crashproof, DCP: self.dcp, RAW: self.raw_write, MEMCPY: self.memcpy}

    def crashproof(self) -> dict[str, float]:
        self.step += 1
        started = time.perf_counter()
        self.manager.save(self.step, self.state)
        blocking = time.perf_counter() - started
        commit = self.manager.wait()
        total = time.perf_counter() - started
        if commit is None or commit.step != self.step:
            raise RuntimeError(f"the save of step {self.step} did not commit")
        # the background write itself (files written, fsynced, published), as the writer timed it
        return {"total": total, "blocking": blocking, "persist": commit.persist_s}

    def dcp(self) -> dict[str, float]:
        self.step += 1
        path = self.work / "dcp" / f"step_{self.step}"
        started = time.perf_counter()
        response: Any = dcp_async(
            dcp_state(self.model, self.optimizer), storage_writer=FileSystemWriter(str(path))
        )
        blocking = time.perf_counter() - started
        getattr(response, "upload_completion", response).result()
        fsync_path(path)
        fsync_path(path.parent)
        total = time.perf_counter() - started
        self._retain(DCP, path)
        return {
            "total": total,
            "blocking": blocking,
            "with delete": time.perf_counter() - started,
        }

    def raw_write(self) -> dict[str, float]:
        self.step += 1
        path = self.work / "raw" / f"state_{self.step}.bin"
        started = time.perf_counter()
        written, flushed = raw_write(path, self.raw_view)
        self._retain(RAW, path)
        return {"total": written + flushed, "with delete": time.perf_counter() - started}

    def memcpy(self) -> dict[str, float]:
        started = time.perf_counter()
        memcpy(self.pairs)
        return {"total": time.perf_counter() - started}

    def _retain(self, method: str, path: Path) -> None:
        kept = self.outputs[method]
        kept.append(path)
        while len(kept) > KEPT:
            old = kept.pop(0)
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()

    def close(self) -> None:
        self.manager.close()


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    shape = choose_shape(int(args.size_mb * MB))
    model, optimizer = trained_state(shape)  # (refuses all-zero moments)
    nbytes = sum(t.nbytes for t in flat_state(model, optimizer).values())
    log(f"state: {shape}, {nbytes / MB:.0f} MB")
    rotation = Rotation(work, model, optimizer)
    names = list(rotation.methods())
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            for number in range(args.warmup + args.rounds):
                order = names[number % len(names) :] + names[: number % len(names)]
                timed = {name: rotation.methods()[name]() for name in order}
                label = "warm-up" if number < args.warmup else f"round {number - args.warmup + 1}"
                log(f"{label}: " + ", ".join(f"{n} {t['total']:.3f} s" for n, t in timed.items()))
                if number >= args.warmup:
                    rounds.append(timed)
    finally:
        rotation.close()
    return {"shape": vars(shape), "state_bytes": nbytes, "rounds": rounds, **summary(rounds)}


def summary(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return round(statistics.median(values), 4)

    times = {
        f"{name} / {part}": med([r[name][part] for r in rounds])
        for name in rounds[0]
        for part in rounds[0][name]
    }
    return {
        "median_s": times,
        "raw_over_crashproof_total": med([r[RAW]["total"] / r[CP]["total"] for r in rounds]),
        "raw_with_delete_over_crashproof_total": med(
            [r[RAW]["with delete"] / r[CP]["total"] for r in rounds]
        ),
        "raw_over_dcp_total": med([r[RAW]["total"] / r[DCP]["total"] for r in rounds]),
        "crashproof_blocking_over_memcpy": med(
            [r[CP]["blocking"] / r[MEMCPY]["total"] for r in rounds]
        ),
        "dcp_blocking_over_memcpy": med([r[DCP]["blocking"] / r[MEMCPY]["total"] for r in rounds]),
    }


def markdown(out: dict[str, Any]) -> str:
    rows = [
        "| method | save-to-committed (median s) | blocking | writer's persist | with delete |",
        "|---|---|---|---|---|",
    ]
    times = out["median_s"]

    def cell(name: str, part: str) -> str:
        value = times.get(f"{name} / {part}")
        return "" if value is None else f"{value:.3f}"

    for name in (CP, DCP, RAW, MEMCPY):
        parts = ("total", "blocking", "persist", "with delete")
        rows.append(f"| {name} | " + " | ".join(cell(name, p) for p in parts) + " |")
    ratios = [
        "",
        "| paired ratio (median over rounds) | value |",
        "|---|---|",
        f"| raw write / crashproof save-to-committed (speed, 1.0 = the disk's) "
        f"| {out['raw_over_crashproof_total']:.2f} |",
        f"| raw write with its delete / crashproof save-to-committed "
        f"| {out['raw_with_delete_over_crashproof_total']:.2f} |",
        f"| raw write / DCP save-to-committed | {out['raw_over_dcp_total']:.2f} |",
        f"| crashproof blocking / memcpy | {out['crashproof_blocking_over_memcpy']:.2f} |",
        f"| DCP blocking / memcpy | {out['dcp_blocking_over_memcpy']:.2f} |",
    ]
    head = f"State: {out['state_bytes'] / MB:.0f} MB ({out['shape']}), {len(out['rounds'])} rounds."
    return "\n".join([head, "", *rows, *ratios])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=1700, help="state bytes (model + AdamW)")
    p.add_argument("--rounds", type=int, default=6, help="counted rounds")
    p.add_argument("--warmup", type=int, default=1, help="uncounted rounds first")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR / "consecutive")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        out = run(args, args.dir)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
    if args.markdown or not args.json:
        print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
