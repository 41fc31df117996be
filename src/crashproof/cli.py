"""The ``crashproof`` command line: run training under supervision; look at, check, prune and
export checkpoints.

``crashproof run`` is :mod:`crashproof.supervisor.launch` (its exit codes are documented there).
For the rest (README "Command line" has the table):

- 0 success (and, for ``verify``, everything checked is valid);
- 1 a checkpoint is invalid (``verify``, ``inspect``, ``export``), a campaign failed (``chaos``);
- 2 a usage error, or nothing to act on (no such root or step, a root that is a file or a run
  directory, an output path an export must not write);
- 74 the storage could not be read or written (no credentials, no such bucket, permission, an
  I/O error; a checkpoint file the storage refuses is this, never "invalid"), an output
  (``export -o``, ``report --html``) could not be written, or ``prune`` on a root whose writer
  holds its lock;
- 70 an internal error (a bug: ``-v`` shows the traceback); 130 interrupted (Ctrl-C).

Every failure is one line on stderr, ``crashproof: <what>: <why>; <what to do>``, naming the
argument or path it is about (control characters in it escaped: :mod:`crashproof._console`);
never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import math
import os
import signal
import stat
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from tqdm import tqdm

from crashproof._console import one_line, output_unwritable, say
from crashproof._version import __version__
from crashproof.chaos import add_chaos_parser
from crashproof.checkpoint import (
    check_target,
    committed_steps,
    export_dcp,
    export_safetensors,
    list_checkpoints,
    located,
    lock_root,
    parse_step_dir,
    prune_plan,
    read_manifest,
    read_rank_index,
    unreadable,
    verify_checkpoint,
)
from crashproof.errors import ConfigError, CrashproofError
from crashproof.exitcodes import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
)
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
from crashproof.storage import LocalStorage, Storage, storage_for
from crashproof.telemetry import add_plan_parser, add_report_parser

__all__ = ["main"]


log = logging.getLogger("crashproof.cli")

_STORAGE_MODULES = ("botocore", "aiobotocore", "boto3", "s3fs", "gcsfs", "adlfs", "fsspec",
                    "google", "azure", "aiohttp", "urllib3", "requests")  # fmt: skip
"""Packages whose exceptions, reaching the command line, mean the storage is out of reach."""


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _iso(ts: float | None) -> str:
    if ts is None:
        return "-"
    try:
        return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):  # a manifest's time no calendar holds
        return str(ts)


def _open_root(root: str) -> tuple[str, Storage, list[tuple[int, str]]]:
    """The root's path, storage and checkpoints; exit 2, saying why, when it holds none."""
    if not root.strip():
        _usage(
            "ROOT is empty: give the checkpoint root (the directory passed to CheckpointManager)"
        )
    path, storage = storage_for(root)
    local = "://" not in path
    if local:
        _check_local_root(root.removeprefix("file://"))
    # What the listing warns about (each stray name in the root) is news only beside checkpoints;
    # without any, the one line below says what the directory is instead.
    with _held_warnings() as held:
        found = committed_steps(storage, path)
        if not found:
            _usage(f"no checkpoints in {storage.describe(path)}: {_why_none(storage, path, local)}")
    for record in held:
        logging.getLogger().handle(record)
    return path, storage, found


class _Hold(logging.Handler):
    def __init__(self, held: list[logging.LogRecord]) -> None:
        super().__init__()
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        self.held.append(record)


@contextlib.contextmanager
def _held_warnings() -> Iterator[list[logging.LogRecord]]:
    """crashproof's log records, kept back (not shown) while the block runs."""
    held: list[logging.LogRecord] = []
    top = logging.getLogger("crashproof")
    handler, propagate = _Hold(held), top.propagate
    top.addHandler(handler)
    top.propagate = False
    try:
        yield held
    finally:
        top.removeHandler(handler)
        top.propagate = propagate


def _usage(message: str) -> NoReturn:
    raise SystemExit(_fail(message, EXIT_USAGE))


def _check_local_root(path: str) -> None:
    """A local root must be a directory: say what it is instead."""
    where = os.path.abspath(path)
    if os.path.islink(path) and not os.path.exists(path):
        _usage(
            f"no checkpoints in {where}: a symbolic link to {os.readlink(path)}, which does not "
            "exist"
        )
    if not os.path.lexists(path):
        _usage(f"no checkpoints in {where}: no such directory")
    if not os.path.isdir(path):
        kind = "a file" if os.path.isfile(path) else "not a directory (a FIFO, socket or device)"
        _usage(
            f"no checkpoints in {where}: it is {kind}; give the checkpoint root, the directory "
            "passed to CheckpointManager"
        )
    step = parse_step_dir(os.path.basename(where))
    if step is not None:
        _usage(
            f"{where} is one checkpoint (step {step}), not a checkpoint root: give the "
            f"directory it is in, {os.path.dirname(where)}"
        )


def _why_none(storage: Storage, path: str, local: bool) -> str:
    """Why a root without checkpoints has none, and where they may be instead."""
    names = storage.list(path)
    if not local:
        return (
            "nothing under that prefix is a checkpoint (step_NNNNNNNNNN)"
            if names
            else ("nothing is stored under that prefix (check the bucket and the prefix)")
        )
    if "events.jsonl" in names:
        roots = _roots_in_events(os.path.join(path, "events.jsonl"))
        where = (
            f"its checkpoints are in {', '.join(roots)} (from its checkpoint events); "
            "run this command on that root"
            if roots
            else "its events record no checkpoint yet; give the checkpoint root the training "
            "script passes to CheckpointManager"
        )
        return f"it is the run directory of `crashproof run` (it holds events.jsonl); {where}"
    nested = [os.path.join(path, n) for n in names if _holds_steps(os.path.join(path, n))]
    if nested:
        verb = "holds" if len(nested) == 1 else "hold"
        return f"{', '.join(nested)} {verb} checkpoints: give that as the root"
    if not names:
        return "the directory is empty"
    return f"none of its {len(names)} entries is a checkpoint directory (step_NNNNNNNNNN)"


def _holds_steps(directory: str) -> bool:
    """``directory`` is a real directory with a checkpoint directory in it (a hint, no more)."""
    if os.path.islink(directory) or not os.path.isdir(directory):
        return False
    try:
        return any(parse_step_dir(n) is not None for n in os.listdir(directory))
    except OSError:
        return False


def _roots_in_events(events: str) -> list[str]:
    """The checkpoint roots a run's events name (the parents of checkpoint and restore paths),
    newest first."""
    try:
        fd = os.open(events, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the command
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return []
        roots: list[str] = []
        for line in f:
            try:
                event = json.loads(line)
                where = event.get("path") if event.get("event") == "checkpoint" else None
                if event.get("event") == "restore":
                    where = event.get("source")
            except (ValueError, AttributeError):
                continue  # a torn or foreign line
            if isinstance(where, str) and where:
                root = os.path.dirname(where.rstrip("/")) or "."
                if root in roots:
                    roots.remove(root)
                roots.insert(0, root)
        return roots


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
    say("crashproof", message)
    return code


def _unreadable(storage: Storage, ckpt: str, exc: OSError) -> int:
    """Exit 74 for a checkpoint file the storage would not read: no verdict on the checkpoint."""
    err = located(storage, ckpt, exc)
    return _fail(
        f"{err.filename}: cannot be read ({err.strerror}); the storage refused it (permissions, "
        "an I/O error), which says nothing about the checkpoint: fix the access and run this again",
        EXIT_STORAGE,
    )


def cmd_ls(args: argparse.Namespace) -> int:
    path, storage, found = _open_root(args.root)
    total = 0
    if args.verify:
        total = sum(sum(e.size for e in _manifest_files(storage, p)) for _, p in found)
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="verify",
        disable=not args.verify or args.json or None,
        file=sys.stderr,
    ) as bar:
        try:
            rows = list_checkpoints(storage, found, verify=args.verify, on_bytes=bar.update)
        except OSError as exc:  # unreadable (not corrupt), named in full by list_checkpoints
            if not unreadable(exc):
                raise
            return _unreadable(storage, path, exc)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
        return EXIT_OK
    # The header says which checks stand behind each column (docs: README "Command line").
    checks = (
        "valid (manifest, sizes)"
        if args.verify
        else "valid (manifest, sizes; checksums unread: --verify)"
    )
    print(
        f"{'step':>10}  {'created (UTC)':<25}  {'size':>10}  {'kind':<18}  {checks}"
        + ("  verified (checksums)" if args.verify else "")
    )
    for r in rows:
        i = r.info
        kind = f"delta (base {i.base_step})" if i.base_step is not None else i.kind
        line = f"{i.step:>10}  {_iso(i.created):<25}  {_human(i.size_bytes):>10}  {kind:<18}  "
        if not args.verify:
            line += "yes" if i.valid else f"NO  {i.problem}"
        else:
            line += f"{'yes' if i.valid else 'NO':<23}  "
            line += "yes" if r.verified else f"NO  {r.problem}"
        print(line)
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
                if isinstance(exc, OSError) and unreadable(exc):  # no verdict on the unread
                    return _unreadable(storage, ckpt, exc)
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
    except (CrashproofError, OSError):
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
    except OSError as exc:
        return _unreadable(storage, ckpt, exc)
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
    lock = None  # prune removes checkpoints: it is a writer and must hold the root's lock
    if not args.dry_run and isinstance(getattr(storage, "inner", storage), LocalStorage):
        try:
            lock = lock_root(path)
        except CrashproofError as exc:  # a run is writing this root: its retention is in charge
            return _fail(str(exc), EXIT_STORAGE)
    try:
        doomed = prune_plan(storage, path, policy)  # never includes the newest valid checkpoint
        for step, ckpt in doomed:
            print(
                f"{'would remove' if args.dry_run else 'removing'} step {step} "
                f"({storage.describe(ckpt)})"
            )
            if not args.dry_run:
                storage.remove(ckpt)
    finally:
        if lock is not None:
            lock.release()
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
        if not metric.strip():
            raise ValueError(f"--keep-best {spec!r}: name the metric, e.g. val_loss:min")
        if mode not in ("", "min", "max"):
            raise ValueError(f"--keep-best {spec!r}: write METRIC, METRIC:min or METRIC:max")
        policies.append(KeepBest(metric, mode="max" if mode == "max" else "min"))
    return policies


def _duration_s(text: str) -> float:
    """``90s``, ``30m``, ``6h``, ``7d``, ``2w`` (or plain seconds) in seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        seconds = math.nan
    if not seconds > 0:  # NaN too
        raise ValueError(
            f"--keep-within {text!r} is not a positive duration: use e.g. 90s, 30m, 6h, 7d, 2w"
        )
    return seconds


def cmd_export(args: argparse.Namespace) -> int:
    try:
        max_shard = _size_bytes(args.max_shard_size)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    path, storage, found = _open_root(args.root)
    # Before anything is read: an export never writes over what it did not write, nor over the
    # root, an ancestor of it, or the current directory (the export functions check again).
    check_target(
        args.output,
        kind="dir" if args.format == "dcp" else "file",
        force=args.force,
        protected=[path] if "://" not in path else [],
    )
    chosen = _pick(found, args.step, storage.describe(path))
    for step, ckpt in chosen:  # newest first: the first that exports wins
        try:
            if args.format == "dcp":
                state = export_dcp(storage, ckpt, args.output, force=args.force)
                print(
                    f"exported step {step} ({', '.join(sorted(state))}) as a "
                    f"torch.distributed.checkpoint directory: {args.output}"
                )
                return EXIT_OK
            tensors, files = export_safetensors(
                storage, ckpt, args.output, max_shard_bytes=max_shard, force=args.force
            )
        except ConfigError as exc:  # the output path, or state safetensors cannot hold
            return _fail(str(exc), EXIT_USAGE)
        except CrashproofError as exc:
            if args.step is not None:
                return _fail(str(exc), EXIT_INVALID)
            say("crashproof", f"skipping step {step}: {exc}")
            continue
        except OSError as exc:  # writing the output (named by its filename), or reading
            if exc.filename == args.output:
                return _fail(output_unwritable("-o", args.output, exc), EXIT_STORAGE)
            return _unreadable(storage, ckpt, exc)
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
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(
            f"--max-shard-size {text!r} is not a size: use e.g. 5GB, 500MB, 64MiB"
        ) from None
    if not math.isfinite(value) or value < 1:  # inf, nan, 1e400, 0, -5GB
        raise ValueError(
            f"--max-shard-size {text!r}: give a positive, finite size, e.g. 5GB, 500MB, 64MiB"
        )
    return int(value)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line that names the argument (not the whole usage);
    the subcommands' parsers are of this class too (``add_subparsers`` takes the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_USAGE, one_line(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="crashproof", description="Fault-tolerant PyTorch training: checkpoint tools."
    )
    parser.add_argument("--version", action="version", version=f"crashproof {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what crashproof does")
    # Of _Parser too (one-line errors); typed as the plain class the add_*_parser hooks take.
    sub: argparse._SubParsersAction[argparse.ArgumentParser] = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser
    )

    # Listed for --help only: main() hands `run` to torchrun's parser before this one runs.
    sub.add_parser(
        "run", help="run a training script like torchrun, restarting it on failures", add_help=False
    )
    p = sub.add_parser(
        "ls",
        help="list checkpoints: step, created, size, kind, valid (manifest and file sizes), "
        "verified (checksums, with --verify)",
    )
    p.add_argument("root")
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also read every checkpoint whole and check its checksums (the `verified` column)",
    )
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
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier export at -o (only one: a file or directory this command wrote, "
        "holding nothing else)",
    )
    p.set_defaults(func=cmd_export)
    add_plan_parser(sub)
    add_report_parser(sub)
    add_chaos_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # torchrun's own option parser: see crashproof.supervisor.launch
        from crashproof.supervisor.launch import main as run_main

        try:  # a supervisor must outlive a closed pipe: SIGPIPE stays ignored
            return run_main(argv[1:])
        except SystemExit as exc:  # its usage errors: said already, in one line
            return _exit_code(exc.code)
    # Die quietly when piped into `head`, like other Unix tools.
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # a usage error (one line, said already), --help, --version
        return _exit_code(exc.code)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.func(args)
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (CrashproofError, ValueError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except Exception as exc:
        return _unexpected(args, exc)
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return EXIT_OK
    if isinstance(code, int):
        return code
    return _fail(str(code), EXIT_USAGE)


def _unexpected(args: argparse.Namespace, exc: Exception) -> int:
    """An exception no command turned into a message: the storage's, or a bug."""
    subject = next(
        (str(v) for k in ("root", "run_dir", "output", "dir") if (v := getattr(args, k, None))),
        args.command,
    )
    what = f"{type(exc).__name__}: {exc}".strip().rstrip(":").replace("\n", " ")
    log.debug("%s failed", args.command, exc_info=exc)  # -v: the traceback
    if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _STORAGE_MODULES:
        remote = "://" in subject and not subject.startswith("file://")
        return _fail(
            f"{subject}: cannot read or write the storage ({what}); check that it exists, "
            + ("the credentials (for S3: AWS_* variables, ~/.aws) and " if remote else "")
            + "the permissions",
            EXIT_STORAGE,
        )
    return _fail(
        f"{args.command} {subject}: internal error ({what}); please report it, with the "
        "traceback `crashproof -v` prints",
        EXIT_INTERNAL,
    )


if __name__ == "__main__":
    sys.exit(main())
