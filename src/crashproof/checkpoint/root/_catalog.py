"""What is in a checkpoint root: committed checkpoints, their summary, leftovers of failed saves,
and the recovery of a publish that a crash cut short.

Only the canonical name ``checkpoint_dir_name(step)`` is a checkpoint directory; the names
crashproof itself puts in a root are known; anything else (another spelling of a step, a stray
file) is ignored with one warning per name. Reading never removes or renames anything: only
:func:`recover_interrupted` and the removals a writer makes do, and only the writer holding the
root's lock calls them (:mod:`crashproof.checkpoint.root._lock`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from crashproof.checkpoint.format import (
    MANIFEST_NAME,
    checkpoint_dir_name,
    held_part,
    parse_step_dir,
    part_files,
)
from crashproof.checkpoint.restore import read_manifest, verify_checkpoint
from crashproof.checkpoint.root._lock_file import LOCK_NAME
from crashproof.checkpoint.root._rollbacks import ROLLBACKS_FILE
from crashproof.checkpoint.save import TMP_PREFIX
from crashproof.errors import CorruptCheckpointError
from crashproof.policy import CheckpointFacts, RetentionPolicy, retained
from crashproof.storage import REPLACED_PREFIX, TRASH_PREFIX, Storage

__all__ = [
    "CheckpointInfo",
    "bases_of",
    "checkpoint_facts",
    "committed_steps",
    "describe_checkpoint",
    "leftover_dirs",
    "prune_plan",
    "published_steps",
    "recover_interrupted",
    "retention_plan",
]

log = logging.getLogger("crashproof.checkpoint")

_OWN_PREFIXES = (TMP_PREFIX, TRASH_PREFIX, REPLACED_PREFIX, f"{ROLLBACKS_FILE}.put-")
_OWN_NAMES = (LOCK_NAME, ROLLBACKS_FILE)
_LEFTOVER = (TMP_PREFIX, TRASH_PREFIX, REPLACED_PREFIX)
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One checkpoint as ``crashproof ls`` shows it."""

    step: int
    path: str
    created: float | None
    """Unix time of the commit, from the manifest (None when the manifest is unreadable)."""
    size_bytes: int
    kind: str
    """``"full"`` or ``"delta"`` (``"unknown"`` when the manifest is unreadable)."""
    world_size: int
    valid: bool
    """Manifest valid and every file present with its listed size (``verify`` checks checksums)."""
    problem: str = ""
    base_step: int | None = None
    """A delta's base: the full checkpoint it needs."""
    ranks: tuple[int, ...] | None = None
    """Saved on node-local roots: the ranks whose part this directory holds (the other nodes'
    roots hold the rest); None: every rank's files are here."""

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "path": self.path,
            "created": self.created,
            "size_bytes": self.size_bytes,
            "kind": self.kind,
            "base_step": self.base_step,
            "world_size": self.world_size,
            "ranks": None if self.ranks is None else list(self.ranks),
            "valid": self.valid,
            "problem": self.problem,
        }


def committed_steps(storage: Storage, root: str) -> list[tuple[int, str]]:
    """``(step, directory)`` of every directory named like a checkpoint, newest first.

    Being listed here does not make it valid: only a verified manifest does. A name that is not
    a checkpoint's nor one crashproof writes (``step_2`` beside ``step_0000000002``, ``step_٣``)
    is ignored with one warning.
    """
    found = []
    for name in storage.list(root):
        step = parse_step_dir(name)
        if step is not None:
            found.append((step, storage.join(root, name)))
        elif not (name in _OWN_NAMES or name.startswith(_OWN_PREFIXES)):
            _warn_ignored(storage, root, name)
    return sorted(found, reverse=True)


def _warn_ignored(storage: Storage, root: str, name: str) -> None:
    where = storage.describe(root)
    with _warned_lock:
        if (where, name) in _warned:
            return
        _warned.add((where, name))
    hint = ""
    if name.lower().startswith("step"):
        digits = name[5:]
        hint = (
            f"; step {int(digits)}'s directory is named {checkpoint_dir_name(int(digits))}"
            if digits.isascii() and digits.isdigit()
            else "; a checkpoint directory is named step_ followed by ten or more ASCII digits"
        )
    log.warning("ignoring %r in %s: not a checkpoint directory%s", name, where, hint)


def _warn_not_published(storage: Storage, root: str, path: str) -> None:
    with _warned_lock:
        if (storage.describe(root), path) in _warned:
            return
        _warned.add((storage.describe(root), path))
    log.warning(
        "%s holds no %s: not a checkpoint, left alone", storage.describe(path), MANIFEST_NAME
    )


def leftover_dirs(storage: Storage, root: str) -> list[str]:
    """Temporary directories of saves that never committed, and trash of replaced ones.

    Only the writer holding the root's lock may remove them: a live writer's save in progress
    looks exactly like this. Call :func:`recover_interrupted` first."""
    return [storage.join(root, n) for n in storage.list(root) if n.startswith(_LEFTOVER)]


def _interrupted_step(name: str) -> int | None:
    """The step of a temporary or set-aside copy's name (``.tmp-step_<N>-...``), else None."""
    for prefix in (TMP_PREFIX, REPLACED_PREFIX):
        if name.startswith(prefix):
            return parse_step_dir(name[len(prefix) :].partition("-")[0])
    return None


def recover_interrupted(storage: Storage, root: str) -> list[int]:
    """Put back a complete copy of every step whose publish a crash cut short; returns the steps.

    A step whose directory is missing or incomplete but which has a complete copy (manifest
    valid, every file present with its size) under a temporary name (the save was publishing it:
    its manifest is written only once every rank's files are) or set aside as ``.replaced-*``
    (the previous copy, where the two could not swap names in one step) gets that copy back
    under its name, the newer first. For the writer holding the root's lock, before it removes
    leftovers; readers never call it."""
    names = storage.list(root)
    present = {step for n in names if (step := parse_step_dir(n)) is not None}
    spares: dict[int, list[str]] = {}
    for name in names:
        step = _interrupted_step(name)
        if step is not None:
            spares.setdefault(step, []).append(name)
    recovered = []
    for step, candidates in sorted(spares.items()):
        final = storage.join(root, checkpoint_dir_name(step))
        if step in present and describe_checkpoint(storage, step, final).valid:
            continue
        for name in sorted(candidates, key=lambda n: (not n.startswith(TMP_PREFIX), n)):
            spare = storage.join(root, name)
            if not describe_checkpoint(storage, step, spare).valid:
                continue
            log.warning(
                "checkpoint step %d: a crash interrupted its publishing; put back the complete "
                "copy %s as %s",
                step,
                storage.describe(spare),
                storage.describe(final),
            )
            storage.publish(spare, final, commit_marker=MANIFEST_NAME)
            recovered.append(step)
            break
    return recovered


def describe_checkpoint(storage: Storage, step: int, path: str) -> CheckpointInfo:
    """A quick look: manifest valid and files present with their sizes; no checksums read."""
    try:
        manifest = read_manifest(storage, path)
        if manifest.step != step:  # read_manifest checks a step directory; this is any copy
            raise CorruptCheckpointError(
                f"{storage.describe(path)}: the manifest is for step {manifest.step}, not {step}"
            )
        present = set(storage.list(path))
        # Saved on node-local roots: this directory holds one node's part (its ranks' files).
        held = held_part(manifest, present, storage.describe(path))
        mine = part_files(held)
        for name, entry in manifest.files.items():
            if manifest.nodes is not None and name not in mine:
                continue
            if name not in present:
                raise CorruptCheckpointError(
                    f"{storage.describe(storage.join(path, name))}: missing"
                )
            stream = storage.open(storage.join(path, name))
            try:
                size = stream.size()
            finally:
                stream.close()
            if size != entry.size:
                raise CorruptCheckpointError(
                    f"{storage.describe(storage.join(path, name))}: {size} bytes, manifest lists {entry.size}"
                )
    except (CorruptCheckpointError, OSError) as exc:
        return CheckpointInfo(step, storage.describe(path), None, 0, "unknown", 0, False, str(exc))
    return CheckpointInfo(
        step=step,
        path=storage.describe(path),
        created=manifest.created_unix,
        size_bytes=sum(e.size for n, e in manifest.files.items() if n in mine),
        kind=manifest.kind,
        world_size=manifest.world_size,
        valid=True,
        base_step=manifest.base_step,
        ranks=None if manifest.nodes is None else held,
    )


def bases_of(storage: Storage, paths: dict[int, str], steps: set[int]) -> set[int]:
    """The full checkpoints the deltas among ``steps`` are taken against (retention keeps them)."""
    bases = set()
    for step in steps:
        if step not in paths:
            continue
        try:
            manifest = read_manifest(storage, paths[step])
        except (CorruptCheckpointError, OSError):
            continue  # unreadable: it needs nothing, it will never be restored
        if manifest.base_step is not None:
            bases.add(manifest.base_step)
    return bases


def newest_verified(storage: Storage, root: str) -> int | None:
    """The step of the newest checkpoint whose every checksum verifies (reads it whole)."""
    for step, path in committed_steps(storage, root):
        try:
            if verify_checkpoint(storage, path).step == step:
                return step
        except (CorruptCheckpointError, OSError):
            continue
    return None


def checkpoint_facts(storage: Storage, found: list[tuple[int, str]]) -> list[CheckpointFacts]:
    """What retention policies judge by, from each checkpoint's manifest (only the step when the
    manifest is unreadable)."""
    facts = []
    for step, path in found:
        try:
            manifest = read_manifest(storage, path)
            facts.append(CheckpointFacts(step, manifest.created_unix, manifest.metadata))
        except (CorruptCheckpointError, OSError):
            facts.append(CheckpointFacts(step))
    return facts


def retention_plan(
    storage: Storage,
    found: list[tuple[int, str]],
    keep: RetentionPolicy,
    *,
    keep_always: set[int],
    facts: list[CheckpointFacts] | None = None,
    unusable: frozenset[int] = frozenset(),
) -> list[tuple[int, str]]:
    """Of ``found``, the checkpoints to remove: what ``keep`` does not keep, sparing
    ``keep_always`` and every full checkpoint a kept delta needs.

    ``facts``: what ``keep`` judges by (default: read from each manifest of ``found``); may name
    a checkpoint not yet in ``found`` (a save not yet committed, judged as if it were).
    ``unusable``: steps whose copy in ``found`` the run found corrupt. They are not counted
    among what ``keep`` keeps (a corrupt copy is not one of "the newest n") and their copies are
    removed, even of a step in ``keep_always`` (the step being saved again replaces it anyway),
    unless a kept delta names it as its base."""
    if facts is None:
        facts = checkpoint_facts(storage, found)
    judged = [f for f in facts if f.step not in unusable or f.step in keep_always]
    kept = retained(keep, judged) | keep_always
    bases = bases_of(storage, dict(found), kept - unusable)
    kept |= bases
    return [
        (step, path)
        for step, path in found
        if step not in kept or (step in unusable and step not in bases)
    ]


def prune_plan(
    storage: Storage, root: str, keep: RetentionPolicy, *, keep_always: int | None = None
) -> list[tuple[int, str]]:
    """The checkpoints ``keep`` would remove, sparing the newest one that fully verifies and
    ``keep_always`` (a step known good beyond this root: on node-local roots, every node's)."""
    found = published_steps(storage, root)
    spared = {s for s in (newest_verified(storage, root), keep_always) if s is not None}
    return retention_plan(storage, found, keep, keep_always=spared)


def published_steps(storage: Storage, root: str) -> list[tuple[int, str]]:
    """:func:`committed_steps` that hold a manifest: the ones retention counts and removes.

    A save is published whole, manifest included, so a ``step_*`` entry without one (a file, or
    a folder someone put there) is not crashproof's: it is left alone, with one warning."""
    found = []
    for step, path in committed_steps(storage, root):
        if _has_manifest(storage, path):
            found.append((step, path))
        else:
            _warn_not_published(storage, root, path)
    return found


def _has_manifest(storage: Storage, path: str) -> bool:
    try:
        return MANIFEST_NAME in storage.list(path)
    except OSError:  # a file, or gone
        return False
