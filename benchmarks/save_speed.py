"""How fast does crashproof save and restore, next to the disk itself and the usual alternatives?

The project's target is a synchronous crashproof save at >= 0.9x the throughput of the raw disk
(one file written with ``os.write`` and fsynced). A checkpoint is only worth as much as its
durability, so every method here ends with its bytes on stable storage (file and directory
fsync), and every method writes the *same* state: a small transformer-like ``nn.Module`` plus the
``torch.optim.AdamW`` state after one real step, scaled to ``--size-mb`` bytes in total.

Save (each repeat deletes the previous output, then ``os.sync()`` and drops the page cache):

* raw write + fsync, the floor: the same bytes with ``os.write`` in 16 MiB chunks to one file,
  fsync, close, fsync the directory; once from one preallocated buffer (the tensors concatenated)
  and once straight from the live tensors. Ratios use the faster of the two by median: on a noisy
  VM either can come out slower, and a slow floor would flatter every method measured against it;
* memcpy: every tensor copied into a preallocated buffer (what no disk is involved costs);
* ``torch.save`` into an open file, flush, fsync; ``safetensors.torch.save_file`` + fsync;
* ``torch.distributed.checkpoint.save`` (DCP, one process, ``sync_files=True``);
* ``crashproof.CheckpointManager(async_save=False).save``.

Restore (the page cache is dropped before every repeat when the kernel allows it): raw read of
the raw file into a preallocated buffer, ``torch.load``, ``safetensors.torch.load_file``, DCP load
and ``CheckpointManager.restore``, each into a fresh, identical model and optimizer.

Methods run round-robin (one repeat of each, then the next repeat) so that a disk whose speed
drifts affects all of them alike; the first round is a warm-up and is not counted. ``--profile``
adds a breakdown of where a crashproof save spends its time.

Run from the repository root::

    .venv/bin/python benchmarks/save_speed.py --size-mb 1000 --repeats 5 --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path
from typing import Any
from unittest import mock

import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save_state

import crashproof
from crashproof.checkpoint.root._lock_file import LOCK_NAME

MB = 1_000_000
GB = 1_000_000_000
# 16 MiB per os.write/preadv: on the test VM 1-16 MiB chunks were equally fast and 64-256 MiB
# chunks slower, so the floor uses the fast size (crashproof's shard writer uses 16 MiB too).
IO_CHUNK = 16 * 1024 * 1024
REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".bench-tmp"
RAW_BUFFER = "raw write + fsync, one buffer"
RAW_TENSORS = "raw write + fsync, from tensors"
RAW_READ = "raw read"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the state -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    vocab: int
    d_model: int
    layers: int

    @property
    def heads(self) -> int:
        return max(1, self.d_model // 64)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class TinyLM(nn.Module):
    """Embedding, blocks, final norm; the output head is tied to the embedding."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape.d_model, shape.heads) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.embed.weight)


# fp32 parameter + AdamW's exp_avg and exp_avg_sq; the per-tensor `step` scalars are negligible.
_BYTES_PER_PARAM = 12


def choose_shape(target_bytes: int) -> Shape:
    """A width giving several layers, a vocabulary holding <= 40% of the bytes, layers for the rest."""
    for d in (1024, 768, 512, 384, 256, 192, 128, 64):
        layer_bytes = _BYTES_PER_PARAM * (12 * d * d + 13 * d)
        if layer_bytes <= target_bytes / 8:
            break
    vocab = max(256, min(32_000, int(0.4 * target_bytes / (_BYTES_PER_PARAM * d))))
    rest = target_bytes - _BYTES_PER_PARAM * (vocab * d + 2 * d)
    return Shape(vocab=vocab, d_model=d, layers=max(1, round(rest / layer_bytes)))


def new_model(shape: Shape, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM(shape)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def trained_state(shape: Shape, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and its AdamW after ``steps`` real steps of next-token prediction, so exp_avg,
    exp_avg_sq and step exist and hold real values. The embedding starts N(0, 0.02), as language
    models do: with N(0, 1) the tied head saturated the softmax, the loss was exactly 0 and every
    moment was 0, which flatters anything that depends on content."""
    model, optimizer = new_model(shape, seed=0)
    with torch.no_grad():
        model.embed.weight.normal_(0.0, 0.02)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(shape.vocab, (1, 17), generator=generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    if not any(bool(m.any()) for m in moments):
        raise RuntimeError("the benchmark state has all-zero AdamW moments: not a real state")
    return model, optimizer


def flat_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the optimizer under a unique flat name (for safetensors)."""
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for param_id, param_state in optimizer.state_dict()["state"].items():
        flat.update({f"optim.{param_id}.{k}": v for k, v in param_state.items()})
    return flat


def load_flat(
    flat: dict[str, torch.Tensor], model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """The inverse of :func:`flat_state`, into a fresh model and optimizer."""
    model.load_state_dict({k[6:]: v for k, v in flat.items() if k.startswith("model.")})
    state: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in flat.items():
        if key.startswith("optim."):
            _, param_id, name = key.split(".", 2)
            state[int(param_id)][name] = value
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": dict(state), "param_groups": groups})


def assert_same_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, expected: dict[str, torch.Tensor]
) -> None:
    got = flat_state(model, optimizer)
    if got.keys() != expected.keys():
        raise AssertionError(f"restored keys differ: {sorted(got.keys() ^ expected.keys())[:5]}")
    bad = [k for k in expected if not torch.equal(got[k], expected[k])]
    if bad:
        raise AssertionError(f"restored tensors differ from the saved ones: {bad[:5]}")


# -- durability and cache helpers ----------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory entry is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False where the kernel does not allow it."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# -- the timing helper ---------------------------------------------------------------------------


@dataclass
class Method:
    """One contender: ``prepare`` (untimed), ``run`` (timed), ``check`` (untimed, optional).

    ``run`` may return a mapping of named parts of its time in seconds (say, the part of an
    asynchronous save that blocks the caller); each is recorded as a series of its own, named
    ``"<name> / <part>"``. Any other return value is ignored.
    """

    name: str
    run: Callable[[], object]
    prepare: Callable[[], object] = lambda: None
    check: Callable[[], object] = lambda: None
    note: str = ""


def time_round_robin(
    methods: list[Method], repeats: int, warmup: int, settle: Callable[[], object]
) -> dict[str, list[float]]:
    """Seconds of each method's ``run``: ``warmup`` uncounted rounds, then ``repeats`` rounds.

    In every round each method is prepared, the system settled (``settle``: sync and drop the page
    cache), the method timed, then checked. Parts that ``run`` reports (see :class:`Method`) are
    recorded next to the methods' own times.
    """
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    for round_no in range(warmup + repeats):
        label = "warm-up" if round_no < warmup else f"repeat {round_no - warmup + 1}/{repeats}"
        for method in methods:
            method.prepare()
            settle()
            started = time.perf_counter()
            returned = method.run()
            elapsed = time.perf_counter() - started
            method.check()
            parts = dict(returned) if isinstance(returned, Mapping) else {}
            detail = "".join(f", {part} {secs:.3f} s" for part, secs in parts.items())
            log(f"  [{label}] {method.name}: {elapsed:.3f} s{detail}")
            if round_no >= warmup:
                times[method.name].append(elapsed)
                for part, secs in parts.items():
                    times.setdefault(f"{method.name} / {part}", []).append(float(secs))
    return times


@dataclass
class Result:
    name: str
    times: list[float]
    nbytes: int
    floor: str
    floor_times: list[float]
    note: str = ""
    median: float = field(init=False)
    best: float = field(init=False)

    def __post_init__(self) -> None:
        self.median = statistics.median(self.times)
        self.best = min(self.times)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median / GB

    @property
    def ratio(self) -> float:
        """Throughput relative to the floor: floor time / this method's time (medians)."""
        return statistics.median(self.floor_times) / self.median

    @property
    def paired_ratio(self) -> float:
        """Median over rounds of floor time / this time in the same round (robust to drift)."""
        return statistics.median(f / t for f, t in zip(self.floor_times, self.times, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "floor": self.floor,
            "times_s": self.times,
            "median_s": self.median,
            "min_s": self.best,
            "gb_per_s": self.gbps,
            "ratio_to_floor": self.ratio,
            "paired_ratio_to_floor": self.paired_ratio,
            "note": self.note,
        }


def results(
    methods: list[Method], times: dict[str, list[float]], nbytes: int, floors: list[str]
) -> list[Result]:
    """Results against the fastest (by median) of ``floors``, so a slow floor flatters nothing."""
    floor = min(floors, key=lambda name: statistics.median(times[name]))
    return [Result(m.name, times[m.name], nbytes, floor, times[floor], m.note) for m in methods]


# -- save methods --------------------------------------------------------------------------------


def byte_views(tensors: Iterable[torch.Tensor]) -> list[memoryview]:
    """The bytes of contiguous CPU tensors, without a copy."""
    return [t.reshape(-1).view(torch.uint8).numpy().data.cast("B") for t in tensors]


def raw_write(path: Path, bufs: Sequence[memoryview]) -> tuple[float, float]:
    """Write ``bufs`` back to back to a new file in large chunks, fsync, close, fsync the directory.

    Returns the seconds spent writing (into the page cache) and flushing (fsyncs and close).
    """
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for view in bufs:
            while view:
                view = view[os.write(fd, view[:IO_CHUNK]) :]
        written = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent)
    return written - started, time.perf_counter() - written


def torch_save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(path.parent)


def safetensors_save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    safetensors.torch.save_file(flat_state(model, optimizer), str(path))
    fsync_path(path)
    fsync_path(path.parent)


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def dcp_save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp_save_state(dcp_state(model, optimizer), storage_writer=FileSystemWriter(str(path)))
    fsync_path(path)
    fsync_path(path.parent)


def memcpy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def raw_write_floors(
    buffer_file: Path, buffer: memoryview, tensors_file: Path, tensor_views: list[memoryview]
) -> list[Method]:
    """The disk's own speed: the same bytes from one buffer, and straight from the tensors."""
    return [
        Method(
            RAW_BUFFER,
            lambda: raw_write(buffer_file, [buffer]),
            lambda: remove(buffer_file),
            note="one preallocated buffer; os.write 16 MiB chunks, fsync file + dir",
        ),
        Method(
            RAW_TENSORS,
            lambda: raw_write(tensors_file, tensor_views),
            lambda: remove(tensors_file),
            note="the same bytes straight from the live tensors, one file, same chunks and fsyncs",
        ),
    ]


def save_methods(
    work: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    raw: memoryview,
    manager: crashproof.CheckpointManager,
) -> list[Method]:
    """The save contenders; each writes into its own directory under ``work``."""
    out = {name: work / name for name in ("raw", "torch", "safetensors", "dcp", "crashproof")}
    for d in out.values():
        d.mkdir(parents=True, exist_ok=True)
    raw_file, raw_file2 = out["raw"] / "state.bin", out["raw"] / "from-tensors.bin"
    torch_file = out["torch"] / "state.pt"
    st_file = out["safetensors"] / "state.safetensors"
    dcp_dir = out["dcp"] / "ckpt"
    state = crashproof.TrainState(model=model, optimizer=optimizer)
    steps = itertools.count(1)
    live = list(flat_state(model, optimizer).values())
    live_bytes = byte_views(live)
    pairs = [(torch.zeros_like(t), t) for t in live]

    def clear_crashproof() -> None:
        for entry in out["crashproof"].iterdir():
            if entry.name != LOCK_NAME:  # the open manager's lock on its root stays
                remove(entry)

    return [
        *raw_write_floors(raw_file, raw, raw_file2, live_bytes),
        Method("memcpy (reference)", lambda: memcpy(pairs), note="tensor.copy_ into preallocated"),
        Method(
            "torch.save",
            lambda: torch_save(torch_file, model, optimizer),
            lambda: remove(torch_file),
            note="into open file, flush, fsync file + dir",
        ),
        Method(
            "safetensors save_file",
            lambda: safetensors_save(st_file, model, optimizer),
            lambda: remove(st_file),
            note="flat dict, then fsync file + dir",
        ),
        Method(
            "DCP save",
            lambda: dcp_save(dcp_dir, model, optimizer),
            lambda: remove(dcp_dir),
            note="FileSystemWriter(sync_files=True), then fsync dir",
        ),
        Method(
            "crashproof save (sync)",
            lambda: manager.save(next(steps), state),
            clear_crashproof,
            note="xxh3 while writing, 3 files + 2 dir fsyncs, rename",
        ),
    ]


# -- restore methods -----------------------------------------------------------------------------


def raw_read(path: Path, buf: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < len(buf):
            got = os.preadv(fd, [buf[pos : pos + IO_CHUNK]], pos)
            if got == 0:
                raise EOFError(f"{path} is shorter than {len(buf)} bytes")
            pos += got
    finally:
        os.close(fd)


def torch_restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])


def safetensors_restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    load_flat(safetensors.torch.load_file(str(path)), model, optimizer)


def dcp_restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        state = dcp_state(model, optimizer)  # allocates the optimizer state DCP loads into
        dcp_load(state, storage_reader=FileSystemReader(str(path)))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def crashproof_restore(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with crashproof.CheckpointManager(str(root)) as manager:
        if manager.restore(crashproof.TrainState(model=model, optimizer=optimizer)) == 0:
            raise RuntimeError(f"crashproof found no checkpoint in {root}")


class FreshTarget:
    """A fresh model and optimizer, rebuilt (untimed) before each restore and checked after it."""

    def __init__(self, shape: Shape, expected: dict[str, torch.Tensor]) -> None:
        self.shape, self.expected = shape, expected
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def rebuild(self) -> None:
        self.model = self.optimizer = None
        gc.collect()
        self.model, self.optimizer = new_model(self.shape, seed=1)

    def method(
        self,
        name: str,
        fn: Callable[[Path, nn.Module, torch.optim.Optimizer], None],
        path: Path,
        note: str = "",
    ) -> Method:
        """A restore of ``path`` with ``fn`` into this target, rebuilt before and checked after."""

        def run() -> None:
            assert self.model is not None and self.optimizer is not None
            fn(path, self.model, self.optimizer)

        def check() -> None:
            assert self.model is not None and self.optimizer is not None
            assert_same_state(self.model, self.optimizer, self.expected)

        return Method(name, run, self.rebuild, check, f"into a fresh model + AdamW{note}")


def restore_methods(work: Path, shape: Shape, expected: dict[str, torch.Tensor]) -> list[Method]:
    read_buf = torch.zeros(sum(t.nbytes for t in expected.values()), dtype=torch.uint8)
    view = read_buf.numpy().data.cast("B")
    target = FreshTarget(shape, expected)
    return [
        Method(
            RAW_READ,
            lambda: raw_read(work / "raw" / "state.bin", view),
            note="preadv 16 MiB chunks",
        ),
        target.method("torch.load", torch_restore, work / "torch" / "state.pt"),
        target.method(
            "safetensors load_file", safetensors_restore, work / "safetensors" / "state.safetensors"
        ),
        target.method(
            "DCP load",
            dcp_restore,
            work / "dcp" / "ckpt",
            "; includes get_state_dict, which runs a zero-grad AdamW step to allocate the "
            "optimizer state DCP loads into",
        ),
        target.method(
            "crashproof restore",
            crashproof_restore,
            work / "crashproof",
            "; verifies every byte's xxh3 checksum",
        ),
    ]


# -- profile of a crashproof save ----------------------------------------------------------------


class PhaseTimer:
    """Wall time of wrapped calls, keyed by their nesting on each thread ("persist/shard/...")."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._lock = threading.Lock()

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack: list[str] = self._local.__dict__.setdefault("stack", [])
            stack.append(label)
            key = "/".join(stack)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                stack.pop()
                with self._lock:
                    self.totals[key] += elapsed

        return timed

    @contextlib.contextmanager
    def patched(self, targets: list[tuple[Any, str, str]]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for owner, attr, label in targets:
                wrapped = self.wrap(label, getattr(owner, attr))
                stack.enter_context(mock.patch.object(owner, attr, wrapped))
            yield


def _crashproof_phases() -> list[tuple[Any, str, str]]:
    """Where to time a save. Private internals: this is a profile, not an API (adjust as needed)."""
    from crashproof.checkpoint import _retention_runner, _save_pipeline
    from crashproof.checkpoint.format import _shard_file
    from crashproof.checkpoint.save import _writer
    from crashproof.storage import _local

    return [
        (_save_pipeline, "take_snapshot", "snapshot (capture + encode tree)"),
        (_save_pipeline, "persist", "persist"),
        (_retention_runner.RetentionRunner, "apply", "retention"),
        (_writer, "write_shard", "shard file"),
        (_writer, "dumps", "JSON encode (index, manifest)"),
        (_writer, "write_all", "small file (index, manifest)"),
        (_shard_file, "_header", "safetensors header"),
        (_local._LocalWriteStream, "write", "os.write"),
        (_local._LocalWriteStream, "commit", "fsync + close"),
        (_local.LocalStorage, "publish", "publish"),
        (_local, "_fsync_dir", "fsync dir"),
    ]


def profile_crashproof(
    work: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    repeats: int,
) -> dict[str, Any]:
    """Instrumented crashproof saves, each after a raw write (from the tensors) of the same bytes."""
    root, raw_file = work / "profile-crashproof", work / "profile-raw.bin"
    state = crashproof.TrainState(model=model, optimizer=optimizer)
    timer = PhaseTimer()
    raw = byte_views(flat_state(model, optimizer).values())
    raw_split: list[tuple[float, float]] = []
    saves: list[float] = []
    with crashproof.CheckpointManager(
        str(root), keep=crashproof.KeepLast(1), async_save=False
    ) as manager:
        for step in range(1, repeats + 1):
            remove(raw_file)
            drop_page_cache()
            raw_split.append(raw_write(raw_file, raw))
            for entry in root.iterdir():
                remove(entry)
            drop_page_cache()
            with timer.patched(_crashproof_phases()):
                started = time.perf_counter()
                manager.save(step, state)
                saves.append(time.perf_counter() - started)
    remove(raw_file)
    remove(root)
    return {
        "save_s": statistics.mean(saves),
        "phases_s": {k: v / repeats for k, v in sorted(timer.totals.items())},
        "raw_write_s": statistics.mean(w for w, _ in raw_split),
        "raw_fsync_s": statistics.mean(f for _, f in raw_split),
        "paired_ratio": statistics.median(
            (w + f) / s for (w, f), s in zip(raw_split, saves, strict=True)
        ),
    }


# -- environment and reporting -------------------------------------------------------------------


def _command_output(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def filesystem_of(path: Path) -> tuple[str, str]:
    """(device, fs type) of the mount holding ``path``, from /proc/mounts."""
    best = ("?", "?", "")
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            device, mount, fstype = line.split()[:3]
            inside = str(path).startswith(mount.rstrip("/") + "/") or str(path) == mount
            if inside and len(mount) >= len(best[2]):
                best = (device, fstype, mount)
    return best[0], best[1]


def environment(work: Path, cache_dropped: bool) -> dict[str, Any]:
    device, fstype = filesystem_of(work.resolve())
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "crashproof": crashproof.__version__,
        "nproc": os.cpu_count(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "dir": str(work),
        "device": device,
        "fstype": fstype,
        "df": _command_output("df", "-h", str(work)),
        "lsblk": _command_output("lsblk", "-d", "-o", "NAME,SIZE,ROTA,TYPE,MODEL"),
        "page_cache": "dropped (echo 3 > /proc/sys/vm/drop_caches) before every repeat"
        if cache_dropped
        else "NOT dropped (not permitted): reads and writes may be served by RAM",
    }


def state_line(out: dict[str, Any]) -> str:
    shape = out["shape"]
    return (
        f"State: `TinyLM(vocab={shape['vocab']}, d_model={shape['d_model']}, "
        f"layers={shape['layers']})` + AdamW after one step: {out['tensors']} tensors, "
        f"{out['state_bytes'] / MB:.1f} MB. Medians of {out['repeats']} repeats "
        f"(+{out['warmup']} warm-up), methods interleaved round-robin. "
        f"Page cache: {out['environment']['page_cache']}."
    )


def markdown_table(title: str, rows: list[Result]) -> str:
    lines = [
        f"**{title}**: ratios are throughput relative to *{rows[0].floor}*, the fastest floor "
        "by median; *paired* is the median over rounds of the ratio within each round.",
        "",
        "| method | median s | min s | GB/s | ratio | paired | notes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r.name} | {r.median:.3f} | {r.best:.3f} | {r.gbps:.2f} | {r.ratio:.2f}x | {r.paired_ratio:.2f}x | {r.note} |"
        for r in rows
    ]
    return "\n".join(lines)


def text_table(title: str, rows: list[Result]) -> str:
    lines = [
        title,
        f"{'method':<34}{'median s':>10}{'min s':>10}{'GB/s':>8}{'ratio':>8}{'paired':>8}",
    ]
    lines += [
        f"{r.name:<34}{r.median:>10.3f}{r.best:>10.3f}{r.gbps:>8.2f}{r.ratio:>7.2f}x{r.paired_ratio:>7.2f}x"
        for r in rows
    ]
    return "\n".join(lines)


def self_times(phases: dict[str, float]) -> dict[str, float]:
    """Each phase's time less its direct children's ("persist/shard file" less "…/os.write")."""
    own = dict(phases)
    for key, secs in phases.items():
        parent = key.rpartition("/")[0]
        if parent in own:
            own[parent] -= secs
    return own


def profile_table(profile: dict[str, Any]) -> str:
    total = profile["save_s"]
    phases = profile["phases_s"]
    own = self_times(phases)
    lines = [
        f"**Where a crashproof save spends its time** (mean of instrumented saves: {total:.3f} s; "
        f"raw floor in the same rounds: {profile['raw_write_s']:.3f} s os.write + "
        f"{profile['raw_fsync_s']:.3f} s fsync; paired ratio {profile['paired_ratio']:.2f}x)",
        "",
        "| phase (nested: parent/child) | s per save | self s | % of save |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {phase} | {secs:.3f} | {own[phase]:.3f} | {100 * secs / total:.1f}% |"
        for phase, secs in phases.items()
    ]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--size-mb", type=float, default=1000, help="total state bytes (1 MB = 1e6)")
    p.add_argument("--repeats", type=int, default=5, help="counted repeats per method")
    p.add_argument("--warmup", type=int, default=1, help="uncounted warm-up rounds")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="scratch dir on the disk to test")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--no-restore", action="store_true", help="skip the restore section")
    p.add_argument("--profile", action="store_true", help="also break down a crashproof save")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.size_mb <= 0:
        p.error("--repeats must be >= 1, --warmup >= 0 and --size-mb > 0")
    return args


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cache_dropped = drop_page_cache()
    env = environment(work, cache_dropped)
    if env["fstype"] in ("tmpfs", "ramfs"):
        log(f"WARNING: {work} is on {env['fstype']}: this measures RAM, not a disk")
    shape = choose_shape(int(args.size_mb * MB))
    model, optimizer = trained_state(shape)
    expected = {k: v.clone() for k, v in flat_state(model, optimizer).items()}
    nbytes = sum(t.nbytes for t in expected.values())
    raw_tensor = torch.cat([t.reshape(-1).view(torch.uint8) for t in expected.values()])
    raw = raw_tensor.numpy().data.cast("B")
    log(f"state: {shape}, {len(expected)} tensors, {nbytes / MB:.1f} MB; scratch dir {work}")
    out: dict[str, Any] = {"environment": env, "shape": vars(shape), "state_bytes": nbytes}
    out["tensors"] = len(expected)
    out["repeats"], out["warmup"] = args.repeats, args.warmup

    keep = crashproof.KeepLast(1)
    # async_save=False: the manager saves asynchronously by default, and this section measures
    # the synchronous save (the clean-up before each repeat also needs no save in flight).
    with crashproof.CheckpointManager(
        str(work / "crashproof"), keep=keep, async_save=False
    ) as manager:
        methods = save_methods(work, model, optimizer, raw, manager)
        log("save:")
        times = time_round_robin(methods, args.repeats, args.warmup, drop_page_cache)
    out["save"] = results(methods, times, nbytes, [RAW_BUFFER, RAW_TENSORS])
    if not args.no_restore:
        methods = restore_methods(work, shape, expected)
        log("restore:")
        times = time_round_robin(methods, args.repeats, args.warmup, drop_page_cache)
        out["restore"] = results(methods, times, nbytes, [RAW_READ])
    if args.profile:
        log("profile of crashproof save:")
        out["profile"] = profile_crashproof(work, model, optimizer, args.repeats)
    return out


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    present = [
        (title, out[key]) for title, key in (("Save", "save"), ("Restore", "restore")) if key in out
    ]
    if args.json:
        serial = {
            k: ([r.to_json() for r in v] if k in ("save", "restore") else v) for k, v in out.items()
        }
        print(json.dumps(serial, indent=2))
    if args.markdown:
        parts = [state_line(out)]
        parts += [markdown_table(f"{t} ({out['state_bytes'] / MB:.0f} MB)", r) for t, r in present]
        if "profile" in out:
            parts.append(profile_table(out["profile"]))
        print("\n\n".join(parts))
    if not args.json and not args.markdown:
        print("\n\n".join(text_table(t, r) for t, r in present))
    print(f"page cache: {out['environment']['page_cache']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = args.dir.resolve()
    created_base = not base.exists()
    work = base / f"run-{os.getpid()}"
    work.mkdir(parents=True)
    try:
        out = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created_base:
            with contextlib.suppress(OSError):
                base.rmdir()
    report(out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
