"""What coordinating a save and a restore costs as the number of ranks grows.

A save ends with rank 0 gathering every rank's file report (name, size, checksum), merging them
into one manifest and writing it; a restore starts with every rank reading and parsing that
manifest and agreeing in a few small collectives. Two parts:

1. **Measured in one process, up to 32,768 ranks**: building the manifest from W ranks' reports
   (merge, JSON), its size, and parsing it (what each rank does at restore), with crashproof's
   own code (``Manifest``, ``dumps``, ``parse_manifest``); medians of ``--repeats``.
2. **Measured with real processes, 1 to ``--max-procs`` ranks (gloo on loopback)**: the
   collectives a save and a restore use, through crashproof's own ``Group``: ``gather`` of a
   report (rank 0 receives W of them), ``broadcast`` of a small object, ``all_gather`` of a
   status; medians of 20 rounds after 3 warm-up rounds.

Beyond what the machine holds, the model fitted from these is written next to the figures
(``docs/benchmarks.md``): the manifest grows linearly in W; every rank reads it, so a restore's
aggregate manifest traffic grows as W squared; gloo's object collectives go through rank 0 one
peer at a time (linear in W).

    .venv/bin/python benchmarks/coordination.py --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _support import free_port
from crashproof.checkpoint import default_group
from crashproof.checkpoint.format._fields import dumps
from crashproof.checkpoint.format._manifest import FileEntry, Manifest, parse_manifest
from crashproof.checkpoint.format._names import index_name, shard_name

CHECKSUM = "0123456789abcdef0123456789abcdef"  # an xxh3-128 hex digest's length


def _reports(world: int) -> list[dict[str, FileEntry]]:
    return [
        {
            shard_name(r): FileEntry(123_456_789, CHECKSUM, "tensors"),
            index_name(r): FileEntry(45_678, CHECKSUM),
        }
        for r in range(world)
    ]


def manifest_costs(world: int, repeats: int) -> dict[str, float]:
    reports = _reports(world)
    merge_s, parse_s = [], []
    data = b""
    for _ in range(repeats):
        started = time.perf_counter()
        files: dict[str, FileEntry] = {}
        for report in reports:
            files.update(report)
        manifest = Manifest(
            step=1000, world_size=world, kind="full", created_unix=time.time(),
            library_version="bench", torch_version=str(torch.__version__),
            hash_algorithm="xxh3_128", files=files,
        )  # fmt: skip
        data = dumps(manifest.to_json())
        merge_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        parse_manifest(data, "bench")
        parse_s.append(time.perf_counter() - started)
    return {
        "world": world,
        "merge_ms": statistics.median(merge_s) * 1e3,
        "manifest_kb": len(data) / 1e3,
        "parse_ms": statistics.median(parse_s) * 1e3,
        "restore_aggregate_mb": world * len(data) / 1e6,
    }


def _collectives(rank: int, world: int, port: int, out: Any) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    group = default_group(60)
    report = _reports(world)[rank]
    timings: dict[str, list[float]] = {"gather": [], "broadcast": [], "all_gather": []}
    for i in range(23):
        for name, call in (
            ("gather", lambda: group.gather(report)),
            ("broadcast", lambda: group.broadcast({"tmp": ".tmp-step_0000001000-abcdef012345"})),
            ("all_gather", lambda: group.all_gather(("ok", ""))),
        ):
            dist.barrier()
            started = time.perf_counter()
            call()
            if i >= 3:
                timings[name].append(time.perf_counter() - started)
    if rank == 0:
        out.put({name: statistics.median(v) * 1e3 for name, v in timings.items()})
    dist.destroy_process_group()


def collective_costs(world: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collectives, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result: dict[str, float] = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return {"world": world, **result}


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b if n else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-procs", type=int, default=8)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    manifest_rows = [manifest_costs(w, args.repeats) for w in (1, 16, 256, 4096, 32768)]
    worlds = [w for w in (1, 2, 4, 8, 16) if w <= args.max_procs]
    collective_rows = []
    for world in worlds:
        collective_rows.append(collective_costs(world))
        print(f"collectives, {world} ranks: {collective_rows[-1]}", file=sys.stderr)
    fits = {
        name: _fit([r["world"] for r in collective_rows], [r[name] for r in collective_rows])
        for name in ("gather", "broadcast", "all_gather")
    }
    kb_per_rank = manifest_rows[-1]["manifest_kb"] / manifest_rows[-1]["world"]
    result = {
        "cpus": os.cpu_count(),
        "manifest": manifest_rows,
        "collectives": collective_rows,
        "fits_ms": {k: {"a": a, "b_per_rank": b} for k, (a, b) in fits.items()},
        "manifest_kb_per_rank": kb_per_rank,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    if args.markdown or not args.json:
        print(f"Manifest, one process ({os.cpu_count()} CPUs), medians of {args.repeats}:\n")
        print(
            "| ranks | merge + JSON ms | manifest KB | parse ms (each rank) | restore: all ranks read MB |"
        )
        print("|---:|---:|---:|---:|---:|")
        for r in manifest_rows:
            print(
                f"| {r['world']:,} | {r['merge_ms']:.2f} | {r['manifest_kb']:.1f} | "
                f"{r['parse_ms']:.2f} | {r['restore_aggregate_mb']:,.1f} |"
            )
        print("\nCollectives through crashproof's Group (gloo, loopback), medians of 20:\n")
        print("| ranks | gather of a report ms | broadcast ms | all_gather ms |")
        print("|---:|---:|---:|---:|")
        for r in collective_rows:
            print(
                f"| {r['world']} | {r['gather']:.2f} | {r['broadcast']:.2f} | {r['all_gather']:.2f} |"
            )
        print("\nLinear fits (ms = a + b x ranks), from the rows above:\n")
        for name, (a, b) in fits.items():
            print(f"- {name}: a = {a:.2f} ms, b = {b:.3f} ms per rank")
        print(f"- manifest: {kb_per_rank:.3f} KB per rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
