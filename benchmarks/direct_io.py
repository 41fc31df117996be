"""Would writing checkpoints past the page cache (``O_DIRECT``) help a training beside them?

A buffered write copies every byte into the page cache, and the kernel's writeback then works
through those pages: CPU time a training beside a background save does not get back. This script
writes the same bytes three ways while a compute loop (NumPy matrix products on one thread, a
stand-in for training) runs beside the writer, and reports each write's wall time, the writer
thread's CPU time, and the compute loop's speed during the write against its speed alone:

1. **buffered**: ``os.write`` of 16 MiB chunks, then ``fsync`` (what crashproof does);
2. **direct, from aligned memory**: the same from a page-aligned buffer through an ``O_DIRECT``
   descriptor (the best case: the data already where ``O_DIRECT`` needs it);
3. **direct, through a bounce buffer**: unaligned data copied into one page-aligned 8 MiB buffer,
   written ``O_DIRECT``, and again (what a writer must do when tensors are not laid out at
   aligned file offsets, as crashproof's shards are not).

Medians of ``--repeats`` rounds, the three in rotated order within each round.

    .venv/bin/python benchmarks/direct_io.py --size-mb 1024 --repeats 3 --markdown
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".bench-tmp" / "direct_io"
CHUNK = 16 * 1024 * 1024
BOUNCE = 8 * 1024 * 1024


def write(path: Path, data: memoryview, *, direct: bool = False) -> None:
    """``data`` to ``path`` in 16 MiB writes, then ``fsync``; through ``O_DIRECT`` if ``direct``
    (then ``data`` must be page-aligned)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        for start in range(0, len(data), CHUNK):
            os.write(fd, data[start : start + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bounced(path: Path, data: memoryview) -> None:
    bounce = mmap.mmap(-1, BOUNCE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        view = memoryview(bounce)
        for start in range(0, len(data), BOUNCE):
            piece = data[start : start + BOUNCE]
            view[: len(piece)] = piece
            os.write(fd, view[: len(piece)])
        view.release()
        os.fsync(fd)
    finally:
        os.close(fd)
        bounce.close()


class Compute:
    """Matrix products on one thread, counted."""

    def __init__(self) -> None:
        self.count, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        a = np.random.default_rng(0).random((256, 256))
        while not self._stop.is_set():
            a = a @ a
            a /= a.max()
            self.count += 1

    def __enter__(self) -> Compute:
        self._thread.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def compute_alone(seconds: float) -> float:
    with Compute() as compute:
        before, started = compute.count, time.perf_counter()
        time.sleep(seconds)
        return (compute.count - before) / (time.perf_counter() - started)


def measure(args: argparse.Namespace) -> dict[str, object]:
    size = args.size_mb * 1024 * 1024
    aligned = mmap.mmap(-1, size)
    np.frombuffer(aligned, np.uint8)[:] = np.random.default_rng(1).integers(
        0, 256, size, dtype=np.uint8
    )
    unaligned_store = bytearray(size + 1)
    unaligned = memoryview(unaligned_store)[1:]  # off any page boundary
    unaligned[:] = memoryview(aligned)
    methods = {
        "buffered": lambda p: write(p, unaligned),
        "direct, from aligned memory": lambda p: write(p, memoryview(aligned), direct=True),
        "direct, through a bounce buffer": lambda p: write_bounced(p, unaligned),
    }
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "file.bin"
    alone = compute_alone(3.0)
    rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
    names = list(methods)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            with Compute() as compute:
                before, cpu0, started = compute.count, time.thread_time(), time.perf_counter()
                methods[name](path)
                wall, cpu = time.perf_counter() - started, time.thread_time() - cpu0
                rate = (compute.count - before) / wall
            path.unlink()
            rows[name].append((wall, cpu, rate / alone))
    return {
        "size_mb": args.size_mb,
        "compute_alone_per_s": alone,
        "methods": {
            name: {
                "wall_s": statistics.median(r[0] for r in runs),
                "writer_cpu_s": statistics.median(r[1] for r in runs),
                "compute_speed": statistics.median(r[2] for r in runs),
            }
            for name, runs in rows.items()
        },
    }


def markdown(result: dict[str, object]) -> str:
    methods = result["methods"]
    assert isinstance(methods, dict)
    size = result["size_mb"]
    assert isinstance(size, int)
    lines = [
        "| write | wall s | GB/s | writer CPU s | compute speed during the write (alone = 1.0) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        gbps = size * 1024 * 1024 / m["wall_s"] / 1e9
        lines.append(
            f"| {name} | {m['wall_s']:.2f} | {gbps:.2f} | {m['writer_cpu_s']:.2f} "
            f"| {m['compute_speed']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="scratch dir on the disk to test")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    if not hasattr(os, "O_DIRECT"):
        print("this platform has no O_DIRECT", file=sys.stderr)
        return 2
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    if args.markdown or not args.json:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
