"""``crashproof import``: a checkpoint from elsewhere (a ``torch.save`` file, a Lightning
``.ckpt``, safetensors, a Hugging Face directory) written as a committed crashproof checkpoint,
so a running project switches to crashproof without retraining (docs/importing.md).

Exit codes as every command's: 2 for a source or option that cannot be imported (no such path,
no known layout, a pickle that needs ``--trust-pickle``, a step the root holds already), 1 for a
source whose files are damaged (truncated, not the format they claim), 74 for a file the storage
refuses or a root another process is writing. The root's earlier checkpoints are never touched.
"""

from __future__ import annotations

import argparse
import os

from crashproof.checkpoint.format import MAX_STEP
from crashproof.checkpoint.imports import Imported, import_checkpoint, read_source
from crashproof.cli._checkpoints import human
from crashproof.cli._conventions import fail, print_json, usage_error, whole_number
from crashproof.errors import ConfigError, CorruptCheckpointError, CrashproofError, RootLockedError
from crashproof.exitcodes import EXIT_INVALID, EXIT_OK, EXIT_STORAGE, EXIT_USAGE
from crashproof.storage import local_path

__all__ = ["add_import_parser"]


def add_import_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``import``; it dispatches through ``func``."""
    p = subparsers.add_parser(
        "import",
        help="bring a torch.save, Lightning, safetensors or Hugging Face checkpoint into a root",
        description="Write SRC as a committed crashproof checkpoint in ROOT (created if need be), "
        "which CheckpointManager.restore then loads. SRC: a torch.save file (.pt, .pth, .bin), "
        "a Lightning .ckpt, a .safetensors file, or a Hugging Face save_pretrained or Trainer "
        "checkpoint directory.",
    )
    p.add_argument("source", metavar="SRC")
    p.add_argument("root", metavar="ROOT")
    p.add_argument(
        "--step",
        type=whole_number(0, MAX_STEP, accepted="give a whole number from 0 to 2**62"),
        help="the checkpoint's step (default: the step SRC records: a Lightning ckpt's or a "
        "dict's global_step, trainer_state.json's global_step; else 0)",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load a torch.save file that needs full unpickling (weights_only=False), which runs "
        "code stored in the file: only for a file you made or trust",
    )
    p.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help="take PREFIX off the model's tensor names (module. of a DDP model, model. of a "
        "LightningModule's network) so they match the model you restore into",
    )
    p.add_argument("--json", action="store_true", help="print what was imported as JSON")
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    if not args.source.strip():
        usage_error(
            "SRC is empty: give a torch.save file, a .ckpt, a .safetensors file or a directory"
        )
    if not args.root.strip():
        usage_error("ROOT is empty: give the checkpoint root to import into")
    given = local_path(args.root)
    if given is not None and os.path.lexists(given) and not os.path.isdir(given):
        usage_error(
            f"{args.root}: exists and is not a directory; give the checkpoint root, a directory "
            "(created if missing)"
        )
    try:
        found = read_source(args.source, trust_pickle=args.trust_pickle)
        if args.strip_prefix is not None:
            found.strip_prefix(args.strip_prefix)
    except OSError as exc:  # the file system's refusal to read the source, naming the file
        if isinstance(exc, CrashproofError):
            raise
        return fail(
            f"{exc.filename or args.source}: cannot be read ({exc.strerror or exc}); check the "
            "permissions",
            EXIT_STORAGE,
        )
    except CorruptCheckpointError as exc:  # the source's files are damaged
        return fail(f"{exc}; nothing was imported", EXIT_INVALID)
    except ConfigError as exc:  # no such source, no known layout, a pickle needing trust
        return fail(str(exc), EXIT_USAGE)
    try:
        done = import_checkpoint(found, args.root, args.step)
    except RootLockedError as exc:  # it names the holder and what to do
        return fail(str(exc), EXIT_STORAGE)
    except ConfigError as exc:
        return fail(str(exc), EXIT_USAGE)
    except OSError as exc:  # a CheckpointWriteError too: the root could not be written
        return fail(
            f"{args.root}: the import could not be written ({exc}); check the root's storage "
            "and permissions",
            EXIT_STORAGE,
        )
    if args.json:
        print_json(done.to_json())
    else:
        _say(done)
    return EXIT_OK


def _say(done: Imported) -> None:
    parts = [f"model ({done.tensors} tensors, {human(done.bytes)})", *done.parts[1:]]
    print(
        f"imported {done.source}, a {done.layout}, as step {done.step} ({done.step_from}): "
        f"{done.checkpoint}"
    )
    print(f"  parts: {', '.join(parts)}")
    if done.extras:
        print(f"  extras: {', '.join(done.extras)}")
    for what in done.left_out:
        print(f"  left out: {what}")
    if done.newer:
        print(
            f"  note: the root holds later steps ({', '.join(map(str, done.newer))}); "
            f"CheckpointManager.restore loads the newest unless given step={done.step}"
        )
