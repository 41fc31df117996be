"""``crashproof prune``: delete the checkpoints no retention option keeps, as the writer of the
root (holding its lock, so never beside a run writing it); the newest valid one is always kept.
"""

from __future__ import annotations

import argparse

from crashproof._units import DURATION_FORMS
from crashproof.checkpoint import (
    held_part,
    hold_root,
    prune_plan,
    published_steps,
    read_manifest,
)
from crashproof.cli._conventions import duration, fail
from crashproof.cli._roots import open_root
from crashproof.errors import CrashproofError
from crashproof.exitcodes import EXIT_OK, EXIT_STORAGE, EXIT_USAGE
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
from crashproof.storage import Storage

__all__ = ["add_prune_parser"]


def add_prune_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``prune``; it dispatches through ``func``."""
    p = subparsers.add_parser(
        "prune", help="delete old checkpoints; the newest valid one is always kept"
    )
    p.add_argument("root")
    p.add_argument("--keep-last", type=int, metavar="N")
    p.add_argument(
        "--keep-every", type=int, metavar="N", help="also keep steps that are multiples of N"
    )
    p.add_argument(
        "--keep-within",
        type=duration(),
        metavar="DURATION",
        help="keep everything made within DURATION before the newest; DURATION is "
        + DURATION_FORMS,
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


def cmd_prune(args: argparse.Namespace) -> int:
    path, storage, _ = open_root(args.root)
    try:
        policies = _prune_policies(args)
    except (ValueError, CrashproofError) as exc:
        return fail(str(exc), EXIT_USAGE)
    if not policies:
        return fail(
            "prune needs at least one of --keep-last, --keep-every, --keep-within, "
            "--keep-hourly, --keep-daily, --keep-weekly, --keep-best",
            EXIT_USAGE,
        )
    policy = policies[0]
    for more in policies[1:]:
        policy = policy | more
    node_part = _node_part(storage, path)
    if node_part:
        return fail(
            f"{storage.describe(path)} holds one node's part of checkpoints saved on node-local "
            f"roots ({node_part}): one node's root cannot tell the newest step every node holds, "
            "and removing that step would leave the run nothing to resume from. Nothing was "
            "removed. Prune from the training job (CheckpointManager.prune after a restore, or "
            "its retention), or remove the same steps by hand from every node's root",
            EXIT_USAGE,
        )
    lock = None  # prune removes checkpoints: it is a writer and must hold the root's lock
    if not args.dry_run:
        try:
            storage, lock = hold_root(storage, path)  # every removal checks the hold first
        except CrashproofError as exc:  # a run is writing this root: its retention is in charge
            return fail(str(exc), EXIT_STORAGE)
    try:
        doomed = prune_plan(storage, path, policy)  # never includes the newest valid checkpoint
        kept = len(published_steps(storage, path)) - len(doomed)
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
    print(f"{len(doomed)} checkpoint(s) {'would be ' if args.dry_run else ''}removed, {kept} kept")
    return EXIT_OK


def _prune_policies(args: argparse.Namespace) -> list[RetentionPolicy]:
    """The retention policies the prune options ask for (kept: what any of them keeps)."""
    policies: list[RetentionPolicy] = []
    if args.keep_last is not None:
        policies.append(KeepLast(args.keep_last))
    if args.keep_every is not None:
        policies.append(KeepEvery(args.keep_every))
    if args.keep_within is not None:
        policies.append(KeepWithin(seconds=args.keep_within))
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


def _node_part(storage: Storage, path: str) -> str:
    """Which part of which checkpoint ``path`` holds, where a checkpoint in it was saved on
    node-local roots by several nodes (e.g. "step 30: ranks 2-3 of 4"); "" for a root that holds
    whole checkpoints. Unreadable manifests tell nothing here (the restore says why)."""
    for step, ckpt in published_steps(storage, path):
        try:
            manifest = read_manifest(storage, ckpt)
        except (CrashproofError, OSError):
            continue
        if manifest.nodes is not None and len(manifest.nodes) > 1:
            try:
                ranks = sorted(held_part(manifest, storage.list(ckpt), storage.describe(ckpt)))
            except (CrashproofError, OSError):
                ranks = []
            held = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "one node's ranks"  # (as ls)
            return f"step {step}: {held} of {manifest.world_size}"
    return ""
