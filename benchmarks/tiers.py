"""Upload and download of a checkpoint to an S3-protocol server: crashproof against boto3.

A checkpoint of ``--size-mb`` (model + AdamW state, one rank) is committed locally, then copied
to and from a real S3-protocol server on loopback (moto's standalone server, started here, reached
through ``AWS_ENDPOINT_URL`` as real S3 would be). Methods, run round-robin, ``--repeats`` times:

- **boto3 upload_file**: ``boto3.client("s3").upload_file`` of every file of the checkpoint
  (boto3's default transfer: 8 MB parts, 10 threads), the baseline;
- **crashproof upload**: ``upload_checkpoint`` as the tier replicator calls it (files in
  parallel, each large one through ``put_file``'s parallel multipart, the manifest last), without
  the read-back check;
- **crashproof upload + verify**: the same with ``verify=True`` (the default of a ``Tier``: every
  checksum read back from the server before the checkpoint counts as durable);
- **boto3 download_file**: every file of the checkpoint to a local directory, plus fsync;
- **crashproof download**: ``download_checkpoint`` as a restore from a tier calls it (8
  parallel ranged reads per file into a temporary directory, fsync, every checksum verified,
  then published).

Throughput is the checkpoint's bytes over the wall time; medians of the repeats, and ratios to
the boto3 baseline of the same direction. moto is a Python server sharing the machine's cores
with the client, so absolute MB/s say little about real S3; the ratios compare the two clients
against the same server.

    .venv/bin/python benchmarks/tiers.py --markdown
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
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import crashproof as cp
from _support import start_moto_server
from crashproof.checkpoint.format._names import MANIFEST_NAME
from crashproof.checkpoint.restore._read_manifest import read_manifest_bytes
from crashproof.checkpoint.tiers._transfer import download_checkpoint, upload_checkpoint
from crashproof.storage import LocalStorage, storage_for

MB = 1e6


def make_checkpoint(root: Path, size_mb: float) -> Path:
    """A committed checkpoint of about ``size_mb`` (weights + AdamW's two moments)."""
    n = int(size_mb * MB / 4 / 3)
    torch.manual_seed(0)
    model = torch.nn.Linear(n // 1024, 1024, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, n // 1024)).sum().backward()
    optimizer.step()
    with cp.CheckpointManager(root, async_save=False, handle_signals=False) as ckpt:
        ckpt.save(1, cp.TrainState(model=model, optimizer=optimizer))
    return root / "step_0000000001"


def timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=".bench-tmp", help="local scratch (on the disk to measure)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    server = start_moto_server()
    import boto3  # after the endpoint is in the environment

    os.makedirs(args.dir, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tiers-", dir=args.dir))
    try:
        ckpt_dir = make_checkpoint(scratch / "local", args.size_mb)
        local = LocalStorage()
        manifest_bytes, manifest = read_manifest_bytes(local, str(ckpt_dir))
        names = [*sorted(manifest.files), MANIFEST_NAME]
        nbytes = sum(e.size for e in manifest.files.values()) + len(manifest_bytes)
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        client = boto3.client("s3")
        client.create_bucket(Bucket=bucket)
        remote_root, remote = storage_for(f"s3://{bucket}/crashproof")
        remote.make_dirs(remote_root)

        def boto3_upload() -> None:
            for name in names:
                client.upload_file(str(ckpt_dir / name), bucket, f"boto3/{name}")

        def crashproof_upload(verify: bool) -> Callable[[], None]:
            def run() -> None:
                upload_checkpoint(
                    local,
                    str(ckpt_dir),
                    manifest_bytes,
                    remote,
                    remote.join(remote_root, "step_0000000001"),
                    verify=verify,
                )

            return run

        def boto3_download() -> None:
            target = scratch / "boto3-download"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for name in names:
                path = target / name
                client.download_file(bucket, f"boto3/{name}", str(path))
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

        def crashproof_download() -> None:
            target = scratch / "crashproof-download"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            download_checkpoint(
                remote,
                remote.join(remote_root, "step_0000000001"),
                local,
                str(target),
                "step_0000000001",
            )

        methods: dict[str, Callable[[], None]] = {
            "boto3 upload_file": boto3_upload,
            "crashproof upload": crashproof_upload(False),
            "crashproof upload + verify": crashproof_upload(True),
            "boto3 download_file": boto3_download,
            "crashproof download (verified)": crashproof_download,
        }
        # Uploads first in each round: the downloads read what the round's uploads wrote.
        times: dict[str, list[float]] = {m: [] for m in methods}
        for fn in methods.values():  # warm-up round, not counted
            fn()
        for r in range(args.repeats):
            for name, fn in methods.items():
                seconds = timed(fn)
                times[name].append(seconds)
                print(f"round {r + 1}: {name}: {seconds:.3f} s", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)

    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        baseline = "boto3 upload_file" if "upload" in name else "boto3 download_file"
        ratio = statistics.median(times[baseline]) / median
        rows.append(
            {
                "method": name,
                "median_s": median,
                "mb_per_s": nbytes / MB / median,
                "vs_boto3": ratio,
                "runs_s": values,
            }
        )
    result: dict[str, Any] = {
        "checkpoint_mb": nbytes / MB,
        "files": len(names),
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    if args.markdown or not args.json:
        print(
            f"Checkpoint: {nbytes / MB:.1f} MB in {len(names)} files; medians of {args.repeats} "
            f"runs; moto server on loopback, {os.cpu_count()} CPUs.\n"
        )
        print("| method | median s | MB/s | speed vs boto3 (same direction) |")
        print("|---|---:|---:|---:|")
        for row in rows:
            print(
                f"| {row['method']} | {row['median_s']:.3f} | {row['mb_per_s']:.0f} | "
                f"{row['vs_boto3']:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
