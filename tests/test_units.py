"""Durations and sizes in text (``crashproof._units``): what each accepts, and that hostile text
is refused with a message naming what it is about, the text, and what is accepted."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crashproof._units import MAX_DURATION_S, parse_duration, parse_size
from crashproof.cli._conventions import duration, number_above, or_auto, size, whole_number

HOSTILE = [
    "",
    " ",
    "\t\n",
    "s",  # a unit without a number
    "GB",
    ".",
    "-",
    "e3",
    "1e",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "infinity",
    "1e309",  # beyond a float: inf
    "9" * 400,
    "1e400s",
    "infGB",
    "\u0661\u0662",  # Arabic-Indic 12: float() takes them, a duration does not
    "\uff11\uff12",  # fullwidth 12
    "1\u00a0s",  # a no-break space
    "1_000",
    "0x10",
    "1,5",
    "1 2",
    "12ss",
    "1.5.2",
    "\x00",
    "1\x00",
    "ten",
    "--5",
]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("90s", 90.0),
        ("1.5m", 90.0),
        ("2h", 7200.0),
        ("7d", 7 * 86400.0),
        ("2w", 14 * 86400.0),
        (".5", 0.5),
        ("5.", 5.0),
        ("2e3", 2000.0),
        ("+3", 3.0),
        (" 90s ", 90.0),
        ("90 s", 90.0),
        ("\t1m\n", 60.0),
    ],
)
def test_a_duration_is_seconds_alone_or_with_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(text, zero_ok=True) == seconds


@pytest.mark.parametrize("text", [*HOSTILE, "0", "0s", "-1", "-5m", "-0", "1y", "1ms", "1S", "1H"])
def test_a_duration_refuses_hostile_text_naming_it_and_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(text, "--keep-within")
    message = str(info.value)
    assert message.startswith(f"--keep-within {text!r} ")
    assert "finite number of seconds" in message and "90s, 1.5m, 6h, 7d, 2w" in message
    assert "\n" not in message


def test_zero_is_a_duration_only_where_allowed() -> None:
    assert parse_duration("0", zero_ok=True) == 0.0
    assert parse_duration("0s", zero_ok=True) == 0.0
    assert math.copysign(1.0, parse_duration("-0", zero_ok=True)) == 1.0  # 0, not -0
    with pytest.raises(ValueError, match="not a positive duration"):
        parse_duration("0")
    with pytest.raises(ValueError, match="not a duration: give a finite number of seconds, 0 or"):
        parse_duration("-1", "at", zero_ok=True)


def test_a_duration_longer_than_a_thread_can_wait_is_refused() -> None:
    assert parse_duration(f"{MAX_DURATION_S:.0f}") == MAX_DURATION_S
    for text in ("1e300", "1e12", "1e9w"):
        with pytest.raises(ValueError, match="too long a duration"):
            parse_duration(text, "--timeout")


@given(st.text(max_size=12))
def test_any_text_is_a_valid_duration_or_a_value_error(text: str) -> None:
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        assert repr(text) in str(exc)
    else:
        assert 0 < seconds <= MAX_DURATION_S and math.isfinite(seconds)
        assert text.isascii()


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("1", 1),
        ("1.9", 1),  # a fraction of a byte is dropped
        ("100B", 100),
        ("5GB", 5 * 10**9),
        ("5G", 5 * 10**9),
        ("5gb", 5 * 10**9),
        ("500M", 500 * 10**6),
        ("500MB", 500 * 10**6),
        ("2K", 2000),
        ("2kb", 2000),
        ("1T", 10**12),
        ("1TB", 10**12),
        ("64KiB", 64 * 1024),
        ("64kib", 64 * 1024),
        ("4MiB", 4 * 2**20),
        ("1GiB", 2**30),
        ("1TiB", 2**40),
        ("1.5GB", 1_500_000_000),
        (" 5 GB ", 5 * 10**9),
        ("1e3", 1000),
    ],
)
def test_a_size_is_bytes_alone_or_with_a_unit(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", [*HOSTILE, "0", "0.5", "-5GB", "0KB", "5PB", "5Gi", "5KIBB"])
def test_a_size_refuses_hostile_text_naming_it_and_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text, "--max-shard-size")
    message = str(info.value)
    assert message.startswith(f"--max-shard-size {text!r} is not a size: ")
    assert "KiB" in message and "5GB" in message
    assert "\n" not in message


@given(st.text(max_size=12))
def test_any_text_is_a_valid_size_or_a_value_error(text: str) -> None:
    try:
        n = parse_size(text)
    except ValueError as exc:
        assert repr(text) in str(exc)
    else:
        assert n >= 1 and text.isascii()


# -- the command line's typed validators ------------------------------------------------------


def _refusal(parse: object, text: str) -> str:
    assert callable(parse)
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    return str(info.value)


def test_the_option_validators_turn_a_refusal_into_argparses_error() -> None:
    assert duration()("2m") == 120.0
    assert duration(zero_ok=True)("0") == 0.0
    assert "not a positive duration" in _refusal(duration(), "0")
    assert size()("5GB") == 5 * 10**9
    assert "not a size" in _refusal(size(), "lots")
    auto = or_auto(duration())
    assert auto("auto") is None and auto("30s") == 30.0
    assert _refusal(auto, "abc").endswith("; or 'auto'")


def test_whole_numbers_and_bounds() -> None:
    count = whole_number(0)
    assert count("0") == 0 and count("7") == 7
    for bad in ("-1", "x", "", "1.5", "nan"):
        assert "a whole number, 0 or more" in _refusal(count, bad)
    port = whole_number(-1, 65535, accepted="give a port")
    assert port("-1") == -1 and port("65535") == 65535
    assert _refusal(port, "65536") == "'65536': give a port"
    assert "from 1 to 3" in _refusal(whole_number(1, 3), "4")
    factor = number_above(1, "1.3")
    assert factor("1.5") == 1.5
    for bad in ("1", "0", "inf", "nan", "x"):
        assert "a number above 1 (e.g. 1.3)" in _refusal(factor, bad)
