"""Reading one field of a logged event, whatever a hand-written or damaged log holds there: a
number is a finite int or float (never a bool), an integer may be logged as ``3.0``."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["Event", "int_field", "number_field"]

Event = dict[str, Any]


def number_field(event: Event, key: str) -> float | None:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def int_field(event: Event, key: str) -> int | None:
    value = event.get(key)
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else None
