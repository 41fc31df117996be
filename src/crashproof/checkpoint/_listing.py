"""What ``crashproof ls`` reports for each checkpoint, and which checks stand behind it.

Two levels, named so that neither claims more than it checked:

- ``valid``: the cheap checks of :func:`~crashproof.checkpoint._catalog.describe_checkpoint`
  (the manifest parses, every file it lists is present with its listed size); no data is read.
- ``verified``: every checksum, as ``crashproof verify`` and a restore check them
  (:func:`~crashproof.checkpoint._reader.verify_checkpoint`): ``True`` or ``False`` when checked,
  ``None`` when not (``ls`` without ``--verify``).

This module only combines the two; the checks themselves live in ``_catalog`` and ``_reader``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from crashproof.checkpoint._catalog import CheckpointInfo, describe_checkpoint
from crashproof.checkpoint._reader import verify_checkpoint
from crashproof.errors import CrashproofError
from crashproof.storage import Storage

__all__ = ["Listed", "list_checkpoints"]


@dataclass(frozen=True, slots=True)
class Listed:
    """One row of ``crashproof ls``."""

    info: CheckpointInfo
    """The cheap checks' result: ``info.valid``."""
    verified: bool | None
    """Every checksum checked: True / False; None: not checked."""
    problem: str
    """What is wrong, from whichever check found it ("" when nothing was found)."""

    def to_json(self) -> dict[str, object]:
        """``CheckpointInfo``'s keys (``valid`` among them, meaning unchanged) and ``verified``."""
        return self.info.to_json() | {"verified": self.verified, "problem": self.problem}


def list_checkpoints(
    storage: Storage,
    found: list[tuple[int, str]],
    *,
    verify: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Listed]:
    """A :class:`Listed` per ``(step, path)`` of ``found``, in that order. With ``verify``, each
    valid checkpoint is read whole and its checksums checked (``on_bytes(n)`` as bytes are
    hashed); one that fails the cheap checks is ``verified=False`` without being read."""
    rows = []
    for step, path in found:
        info = describe_checkpoint(storage, step, path)
        verified: bool | None = None
        problem = info.problem
        if verify and not info.valid:
            verified = False
        elif verify:
            try:
                verify_checkpoint(storage, path, on_bytes=on_bytes)
                verified = True
            except (CrashproofError, OSError) as exc:
                verified, problem = False, str(exc)
        rows.append(Listed(info, verified, problem))
    return rows
