"""Save and restore with 1 and 2 ranks: crashproof against ``torch.distributed.checkpoint`` and the
disk, in the same run on the same machine.

Each rank holds the same state (a DDP job: an ``nn.Linear`` stack wrapped in
``DistributedDataParallel`` and AdamW's moments, ``--size-mb`` in all) and the ranks save at once (real processes, gloo on loopback). Methods, round-robin
over ``--repeats`` rounds after a warm-up round, every save ending fsynced:

- **raw write**: every rank writes its state's bytes to its own file (``os.write`` + fsync), the
  floor for "every rank writes everything";
- **crashproof**: ``CheckpointManager(async_save=False).save`` (the replicated model and optimizer
  state written once, spread over the ranks; rank 0 commits the manifest);
- **DCP**: ``torch.distributed.checkpoint.save`` with the process group (its planner writes each
  replicated tensor once, spread over the ranks);

and restores into a fresh model and a fresh AdamW without state, as a restarted job has
(crashproof ``restore``; DCP ``load`` through ``get_state_dict``, which allocates the optimizer
state it loads into, and ``set_state_dict``), each checked afterwards against the saved weights
and moments. Times are the slowest rank's
(a save is done when every rank is); throughput is the state's size over that time; "bytes" is
what the method put on disk. The page cache is not dropped (no root needed): restores may be served
from memory.

    .venv/bin/python benchmarks/distributed_save.py --size-mb 256 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

import crashproof as cp
from _support import free_port

MB = 1e6


def _state(
    size_mb: float, *, trained: bool = True
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The saved state (after one real AdamW step: non-zero moments), or a fresh one to restore
    into (``trained=False``: other weights, an optimizer with no state yet)."""
    width = 1024
    layers = max(1, round(size_mb * MB / 3 / 4 / (width * width)))
    torch.manual_seed(0 if trained else 1)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    if trained:
        model(torch.randn(2, width)).sum().backward()
        optimizer.step()
        moments = [s["exp_avg"] for s in optimizer.state.values()]
        assert all(bool(m.abs().sum() > 0) for m in moments), "the moments must not be all zero"
    return model, optimizer


def _check_restored(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: torch.nn.Module, method: str
) -> None:
    """The restore brought back the saved weights and every parameter's moments."""
    weights = zip(model.state_dict().values(), saved.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in weights), f"{method}: weights differ"
    assert len(optimizer.state) == len(list(model.parameters())), f"{method}: no moments"


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    scratch = Path(args.scratch) / f"w{world}"
    model, optimizer = _state(args.size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size()
        for s in optimizer.state_dict()["state"].values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    buffer = torch.cat(
        [t.reshape(-1).view(torch.uint8) for t in model.state_dict().values()]
        + [
            v.reshape(-1).view(torch.uint8)
            for s in optimizer.state_dict()["state"].values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
    ).numpy()

    def raw() -> None:
        path = scratch / "raw" / f"rank{rank}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(buffer)
        for start in range(0, len(view), 16 << 20):
            os.write(fd, view[start : start + (16 << 20)])
        os.fsync(fd)
        os.close(fd)

    ddp = DistributedDataParallel(model)  # a DDP job: crashproof writes its state once

    def crashproof_save() -> None:
        root = scratch / "crashproof"
        with cp.CheckpointManager(root, async_save=False, handle_signals=False) as ckpt:
            ckpt.save(1, cp.TrainState(model=ddp, optimizer=optimizer))

    def dcp_save() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save(
            {"model": model_sd, "optimizer": optim_sd},
            storage_writer=dcp.FileSystemWriter(str(scratch / "dcp"), sync_files=True),
        )

    # made before the clock: a fresh model (wrapped in DDP for crashproof, as a job wraps it)
    fresh: list[tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]] = []

    def crashproof_restore() -> None:
        wrapped, _, optimizer = fresh[0]
        with cp.CheckpointManager(scratch / "crashproof", handle_signals=False) as ckpt:
            ckpt.restore(cp.TrainState(model=wrapped, optimizer=optimizer))

    def dcp_restore() -> None:
        _, model, optimizer = fresh[0]
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(scratch / "dcp")))
        set_state_dict(
            model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"]
        )

    methods = {
        "raw write (every rank its state)": raw,
        "crashproof save": crashproof_save,
        "DCP save": dcp_save,
        "crashproof restore": crashproof_restore,
        "DCP restore": dcp_restore,
    }
    output_of = {
        "raw write (every rank its state)": "raw",
        "crashproof save": "crashproof",
        "DCP save": "dcp",
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    for round_ in range(args.repeats + 1):
        for name, fn in methods.items():
            if name in output_of and rank == 0:  # each save writes afresh
                shutil.rmtree(scratch / output_of[name], ignore_errors=True)
            if "restore" in name:  # a fresh model and optimizer to restore into, not timed
                new_model, new_optimizer = _state(args.size_mb, trained=False)
                fresh[:] = [(DistributedDataParallel(new_model), new_model, new_optimizer)]
            dist.barrier()
            started = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - started
            if "restore" in name:
                _check_restored(fresh[0][1], fresh[0][2], model, name)
            slowest = [0.0] * world
            dist.all_gather_object(slowest, elapsed)
            if round_ > 0:
                times[name].append(max(slowest))
    if rank == 0:
        disk = {name: _du(scratch / sub) for name, sub in output_of.items()}
        out.put({"world": world, "state_bytes": nbytes, "times": times, "disk": disk})
    dist.destroy_process_group()


def run(world: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result: dict[str, Any] = queue.get(timeout=1800)
    for p in procs:
        p.join(120)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=".bench-tmp")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    args.scratch = tempfile.mkdtemp(prefix="dist-", dir=args.dir)
    try:
        results = [run(world, args) for world in (1, 2)]
    finally:
        shutil.rmtree(args.scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
    if args.markdown or not args.json:
        print(
            f"State per rank: {results[0]['state_bytes'] / MB:.0f} MB (replicated); medians of "
            f"{args.repeats} rounds; time = the slowest rank; {os.cpu_count()} CPUs.\n"
        )
        print("| ranks | method | median s | state GB/s | on disk MB | vs raw write |")
        print("|---:|---|---:|---:|---:|---:|")
        for r in results:
            floor = statistics.median(r["times"]["raw write (every rank its state)"])
            for name, values in r["times"].items():
                median = statistics.median(values)
                disk = r["disk"].get(name)
                print(
                    f"| {r['world']} | {name} | {median:.3f} | "
                    f"{r['state_bytes'] / 1e9 / median:.2f} | "
                    f"{'-' if disk is None else f'{disk / MB:.0f}'} | "
                    f"{'-' if 'restore' in name else f'{floor / median:.2f}x'} |"
                )
    print("done", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
