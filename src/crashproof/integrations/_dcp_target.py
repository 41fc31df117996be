"""Where a DCP save goes and a DCP load reads from: one checkpoint directory, named by the user.

Two spellings name it (docs/dcp.md):

- ``path``: the checkpoint directory itself, a local path or a storage URI (``s3://b/ckpt``);
- ``root, step=N``: ``root/step_000000000N``, the directory a :class:`~crashproof.CheckpointManager`
  on ``root`` would use, which ``crashproof ls``, ``verify`` and ``inspect`` list.

A save writes into a temporary sibling (``.tmp-<name>-dcp``, which every crashproof reader
ignores) and publishes it under the final name in one atomic step.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from crashproof.checkpoint.format import (
    MANIFEST_NAME,
    MAX_STEP,
    checkpoint_dir_name,
    parse_step_dir,
)
from crashproof.checkpoint.save import TMP_PREFIX
from crashproof.errors import CheckpointWriteError, ConfigError
from crashproof.storage import Storage, local_path, storage_for

__all__ = ["Target"]

_TMP_SUFFIX = "-dcp"
"""One temporary name per target, the same on every rank, so the ranks need not agree on a
random one: DCP's plan caching may hand a rank the plan of an earlier save."""


@dataclass(frozen=True)
class Target:
    """A checkpoint directory: its storage, the directory, its temporary sibling, its step."""

    storage: Storage
    final: str
    tmp: str
    step: int
    local: str | None
    """The final directory's local path, None on other storage."""

    @classmethod
    def of(cls, path: str | os.PathLike[str], step: int | None = None) -> Target:
        """The checkpoint directory ``path`` names (``step`` None), or ``path/step_<step>``."""
        text = os.fspath(path)
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{path!r}: give a checkpoint directory (a path or a storage URI)")
        if step is not None:
            if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
                raise ConfigError(f"step={step!r}: a checkpoint's step is an int from 0")
            return cls._at(text, checkpoint_dir_name(step))
        local = local_path(text)
        if local is not None:
            parent, name = os.path.split(os.path.abspath(local))
        elif "/" in text.rstrip("/").split("://", 1)[-1]:
            parent, name = text.rstrip("/").rsplit("/", 1)
        else:
            raise ConfigError(f"{text!r}: names a bucket or store, not a directory in it")
        return cls._at(parent, name)

    @classmethod
    def _at(cls, parent: str, name: str) -> Target:
        if name in ("", ".", "..") or name.startswith(TMP_PREFIX):
            raise ConfigError(f"{parent}/{name}: not a name a checkpoint directory can have")
        root, storage = storage_for(parent)
        final = storage.join(root, name)
        local = final if local_path(parent) is not None else None
        step = parse_step_dir(name)
        tmp = storage.join(root, f"{TMP_PREFIX}{name}{_TMP_SUFFIX}")
        return cls(storage, final, tmp, 0 if step is None else step, local)

    @property
    def where(self) -> str:
        """The checkpoint directory, as messages name it."""
        return self.storage.describe(self.final)

    def prepare(self, *, overwrite: bool) -> None:
        """Before any rank writes: refuse a target that holds what must not be replaced, and
        clear what an earlier save to it, cut short, left in the temporary directory."""
        local = self.local
        if local is not None and os.path.lexists(local) and not _plain_dir(local):
            raise CheckpointWriteError(
                errno.EEXIST,
                f"{self.where} exists and is not a directory; crashproof replaces only its "
                "own checkpoints: choose another path",
            )
        names = self.storage.list(self.final)
        if MANIFEST_NAME in names and not overwrite:
            raise CheckpointWriteError(
                errno.EEXIST,
                f"{self.where} already holds a committed checkpoint; pass overwrite=True to "
                "replace it (atomically: it stays whole until the new one is committed), or "
                "save to another path",
            )
        if names and MANIFEST_NAME not in names:
            raise CheckpointWriteError(
                errno.EEXIST,
                f"{self.where} holds files but no crashproof manifest ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}): not a crashproof checkpoint, so it is "
                "never replaced; choose another path or remove it yourself",
            )
        self.storage.remove(self.tmp)


def _plain_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)
