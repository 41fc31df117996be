"""The format's JSON: written canonically, read defensively, within the format's limits.

Every field read from a file goes through these checks (its type, its range, a plain file name)
before it is used, so a hostile or corrupt file can cause a :class:`CorruptCheckpointError` or an
:class:`UnsafeCheckpointError`, never an out-of-bounds read or a huge allocation.
"""

from __future__ import annotations

import json
import re
from typing import Any

from crashproof.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "MAX_ELEMENTS",
    "MAX_INDEX_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_NDIM",
    "MAX_STEP",
    "MAX_WORLD_SIZE",
    "check_plain_name",
    "count_field",
    "dumps",
    "load_json",
    "require_field",
]

MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_INDEX_BYTES = 512 * 1024 * 1024
MAX_WORLD_SIZE = 1 << 20
MAX_STEP = 1 << 62
"""The largest step a manifest may record (a save of a larger one is refused)."""
MAX_NDIM = 64
MAX_ELEMENTS = 1 << 48  # even with zero-size dims, larger shapes overflow torch's stride maths
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")


def dumps(obj: Any) -> bytes:
    """Canonical JSON: sorted keys; ``allow_nan=False`` because non-finite floats are tagged."""
    return json.dumps(obj, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()


def load_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (
        ValueError,
        RecursionError,
    ) as exc:  # ValueError covers UnicodeDecodeError and huge ints
        raise CorruptCheckpointError(f"{where}: not valid JSON ({str(exc)[:200]})") from None


def require_field(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CorruptCheckpointError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (
        isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))
    ):
        raise CorruptCheckpointError(f"{where}: field {key!r} has type {type(value).__name__}")
    return value


def count_field(obj: Any, key: str, where: str, *, upper: int = MAX_STEP) -> int:
    value: int = require_field(obj, key, int, where)
    if not 0 <= value <= upper:
        raise CorruptCheckpointError(
            f"{where}: field {key!r} = {value} is out of range [0, {upper}]"
        )
    return value


def check_plain_name(name: Any, where: str) -> str:
    """A file name inside a checkpoint directory: no separators, no ``..``, no absolute paths."""
    if not isinstance(name, str) or not _PLAIN_NAME.match(name) or ".." in name:
        raise UnsafeCheckpointError(
            f"{where}: refers to {str(name)[:100]!r}, which is not a plain file name inside the "
            "checkpoint directory; the checkpoint was tampered with or is corrupt"
        )
    return name
