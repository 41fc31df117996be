"""What one agent may ask another (:mod:`._memory_peers`): every request's fields are checked
before any of them is acted on.

A peer proves it knows the run's secret before it asks anything, so a request comes from one of
the run's own agents; but an agent of another version, or one with a bug, must not be able to
make this one allocate without bound, hold memory for ever, read past a segment or end its
serving thread with an error nobody sees. A request that fails a check is refused by name
(``{"error": "malformed request: ..."}``) and the connection closed; nothing of it was kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MAX_ROOTS", "MAX_SLOTS", "MAX_TEXT", "MAX_WORLD_SIZE", "Malformed", "checked", "whole"]

MAX_WORLD_SIZE = 1 << 20
"""More ranks than any run has."""
MAX_SLOTS = 64
"""More staging slots than a trainer keeps."""
_MAX_BYTES = 1 << 50
"""More bytes than any node's memory."""
MAX_TEXT = 256
"""Longer than any name on the wire (a root's key is 16 characters)."""
MAX_ROOTS = 64
"""More checkpoint roots than a run's trainers save to (a model, its EMA, ...)."""


class Malformed(ValueError):
    """A peer's request that fails a check: what is wrong, in words."""


def whole(name: str, value: object, low: int, high: int) -> int:
    """``value`` when it is a whole number from ``low`` to ``high``; else :class:`Malformed`
    (JSON's floats, strings and booleans are not: to Python a bool is an int, never a count or
    an index on the wire)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise Malformed(f"{name} must be an integer, not {type(value).__name__}")
    if not low <= value <= high:
        raise Malformed(f"{name} {value} is outside {low}..{high}")
    return value


def _step(name: str, value: object) -> None:
    whole(name, value, 0, 1 << 62)


def _rank(name: str, value: object) -> None:
    whole(name, value, 0, MAX_WORLD_SIZE - 1)


def _world_size(name: str, value: object) -> None:
    whole(name, value, 1, MAX_WORLD_SIZE)


def _slot(name: str, value: object) -> None:
    whole(name, value, 0, MAX_SLOTS - 1)


def _size(name: str, value: object) -> None:
    whole(name, value, 0, _MAX_BYTES)


def _segment_size(name: str, value: object) -> None:
    whole(name, value, 1, _MAX_BYTES)  # (an empty segment cannot be mapped)


def _text(name: str, value: object) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
        raise Malformed(f"{name} must be a string of 1..{MAX_TEXT} characters")


def _optional_text(name: str, value: object) -> None:
    if value is not None:
        _text(name, value)


def _object(name: str, value: object) -> None:
    if not isinstance(value, dict):
        raise Malformed(f"{name} must be an object")


def _agents(name: str, value: object) -> None:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_WORLD_SIZE:
        raise Malformed(f"{name} must be a list of agents")
    for i, agent in enumerate(value):
        _text(f"{name}[{i}]", agent)


def _record(name: str, value: object) -> None:
    _object(name, value)
    assert isinstance(value, dict)
    _size(f"{name}.size", value.get("size"))


def _ranks(name: str, value: object) -> None:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_SLOTS * 16:
        raise Malformed(f"{name} must be a list of ranks, at most {MAX_SLOTS * 16}")
    for i, rank in enumerate(value):
        _rank(f"{name}[{i}]", rank)


def _segments(name: str, value: object) -> None:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_WORLD_SIZE:
        raise Malformed(f"{name} must be a list of segments")
    for i, segment in enumerate(value):
        _object(f"{name}[{i}]", segment)
        _rank(f"{name}[{i}].rank", segment.get("rank"))
        _slot(f"{name}[{i}].slot", segment.get("slot"))


Check = Callable[[str, object], None]
_ONE_RANK: Mapping[str, Check] = {"key": _text, "rank": _rank, "world_size": _world_size}
_FIELDS: Mapping[str, Mapping[str, Check]] = {
    "push": {
        **_ONE_RANK,
        "slot": _slot,
        "step": _step,
        "nbytes": _segment_size,
        "contents": _object,
        "node": _optional_text,
    },
    "have": _ONE_RANK,
    "fetch": _ONE_RANK,
    "parity_have": _ONE_RANK,
    "held": {"ranks": _ranks, "world_size": _world_size},
    "piece": {
        "key": _text,
        "step": _step,
        "world_size": _world_size,
        "agent": _text,
        "expected": _agents,
        "record": _record,
    },
    "covered": {"key": _text, "step": _step, "agent": _text},
    "parity_fetch": {"key": _text, "step": _step},
    "piece_fetch": {
        "key": _text,
        "step": _step,
        "world_size": _world_size,
        "segments": _segments,
        "offset": _size,
        "size": _size,
    },
}


def checked(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` when every field its request needs is there and in range; else
    :class:`Malformed`. Ranks are checked against the world size they come with."""
    op = message.get("op")
    if not isinstance(op, str) or op not in _FIELDS:
        raise Malformed(f"unknown request {op!r}")
    fields = _FIELDS[op]
    for name, check in fields.items():
        check(name, message.get(name))
    ranks = [message["rank"]] if "rank" in fields else []
    if op == "held":
        ranks += message["ranks"]
    if op == "piece_fetch":
        ranks += [segment["rank"] for segment in message["segments"]]
    for rank in ranks:  # (every request that names a rank comes with its world size)
        if rank >= message["world_size"]:
            raise Malformed(f"rank {rank} of a world of {message['world_size']}")
    return message
