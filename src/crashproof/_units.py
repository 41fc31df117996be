"""Durations and sizes written as text: one parser each, for every option, fault spec and
environment variable that takes one, so that ``90``, ``90s`` and ``1.5m`` mean the same everywhere.

- A duration is a number of seconds, alone (``90``) or with a unit: ``s``, ``m``, ``h``, ``d``
  or ``w`` (``90s``, ``1.5m``, ``6h``, ``7d``, ``2w``).
- A size is a number of bytes, alone (``4096``) or with a unit, in any case: ``K``, ``M``,
  ``G``, ``T`` or ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000), ``KiB``, ``MiB``, ``GiB``,
  ``TiB`` (powers of 1024); a ``B`` alone is bytes.

Numbers are ASCII decimals (``1.5``, ``.5``, ``2e3``), with blanks allowed around them and
before the unit; ``nan``, ``inf``, ``1e309`` (too large for a float) and digits of other scripts
are refused. A refusal is a ``ValueError`` naming what it is about (the option or field, then the
text given) and saying what is accepted.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping

__all__ = [
    "DURATION_FORMS",
    "MAX_DURATION_S",
    "SIZE_FORMS",
    "format_duration",
    "format_size",
    "parse_duration",
    "parse_size",
]

_DURATION_UNITS = "s, m, h, d or w (90s, 1.5m, 6h, 7d, 2w)"
DURATION_FORMS = f"seconds, or a number with a unit {_DURATION_UNITS}"
"""What a duration may be, as help texts say it."""

SIZE_FORMS = (
    "bytes, or a number with K, M, G, T (also KB...: powers of 1000) or KiB, MiB, GiB, TiB "
    "(powers of 1024), e.g. 5GB, 500M, 64KiB"
)
"""What a size may be, as help texts and refusals say it."""

MAX_DURATION_S = threading.TIMEOUT_MAX
"""The longest duration accepted: the longest a thread can wait (about 292 years), so that any
accepted duration can be waited for."""

_SECONDS_PER = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_BYTES_PER = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
              "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30, "TIB": 2**40}  # fmt: skip

_NUMBER_AND_UNIT = re.compile(
    r"\s*([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", re.ASCII
)


def format_size(nbytes: float) -> str:
    """``nbytes`` in the largest power-of-1024 unit that keeps it at 1 or more: ``640 B``,
    ``400 KiB``, ``1.5 GiB`` (three significant digits)."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"


def format_duration(seconds: float) -> str:
    """A length of time for people, as precise as its size deserves: ``0.35 s``, ``16.2 s``,
    ``5 min 3 s``, ``2 h 5 min``, ``3 d 4 h``; a whole unit alone: ``1 h``, ``30 min``."""
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "min", 60)):
        if s >= size:
            rest = int(s % size // sub_size)
            return f"{int(s // size)} {unit}" + (f" {rest} {sub}" if rest else "")
    rest = int(s % 60)
    return f"{int(s // 60)} min" + (f" {rest} s" if rest else "")


def parse_duration(text: str, what: str = "", *, zero_ok: bool = False) -> float:
    """The seconds ``text`` stands for: above 0 (0 too with ``zero_ok``), finite, at most
    :data:`MAX_DURATION_S`. ``what`` (``--keep-within``, ``at``) begins the message of a
    refusal; argparse, which names the option itself, leaves it out."""
    seconds = _scaled(text, _SECONDS_PER, fold_case=False)
    if seconds is None or not (seconds >= 0 if zero_ok else seconds > 0):
        kind, floor = ("duration", ", 0 or more") if zero_ok else ("positive duration", " above 0")
        raise ValueError(
            f"{_subject(text, what)} is not a {kind}: give a finite number of seconds{floor}, "
            f"alone or with a unit {_DURATION_UNITS}"
        )
    if seconds > MAX_DURATION_S:
        raise ValueError(
            f"{_subject(text, what)} is too long a duration: give at most "
            f"{MAX_DURATION_S:.0f} seconds (about {MAX_DURATION_S / (365.25 * 86400):.0f} years)"
        )
    return seconds or 0.0  # -0 is 0


def parse_size(text: str, what: str = "") -> int:
    """The bytes ``text`` stands for, at least 1 (a fraction of a byte is dropped). ``what`` as
    for :func:`parse_duration`."""
    size = _scaled(text, _BYTES_PER, fold_case=True)
    if size is None or size < 1:
        raise ValueError(
            f"{_subject(text, what)} is not a size: give a finite number of at least 1 byte, in "
            f"{SIZE_FORMS}"
        )
    return int(size)


def _scaled(text: str, units: Mapping[str, float], *, fold_case: bool) -> float | None:
    """The number in ``text`` times its unit's factor; None when it is not a number and a unit
    of ``units``, or when the product is not finite."""
    match = _NUMBER_AND_UNIT.fullmatch(text)
    if match is None:
        return None
    number, unit = match.groups()
    factor = units.get(unit.upper() if fold_case else unit)
    if factor is None:
        return None
    value = float(number) * factor
    return value if math.isfinite(value) else None


def _subject(text: str, what: str) -> str:
    return f"{what} {text!r}" if what else repr(text)
