"""Check what a caller passes as ``save(..., metadata=)`` at the call, not in the background.

The metadata goes into ``manifest.json`` as plain JSON. A value that JSON cannot hold exactly (NaN,
a NumPy scalar, a tensor, a tuple that would come back as a list, a non-string key) is refused
here, naming its key, while the caller's stack is still the one that passed it. So is what the
JSON writer or a reader could not handle, which would otherwise fail the save in the background
or make the checkpoint unreadable:

- an integer of more than 4300 digits (Python's default limit on converting an int to or from a
  string, ``sys.int_info.default_max_str_digits``, which every reader of the manifest has, whatever
  this process set with ``sys.set_int_max_str_digits``): pass it as a string;
- nesting deeper than 32 levels (a cycle, or a structure the JSON coders would recurse into);
- metadata whose JSON is over 1 MiB (``MAX_METADATA_BYTES``): metadata is read with every
  manifest (``crashproof ls``, each restore), so large data belongs in the training state or an
  extra, not here.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Mapping
from typing import Any

from crashproof.errors import ConfigError

__all__ = ["MAX_METADATA_BYTES", "checked_metadata"]

_MAX_DEPTH = 32
MAX_METADATA_BYTES = 1 << 20
"""The largest metadata accepted: the length of its JSON as the manifest holds it (ASCII)."""
_DEFAULT_INT_DIGITS = getattr(sys.int_info, "default_max_str_digits", 4300)


@functools.cache
def _int_bound(digits: int) -> int:
    return int(10**digits)


def _max_int_digits() -> int:
    """The most digits an int may have: what a reader with Python's default limit parses, and
    what this process writes (less, if it lowered its own limit)."""
    here = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
    return min(here, _DEFAULT_INT_DIGITS) if here else _DEFAULT_INT_DIGITS


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
    budget = [MAX_METADATA_BYTES]  # a cheap lower bound, spent as the walk goes: stops early
    copied = _plain(metadata, "metadata", at, 0, budget)
    assert isinstance(copied, dict)
    size = len(json.dumps(copied, allow_nan=False, separators=(",", ":")))  # as the manifest
    if size > MAX_METADATA_BYTES:
        raise _too_large(at, f"{size} bytes of JSON")
    return copied


def _too_large(at: str, found: str) -> ConfigError:
    return ConfigError(
        f"save(metadata=...){at}: the metadata is over {MAX_METADATA_BYTES} bytes as JSON "
        f"({found}); it is read with every manifest. Keep it to small values (metrics, tags) "
        "and put large data in the training state or an extra"
    )


def _plain(value: Any, key: str, at: str, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1 + (len(value) if type(value) is str else 0)
    if budget[0] < 0:
        raise _too_large(at, f"found at {key}")
    if depth > _MAX_DEPTH:
        raise ConfigError(
            f"save(metadata=...){at}: {key} is nested deeper than {_MAX_DEPTH} levels (a cycle?)"
        )
    kind = type(value)
    if kind is int and not -_int_bound(digits := _max_int_digits()) < value < _int_bound(digits):
        raise ConfigError(
            f"save(metadata=...){at}: {key} is an integer of about "
            f"{int(value.bit_length() * math.log10(2)) + 1} digits; JSON readers (Python's int "
            f"conversion) refuse more than {digits}. Pass a float, or a string"
        )
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
        budget[0] -= sum(len(k) for k in value)
        return {k: _plain(v, f"{key}[{k!r}]", at, depth + 1, budget) for k, v in value.items()}
    if kind is list:
        return [_plain(v, f"{key}[{i}]", at, depth + 1, budget) for i, v in enumerate(value)]
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
