"""Which local checkpoints a tier lacks and wants, most urgent first.

One plan for the replicator that uploads (:mod:`crashproof.checkpoint.tiers._replicator`) and for a
trainer whose tiers the agent replicates (:mod:`crashproof.checkpoint.tiers._agent_replication`): both then spare
the same checkpoints from local retention.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from crashproof.checkpoint.format import MANIFEST_NAME, MAX_MANIFEST_BYTES, digest, parse_manifest
from crashproof.checkpoint.root import committed_steps
from crashproof.errors import CorruptCheckpointError
from crashproof.policy import CheckpointFacts, RetentionPolicy, retained
from crashproof.storage import Storage, read_all

__all__ = ["LocalCheckpoint", "LocalCheckpoints", "plan_backlog"]


@dataclass
class LocalCheckpoint:
    """A committed local checkpoint as replication sees it."""

    path: str
    manifest: bytes
    facts: CheckpointFacts
    base_step: int | None


class LocalCheckpoints:
    """The committed checkpoints of a local root with their manifests, as replication sees them.

    Manifests are re-read at every scan (they are small): a step removed by a rollback and saved
    again has a new manifest under the same name. Parsing is cached by the bytes' digest. Safe to
    share between threads."""

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage, self.root = storage, root
        self._parsed: dict[str, tuple[CheckpointFacts, int | None]] = {}
        self._lock = threading.Lock()

    def scan(self) -> dict[int, LocalCheckpoint]:
        with self._lock:
            found: dict[int, LocalCheckpoint] = {}
            parsed: dict[str, tuple[CheckpointFacts, int | None]] = {}
            for step, path in committed_steps(self.storage, self.root):
                manifest_path = self.storage.join(path, MANIFEST_NAME)
                try:
                    data = read_all(self.storage, manifest_path, limit=MAX_MANIFEST_BYTES)
                    key = digest(data)
                    if key not in self._parsed:
                        m = parse_manifest(data, self.storage.describe(manifest_path))
                        self._parsed[key] = (
                            CheckpointFacts(step, m.created_unix, m.metadata),
                            m.base_step,
                        )
                except (OSError, ValueError, CorruptCheckpointError):
                    continue  # being written, removed, or corrupt: not ours to copy now
                parsed[key] = self._parsed[key]
                facts, base = parsed[key]
                found[step] = LocalCheckpoint(path, data, facts, base)
            self._parsed = parsed
            return found


def plan_backlog(
    local: Mapping[int, LocalCheckpoint],
    durable: Mapping[int, str],
    remote_facts: Mapping[int, CheckpointFacts],
    keep: RetentionPolicy,
    max_backlog: int,
    given_up: Collection[int] = (),
) -> tuple[list[int], list[int]]:
    """``(todo, dropped)``: the local checkpoints a tier lacks and wants, most urgent first (the
    newest, then those the tier's retention keeps, a delta's base before the delta), at most
    ``max_backlog`` of them; and the older ones beyond that bound.

    ``durable`` maps the tier's steps to their manifest's digest (a local checkpoint with a
    different manifest, e.g. one saved again after a rollback, is missing from the tier).
    ``given_up``: steps that can never be copied (corrupt here), left out.
    """
    missing = {
        s for s, e in local.items() if durable.get(s) != digest(e.manifest) and s not in given_up
    }
    if not missing:
        return [], []
    facts = {s: e.facts for s, e in local.items()} | {
        s: f for s, f in remote_facts.items() if s not in local
    }
    wanted = retained(keep, list(facts.values())) & missing
    newest = max(local)
    if newest in missing:
        wanted.add(newest)
    ordered = sorted(wanted, reverse=True)
    todo: list[int] = []
    for step in ordered[:max_backlog]:
        base = local[step].base_step
        if base is not None and base in missing and base not in todo:
            todo.append(base)  # a delta is only restorable next to its base
        if step not in todo:
            todo.append(step)
    return todo, [s for s in ordered[max_backlog:] if s not in todo]
