"""What is in a checkpoint root: committed checkpoints, their summary, leftovers of failed saves."""

from __future__ import annotations

from dataclasses import dataclass

from crashproof.checkpoint._format import parse_step_dir
from crashproof.checkpoint._reader import read_manifest, verify_checkpoint
from crashproof.checkpoint._writer import TMP_PREFIX
from crashproof.errors import CorruptCheckpointError
from crashproof.policy import CheckpointFacts, RetentionPolicy, retained
from crashproof.storage import Storage

__all__ = [
    "CheckpointInfo",
    "bases_of",
    "checkpoint_facts",
    "committed_steps",
    "describe_checkpoint",
    "leftover_dirs",
    "prune_plan",
    "retention_plan",
]


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

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "path": self.path,
            "created": self.created,
            "size_bytes": self.size_bytes,
            "kind": self.kind,
            "base_step": self.base_step,
            "world_size": self.world_size,
            "valid": self.valid,
            "problem": self.problem,
        }


def committed_steps(storage: Storage, root: str) -> list[tuple[int, str]]:
    """``(step, directory)`` of every directory named like a checkpoint, newest first.

    Being listed here does not make it valid: only a verified manifest does.
    """
    found = [
        (step, storage.join(root, name))
        for name in storage.list(root)
        if (step := parse_step_dir(name)) is not None
    ]
    return sorted(found, reverse=True)


def leftover_dirs(storage: Storage, root: str) -> list[str]:
    """Temporary directories of saves that never committed, and trash of replaced ones."""
    return [
        storage.join(root, n) for n in storage.list(root) if n.startswith((TMP_PREFIX, ".trash-"))
    ]


def describe_checkpoint(storage: Storage, step: int, path: str) -> CheckpointInfo:
    """A quick look: manifest valid and files present with their sizes; no checksums read."""
    try:
        manifest = read_manifest(storage, path)
        present = set(storage.list(path))
        for name, entry in manifest.files.items():
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
        if manifest.step != step:
            raise CorruptCheckpointError(
                f"{storage.describe(path)}: the manifest is for step {manifest.step}"
            )
    except (CorruptCheckpointError, OSError) as exc:
        return CheckpointInfo(step, storage.describe(path), None, 0, "unknown", 0, False, str(exc))
    return CheckpointInfo(
        step=step,
        path=storage.describe(path),
        created=manifest.created_unix,
        size_bytes=sum(e.size for e in manifest.files.values()),
        kind=manifest.kind,
        world_size=manifest.world_size,
        valid=True,
        base_step=manifest.base_step,
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
) -> list[tuple[int, str]]:
    """Of ``found``, the checkpoints to remove: what ``keep`` does not keep, sparing
    ``keep_always`` and every full checkpoint a kept delta needs."""
    kept = retained(keep, checkpoint_facts(storage, found)) | keep_always
    kept |= bases_of(storage, dict(found), kept)
    return [(step, path) for step, path in found if step not in kept]


def prune_plan(storage: Storage, root: str, keep: RetentionPolicy) -> list[tuple[int, str]]:
    """The checkpoints ``keep`` would remove, sparing the newest one that fully verifies."""
    found = committed_steps(storage, root)
    newest_valid = newest_verified(storage, root)
    return retention_plan(
        storage, found, keep, keep_always=set() if newest_valid is None else {newest_valid}
    )
