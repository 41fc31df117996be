"""What coordinating a save and a restore costs as the number of ranks grows.

A save ends with rank 0 gathering every rank's file report (name, size, checksum), merging them
into one manifest and writing it; a restore starts with rank 0 reading that manifest once and
handing each rank the part it reads (its plan), then the ranks agree in a few small
collectives. Three parts:

1. **Measured in one process, up to 32,768 ranks**: building the manifest from W ranks' reports
   (merge, JSON), its size, and parsing it (what each rank does at restore), with crashproof's
   own code (``Manifest``, ``dumps``, ``parse_manifest``); medians of ``--repeats``.
2. **A restore's fan-out, on real checkpoint directories of up to 32,768 simulated ranks**
   (:func:`simulated_checkpoint`): rank 0's ``plan_restore`` (the manifest read once, the indexes
   it needs), the bytes it reads, each rank's plan as sent, and the aggregate over all ranks
   against what every rank reading the whole manifest cost before; also on half the ranks (a
   world-size change, where rank 0 reads every saved index once).
3. **Measured with real processes, 1 to ``--max-procs`` ranks (gloo on loopback)**: the
   collectives a save and a restore use, through crashproof's own ``Group``: ``gather`` of a
   report (rank 0 receives W of them), ``broadcast`` of a small object, ``scatter`` of one plan
   per rank, ``all_gather`` of a status; medians of 20 rounds after 3 warm-up rounds.

Beyond what the machine holds, the model fitted from these is written next to the figures
(``docs/benchmarks.md``): the manifest grows linearly in W, and so does a restore's aggregate
traffic now that only rank 0 reads it; gloo's object collectives go through rank 0 one peer at
a time (linear in W).

    .venv/bin/python benchmarks/coordination.py --markdown
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import crashproof as cp
from _support import CountingStorage, free_port
from crashproof.checkpoint import default_group
from crashproof.checkpoint.format import (
    MANIFEST_NAME,
    checkpoint_dir_name,
    digest,
    parse_rank_index,
    seal_manifest,
)
from crashproof.checkpoint.format._fields import dumps
from crashproof.checkpoint.format._manifest import FileEntry, Manifest, parse_manifest
from crashproof.checkpoint.format._names import index_name, shard_name
from crashproof.checkpoint.restore import plan_restore, read_manifest
from crashproof.storage import LocalStorage

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


def simulated_checkpoint(directory: Path, world: int, *, differ: int | None = None) -> None:
    """A real checkpoint of ``world`` ranks in ``directory`` (``step_0000001000``), made from one
    real save of a small model: each rank's index is the saved one with its rank changed (its
    own checksum), each shard a hard link to the saved shard, and a sealed manifest listing all.
    ``differ``: that rank's tensors differ from the others' (state split by hand)."""
    source = directory / "source"
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    with cp.CheckpointManager(source, handle_signals=False) as ckpt:
        ckpt.save(1000, cp.TrainState(model=model))
    saved = source / checkpoint_dir_name(1000)
    index = parse_rank_index((saved / index_name(0)).read_bytes(), "bench")
    manifest = read_manifest(LocalStorage(), str(saved))
    target = directory / checkpoint_dir_name(1000)
    target.mkdir()
    files: dict[str, FileEntry] = {}
    for r in range(world):
        tensors = index.tensors
        if r == differ:
            tensors = [dataclasses.replace(t, checksum="f" * 32) for t in tensors]
        data = dumps(
            dataclasses.replace(index, rank=r, shard_file=shard_name(r), tensors=tensors).to_json()
        )
        (target / index_name(r)).write_bytes(data)
        os.link(saved / shard_name(0), target / shard_name(r))
        files[index_name(r)] = FileEntry(len(data), digest(data))
        files[shard_name(r)] = manifest.files[shard_name(0)]
    sealed = dataclasses.replace(manifest, world_size=world, files=files).to_json()
    (target / MANIFEST_NAME).write_bytes(seal_manifest(sealed))
    shutil.rmtree(source)


def fan_out_costs(world: int, work: Path, *, restore_on: int | None = None) -> dict[str, float]:
    """A restore's fan-out on ``world`` simulated ranks (``restore_on`` ranks, when the world size
    changes): rank 0 reads the manifest once (and the indexes it needs) and hands each rank its
    plan; bytes are what is read from storage and what goes over the network, summed over the
    ranks. Before: every rank read and parsed the whole manifest."""
    directory = work / f"fan-out-{world}-{restore_on}"
    simulated_checkpoint(directory, world)
    ckpt_dir = str(directory / checkpoint_dir_name(1000))
    ranks = restore_on or world
    storage = CountingStorage()
    started = time.perf_counter()
    plans = plan_restore(storage, ckpt_dir, ranks)
    plan_s = time.perf_counter() - started
    read = sum(storage.counts.values())  # rank 0's reads
    index_bytes = max(
        n
        for p, n in storage.counts.items()
        if Path(p).name.startswith("rank_") and p.endswith(".json")
    )
    sent = [len(pickle.dumps(plan)) for plan in plans]
    manifest_bytes = (directory / checkpoint_dir_name(1000) / MANIFEST_NAME).stat().st_size
    shutil.rmtree(directory)
    # Each rank then reads its (source's) own index, before as after; before, on another world
    # size, every rank read every saved rank's index instead.
    own = ranks * index_bytes
    return {
        "world": world, "ranks": ranks, "rank0_plan_ms": plan_s * 1e3,
        "rank0_read_kb": read / 1e3, "plan_kb_max": max(sent) / 1e3,
        "after_aggregate_mb": (read + sum(sent) + own) / 1e6,
        "before_aggregate_mb": (ranks * manifest_bytes + (own * world if restore_on else own)) / 1e6,
    }  # fmt: skip


def _collectives(rank: int, world: int, port: int, out: Any) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    group = default_group(60)
    report = _reports(world)[rank]
    timings: dict[str, list[float]] = {
        "gather": [],
        "broadcast": [],
        "scatter": [],
        "all_gather": [],
    }
    plans = [{"files": report, "source": r} for r in range(world)] if rank == 0 else None
    for i in range(23):
        for name, call in (
            ("gather", lambda: group.gather(report)),
            ("broadcast", lambda: group.broadcast({"tmp": ".tmp-step_0000001000-abcdef012345"})),
            ("scatter", lambda: group.scatter(plans)),
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
    work = Path(tempfile.mkdtemp(prefix="crashproof-coordination-"))
    try:
        fan_out_rows = [fan_out_costs(w, work) for w in (16, 256, 4096, 32768)]
        fan_out_rows += [fan_out_costs(w, work, restore_on=w // 2) for w in (16, 256, 4096)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    worlds = [w for w in (1, 2, 4, 8, 16) if w <= args.max_procs]
    collective_rows = []
    for world in worlds:
        collective_rows.append(collective_costs(world))
        print(f"collectives, {world} ranks: {collective_rows[-1]}", file=sys.stderr)
    fits = {
        name: _fit([r["world"] for r in collective_rows], [r[name] for r in collective_rows])
        for name in ("gather", "broadcast", "scatter", "all_gather")
    }
    kb_per_rank = manifest_rows[-1]["manifest_kb"] / manifest_rows[-1]["world"]
    result = {
        "cpus": os.cpu_count(),
        "manifest": manifest_rows,
        "fan_out": fan_out_rows,
        "collectives": collective_rows,
        "fits_ms": {k: {"a": a, "b_per_rank": b} for k, (a, b) in fits.items()},
        "manifest_kb_per_rank": kb_per_rank,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    if args.markdown or not args.json:
        print(f"Manifest, one process ({os.cpu_count()} CPUs), medians of {args.repeats}:\n")
        print(
            "| ranks | merge + JSON ms | manifest KB | parse ms | every rank reading it (before), MB |"
        )
        print("|---:|---:|---:|---:|---:|")
        for r in manifest_rows:
            print(
                f"| {r['world']:,} | {r['merge_ms']:.2f} | {r['manifest_kb']:.1f} | "
                f"{r['parse_ms']:.2f} | {r['restore_aggregate_mb']:,.1f} |"
            )
        print("\nRestore fan-out: rank 0 reads the manifest (and the indexes it needs) once and "
              "hands each rank its plan; aggregate = bytes read from storage + plans sent, over "
              "all ranks (before: every rank read the whole manifest and, on another world size, "
              "every saved index):\n")  # fmt: skip
        print("| saved ranks | restoring ranks | rank 0 plans ms | rank 0 reads KB | plan per rank KB "
              "| aggregate MB | before MB |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in fan_out_rows:
            print(
                f"| {r['world']:,} | {r['ranks']:,} | {r['rank0_plan_ms']:.1f} | "
                f"{r['rank0_read_kb']:,.1f} | {r['plan_kb_max']:.2f} | "
                f"{r['after_aggregate_mb']:,.2f} | {r['before_aggregate_mb']:,.1f} |"
            )
        print("\nCollectives through crashproof's Group (gloo, loopback), medians of 20:\n")
        print(
            "| ranks | gather of a report ms | broadcast ms | scatter of plans ms | all_gather ms |"
        )
        print("|---:|---:|---:|---:|---:|")
        for r in collective_rows:
            print(
                f"| {r['world']} | {r['gather']:.2f} | {r['broadcast']:.2f} | {r['scatter']:.2f} "
                f"| {r['all_gather']:.2f} |"
            )
        print("\nLinear fits (ms = a + b x ranks), from the rows above:\n")
        for name, (a, b) in fits.items():
            print(f"- {name}: a = {a:.2f} ms, b = {b:.3f} ms per rank")
        print(f"- manifest: {kb_per_rank:.3f} KB per rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
