"""Opening the checkpoint root a command is given: its storage and checkpoints, or exit 2 saying
what the path is instead (a file, one checkpoint, a run directory, a directory with checkpoints
further down); picking a step among them; exit 74 for a file the storage would not read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
from collections.abc import Iterator

from crashproof._rundir import EVENTS_FILE, RunDir
from crashproof.checkpoint import committed_steps, located, parse_step_dir, unreadable
from crashproof.cli._conventions import fail, usage_error
from crashproof.exitcodes import EXIT_STORAGE
from crashproof.storage import Storage, local_path, storage_for

__all__ = ["open_root", "pick", "refusal", "storage_refused"]


def open_root(root: str) -> tuple[str, Storage, list[tuple[int, str]]]:
    """The root's path, storage and checkpoints; exit 2, saying why, when it holds none."""
    if not root.strip():
        usage_error(
            "ROOT is empty: give the checkpoint root (the directory passed to CheckpointManager)"
        )
    _check_uri(root)
    try:
        path, storage = storage_for(root)
    except (TypeError, AttributeError, NotImplementedError, LookupError) as exc:
        # A storage client that cannot be made from a URI alone (ftp://, github://...).
        usage_error(f"{root}: crashproof cannot use {_scheme(root)}:// storage ({exc})")
    given = local_path(root)  # as given (a link as the root is named as such), if local
    local = given is not None
    if given is not None:
        _check_local_root(given)
    # What the listing warns about (each stray name in the root) is news only beside checkpoints;
    # without any, the one line below says what the directory is instead.
    with _held_warnings() as held:
        found = committed_steps(storage, path)
        if not found:
            usage_error(
                f"no checkpoints in {storage.describe(path)}: {_why_none(storage, path, local)}"
            )
    for record in held:
        logging.getLogger().handle(record)
    return path, storage, found


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*\Z")
"""A URI's scheme (RFC 3986): what comes before ``://``."""


def _scheme(root: str) -> str:
    return root.partition("://")[0]


def _check_uri(root: str) -> None:
    """A storage URI must name a scheme and something in it (``s3://`` alone names nothing,
    and must not be read as the local path ``s3:``)."""
    if "://" not in root or root.startswith("file://"):
        return
    scheme, _, rest = root.partition("://")
    if not _SCHEME.match(scheme):
        usage_error(
            f"{root}: not a storage URI (SCHEME://PATH, e.g. s3://BUCKET/PATH) nor a local path"
        )
    if not rest.strip("/"):
        usage_error(f"{root}: names nothing after {scheme}://; give e.g. {scheme}://BUCKET/PATH")


def pick(found: list[tuple[int, str]], step: int | None, root: str) -> list[tuple[int, str]]:
    """``found``, or only its checkpoint of ``step``; exit 2 naming the steps there are when
    there is none of that step."""
    if step is None:
        return found
    chosen = [(s, p) for s, p in found if s == step]
    if not chosen:
        steps = ", ".join(str(s) for s, _ in found) or "none"
        usage_error(f"no checkpoint of step {step} in {root} (steps present: {steps})")
    return chosen


def storage_refused(storage: Storage, ckpt: str, exc: OSError) -> int:
    """Exit 74 for a checkpoint file the storage would not read: no verdict on the checkpoint."""
    err = located(storage, ckpt, exc)
    return fail(
        f"{err.filename}: cannot be read ({err.strerror}); the storage refused it (permissions, "
        "an I/O error), which says nothing about the checkpoint: fix the access and run this again",
        EXIT_STORAGE,
    )


def refusal(exc: BaseException | None) -> OSError | None:
    """The storage's refusal to read a file (:func:`~crashproof.checkpoint.unreadable`) that
    ``exc`` is or was raised from, if any. The checkpoint reader words a manifest, index or
    directory it could not read as corruption, with the OSError as its context; a command
    answers it with exit 74 (:func:`storage_refused`), never with a verdict."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and unreadable(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


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


def _check_local_root(path: str) -> None:
    """A local root must be a directory: say what it is instead."""
    where = os.path.abspath(path)
    if os.path.islink(path) and not os.path.exists(path):
        usage_error(
            f"no checkpoints in {where}: a symbolic link to {os.readlink(path)}, which does not "
            "exist"
        )
    if not os.path.lexists(path):
        usage_error(f"no checkpoints in {where}: no such directory")
    if not os.path.isdir(path):
        kind = "a file" if os.path.isfile(path) else "not a directory (a FIFO, socket or device)"
        usage_error(
            f"no checkpoints in {where}: it is {kind}; give the checkpoint root, the directory "
            "passed to CheckpointManager"
        )
    step = parse_step_dir(os.path.basename(where))
    if step is not None:
        usage_error(
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
    if EVENTS_FILE in names:
        roots = _roots_in_events(RunDir(path).events)
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
