"""Small files written whole or not at all, and JSON read back without surprises.

The one place for both: a report, a control or status file, an export's marker. A file is
written under a fresh name beside its target (created, never reused, never through a link) and
renamed into place, so a reader sees the old file or the new one, never half of one. Checkpoint
data does not come through here: the storage backends own that (:mod:`crashproof.storage`).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

from crashproof.errors import ConfigError

__all__ = [
    "check_parent",
    "fresh_name",
    "read_json_object",
    "write_atomically",
    "write_json_atomically",
]


def fresh_name(path: str, what: str) -> str:
    """A name beside ``path`` that nothing uses: ``.<name>.<what>-<random>``."""
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}.{what}-{uuid.uuid4().hex[:12]}")


def write_atomically(path: str, data: bytes, *, durable: bool = True) -> None:
    """``data`` as the file ``path``, renamed into place whole; ``durable`` fsyncs it first (a
    file that must survive a power cut; a status file rewritten every few seconds need not).
    Whatever was at ``path`` is replaced: the caller checked it may be."""
    tmp = fresh_name(path, "tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


def write_json_atomically(
    path: str, obj: Any, *, indent: int | None = None, durable: bool = False
) -> None:
    """``obj`` as JSON in the file ``path`` (see :func:`write_atomically`)."""
    text = json.dumps(obj, indent=indent) + ("\n" if indent is not None else "")
    write_atomically(path, text.encode("utf-8"), durable=durable)


def read_json_object(path: str) -> dict[str, Any] | None:
    """The JSON object in the file ``path``; None when it is missing, unreadable, not JSON or not
    an object (a file being replaced is read whole, old or new: see :func:`write_atomically`)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_parent(out: str, option: str = "-o") -> None:
    """The nearest existing directory above ``out`` must be a directory (not a file, a FIFO):
    :class:`ConfigError` naming ``option`` and ``out`` otherwise."""
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(
            f"{option} {out}: {parent} is a file, not a directory; choose a path in a directory"
        )
