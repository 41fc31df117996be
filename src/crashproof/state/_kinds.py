"""Is a saved Python value of the kind the live one it replaces is? One comparison for all.

A restore puts saved values over live ones: an optimizer's hyperparameters and per-parameter
state, a scheduler's fields, a ``Value``, a JSON extra. torch's ``load_state_dict`` takes
whatever it is given, so a string learning rate, a one-element ``betas`` or a tensor of another
shape is accepted and the next training step crashes. :func:`check_same_kind` compares a saved
value with the live one before anything changes, recursively:

- numbers with numbers (``int`` and ``float`` alike, NumPy's too; a one-element tensor counts as
  one: torch accepts a tensor learning rate); ``bool`` is no number, so ``True`` and ``1`` differ;
- strings with strings, bytes with bytes;
- tensors and arrays with tensors and arrays of the same shape and dtype;
- a tuple with a tuple of the same length (``betas``, an LSTM's ``(h, c)``); a list with a list,
  of the same length where ``same_length`` (a scheduler's fields), else of any length, its items
  of the kind of the live ones when those are all of one kind (a growing history);
- a dict with a dict holding the keys the live one defines (exactly those, at every depth,
  where ``exact_keys``).

Where the live value is None it defines no kind (a ``Value(None)`` the loop fills later), and a
saved None replaces a live flag (torch's ``foreach=None``: let torch choose) or, where
``none_is_unset``, anything (optimizer state that torch creates when first needed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from crashproof.errors import StateMismatchError

__all__ = ["check_same_kind", "kind_of"]

_MAX_DEPTH = 64


def kind_of(value: Any) -> str:
    """A short description of ``value``'s kind, as the messages name it."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if _is_number(value):
        return "number"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"{type(value).__name__} {value.dtype}{list(value.shape)}"
    if isinstance(value, tuple):
        return f"tuple of {len(value)}"
    return type(value).__name__


def check_same_kind(
    live: Any,
    saved: Any,
    where: str,
    *,
    exact_keys: bool = False,
    same_length: bool = False,
    none_is_unset: bool = False,
) -> None:
    """Raise :class:`StateMismatchError` naming ``where``, what this run holds and what the
    checkpoint does, unless ``saved`` is of ``live``'s kind (see the module's docstring)."""
    _compare(live, saved, where, exact_keys, same_length, none_is_unset, 0)


def _compare(
    live: Any, saved: Any, where: str, exact: bool, same_length: bool, unset: bool, depth: int
) -> None:
    if depth > _MAX_DEPTH or live is None:
        return
    if saved is None:
        if unset or isinstance(live, (bool, np.bool_)):
            return
        _mismatch(live, saved, where)
    if isinstance(live, (bool, np.bool_)) or isinstance(saved, (bool, np.bool_)):
        if not (isinstance(live, (bool, np.bool_)) and isinstance(saved, (bool, np.bool_))):
            _mismatch(live, saved, where)
    elif (
        _is_number_like(live)
        and _is_number_like(saved)
        and not (_is_array(live) and _is_array(saved))
    ):
        return  # two numbers, one of them perhaps a one-element tensor
    elif _is_array(live) or _is_array(saved) or _is_number(live):
        if not (_is_array(live) and _is_array(saved) and _same_array(live, saved)):
            _mismatch(live, saved, where)
    elif isinstance(live, (str, bytes)):
        if type(saved) is not type(live):
            _mismatch(live, saved, where)
    elif isinstance(live, tuple):
        if not isinstance(saved, tuple) or len(saved) != len(live):
            _mismatch(live, saved, where)
        for i, (a, b) in enumerate(zip(live, saved, strict=True)):
            _compare(a, b, f"{where}[{i}]", exact, same_length, unset, depth + 1)
    elif isinstance(live, list):
        _compare_lists(live, saved, where, exact, same_length, unset, depth)
    elif isinstance(live, Mapping):
        _compare_dicts(live, saved, where, exact, same_length, unset, depth)


def _compare_lists(
    live: list[Any], saved: Any, where: str, exact: bool, same_length: bool, unset: bool, depth: int
) -> None:
    if not isinstance(saved, list) or (same_length and len(saved) != len(live)):
        _mismatch(live, saved, where)
    if len(saved) == len(live):
        pairs = list(zip(live, saved, strict=True))
    elif live and all(kind_of(v) == kind_of(live[0]) for v in live):
        pairs = [(live[0], v) for v in saved]  # a history of one kind, of another length
    else:
        return
    for i, (a, b) in enumerate(pairs):
        _compare(a, b, f"{where}[{i}]", exact, same_length, unset, depth + 1)


def _compare_dicts(
    live: Mapping[Any, Any],
    saved: Any,
    where: str,
    exact: bool,
    same_length: bool,
    unset: bool,
    depth: int,
) -> None:
    if not isinstance(saved, Mapping):
        _mismatch(live, saved, where)
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live] if exact else []
    if missing or unexpected:
        raise StateMismatchError(
            f"{where}: fields differ from this run's: missing in checkpoint "
            f"{sorted(map(str, missing))}, unexpected in checkpoint "
            f"{sorted(map(str, unexpected))}. Was another class or version saved?"
        )
    for key, value in live.items():
        _compare(value, saved[key], f"{where}[{key!r}]", exact, same_length, unset, depth + 1)


def _mismatch(live: Any, saved: Any, where: str) -> None:
    raise StateMismatchError(
        f"{where}: expected {_shown(live)} (this run's), the checkpoint holds {_shown(saved)}. "
        "Is it the same quantity, saved by the same class?"
    )


def _shown(value: Any) -> str:
    if value is None or _is_array(value):  # a tensor's values may be meta stand-ins here
        return "None" if value is None else f"a {kind_of(value)}"
    return f"a {kind_of(value)} {str(value)[:60]}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, complex, np.number)) and not isinstance(
        value, (bool, np.bool_)
    )


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def _is_number_like(value: Any) -> bool:
    """A number, or a one-element tensor (a learning rate may be either)."""
    if _is_array(value):
        return bool(value.size == 1 if isinstance(value, np.ndarray) else value.numel() == 1)
    return _is_number(value)


def _same_array(live: Any, saved: Any) -> bool:
    return bool(
        type(live) is type(saved) and live.shape == saved.shape and live.dtype == saved.dtype
    )
