"""What every ``crashproof`` command does the same way: a usage error or a failure is one line
on stderr naming what it is about (:class:`OneLineParser`, :func:`fail`), and an option's value
is checked by one of a few typed validators (durations and sizes through
:mod:`crashproof._units`), so the same kind of value is refused with the same words everywhere.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import NoReturn, TypeVar

from crashproof._console import one_line, say
from crashproof._units import parse_duration, parse_size
from crashproof.exitcodes import EXIT_USAGE

__all__ = [
    "OneLineParser",
    "duration",
    "fail",
    "finite_number",
    "number_above",
    "or_auto",
    "print_json",
    "size",
    "usage_error",
    "whole_number",
]

T = TypeVar("T")


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line that names the argument (not the whole usage);
    the subcommands' parsers are of this class too (``add_subparsers`` takes the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_USAGE, one_line(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n"
        )


def fail(message: str, code: int) -> int:
    """Say ``crashproof: <message>`` in one line on stderr; returns ``code``, the exit code."""
    say("crashproof", message)
    return code


def print_json(value: object) -> None:
    """Print ``value`` as indented JSON that every parser reads: a non-finite number, which JSON
    cannot hold (Python would write ``NaN``), is written as the string "NaN", "Infinity" or
    "-Infinity"."""
    print(json.dumps(_finite(value), indent=2, allow_nan=False))


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def usage_error(message: str) -> NoReturn:
    """Fail with ``message`` and exit 2, from however deep in a command."""
    raise SystemExit(fail(message, EXIT_USAGE))


# Option types. argparse shows an ArgumentTypeError's message after "argument --option:" (a
# ValueError's it replaces with "invalid value"), so each validator raises one.


def duration(*, zero_ok: bool = False) -> Callable[[str], float]:
    """A duration in seconds (:func:`crashproof._units.parse_duration`)."""

    def parse(text: str) -> float:
        try:
            return parse_duration(text, zero_ok=zero_ok)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def size() -> Callable[[str], int]:
    """A size in bytes (:func:`crashproof._units.parse_size`)."""

    def parse(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def or_auto(parse: Callable[[str], T]) -> Callable[[str], T | None]:
    """``parse``, or None for the word ``auto`` (said in its refusals)."""

    def parse_or_auto(text: str) -> T | None:
        if text == "auto":
            return None
        try:
            return parse(text)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc}; or 'auto'") from None

    return parse_or_auto


def whole_number(
    minimum: int, maximum: int | None = None, *, accepted: str = ""
) -> Callable[[str], int]:
    """A whole number from ``minimum`` (to ``maximum``); ``accepted`` says what is accepted in
    a refusal, when the range alone does not."""
    if not accepted:
        accepted = (
            f"give a whole number, {minimum} or more"
            if maximum is None
            else f"give a whole number from {minimum} to {maximum}"
        )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text!r}: {accepted}")
        return value

    return parse


def finite_number() -> Callable[[str], float]:
    """Any finite number (its range is the command's to check)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: give a finite number")
        return value

    return parse


def number_above(bound: float, example: str) -> Callable[[str], float]:
    """A finite number above ``bound``; ``example`` is shown in a refusal."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value > bound or math.isinf(value):  # NaN too
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a number above {bound:g} (e.g. {example})"
            )
        return value

    return parse
