"""The ``crashproof`` command line: run training under supervision; look at, check, prune and
export checkpoints.

``crashproof run`` is :mod:`crashproof.supervisor._launch` (its exit codes are documented there).
For the rest, exit codes: 0 success (and, for ``verify``, everything checked is valid); 1 a checkpoint is
invalid; 2 a usage error, or nothing to act on (no such root or step).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

import crashproof
from crashproof.chaos import add_chaos_parser
from crashproof.checkpoint import (
    committed_steps,
    describe_checkpoint,
    read_manifest,
    verify_checkpoint,
)
from crashproof.checkpoint._catalog import prune_plan
from crashproof.checkpoint._export import export_dcp, export_safetensors
from crashproof.checkpoint._reader import read_rank_index
from crashproof.errors import CrashproofError
from crashproof.goodput._planner import add_plan_parser
from crashproof.goodput._report import add_report_parser
from crashproof.policy import (
    KeepBest,
    KeepDaily,
    KeepEvery,
    KeepHourly,
    KeepLast,
    KeepWeekly,
    KeepWithin,
    RetentionPolicy,
)
from crashproof.storage import Storage, storage_for

__all__ = ["main"]

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _iso(ts: float | None) -> str:
    return (
        dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds")
        if ts is not None
        else "-"
    )


def _open_root(root: str) -> tuple[str, Storage, list[tuple[int, str]]]:
    path, storage = storage_for(root)
    found = committed_steps(storage, path)
    if not found and not storage.list(path):
        raise SystemExit(
            _fail(
                f"no checkpoints in {storage.describe(path)}: the directory is empty or missing",
                EXIT_USAGE,
            )
        )
    return path, storage, found


def _pick(found: list[tuple[int, str]], step: int | None, root: str) -> list[tuple[int, str]]:
    if step is None:
        return found
    chosen = [(s, p) for s, p in found if s == step]
    if not chosen:
        steps = ", ".join(str(s) for s, _ in found) or "none"
        raise SystemExit(
            _fail(f"no checkpoint of step {step} in {root} (steps present: {steps})", EXIT_USAGE)
        )
    return chosen


def _fail(message: str, code: int) -> int:
    print(f"crashproof: {message}", file=sys.stderr)
    return code


def cmd_ls(args: argparse.Namespace) -> int:
    _, storage, found = _open_root(args.root)
    infos = [describe_checkpoint(storage, s, p) for s, p in found]
    if args.json:
        print(json.dumps([i.to_json() for i in infos], indent=2))
        return EXIT_OK
    print(f"{'step':>10}  {'created (UTC)':<25}  {'size':>10}  {'kind':<18}  valid")
    for i in infos:
        note = "yes" if i.valid else f"NO  {i.problem}"
        kind = f"delta (base {i.base_step})" if i.base_step is not None else i.kind
        print(
            f"{i.step:>10}  {_iso(i.created):<25}  {_human(i.size_bytes):>10}  {kind:<18}  {note}"
        )
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    path, storage, found = _open_root(args.root)
    chosen = _pick(found, args.step, storage.describe(path))
    if args.latest:
        chosen = chosen[:1]
    results: list[dict[str, Any]] = []
    for step, ckpt in chosen:
        total = sum(e.size for e in _manifest_files(storage, ckpt))
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"verify step {step}",
            disable=args.json or None,
            file=sys.stderr,
        ) as bar:
            try:
                verify_checkpoint(storage, ckpt, on_bytes=bar.update)
                results.append(
                    {"step": step, "path": storage.describe(ckpt), "valid": True, "problem": ""}
                )
            except (CrashproofError, OSError) as exc:
                results.append(
                    {
                        "step": step,
                        "path": storage.describe(ckpt),
                        "valid": False,
                        "problem": str(exc),
                    }
                )
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"step {r['step']}: {'valid' if r['valid'] else 'INVALID: ' + r['problem']}")
    return EXIT_OK if results and all(r["valid"] for r in results) else EXIT_INVALID


def _manifest_files(storage: Storage, ckpt: str) -> list[Any]:
    try:
        return list(read_manifest(storage, ckpt).files.values())
    except CrashproofError:
        return []


def cmd_inspect(args: argparse.Namespace) -> int:
    path, storage, found = _open_root(args.root)
    chosen = _pick(found, args.step, storage.describe(path))[:1]
    if not chosen:
        return _fail(f"no checkpoints in {storage.describe(path)}", EXIT_USAGE)
    _, ckpt = chosen[0]
    try:
        manifest = read_manifest(storage, ckpt)
        ranks = [read_rank_index(storage, ckpt, manifest, r) for r in range(manifest.world_size)]
    except CrashproofError as exc:
        return _fail(str(exc), EXIT_INVALID)
    rank_reports: list[dict[str, Any]] = [
        {
            "rank": idx.rank,
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
                | (
                    {"global_shape": list(t.global_shape), "global_offset": list(t.global_offset)}
                    if t.global_shape is not None and t.global_offset is not None
                    else {}
                )
                for t in idx.tensors
            ],
            "components": sorted(idx.state) if isinstance(idx.state, dict) else [],
        }
        for idx in ranks
    ]
    report = {"manifest": manifest.to_json(), "ranks": rank_reports}
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    m = manifest
    print(f"checkpoint {storage.describe(ckpt)}")
    print(
        f"  step {m.step}, kind {m.kind}, world size {m.world_size}, created {_iso(m.created_unix)}"
    )
    print(
        f"  crashproof {m.library_version}, torch {m.torch_version}, checksums {m.hash_algorithm}"
    )
    if m.metadata:
        print(f"  metadata {json.dumps(m.metadata)}")
    for name, entry in sorted(m.files.items()):
        print(f"  file {name:<28} {_human(entry.size):>10}  {entry.checksum}")
    for r in rank_reports:
        print(f"  rank {r['rank']}: components {', '.join(r['components'])}")
        print(f"    {'tensor':<50} {'dtype':<10} {'shape':<20} {'size':>10}")
        for t in r["tensors"]:
            print(
                f"    {t['name']:<50} {t['dtype']:<10} {t['shape']!s:<20} {_human(t['nbytes']):>10}"
                + (  # a rank's piece of a sharded tensor: where it lies in the whole
                    f"  piece of {t['global_shape']} at {t['global_offset']}"
                    if "global_shape" in t
                    else ""
                )
            )
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    path, storage, found = _open_root(args.root)
    try:
        policies = _prune_policies(args)
    except (ValueError, CrashproofError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    if not policies:
        return _fail(
            "prune needs at least one of --keep-last, --keep-every, --keep-within, "
            "--keep-hourly, --keep-daily, --keep-weekly, --keep-best",
            EXIT_USAGE,
        )
    policy = policies[0]
    for more in policies[1:]:
        policy = policy | more
    doomed = prune_plan(storage, path, policy)  # never includes the newest valid checkpoint
    for step, ckpt in doomed:
        print(
            f"{'would remove' if args.dry_run else 'removing'} step {step} ({storage.describe(ckpt)})"
        )
        if not args.dry_run:
            storage.remove(ckpt)
    print(
        f"{len(doomed)} checkpoint(s) {'would be ' if args.dry_run else ''}removed, {len(found) - len(doomed)} kept"
    )
    return EXIT_OK


def _prune_policies(args: argparse.Namespace) -> list[RetentionPolicy]:
    """The retention policies the prune options ask for (kept: what any of them keeps)."""
    policies: list[RetentionPolicy] = []
    if args.keep_last is not None:
        policies.append(KeepLast(args.keep_last))
    if args.keep_every is not None:
        policies.append(KeepEvery(args.keep_every))
    if args.keep_within is not None:
        policies.append(KeepWithin(seconds=_duration_s(args.keep_within)))
    for n, cls in ((args.keep_hourly, KeepHourly), (args.keep_daily, KeepDaily),
                   (args.keep_weekly, KeepWeekly)):  # fmt: skip
        if n is not None:
            policies.append(cls(n))
    for spec in args.keep_best:
        metric, _, mode = spec.partition(":")
        if mode not in ("", "min", "max"):
            raise ValueError(f"--keep-best {spec!r}: write METRIC, METRIC:min or METRIC:max")
        policies.append(KeepBest(metric, mode="max" if mode == "max" else "min"))
    return policies


def _duration_s(text: str) -> float:
    """``90s``, ``30m``, ``6h``, ``7d``, ``2w`` (or plain seconds) in seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        return float(number) * units[unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a duration: use e.g. 90s, 30m, 6h, 7d, 2w") from None


def cmd_export(args: argparse.Namespace) -> int:
    path, storage, found = _open_root(args.root)
    chosen = _pick(found, args.step, storage.describe(path))
    try:
        max_shard = _size_bytes(args.max_shard_size)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    for step, ckpt in chosen:  # newest first: the first that exports wins
        try:
            if args.format == "dcp":
                state = export_dcp(storage, ckpt, args.output)
                print(
                    f"exported step {step} ({', '.join(sorted(state))}) as a "
                    f"torch.distributed.checkpoint directory: {args.output}"
                )
                return EXIT_OK
            tensors, files = export_safetensors(
                storage, ckpt, args.output, max_shard_bytes=max_shard
            )
        except CrashproofError as exc:
            if args.step is not None:
                return _fail(str(exc), EXIT_INVALID)
            print(f"crashproof: skipping step {step}: {exc}", file=sys.stderr)
            continue
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        where = args.output if len(files) == 1 else f"{len(files) - 1} files and {files[-1]}"
        print(f"exported {len(tensors)} tensors ({_human(size)}) of step {step} to {where}")
        return EXIT_OK
    return _fail(f"no valid checkpoint to export in {storage.describe(path)}", EXIT_INVALID)


def _size_bytes(text: str) -> int:
    """``5GB``, ``500MB``, ``64KiB`` or plain bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
    number = text.strip().upper().rstrip("BIKMGT")
    unit = text.strip().upper()[len(number) :]
    try:
        value = int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a size: use e.g. 5GB, 500MB, 64MiB") from None
    if value < 1:
        raise ValueError(f"{text!r}: a shard size must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crashproof", description="Fault-tolerant PyTorch training: checkpoint tools."
    )
    parser.add_argument(
        "--version", action="version", version=f"crashproof {crashproof.__version__}"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what crashproof does")
    sub = parser.add_subparsers(dest="command", required=True)

    # Listed for --help only: main() hands `run` to torchrun's parser before this one runs.
    sub.add_parser(
        "run", help="run a training script like torchrun, restarting it on failures", add_help=False
    )
    p = sub.add_parser("ls", help="list checkpoints: step, created, size, kind, valid")
    p.add_argument("root")
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("verify", help="check every file's checksum; exit 1 if anything is invalid")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="only this step (default: every checkpoint)")
    p.add_argument("--latest", action="store_true", help="only the newest checkpoint")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", help="show a checkpoint's metadata and tensors")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="default: the newest")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("prune", help="delete old checkpoints; the newest valid one is always kept")
    p.add_argument("root")
    p.add_argument("--keep-last", type=int, metavar="N")
    p.add_argument(
        "--keep-every", type=int, metavar="N", help="also keep steps that are multiples of N"
    )
    p.add_argument(
        "--keep-within",
        metavar="DURATION",
        help="keep everything made within DURATION (90s, 30m, 6h, 7d, 2w) before the newest",
    )
    p.add_argument("--keep-hourly", type=int, metavar="N", help="the newest of each of N hours")
    p.add_argument("--keep-daily", type=int, metavar="N", help="the newest of each of N UTC days")
    p.add_argument("--keep-weekly", type=int, metavar="N", help="the newest of each of N weeks")
    p.add_argument(
        "--keep-best",
        action="append",
        default=[],
        metavar="METRIC[:min|max]",
        help="the best checkpoint by a metric saved in its metadata (repeatable)",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("export", help="write a checkpoint in a standard format")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="default: the newest valid checkpoint")
    p.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "dcp"],
        help="safetensors: the model weights (FILE); dcp: model, optimizer, scheduler and scaler "
        "state as a torch.distributed.checkpoint directory (-o DIR)",
    )
    p.add_argument("-o", "--output", required=True, metavar="FILE|DIR")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="safetensors above this are split into numbered files plus an index (default 5GB)",
    )
    p.set_defaults(func=cmd_export)
    add_plan_parser(sub)
    add_report_parser(sub)
    add_chaos_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # torchrun's own option parser: see crashproof.supervisor._launch
        from crashproof.supervisor._launch import main as run_main

        return run_main(argv[1:])  # a supervisor must outlive a closed pipe: SIGPIPE stays ignored
    # Die quietly when piped into `head`, like other Unix tools.
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.func(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except (CrashproofError, ValueError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    return code


if __name__ == "__main__":
    sys.exit(main())
