"""Checks of the values a user passes to the Python API, shared by every constructor that takes
a count, a duration or a switch, so that ``EverySteps(1.5)``, ``KeepLast("3")`` and
``async_save="no"`` are refused with a :class:`~crashproof.errors.ConfigError` where they are
given rather than misread (``step % 1.5``, a truthy ``"no"``) or failing steps later.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy

__all__ = ["is_count", "is_positive_seconds", "is_real", "is_switch", "real", "whole"]


def is_count(value: Any, minimum: int = 1) -> bool:
    """A whole number (an ``int``, a numpy integer; not a ``bool``) of at least ``minimum``."""
    return _integral(value) and int(value) >= minimum


def is_real(value: Any) -> bool:
    """A finite real number (an ``int``, a ``float``, a numpy scalar; not a ``bool``)."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def is_positive_seconds(value: Any) -> bool:
    """A finite number of seconds above 0."""
    return is_real(value) and value > 0


def is_switch(value: Any) -> bool:
    """True or false as a ``bool``, a numpy bool, or the integer 0 or 1: a string such as
    ``"no"`` is truthy, and is refused."""
    return isinstance(value, bool | numpy.bool_) or (_integral(value) and int(value) in (0, 1))


def whole(value: Any) -> Any:
    """A whole number as an ``int`` (a numpy integer kept in a policy would not go into JSON),
    anything else as it is (to be refused by its check)."""
    return int(value) if _integral(value) else value


def real(value: Any) -> Any:
    """A real number as an ``int`` or a ``float`` (not a numpy scalar), anything else as it is."""
    if _integral(value):
        return int(value)
    return float(value) if is_real(value) else value


def _integral(value: Any) -> bool:
    """An ``int`` or a numpy integer; a ``bool`` (an ``int`` in Python) is not a number here."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
