"""``crashproof export``: a checkpoint written as safetensors (the model weights), as a
``torch.distributed.checkpoint`` directory, or as a Hugging Face ``save_pretrained`` directory;
never over what an export did not write.
"""

from __future__ import annotations

import argparse

from crashproof._console import output_unwritable, say
from crashproof._units import SIZE_FORMS
from crashproof.checkpoint import check_target, export_dcp, export_safetensors, list_checkpoints
from crashproof.checkpoint.export import HF_CONFIG, HfExport, export_hf
from crashproof.cli._checkpoints import human, raise_refusal
from crashproof.cli._conventions import fail, size
from crashproof.cli._roots import open_root, pick, refusal, storage_refused
from crashproof.errors import ConfigError, CorruptCheckpointError, CrashproofError
from crashproof.exitcodes import EXIT_INVALID, EXIT_OK, EXIT_STORAGE, EXIT_USAGE
from crashproof.storage import Storage

__all__ = ["add_export_parser"]


def add_export_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``export``; it dispatches through ``func``."""
    p = subparsers.add_parser("export", help="write a checkpoint in a standard format")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="default: the newest valid checkpoint")
    p.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "dcp", "hf"],
        help="safetensors: the model weights (FILE); dcp: model, optimizer, scheduler and scaler "
        "state as a torch.distributed.checkpoint directory (-o DIR); hf: the model weights and "
        f"config.json (carried as the extra {HF_CONFIG!r}) as a Hugging Face save_pretrained "
        "directory (-o DIR)",
    )
    p.add_argument("-o", "--output", required=True, metavar="FILE|DIR")
    p.add_argument(
        "--what",
        default=None,
        metavar="model|ema|optimizer|all|KEY/PATH",
        help="the state to export: model (safetensors' and hf's default), ema (the extra named "
        "'ema'), optimizer, all, or a key path as `crashproof inspect` lists it "
        "(extra/ema/state_dict/shadow); "
        "dcp's default: model, optimizer, scheduler and scaler",
    )
    p.add_argument(
        "--max-shard-size",
        type=size(),
        default="5GB",
        metavar="SIZE",
        help="safetensors above this are split into numbered files plus an index (default 5GB); "
        "SIZE is " + SIZE_FORMS,
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier export at -o (only one: a file or directory this command wrote, "
        "holding nothing else)",
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    path, storage, found = open_root(args.root)
    # Before anything is read: an export never writes over what it did not write, nor over the
    # root, an ancestor of it, or the current directory (the export functions check again).
    check_target(
        args.output,
        kind="file" if args.format == "safetensors" else "dir",
        force=args.force,
        protected=[path] if "://" not in path else [],
    )
    chosen = pick(found, args.step, storage.describe(path))
    for step, ckpt in chosen:  # newest first: the first that exports wins
        try:
            if args.step is None:
                _check_whole(storage, step, ckpt)
            if args.format == "dcp":
                state = export_dcp(storage, ckpt, args.output, force=args.force, what=args.what)
                print(
                    f"exported step {step} ({', '.join(sorted(state))}) as a "
                    f"torch.distributed.checkpoint directory: {args.output}"
                )
                return EXIT_OK
            if args.format == "hf":
                what = "model" if args.what is None else args.what
                done = export_hf(storage, ckpt, args.output, max_shard_bytes=args.max_shard_size,
                                 force=args.force, what=what)  # fmt: skip
                _say_hf(done, args.output)
                return EXIT_OK
            tensors, files = export_safetensors(
                storage,
                ckpt,
                args.output,
                max_shard_bytes=args.max_shard_size,
                force=args.force,
                what="model" if args.what is None else args.what,
            )
        except ConfigError as exc:  # the output path, or state safetensors cannot hold
            return fail(str(exc), EXIT_USAGE)
        except CrashproofError as exc:
            refused = refusal(exc)
            if refused is not None:  # not a verdict on the checkpoint: no older one instead
                return storage_refused(storage, ckpt, refused)
            if args.step is not None:
                return fail(str(exc), EXIT_INVALID)
            say("crashproof", f"skipping step {step}: {exc}")
            continue
        except OSError as exc:  # writing the output (named by its filename), or reading
            if exc.filename == args.output:
                return fail(output_unwritable("-o", args.output, exc), EXIT_STORAGE)
            return storage_refused(storage, ckpt, exc)
        size_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        where = args.output if len(files) == 1 else f"{len(files) - 1} files and {files[-1]}"
        print(f"exported {len(tensors)} tensors ({human(size_bytes)}) of step {step} to {where}")
        return EXIT_OK
    return fail(f"no valid checkpoint to export in {storage.describe(path)}", EXIT_INVALID)


def _check_whole(storage: Storage, step: int, ckpt: str) -> None:
    """An export reads the files that hold one rank's state (verified as it reads them); the
    others are checked here by their sizes, as ``ls`` checks them, so that the export of the
    newest checkpoint takes the newest that ``ls`` calls valid. (A step asked for by ``--step``
    is exported if what the export reads verifies.)"""
    row = list_checkpoints(storage, [(step, ckpt)])[0]
    if not row.info.valid:
        raise_refusal(storage, step, ckpt)  # (a file the storage refuses: exit 74, as ls)
        raise CorruptCheckpointError(row.info.problem)


def _say_hf(done: HfExport, out: str) -> None:
    size_bytes = sum(t.numel() * t.element_size() for t in done.tensors.values())
    print(
        f"exported {len(done.tensors)} tensors ({human(size_bytes)}) of step {done.step} as a "
        f"Hugging Face save_pretrained directory: {out} ({', '.join(_grouped(done.files))})"
    )
    if not done.has_config:
        say(
            "crashproof",
            f"note: {out} has no config.json, which from_pretrained needs: this checkpoint "
            f"carries no extra {HF_CONFIG!r} (an import of a Hugging Face directory carries "
            f"it; a training script saves it with TrainState(extra={{'{HF_CONFIG}': "
            "json.loads(model.config.to_json_string())})); copy the model's config.json into it",
        )


def _grouped(files: list[str]) -> list[str]:
    """The files of an hf export for a person: the shards counted, not listed."""
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    rest = [f for f in files if f not in shards]
    return [*rest, f"{len(shards)} shards"] if shards else rest
