"""Check what a caller passes as ``save(..., metadata=)`` at the call, not in the background.

The metadata goes into ``manifest.json`` as plain JSON. A value that JSON cannot hold exactly (NaN,
a NumPy scalar, a tensor, a tuple that would come back as a list, a non-string key) is refused
here, naming its key, while the caller's stack is still the one that passed it. What it does
not check: the size of the metadata (it is the caller's to keep small).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from crashproof.errors import ConfigError

__all__ = ["checked_metadata"]

_MAX_DEPTH = 32


def checked_metadata(metadata: Mapping[str, Any] | None, step: int | None = None) -> dict[str, Any]:
    """A copy of ``metadata`` that is plain JSON; :class:`ConfigError` naming the offending key
    otherwise. The copy is what is saved, so changing the caller's dict afterwards cannot change
    a save in flight."""
    at = "" if step is None else f" of step {step}"
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(
            f"save(metadata=...){at}: expected a dict of JSON values, found {type(metadata).__name__}"
        )
    copied = _plain(metadata, "metadata", at, 0)
    assert isinstance(copied, dict)
    return copied


def _plain(value: Any, key: str, at: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ConfigError(
            f"save(metadata=...){at}: {key} is nested deeper than {_MAX_DEPTH} levels (a cycle?)"
        )
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if not math.isfinite(value):
            raise ConfigError(
                f"save(metadata=...){at}: {key} is {value!r}, which JSON cannot hold. Pass a "
                "finite number, or None (or a string) for a missing value"
            )
        return value
    if isinstance(value, Mapping):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(
                f"save(metadata=...){at}: {key} has the key {bad!r} ({type(bad).__name__}); "
                "JSON keys are strings"
            )
        return {k: _plain(v, f"{key}[{k!r}]", at, depth + 1) for k, v in value.items()}
    if kind is list:
        return [_plain(v, f"{key}[{i}]", at, depth + 1) for i, v in enumerate(value)]
    hint = (
        "call .item() (a tensor or NumPy scalar) or float()/int() on it"
        if hasattr(value, "item")
        else "use a list"
        if isinstance(value, tuple)
        else "convert it to a number, string, list or dict"
    )
    raise ConfigError(
        f"save(metadata=...){at}: {key} is a {kind.__module__}.{kind.__qualname__} ({str(value)[:50]}), "
        f"not a plain JSON value; {hint}"
    )
