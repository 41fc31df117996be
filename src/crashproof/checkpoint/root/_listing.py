"""What ``crashproof ls`` reports for each checkpoint, and which checks stand behind it.

Two levels, named so that neither claims more than it checked:

- ``valid``: the cheap checks of :func:`~crashproof.checkpoint.root._catalog.describe_checkpoint`
  (the manifest parses, every file it lists is present with its listed size); no data is read.
- ``verified``: every checksum, as ``crashproof verify`` and a restore check them
  (:func:`~crashproof.checkpoint.restore._rank_read.verify_checkpoint`): ``True`` or ``False`` when checked,
  ``None`` when not (``ls`` without ``--verify``).

A file the storage refuses to read (permissions, an I/O error) says nothing about the
checkpoint: :func:`unreadable` tells such an error from corruption, and ``verify`` raises it
(naming the file, :func:`located`) instead of calling the checkpoint unverified. This module
only combines the checks; they live in ``_catalog`` and ``_rank_read``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

from crashproof.checkpoint.restore import read_manifest, unreadable, verify_checkpoint
from crashproof.checkpoint.root._catalog import CheckpointInfo, describe_checkpoint
from crashproof.errors import CrashproofError
from crashproof.storage import Storage

__all__ = ["Listed", "list_checkpoints", "located", "unreadable"]


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
    hashed); one that fails the cheap checks is ``verified=False`` without being read. A file
    the storage refuses to read raises its OSError (:func:`located`): no verdict is given on
    what could not be read."""
    rows = []
    for step, path in found:
        info = describe_checkpoint(storage, step, path)
        if not info.valid:
            info, refused = _with_manifest(storage, path, info)
            if verify and refused is not None:
                raise refused
        verified: bool | None = None
        problem = info.problem
        if verify and not info.valid:
            verified = False
        elif verify:
            try:
                verify_checkpoint(storage, path, on_bytes=on_bytes)
                verified = True
            except (CrashproofError, OSError) as exc:
                if isinstance(exc, OSError) and unreadable(exc):
                    raise located(storage, path, exc) from exc
                verified, problem = False, str(exc)
        rows.append(Listed(info, verified, problem))
    return rows


def located(storage: Storage, ckpt_dir: str, exc: OSError) -> OSError:
    """``exc`` (same type and errno) naming its file in full: the reader opens files relative
    to their checkpoint directory, so the error names only ``rank_00001.safetensors``."""
    name = exc.filename
    if not isinstance(name, str) or not name:
        name = storage.describe(ckpt_dir)
    elif "/" not in name:  # opened relative to the checkpoint directory
        name = storage.describe(storage.join(ckpt_dir, name))
    elif "://" not in name:
        name = os.path.abspath(name)
    return type(exc)(exc.errno, exc.strerror or str(exc), name)


def _with_manifest(
    storage: Storage, ckpt_dir: str, info: CheckpointInfo
) -> tuple[CheckpointInfo, OSError | None]:
    """An invalid row with what its manifest says (created, size, kind) when the manifest
    itself reads and parses: a data file that cannot be read, or has the wrong size, leaves
    the rest of the checkpoint's description true. Also the error of a file the storage
    refuses to open (:func:`located`), if any: then the row's problem says so."""
    try:
        manifest = read_manifest(storage, ckpt_dir)
    except (CrashproofError, OSError):
        return info, None
    if manifest.step != info.step:
        return info, None
    problem, refused = info.problem, None
    for name in manifest.files:  # the storage refusing a file is not the checkpoint's fault
        try:
            storage.open(storage.join(ckpt_dir, name)).close()
        except OSError as exc:
            if unreadable(exc):
                refused = located(storage, ckpt_dir, exc)
                problem = (
                    f"{refused.filename}: cannot be read ({refused.strerror}); a storage "
                    "problem, not a sign of corruption: check the permissions and the device"
                )
                break
    return dataclasses.replace(
        info,
        created=manifest.created_unix,
        size_bytes=sum(e.size for e in manifest.files.values()),
        kind=manifest.kind,
        world_size=manifest.world_size,
        base_step=manifest.base_step,
        problem=problem,
    ), refused
