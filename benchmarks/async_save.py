"""How long does an asynchronous crashproof save pause training, and what does it cost overall?

Targets of the asynchronous-save issue, all checked in one run:

* the blocking part of ``CheckpointManager(async_save=True).save`` (from the second save on: the
  first one allocates the staging buffers) <= 1.2x a memcpy of the state into preallocated
  buffers, and <= 0.5x the blocking part of ``torch.distributed.checkpoint.async_save`` (DCP);
* the persist (total - blocking) <= 1/0.9 of a raw write + fsync of the same bytes;
* training with asynchronous checkpoints adds <= 3% wall time over training without any.

Three sections:

1. **Save**, on the state of ``save_speed.py`` (TinyLM + AdamW after one step, ``--size-mb``
   bytes), the methods interleaved round-robin with the page cache dropped before each (first
   round a warm-up): the floors (raw write + fsync of the same bytes, from one buffer and from the
   tensors; raw read of that file; memcpy into preallocated buffers), DCP ``async_save`` (its
   blocking part: ``get_state_dict`` and the call until it returns a future; its total: until the
   future's result, then the directory fsyncs), crashproof's first asynchronous save on a fresh
   manager, its later saves on a manager that already holds its staging buffers, and crashproof's
   synchronous save. A final check saves asynchronously, changes every live tensor before the
   write is done, and restores: the checkpoint must hold the values at the save.
2. **Training**: a smaller TinyLM (``--train-*``; embedding initialised N(0, 0.02)) trained with
   AdamW on random tokens on the CPU, a fresh model per run: no checkpoints, crashproof sync every
   K steps, crashproof async every K steps. A short calibration sets K (a checkpoint every
   ``--ckpt-seconds``) and the steps per run (about ``--train-seconds``, the last checkpoint half
   an interval before the end). Wall time is the training loop plus ``close()`` (the last
   checkpoint committed).
3. **Writer thread vs writer process**: the same training loop while the training state's bytes
   (staged once into one shared-memory buffer) are written in the background every
   ``--writer-interval-s`` seconds of training (if no write is in flight) with crashproof's
   ``write_shard`` (file + fsync), by (a) a thread, (b) a persistent child process that maps the
   same buffer and is told per write over a pipe; and with no writes. Which slows training less,
   over the whole run and over the steps that overlap a write?

Variants of sections 2 and 3 run interleaved, their order rotated each repeat; medians are
reported, with the CPU the rest of the machine used meanwhile (the test machine is shared).
About 8 minutes at the defaults on a 2-vCPU VM. Run from the repository root::

    .venv/bin/python benchmarks/async_save.py --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.multiprocessing
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async

import crashproof
from crashproof.checkpoint.format._shard_file import write_shard
from save_speed import (
    DEFAULT_DIR,
    MB,
    RAW_BUFFER,
    RAW_READ,
    RAW_TENSORS,
    Method,
    Shape,
    assert_same_state,
    byte_views,
    choose_shape,
    dcp_state,
    drop_page_cache,
    environment,
    flat_state,
    fsync_path,
    log,
    memcpy,
    new_model,
    raw_read,
    raw_write_floors,
    remove,
    time_round_robin,
    trained_state,
)

MEMCPY = "memcpy into preallocated buffers"
DCP_ASYNC = "DCP async_save"
CP_FIRST = "crashproof async, first save"
CP_ASYNC = "crashproof async"
CP_SYNC = "crashproof sync save"
BLOCKING = "blocking"
WRITER_PERSIST = "writer persist_s"
PERSIST = "persist (total - blocking)"

# The targets of the issue.
MAX_BLOCKING_VS_MEMCPY = 1.2
MAX_BLOCKING_VS_DCP = 0.5
MAX_PERSIST_VS_RAW = 1 / 0.9
MAX_TRAIN_OVERHEAD_PCT = 3.0

NO_CKPT, SYNC_CKPT, ASYNC_CKPT = "no checkpoints", "crashproof sync", "crashproof async"
MEMORY_CKPT = "crashproof memory snapshots"
"""Snapshots into the memory of crashproof run's agent every ``every`` steps, none to disk (the
caller runs the agent's memory host: training_overhead.py --memory)."""
NO_WRITE, THREAD_WRITE, PROCESS_WRITE = "no background write", "writer thread", "writer process"

_ALIGN = 64  # byte alignment of each tensor inside the shared staging buffer


OTHERS_NOTE = (
    "*Others' CPU*: the machine's busy CPU time during a run less this benchmark's processes' "
    "own, in cores (of 2), median over runs: other users' jobs, and kernel threads such as "
    "writeback, some of which work for the benchmark's writes."
)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


_TICK = os.sysconf("SC_CLK_TCK")


class OtherCpu:
    """CPU time the rest of the machine used while this was alive, in cores on average: every
    CPU's busy time (``/proc/stat``) less this process's and ``pids``' own. It counts other users'
    jobs, and kernel threads such as writeback (some of which work for this benchmark)."""

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self._pids = pids
        self._wall, self._busy, self._own = time.perf_counter(), *self._sample()

    def _sample(self) -> tuple[float, float]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user .. steal
        busy = (sum(ticks) - ticks[3] - ticks[4]) / _TICK  # less idle and iowait
        own = sum(os.times()[:2])
        for pid in self._pids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
                own += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        return busy, own

    def cores(self) -> tuple[float, float]:
        """(the rest of the machine's, this process's and ``pids``') CPU use, in cores."""
        busy, own = self._sample()
        wall = time.perf_counter() - self._wall
        return max(0.0, (busy - self._busy) - (own - self._own)) / wall, (own - self._own) / wall


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def clear_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for entry in path.iterdir():
        remove(entry)


# -- section 1: save ------------------------------------------------------------------------------


def dcp_behaviour(work: Path) -> dict[str, Any]:
    """What DCP's ``async_save`` does with the defaults in this torch, and whether the cached
    (reused) staging of ``FileSystemWriter(cache_staged_state_dict=True)`` works here."""
    default = inspect.signature(dcp_async).parameters["async_checkpointer_type"].default
    probe = work / "dcp-probe"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            response: Any = dcp_async(
                {"x": torch.zeros(4)},
                storage_writer=FileSystemWriter(str(probe), cache_staged_state_dict=True),
            )
            getattr(response, "upload_completion", response).result()
        cached = "works"
    except Exception as exc:
        cached = f"fails: {type(exc).__name__}: {str(exc).rstrip('.')}"
    remove(probe)
    return {
        "async_checkpointer_type": str(default),
        "file_system_writer_is_blocking_stager": issubclass(FileSystemWriter, BlockingAsyncStager),
        "staging": (
            "FileSystemWriter is a BlockingAsyncStager: async_save copies the state into freshly "
            "allocated CPU tensors before it returns (no reuse across saves), then one thread "
            "writes and fsyncs"
        ),
        "cache_staged_state_dict=True": cached,
    }


def dcp_async_save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One DCP ``async_save``, waited for; returns its blocking part (state dict + the call)."""
    started = time.perf_counter()
    response: Any = dcp_async(
        dcp_state(model, optimizer), storage_writer=FileSystemWriter(str(path))
    )
    blocking = time.perf_counter() - started
    getattr(response, "upload_completion", response).result()
    fsync_path(path)
    fsync_path(path.parent)
    return blocking


@dataclass
class Managers:
    """The crashproof managers of the save section; ``first`` is replaced before every repeat."""

    steady: crashproof.CheckpointManager
    sync: crashproof.CheckpointManager
    first: crashproof.CheckpointManager | None = None

    def close(self) -> None:
        for manager in (self.steady, self.sync, self.first):
            if manager is not None:
                with contextlib.suppress(Exception):
                    manager.close()


def async_save_and_wait(
    manager: crashproof.CheckpointManager, step: int, state: Any
) -> dict[str, float]:
    started = time.perf_counter()
    manager.save(step, state)
    blocking = time.perf_counter() - started
    manager.wait()
    commit = manager.last_commit
    if commit is None or commit.step != step:
        raise RuntimeError(f"the save of step {step} did not commit")
    return {BLOCKING: blocking, WRITER_PERSIST: commit.persist_s}


def save_methods(
    work: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    raw: memoryview,
    managers: Managers,
) -> list[Method]:
    dirs = {n: work / n for n in ("raw", "dcp", "first", "async", "sync")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    raw_file, raw_file2 = dirs["raw"] / "state.bin", dirs["raw"] / "from-tensors.bin"
    dcp_dir = dirs["dcp"] / "ckpt"
    state = crashproof.TrainState(model=model, optimizer=optimizer)
    steps = itertools.count(1)
    live = list(flat_state(model, optimizer).values())
    live_bytes = byte_views(live)
    pairs = [(torch.empty_like(t), t) for t in live]
    memcpy(pairs)  # fault the destination pages in once: the floor copies into warm buffers
    read_buf = torch.zeros(len(raw), dtype=torch.uint8)
    read_view = read_buf.numpy().data.cast("B")

    def prepare_first() -> None:
        clear_dir(dirs["first"])
        managers.first = crashproof.CheckpointManager(
            str(dirs["first"]), keep=crashproof.KeepLast(1), async_save=True
        )

    def run_first() -> dict[str, float]:
        assert managers.first is not None
        return async_save_and_wait(managers.first, next(steps), state)

    def close_first() -> None:
        if managers.first is not None:
            managers.first.close()
            managers.first = None
        gc.collect()  # frees its staging buffers before the next method

    def prepare(manager: crashproof.CheckpointManager, root: Path) -> Callable[[], None]:
        def clear() -> None:
            manager.wait()  # nothing in flight (retention included) while the old ones go
            clear_dir(root)

        return clear

    def run_sync() -> None:
        managers.sync.save(next(steps), state)

    return [
        *raw_write_floors(raw_file, raw, raw_file2, live_bytes),
        Method(
            RAW_READ,
            lambda: raw_read(raw_file, read_view),
            note="the one-buffer file just written, preadv 16 MiB chunks, cold cache",
        ),
        Method(MEMCPY, lambda: memcpy(pairs), note="one tensor.copy_ per tensor"),
        Method(
            DCP_ASYNC,
            lambda: {BLOCKING: dcp_async_save(dcp_dir, model, optimizer)},
            lambda: remove(dcp_dir),
            note="default FileSystemWriter (sync_files=True), one process, no process group",
        ),
        Method(
            CP_FIRST,
            run_first,
            prepare_first,
            close_first,
            note="a fresh manager: allocates its staging buffers",
        ),
        Method(
            CP_ASYNC,
            lambda: async_save_and_wait(managers.steady, next(steps), state),
            prepare(managers.steady, dirs["async"]),
            note="the staging buffers of earlier saves reused",
        ),
        Method(
            CP_SYNC,
            run_sync,
            prepare(managers.sync, dirs["sync"]),
            note="async_save=False: writes from the live tensors",
        ),
    ]


def check_isolation(
    model: nn.Module, optimizer: torch.optim.Optimizer, shape: Shape, root: Path
) -> str:
    """Save asynchronously twice (the second reuses the staging buffers); change every live
    tensor while the second is written; restore it and compare with the state at ``save()``."""
    clear_dir(root)
    state = crashproof.TrainState(model=model, optimizer=optimizer)
    with crashproof.CheckpointManager(str(root), async_save=True) as manager:
        manager.save(1, state)
        manager.wait()
        expected = {k: v.clone() for k, v in flat_state(model, optimizer).items()}
        manager.save(2, state)
        saved = time.perf_counter()
        with torch.no_grad():
            for tensor in flat_state(model, optimizer).values():
                if tensor.is_floating_point():
                    tensor.add_(1.0)
        changed_s = time.perf_counter() - saved
        commit = manager.wait()
    # The write starts when save() returns: was it still going once every tensor had changed?
    in_flight = commit is not None and changed_s < commit.persist_s
    fresh_model, fresh_optimizer = new_model(shape, seed=1)
    with crashproof.CheckpointManager(str(root), async_save=False) as reader:
        reader.restore(crashproof.TrainState(model=fresh_model, optimizer=fresh_optimizer), step=2)
    assert_same_state(fresh_model, fresh_optimizer, expected)
    with torch.no_grad():  # put the state back as it was
        for key, tensor in flat_state(model, optimizer).items():
            tensor.copy_(expected[key])
    clear_dir(root)
    when = "while the write was still in flight" if in_flight else "(the write had finished first)"
    return (
        f"passed: every live tensor was changed right after the second save() returned, {when}; "
        "the checkpoint restored into a fresh model and AdamW equals the state at that save()"
    )


def save_section(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    shape = choose_shape(int(args.size_mb * MB))
    model, optimizer = trained_state(shape)
    live = list(flat_state(model, optimizer).values())
    nbytes = sum(t.nbytes for t in live)
    raw_tensor = torch.cat([t.reshape(-1).view(torch.uint8) for t in live])
    raw = raw_tensor.numpy().data.cast("B")
    log(f"save section: {shape}, {len(live)} tensors, {nbytes / MB:.1f} MB")
    out: dict[str, Any] = {"shape": vars(shape), "state_bytes": nbytes, "tensors": len(live)}
    out["dcp"] = dcp_behaviour(work)
    keep = crashproof.KeepLast(1)
    managers = Managers(
        steady=crashproof.CheckpointManager(str(work / "async"), keep=keep, async_save=True),
        sync=crashproof.CheckpointManager(str(work / "sync"), keep=keep, async_save=False),
    )
    try:
        # The steady manager's first save (allocating its buffers) happens here, untimed.
        state = crashproof.TrainState(model=model, optimizer=optimizer)
        out["steady_priming_save"] = async_save_and_wait(managers.steady, 0, state)
        methods = save_methods(work, model, optimizer, raw, managers)
        with warnings.catch_warnings():
            # DCP without a process group: "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message=".*single process.*")
            times = time_round_robin(methods, args.repeats, args.warmup, drop_page_cache)
        try:
            out["isolation_check"] = check_isolation(model, optimizer, shape, work / "isolation")
        except Exception as exc:  # report, do not lose the timings
            out["isolation_check"] = f"FAILED: {type(exc).__name__}: {exc}"
        log(f"isolation check: {out['isolation_check']}")
    finally:
        managers.close()
    for name in (CP_FIRST, CP_ASYNC):
        times[f"{name} / {PERSIST}"] = [
            t - b for t, b in zip(times[name], times[f"{name} / {BLOCKING}"], strict=True)
        ]
    out["times_s"] = times
    out["notes"] = {m.name: m.note for m in methods}
    out["loadavg_after"] = loadavg()
    return out


# -- the training loop (sections 2 and 3) ---------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    shape: Shape
    batch: int
    seq: int
    warmup_steps: int = 3


class Trainer:
    """A TinyLM trained with AdamW on random tokens (the same tokens for every variant).

    The embedding (tied to the output head) is initialised N(0, 0.02) as in GPT-2: with
    ``nn.Embedding``'s N(0, 1) the logits are huge, the softmax gradients underflow into denormal
    floats, and the steps slow down 2-4x a few steps in. ``torch.set_flush_denormal`` is no cure
    here: it sets only the calling thread's flags, not those of the intra-op threads that
    already exist by then.
    """

    def __init__(self, config: TrainConfig, seed: int = 0) -> None:
        self.config = config
        self.model, self.optimizer = new_model(config.shape, seed)
        embed = self.model.get_submodule("embed")
        assert isinstance(embed, nn.Embedding)
        with torch.no_grad():
            nn.init.normal_(embed.weight, std=0.02)
        self.tokens = torch.Generator().manual_seed(seed)
        for _ in range(config.warmup_steps):  # allocations and AdamW's state: not timed
            self.step()

    def step(self) -> None:
        c = self.config
        tokens = torch.randint(c.shape.vocab, (c.batch, c.seq + 1), generator=self.tokens)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        torch.autograd.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> crashproof.TrainState:
        return crashproof.TrainState(model=self.model, optimizer=self.optimizer)


def calibrate(config: TrainConfig, steps: int = 16) -> float:
    """Seconds per training step on this machine now: the lower quartile, so that a burst of load
    from elsewhere does not shrink the runs (a loaded machine makes them longer instead)."""
    trainer = Trainer(config)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - started)
    return statistics.quantiles(times, n=4)[0]


def rotated(variants: Sequence[str], repeat: int) -> list[str]:
    k = repeat % len(variants)
    return [*variants[k:], *variants[:k]]


# -- section 2: training with checkpoints ---------------------------------------------------------


def train_run(
    config: TrainConfig, variant: str, steps: int, every: int, root: Path
) -> dict[str, Any]:
    trainer = Trainer(config)
    manager = None
    if variant != NO_CKPT:
        clear_dir(root)
        memory = variant == MEMORY_CKPT
        manager = crashproof.CheckpointManager(
            str(root),
            every=crashproof.EverySteps(10**9 if memory else every),
            keep=crashproof.KeepLast(1),
            async_save=variant in (ASYNC_CKPT, MEMORY_CKPT),
            memory_every=crashproof.EverySteps(every) if memory else None,
        )
    state = trainer.state()
    blocking: list[float] = []
    os.sync()
    gc.collect()
    others = OtherCpu()
    started = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            trainer.step()
            if manager is not None and manager.maybe_save(step, state):
                blocking.append(manager.last_blocking_s)
            elif manager is not None and variant == MEMORY_CKPT and step % every == 0:
                blocking.append(manager.stats.memory_last_blocking_s)
        loop_s = time.perf_counter() - started
        started = time.perf_counter()
    finally:
        if manager is not None:
            manager.close()  # the last checkpoint committed: part of the wall time
    closing_s = time.perf_counter() - started if manager is not None else 0.0
    run: dict[str, Any] = {}
    run["other_cpu_cores"], run["own_cpu_cores"] = others.cores()
    if manager is not None:
        stats = manager.stats
        run.update(
            saves=stats.saves_committed,
            bytes_per_save=stats.bytes_written / max(1, stats.saves_committed),
            waited_busy=stats.waited_busy,
            persist_s_last=stats.last_persist_s,
        )
        remove(root)
    run.update(loop_s=loop_s, close_s=closing_s, wall_s=loop_s + closing_s, blocking_s=blocking)
    run["loadavg"] = loadavg()
    return run


def checkpoint_every(step_s: float, ckpt_seconds: float) -> int:
    """Steps between checkpoints for one every ``ckpt_seconds`` at ``step_s`` per step."""
    return max(1, round(ckpt_seconds / step_s))


def run_steps(step_s: float, every: int, train_seconds: float) -> int:
    """Steps of a run of about ``train_seconds``: whole intervals, the last save half an
    interval before the end."""
    saves = max(1, round(train_seconds / (every * step_s) - 0.5))
    return saves * every + every // 2


def state_bytes(config: TrainConfig) -> int:
    """The bytes a checkpoint of the trained model and its AdamW state holds."""
    return sum(t.nbytes for t in flat_state(*trained_state(config.shape)).values())


def train_section(
    args: argparse.Namespace, work: Path, config: TrainConfig, step_s: float
) -> dict[str, Any]:
    every = args.ckpt_every or checkpoint_every(step_s, args.ckpt_seconds)
    steps = args.train_steps or run_steps(step_s, every, args.train_seconds)
    nbytes = state_bytes(config)
    log(
        f"training section: {config}, {step_s * 1000:.0f} ms/step (calibration), {steps} steps, "
        f"a checkpoint every {every} steps, {nbytes / MB:.1f} MB of state"
    )
    variants = [NO_CKPT, SYNC_CKPT, ASYNC_CKPT]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(args.train_repeats):
        for variant in rotated(variants, repeat):
            run = train_run(config, variant, steps, every, work / "train")
            runs[variant].append(run)
            log(
                f"  [repeat {repeat + 1}/{args.train_repeats}] {variant}: {run['wall_s']:.2f} s "
                f"(loop {run['loop_s']:.2f} + close {run['close_s']:.2f}), "
                f"blocking per save {[round(b, 3) for b in run['blocking_s']]}, load {loadavg()}"
            )
    return {
        "calibrated_step_s": step_s,
        "steps": steps,
        "every": every,
        "state_bytes": nbytes,
        "runs": runs,
        "loadavg_after": loadavg(),
    }


# -- section 3: writer thread vs writer process ---------------------------------------------------


Spec = tuple[str, torch.dtype, tuple[int, ...], int]
"""A tensor inside the shared staging buffer: name, dtype, shape, byte offset."""


def shared_staging(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[Spec]]:
    """One shared-memory byte buffer holding a copy of ``tensors``, and where each one lies."""
    specs: list[Spec] = []
    pos = 0
    for name, tensor in tensors.items():
        specs.append((name, tensor.dtype, tuple(tensor.shape), pos))
        pos += -(-tensor.nbytes // _ALIGN) * _ALIGN
    flat = torch.zeros(pos, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
    for (_, tensor), (_, staged) in zip(tensors.items(), staged_views(flat, specs), strict=True):
        staged.copy_(tensor)
    return flat, specs


def staged_views(flat: torch.Tensor, specs: Sequence[Spec]) -> list[tuple[str, torch.Tensor]]:
    views = []
    for name, dtype, shape, offset in specs:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        views.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
    return views


def write_file(path: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> float:
    """Replace ``path`` by a shard of ``tensors`` (file + fsync); returns the seconds taken."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    started = time.perf_counter()
    write_shard(crashproof.LocalStorage(), path, tensors)
    return time.perf_counter() - started


def _writer_process_main(conn: Connection, flat: torch.Tensor, specs: list[Spec]) -> None:
    """The child: maps the shared buffer once, then writes one shard per path it is sent."""
    torch.set_num_threads(1)
    tensors = staged_views(flat, specs)
    conn.send(("ready", os.getpid()))
    while (path := conn.recv()) is not None:
        try:
            conn.send(("ok", write_file(path, tensors)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    conn.close()


class Writer(Protocol):
    def start(self, path: str) -> None: ...

    def poll(self) -> float | None:
        """The seconds of the write in flight if it has finished, else None."""
        ...

    def wait(self) -> float: ...


class ThreadWriter:
    def __init__(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._tensors = tensors
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="bench-writer")
        self._future: Future[float] | None = None

    def start(self, path: str) -> None:
        self._future = self._executor.submit(write_file, path, self._tensors)

    def poll(self) -> float | None:
        assert self._future is not None
        return self.wait() if self._future.done() else None

    def wait(self) -> float:
        assert self._future is not None
        future, self._future = self._future, None
        return future.result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class ProcessWriter:
    """A persistent child process writing from the shared buffer, told per write over a pipe."""

    def __init__(self, flat: torch.Tensor, specs: list[Spec]) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(
            target=_writer_process_main, args=(child_conn, flat, specs), daemon=True
        )
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        child_conn.close()
        if not self._conn.poll(120):
            raise RuntimeError("the writer process did not start within 120 s")
        self._conn.recv()  # "ready"

    def start(self, path: str) -> None:
        self._conn.send(path)

    def poll(self) -> float | None:
        return self.wait() if self._conn.poll() else None

    def wait(self) -> float:
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"the writer process failed: {value}")
        return float(value)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._process.join(30)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)


def writer_run(
    config: TrainConfig,
    writer: Writer | None,
    steps: int,
    every: int,
    root: Path,
    pids: Sequence[int] = (),
) -> dict[str, Any]:
    """Train ``steps`` steps; every ``every`` steps start a background write (if none is in flight)."""
    trainer = Trainer(config)
    paths = itertools.cycle([str(root / "a.safetensors"), str(root / "b.safetensors")])
    durations: list[float] = []
    during: list[bool] = []  # whether a write was in flight when the step started
    writes: list[float] = []
    in_flight = False
    os.sync()
    gc.collect()
    others = OtherCpu(pids)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        busy = in_flight
        step_started = time.perf_counter()
        trainer.step()
        durations.append(time.perf_counter() - step_started)
        during.append(busy)
        if writer is not None:
            if in_flight and (secs := writer.poll()) is not None:
                writes.append(secs)
                in_flight = False
            if not in_flight and step % every == 0:
                writer.start(next(paths))
                in_flight = True
    loop_s = time.perf_counter() - started
    other_cpu, own_cpu = others.cores()
    if writer is not None and in_flight:
        writes.append(writer.wait())
    busy_s = sum(d for d, b in zip(durations, during, strict=True) if b)
    busy_steps = sum(during)
    return {
        "loop_s": loop_s,
        "steps_per_s": steps / loop_s,
        "writes": len(writes),
        "write_s": writes,
        "steps_during_writes": busy_steps,
        "steps_per_s_during_writes": busy_steps / busy_s if busy_s else None,
        "steps_per_s_between_writes": (
            (steps - busy_steps) / (sum(durations) - busy_s) if busy_steps < steps else None
        ),
        "loadavg": loadavg(),
        "other_cpu_cores": other_cpu,
        "own_cpu_cores": own_cpu,
    }


def writer_section(
    args: argparse.Namespace, work: Path, config: TrainConfig, step_s: float
) -> dict[str, Any]:
    steps = max(2, round(args.writer_seconds / step_s))
    every = max(1, round(args.writer_interval_s / step_s))
    flat, specs = shared_staging(flat_state(*trained_state(config.shape)))
    nbytes = sum(t.nbytes for _, t in staged_views(flat, specs))
    root = work / "writer"
    root.mkdir(parents=True, exist_ok=True)
    log(
        f"writer section: {step_s * 1000:.0f} ms/step (calibration), {steps} steps, a write of "
        f"{nbytes / MB:.1f} MB started every {every} steps when none is in flight"
    )
    thread_writer = ThreadWriter(staged_views(flat, specs))
    process_writer: ProcessWriter | None = None
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in (NO_WRITE, THREAD_WRITE, PROCESS_WRITE)}
    try:
        process_writer = ProcessWriter(flat, specs)
        writers: dict[str, Writer | None] = {
            NO_WRITE: None,
            THREAD_WRITE: thread_writer,
            PROCESS_WRITE: process_writer,
        }
        for repeat in range(args.train_repeats):
            for variant in rotated(list(writers), repeat):
                run = writer_run(config, writers[variant], steps, every, root, [process_writer.pid])
                runs[variant].append(run)
                log(
                    f"  [repeat {repeat + 1}/{args.train_repeats}] {variant}: {run['loop_s']:.2f} s, "
                    f"{run['steps_per_s']:.2f} steps/s, {run['writes']} writes, load {loadavg()}"
                )
    finally:
        thread_writer.close()
        if process_writer is not None:
            process_writer.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "calibrated_step_s": step_s,
        "steps": steps,
        "every": every,
        "write_bytes": nbytes,
        "runs": runs,
        "loadavg_after": loadavg(),
    }


# -- summaries ------------------------------------------------------------------------------------


def ratio(num: Sequence[float], den: Sequence[float]) -> tuple[float, float]:
    """(median(num) / median(den), median over rounds of num / den in the same round)."""
    paired = median([n / d for n, d in zip(num, den, strict=True)])
    return median(num) / median(den), paired


def save_targets(save: dict[str, Any]) -> list[dict[str, Any]]:
    t = save["times_s"]
    raw_floor = min((RAW_BUFFER, RAW_TENSORS), key=lambda n: median(t[n]))
    blocking = t[f"{CP_ASYNC} / {BLOCKING}"]
    rows = []
    for what, num, den, limit in (
        (f"{CP_ASYNC} blocking / {MEMCPY}", blocking, t[MEMCPY], MAX_BLOCKING_VS_MEMCPY),
        (
            f"{CP_ASYNC} blocking / {DCP_ASYNC} blocking",
            blocking,
            t[f"{DCP_ASYNC} / {BLOCKING}"],
            MAX_BLOCKING_VS_DCP,
        ),
        (
            f"{CP_ASYNC} {PERSIST} / {raw_floor}",
            t[f"{CP_ASYNC} / {PERSIST}"],
            t[raw_floor],
            MAX_PERSIST_VS_RAW,
        ),
    ):
        value, paired = ratio(num, den)
        rows.append(
            {
                "target": what,
                "ratio": value,
                "paired": paired,
                "limit": limit,
                "met": value <= limit,
            }
        )
    rows.append(
        {
            "target": f"(reference) {CP_FIRST} blocking / {MEMCPY}",
            "ratio": ratio(t[f"{CP_FIRST} / {BLOCKING}"], t[MEMCPY])[0],
            "paired": ratio(t[f"{CP_FIRST} / {BLOCKING}"], t[MEMCPY])[1],
            "limit": None,
            "met": None,
        }
    )
    return rows


def overhead(
    runs: dict[str, list[dict[str, Any]]], variant: str, base: str, key: str
) -> tuple[float, float]:
    """Added ``key`` time of ``variant`` over ``base`` in %: of the medians, and paired by repeat."""
    v = [r[key] for r in runs[variant]]
    b = [r[key] for r in runs[base]]
    paired = median([100 * (x / y - 1) for x, y in zip(v, b, strict=True)])
    return 100 * (median(v) / median(b) - 1), paired


def load_range(runs: dict[str, list[dict[str, Any]]]) -> str:
    ones = [r["loadavg"][0] for rs in runs.values() for r in rs]
    return f"{min(ones):.2f} to {max(ones):.2f}"


def spread_pct(xs: Sequence[float]) -> float:
    return 100 * (max(xs) - min(xs)) / median(xs)


def writer_verdict(writer: dict[str, Any]) -> dict[str, Any]:
    runs = writer["runs"]
    slow = {v: overhead(runs, v, NO_WRITE, "loop_s")[0] for v in (THREAD_WRITE, PROCESS_WRITE)}
    noise = spread_pct([r["loop_s"] for r in runs[NO_WRITE]])
    gap = slow[THREAD_WRITE] - slow[PROCESS_WRITE]
    better, worse = (PROCESS_WRITE, THREAD_WRITE) if gap > 0 else (THREAD_WRITE, PROCESS_WRITE)
    # Decisive only if every run (of at least 3) of the better one beat every run of the other, by
    # more than the no-write runs' own spread.
    apart = min(r["loop_s"] for r in runs[worse]) > max(r["loop_s"] for r in runs[better])
    decisive = apart and abs(gap) >= noise and len(runs[NO_WRITE]) >= 3
    if decisive:
        choice = f"the {better} disturbs training less: {abs(gap):.1f} points less slowdown"
    else:
        choice = (
            f"no decisive difference: the {better} slowed training {abs(gap):.1f} points less "
            "by medians, but "
            + ("the runs of the two overlap" if not apart else "within the noise or too few runs")
            + f" (no-write runs' spread {noise:.1f}%)"
        )
    return {
        "slowdown_pct": slow,
        "baseline_spread_pct": noise,
        "decisive": decisive,
        "verdict": choice,
    }


# -- reporting ------------------------------------------------------------------------------------


def save_rows(save: dict[str, Any]) -> list[tuple[str, list[float], str]]:
    t, notes = save["times_s"], save["notes"]
    rows = []
    for name in (RAW_BUFFER, RAW_TENSORS, RAW_READ, MEMCPY):
        rows.append((name, t[name], notes[name]))
    rows.append(
        (
            f"{DCP_ASYNC}: blocking",
            t[f"{DCP_ASYNC} / {BLOCKING}"],
            "get_state_dict + async_save() until it returns",
        )
    )
    rows.append(
        (f"{DCP_ASYNC}: total", t[DCP_ASYNC], notes[DCP_ASYNC] + "; until result(), then fsync dir")
    )
    for name in (CP_FIRST, CP_ASYNC):
        rows.append(
            (
                f"{name}: blocking",
                t[f"{name} / {BLOCKING}"],
                f"save() until it returns; {notes[name]}",
            )
        )
        rows.append((f"{name}: persist", t[f"{name} / {PERSIST}"], "total - blocking"))
        rows.append(
            (
                f"{name}: writer persist_s",
                t[f"{name} / {WRITER_PERSIST}"],
                "manager.last_commit.persist_s",
            )
        )
        rows.append((f"{name}: total", t[name], "until wait() returns"))
    rows.append((CP_SYNC, t[CP_SYNC], notes[CP_SYNC]))
    return rows


def limit_text(limit: float | None) -> str:
    return "-" if limit is None else f"<= {limit:.2f}x"


def yes_no(met: bool | None) -> str:
    return "-" if met is None else ("**yes**" if met else "**no**")


def markdown(out: dict[str, Any]) -> str:
    parts = [environment_lines(out)]
    if "save" in out:
        save = out["save"]
        shape = save["shape"]
        parts.append(
            f"**Save**: `TinyLM(vocab={shape['vocab']}, d_model={shape['d_model']}, "
            f"layers={shape['layers']})` + AdamW after one step: {save['tensors']} tensors, "
            f"{save['state_bytes'] / MB:.1f} MB. Medians of {out['repeats']} repeats "
            f"(+{out['warmup']} warm-up), methods interleaved round-robin, page cache dropped "
            "before each method when permitted.\n\n"
            "| measurement | median s | min s | GB/s | notes |\n|---|---:|---:|---:|---|\n"
            + "\n".join(
                f"| {name} | {median(xs):.3f} | {min(xs):.3f} | {save['state_bytes'] / median(xs) / 1e9:.2f} | {note} |"
                for name, xs, note in save_rows(save)
            )
        )
        parts.append(
            "**Targets (save)**: *ratio* of the medians; *paired*: median over rounds of the "
            "ratio within each round.\n\n| target | ratio | paired | limit | met |\n|---|---:|---:|---:|---|\n"
            + "\n".join(
                f"| {r['target']} | {r['ratio']:.2f}x | {r['paired']:.2f}x | "
                f"{limit_text(r['limit'])} | {yes_no(r['met'])} |"
                for r in out["save_targets"]
            )
        )
        dcp_info = save["dcp"]
        parts.append(
            f"DCP `async_save` in torch {torch.__version__}: default `async_checkpointer_type` = "
            f"`{dcp_info['async_checkpointer_type']}`; {dcp_info['staging']}. "
            f"`FileSystemWriter(cache_staged_state_dict=True)` (reused pinned buffers) "
            f"{dcp_info['cache_staged_state_dict=True']}.\n\n"
            f"Snapshot isolation check: {save['isolation_check']}."
        )
    if "train" in out:
        parts.append(train_markdown(out["train"]))
    if "writer" in out:
        parts.append(writer_markdown(out["writer"]))
    return "\n\n".join(parts)


def train_markdown(train: dict[str, Any]) -> str:
    runs = train["runs"]
    lines = [
        f"**Training**: {train['config']}, {train['steps']} steps per run "
        f"({train['calibrated_step_s'] * 1000:.0f} ms/step at calibration), a checkpoint every "
        f"{train['every']} steps ({train['every'] * train['calibrated_step_s']:.1f} s), "
        f"{train['state_bytes'] / MB:.1f} MB of tensors per checkpoint. Medians of "
        f"{len(runs[NO_CKPT])} runs per variant, interleaved. Wall = training loop + `close()`. "
        "1-min load average after each run: "
        f"{load_range(runs)}.",
        "",
        "| variant | wall s (median) | min s | steps/s | added wall (medians) | added (paired) | saves/run | blocking per save, median ms (first save) | MB written per save | others' CPU, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in (NO_CKPT, SYNC_CKPT, ASYNC_CKPT):
        rs = runs[variant]
        wall = [r["wall_s"] for r in rs]
        if variant == NO_CKPT:
            added, paired, saves, block, written = "-", "-", "0", "-", "-"
        else:
            a, p = overhead(runs, variant, NO_CKPT, "wall_s")
            added, paired = f"{a:+.1f}%", f"{p:+.1f}%"
            saves = f"{median([r['saves'] for r in rs]):.0f}"
            later = [b for r in rs for b in r["blocking_s"][1:]]
            first = [r["blocking_s"][0] for r in rs if r["blocking_s"]]
            block = f"{1000 * median(later or first):.0f} ({1000 * median(first):.0f})"
            written = f"{median([r['bytes_per_save'] for r in rs]) / MB:.1f}"
        lines.append(
            f"| {variant} | {median(wall):.2f} | {min(wall):.2f} | "
            f"{train['steps'] / median(wall):.2f} | {added} | {paired} | {saves} | {block} | {written} | "
            f"{median([r['other_cpu_cores'] for r in rs]):.2f} |"
        )
    a, _ = overhead(runs, ASYNC_CKPT, NO_CKPT, "wall_s")
    lines += [
        "",
        OTHERS_NOTE,
        "",
        f"Target: async adds <= {MAX_TRAIN_OVERHEAD_PCT:.0f}% wall time: {a:+.1f}% -> "
        f"{yes_no(a <= MAX_TRAIN_OVERHEAD_PCT)}; run-to-run spread of the no-checkpoint runs "
        f"{spread_pct([r['wall_s'] for r in runs[NO_CKPT]]):.1f}%.",
    ]
    return "\n".join(lines)


def writer_markdown(writer: dict[str, Any]) -> str:
    runs = writer["runs"]
    lines = [
        f"**Writer thread vs writer process**: same model, {writer['steps']} steps per run "
        f"({writer['calibrated_step_s'] * 1000:.0f} ms/step at calibration); every "
        f"{writer['every']} steps, if none is in flight, a background `write_shard` of the "
        f"{writer['write_bytes'] / MB:.1f} MB training state (staged once in shared memory) to a "
        f"file + fsync. Medians of {len(runs[NO_WRITE])} runs per variant, interleaved. 1-min load "
        f"average after each run: {load_range(runs)}.",
        "",
        "| variant | loop s (median) | steps/s | slowdown (medians) | slowdown (paired) | steps/s during writes | writes/run | write s (median) | write GB/s | others' CPU, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in (NO_WRITE, THREAD_WRITE, PROCESS_WRITE):
        rs = runs[variant]
        loop = median([r["loop_s"] for r in rs])
        if variant == NO_WRITE:
            slow = paired = during = nwrites = wsecs = gbps = "-"
        else:
            s, p = overhead(runs, variant, NO_WRITE, "loop_s")
            slow, paired = f"{s:+.1f}%", f"{p:+.1f}%"
            during = f"{median([r['steps_per_s_during_writes'] or 0.0 for r in rs]):.2f}"
            nwrites = f"{median([r['writes'] for r in rs]):.0f}"
            all_writes = [w for r in rs for w in r["write_s"]]
            wsecs = f"{median(all_writes):.3f}"
            gbps = f"{writer['write_bytes'] / median(all_writes) / 1e9:.2f}"
        lines.append(
            f"| {variant} | {loop:.2f} | {writer['steps'] / loop:.2f} | {slow} | {paired} | "
            f"{during} | {nwrites} | {wsecs} | {gbps} | "
            f"{median([r['other_cpu_cores'] for r in rs]):.2f} |"
        )
    lines += ["", f"Verdict: {writer['verdict']['verdict']}.", "", OTHERS_NOTE]
    return "\n".join(lines)


def git_state() -> str:
    """The commit measured, and whether src/ differs from it (others may be editing it)."""
    repo = str(Path(__file__).resolve().parent.parent)

    def git(*cmd: str) -> str:
        try:
            done = subprocess.run(["git", "-C", repo, *cmd], capture_output=True, text=True)
        except OSError:
            return ""
        return done.stdout.rstrip()

    head = git("rev-parse", "--short", "HEAD") or "?"
    dirty = git("status", "--porcelain", "--", "src")
    files = ", ".join(line[3:] for line in dirty.splitlines())
    return f"{head}" + (f" with uncommitted changes in {files}" if files else ", src/ unmodified")


def environment_lines(out: dict[str, Any]) -> str:
    env = out["environment"]
    return (
        f"Machine: {env['nproc']} CPUs, {env['ram_gib']} GiB RAM; Python {env['python']}, torch "
        f"{env['torch']} ({out['torch_threads']} intra-op threads), crashproof {env['crashproof']}; "
        f"scratch on {env['device']} ({env['fstype']}). Page cache: {env['page_cache']}. "
        f"Load average (1, 5, 15 min) at start {out['loadavg_start']}, at end {out['loadavg_end']}. "
        f"crashproof at git {out['git']}."
    )


def to_json(out: dict[str, Any]) -> str:
    def default(obj: object) -> Any:
        return str(obj)

    return json.dumps(out, indent=2, default=default)


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--size-mb", type=float, default=1000, help="state bytes of the save section")
    p.add_argument("--repeats", type=int, default=5, help="counted repeats of the save section")
    p.add_argument("--warmup", type=int, default=1, help="uncounted warm-up rounds (save section)")
    p.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR / "async", help="scratch dir on the disk to test"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--train-repeats", type=int, default=3, help="runs per variant (sections 2, 3)")
    p.add_argument(
        "--train-seconds", type=float, default=30, help="target seconds per training run"
    )
    p.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="steps per training run (0: from --train-seconds)",
    )
    p.add_argument(
        "--ckpt-seconds", type=float, default=6, help="target seconds between checkpoints"
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=0,
        help="steps between checkpoints (0: from --ckpt-seconds)",
    )
    p.add_argument("--train-d-model", type=int, default=512)
    p.add_argument("--train-layers", type=int, default=4)
    p.add_argument("--train-vocab", type=int, default=8192)
    p.add_argument("--train-batch", type=int, default=2)
    p.add_argument("--train-seq", type=int, default=64)
    p.add_argument("--writer-seconds", type=float, default=12, help="target seconds per writer run")
    p.add_argument(
        "--writer-interval-s",
        type=float,
        default=1.0,
        help="training seconds between background writes",
    )
    p.add_argument("--no-save", action="store_true", help="skip section 1 (save)")
    p.add_argument("--no-train", action="store_true", help="skip section 2 (training)")
    p.add_argument("--no-writer", action="store_true", help="skip section 3 (thread vs process)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.size_mb <= 0 or args.train_repeats < 1:
        p.error("--repeats and --train-repeats must be >= 1, --warmup >= 0 and --size-mb > 0")
    return args


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"loadavg_start": loadavg(), "argv": sys.argv}
    cache_dropped = drop_page_cache()
    out["environment"] = environment(work, cache_dropped)
    out["torch_threads"] = torch.get_num_threads()
    out["git"] = git_state()
    if out["environment"]["fstype"] in ("tmpfs", "ramfs"):
        log(f"WARNING: {work} is on {out['environment']['fstype']}: this measures RAM, not a disk")
    out["repeats"], out["warmup"] = args.repeats, args.warmup
    started = time.perf_counter()
    if not args.no_save:
        out["save"] = save_section(args, work)
        out["save_targets"] = save_targets(out["save"])
        gc.collect()
    config = TrainConfig(
        Shape(args.train_vocab, args.train_d_model, args.train_layers),
        args.train_batch,
        args.train_seq,
    )
    step_s = calibrate(config) if not (args.no_train and args.no_writer) else 0.0
    if not args.no_train:
        out["train"] = train_section(args, work, config, step_s)
        out["train"]["config"] = (
            f"`TinyLM({config.shape})` (embedding N(0, 0.02)), batch {config.batch} x "
            f"{config.seq} tokens"
        )
    if not args.no_writer:
        out["writer"] = writer_section(args, work, config, step_s)
        out["writer"]["verdict"] = writer_verdict(out["writer"])
    out["loadavg_end"] = loadavg()
    out["elapsed_s"] = time.perf_counter() - started
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = args.dir.resolve()
    created = [d for d in (base, *base.parents) if not d.exists()]  # removed again if empty
    work = base / f"run-{os.getpid()}"
    work.mkdir(parents=True)
    try:
        out = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for d in created:  # innermost first
            with contextlib.suppress(OSError):
                d.rmdir()
    if args.json:
        print(to_json(out))
    if args.markdown or not args.json:
        print(markdown(out))
    log(f"done in {out['elapsed_s']:.0f} s; load average {out['loadavg_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
