"""``crashproof ls``, ``verify`` and ``inspect``: what a checkpoint root holds, whether it is
intact, and what one checkpoint holds; and how sizes and times are written for a person.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any

from tqdm import tqdm

from crashproof._console import say
from crashproof.checkpoint import (
    committed_steps,
    held_files,
    held_part,
    list_checkpoints,
    located,
    read_manifest,
    read_rank_index,
    unreadable,
    verify_checkpoint,
)
from crashproof.cli._conventions import fail, print_json
from crashproof.cli._roots import open_root, pick, refusal, storage_refused
from crashproof.errors import CrashproofError
from crashproof.exitcodes import EXIT_INVALID, EXIT_OK, EXIT_USAGE
from crashproof.storage import Storage

__all__ = ["add_checkpoint_parsers", "human", "iso", "raise_refusal"]


def add_checkpoint_parsers(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Register ``ls``, ``verify`` and ``inspect``; each dispatches through ``func``."""
    p = subparsers.add_parser(
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

    p = subparsers.add_parser(
        "verify", help="check every file's checksum; exit 1 if anything is invalid"
    )
    p.add_argument("root")
    p.add_argument("--step", type=int, help="only this step (default: every checkpoint)")
    p.add_argument("--latest", action="store_true", help="only the newest checkpoint")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = subparsers.add_parser("inspect", help="show a checkpoint's metadata and tensors")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="default: the newest")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)


def human(n: float) -> str:
    """A size in bytes for a person: ``512 B``, ``1.5 MB`` (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def iso(ts: float | None) -> str:
    """A Unix time as an ISO 8601 UTC time, ``-`` for none."""
    if ts is None:
        return "-"
    try:
        return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):  # a manifest's time no calendar holds
        return str(ts)


def cmd_ls(args: argparse.Namespace) -> int:
    path, storage, found = open_root(args.root)
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
            listed = list_checkpoints(storage, found, verify=args.verify, on_bytes=bar.update)
            rows = []
            for (step, ckpt), row in zip(found, listed, strict=True):
                if not (row.info.valid and row.verified is not False) and not _still_listed(
                    storage, path, ckpt
                ):  # a run writing this root removed it meanwhile (its retention)
                    say("crashproof", f"step {step} was removed while it was listed: left out")
                    continue
                # --verify gives a verdict: none on what the storage would not let be read
                # (plain ls lists such a row, its problem naming the file: test_ls_honest)
                if args.verify and not row.info.valid:
                    raise_refusal(storage, step, ckpt)
                rows.append(row)
        except OSError as exc:  # unreadable (not corrupt), named in full by list_checkpoints
            if not unreadable(exc):
                raise
            return storage_refused(storage, path, exc)
    if args.json:
        print_json([r.to_json() for r in rows])
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
        if i.ranks is not None:  # a node-local root: this node's part only
            kind += f", ranks {i.ranks[0]}-{i.ranks[-1]} of {i.world_size}"
        line = f"{i.step:>10}  {iso(i.created):<25}  {human(i.size_bytes):>10}  {kind:<18}  "
        if not args.verify:
            line += "yes" if i.valid else f"NO  {i.problem}"
        else:
            line += f"{'yes' if i.valid else 'NO':<23}  "
            line += "yes" if r.verified else f"NO  {r.problem}"
        print(line)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    path, storage, found = open_root(args.root)
    chosen = pick(found, args.step, storage.describe(path))
    if args.latest:
        chosen = chosen[:1]
    results: list[dict[str, Any]] = []
    removed: list[int] = []
    for _ in range(_RELISTS):
        for step, ckpt in chosen:
            result = _verify_one(storage, step, ckpt, quiet=args.json)
            if isinstance(result, int):
                return result  # (the storage refused a read: no verdict)
            if not result["valid"] and not _still_listed(storage, path, ckpt):
                # A run writing this root removed it meanwhile (its retention): not a fault.
                say("crashproof", f"step {step} was removed while it was verified: skipped")
                removed.append(step)
                continue
            results.append(result)
        if not (args.latest and args.step is None and removed and not results):
            break
        chosen = committed_steps(storage, path)[:1]  # --latest: the newest there is now
    if not results and removed:
        return fail(
            f"{storage.describe(path)}: step(s) {', '.join(map(str, removed))} were removed while "
            "they were verified (a run's retention); run this again",
            EXIT_USAGE,
        )
    if args.json:
        print_json(results)
    else:
        for r in results:
            print(f"step {r['step']}: {'valid' if r['valid'] else 'INVALID: ' + r['problem']}")
    return EXIT_OK if results and all(r["valid"] for r in results) else EXIT_INVALID


_RELISTS = 3
"""How often ``verify --latest`` looks again when its newest checkpoint is removed under it."""


def _verify_one(storage: Storage, step: int, ckpt: str, *, quiet: bool) -> dict[str, Any] | int:
    """The verdict on checkpoint ``step``, or the exit code of a read the storage refused."""
    total = sum(e.size for e in _manifest_files(storage, ckpt))
    result = {"step": step, "path": storage.describe(ckpt), "valid": True, "problem": ""}
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"verify step {step}",
        disable=quiet or None,
        file=sys.stderr,
    ) as bar:
        try:
            verify_checkpoint(storage, ckpt, on_bytes=bar.update)
        except (CrashproofError, OSError) as exc:
            refused = refusal(exc)
            if refused is not None:
                return storage_refused(storage, ckpt, refused)
            result |= {"valid": False, "problem": str(exc)}
    return result


def _still_listed(storage: Storage, root: str, ckpt: str) -> bool:
    """Whether ``ckpt`` is still among ``root``'s checkpoints: a checkpoint a run's retention
    removed is gone from the listing (a local removal renames it aside in one step), while a
    damaged one is still there."""
    try:
        return ckpt in dict(committed_steps(storage, root)).values()
    except OSError:
        return True  # (cannot tell: the verdict stands)


def raise_refusal(storage: Storage, step: int, ckpt: str) -> None:
    """Raise the OSError of a file of ``ckpt`` (an invalid row of ``ls``) that the storage
    refused to read, named in full; return when the checkpoint is invalid on its own."""
    try:
        read_manifest(storage, ckpt)
    except (CrashproofError, OSError) as exc:
        refused = refusal(exc)
        if refused is not None:
            raise located(storage, ckpt, refused) from exc
        return
    # The manifest reads: a listed file the storage refuses is raised by the checkpoint's own
    # listing, which reads no data for a checkpoint that failed the cheap checks.
    list_checkpoints(storage, [(step, ckpt)], verify=True)


def _manifest_files(storage: Storage, ckpt: str) -> list[Any]:
    """The files of ``ckpt`` its manifest lists (on a node-local root, the node's part's)."""
    try:
        manifest = read_manifest(storage, ckpt)
        held = held_files(storage, ckpt, manifest)
        return [e for n, e in manifest.files.items() if n in held]
    except (CrashproofError, OSError):
        return []


def cmd_inspect(args: argparse.Namespace) -> int:
    path, storage, found = open_root(args.root)
    chosen = pick(found, args.step, storage.describe(path))
    if not chosen:
        return fail(f"no checkpoints in {storage.describe(path)}", EXIT_USAGE)
    # Without --step, the newest checkpoint that reads: one whose manifest or index does not
    # (a step_* entry that is a file, one never committed) is skipped, saying why, as export does.
    for position, (step, ckpt) in enumerate(chosen):
        try:
            manifest = read_manifest(storage, ckpt)
            held = held_part(manifest, storage.list(ckpt), storage.describe(ckpt))
            ranks = [read_rank_index(storage, ckpt, manifest, r) for r in held]
            break
        except (CrashproofError, OSError) as exc:
            refused = refusal(exc)
            if refused is not None:
                return storage_refused(storage, ckpt, refused)
            if isinstance(exc, OSError):
                raise
            if args.step is not None or position == len(chosen) - 1:
                return fail(str(exc), EXIT_INVALID)
            say("crashproof", f"skipping step {step}: {exc}")
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
        print_json(report)
        return EXIT_OK
    m = manifest
    print(f"checkpoint {storage.describe(ckpt)}")
    print(
        f"  step {m.step}, kind {m.kind}, world size {m.world_size}, created {iso(m.created_unix)}"
    )
    print(
        f"  crashproof {m.library_version}, torch {m.torch_version}, checksums {m.hash_algorithm}"
    )
    if m.metadata:
        print(f"  metadata {json.dumps(m.metadata)}")
    for name, entry in sorted(m.files.items()):
        print(f"  file {name:<28} {human(entry.size):>10}  {entry.checksum}")
    for r in rank_reports:
        print(f"  rank {r['rank']}: components {', '.join(r['components'])}")
        print(f"    {'tensor':<50} {'dtype':<10} {'shape':<20} {'size':>10}")
        for t in r["tensors"]:
            print(
                f"    {t['name']:<50} {t['dtype']:<10} {t['shape']!s:<20} {human(t['nbytes']):>10}"
                + (  # a rank's piece of a sharded tensor: where it lies in the whole
                    f"  piece of {t['global_shape']} at {t['global_offset']}"
                    if "global_shape" in t
                    else ""
                )
            )
    return EXIT_OK
