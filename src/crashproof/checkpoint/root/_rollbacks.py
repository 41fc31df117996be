"""Rollback marks: which checkpoints a rollback abandoned, remembered in the local root.

A rollback to step ``S`` at time ``T`` abandons every checkpoint of a step after ``S`` committed
before ``T``; training then goes on from ``S`` and may commit those step numbers again, later than
``T``, with other contents. Removing the abandoned copies from a remote tier can fail (the tier is
down) or be cut short (a crash), so the mark is written to the local root first
(``ROOT/rollbacks.json``) and every reader of a tier consults it: replication removes what it
marks, restore never resumes into it. The file is small and rewritten atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from crashproof.policy import CheckpointFacts
from crashproof.storage import Storage, read_all

__all__ = [
    "ROLLBACKS_FILE",
    "RollbackMark",
    "abandoned",
    "abandoned_steps",
    "read_marks",
    "record_rollback",
]

ROLLBACKS_FILE = "rollbacks.json"
_MAX_MARKS = 64
_MAX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class RollbackMark:
    after: int
    """The step rolled back to: later steps committed before ``at`` are abandoned."""
    at: float
    """Unix time of the rollback."""


def read_marks(storage: Storage, root: str) -> list[RollbackMark]:
    """The marks of ``root``; none when the file is missing or unreadable (it only ever hides
    checkpoints, so a lost file errs toward keeping them)."""
    try:
        data = json.loads(read_all(storage, storage.join(root, ROLLBACKS_FILE), limit=_MAX_BYTES))
        return [RollbackMark(int(m["after"]), float(m["at"])) for m in data["rollbacks"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def record_rollback(storage: Storage, root: str, after: int) -> RollbackMark:
    """Add a mark for a rollback to ``after`` happening now."""
    mark = RollbackMark(after, time.time())
    marks = [*read_marks(storage, root), mark][-_MAX_MARKS:]
    body = json.dumps({"rollbacks": [{"after": m.after, "at": m.at} for m in marks]})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(body)
    try:
        storage.put_file(f.name, storage.join(root, ROLLBACKS_FILE))  # replaces in one step
    finally:
        os.unlink(f.name)
    return mark


def abandoned(marks: list[RollbackMark], step: int, created_unix: float | None) -> bool:
    """Whether a checkpoint of ``step`` committed at ``created_unix`` was abandoned by a rollback."""
    return any(step > m.after and (created_unix is None or created_unix < m.at) for m in marks)


def abandoned_steps(
    marks: list[RollbackMark], steps: Iterable[int], facts: Mapping[int, CheckpointFacts]
) -> list[int]:
    """Of a tier's ``steps`` (with their ``facts``: the commit time), those a rollback abandoned."""
    return [s for s in steps if abandoned(marks, s, facts.get(s, CheckpointFacts(s)).created_unix)]
