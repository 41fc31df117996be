"""Framework state that is neither a tensor nor JSON, stored without pickle and read back safely.

A framework's checkpoint dict holds values crashproof's format does not take as they are:
hyper-parameters saved as an ``argparse.Namespace`` or a dataclass, enums, paths, sets, dict
subclasses. :func:`encode_safe` turns a tree of them into plain containers the format stores
(dicts, lists, tuples, scalars, tensors, NumPy values, bytes, dtypes), each such value tagged::

    {"__crashproof__": "<kind>", ...}

========================================  ===================================================
value                                     decoded as
========================================  ===================================================
``argparse.Namespace``                    an ``argparse.Namespace``
dataclass instance                        the live value's class when ``like`` is an instance of
                                          the same class (fields set without running
                                          ``__init__``), else a dict of its fields
``enum.Enum`` member                      the live value's enum member of that name when
                                          ``like`` is of the same enum, else its value
``pathlib.PurePath``                      ``pathlib.Path`` (a pure path of the other flavour
                                          where it was saved on another OS family)
``set``, ``frozenset``                    the same kind of set
list or tuple subclass (``namedtuple``)   a list or tuple
``OrderedDict``                           an ``OrderedDict``
another ``dict`` subclass                 the live value's class when ``like`` is of it (built
                                          from a dict of the items), else a dict
========================================  ===================================================

Decoding never imports a name found in the file and never calls a class named by it: a saved
class name is only compared with the class of the live value the caller passes as ``like``
(the value the running program built itself). Anything else is refused at encoding with
:class:`~crashproof.UnsupportedStateError` naming its key path and how to make it storable.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import pathlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from crashproof.errors import CorruptCheckpointError, UnsupportedStateError

__all__ = ["TAG", "decode_safe", "encode_safe"]

TAG = "__crashproof__"
"""The key that marks an encoded value (a user dict holding it is escaped, so it round-trips)."""

_MAX_DEPTH = 60  # below the format's own limit (64), which counts the tags this adds
_NATIVE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.Tensor,
    torch.dtype,
    np.generic,
    np.ndarray,
)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def encode_safe(
    value: Any, path: str = "", *, hint: Callable[[str, Any], str] | None = None
) -> Any:
    """``value`` as plain containers crashproof's format stores (see the module's table).

    ``hint(path, value)`` adds how to avoid an unsupported value to the refusal (a framework
    knows its own remedy: leaving a hyper-parameter out, a state_dict of plain values).
    """
    return _encode(value, path, hint, 0)


def _encode(value: Any, path: str, hint: Callable[[str, Any], str] | None, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise UnsupportedStateError(f"state nested deeper than {_MAX_DEPTH} levels at {path!r}")
    if isinstance(value, enum.Enum):  # before int and str: IntEnum and StrEnum are both
        return {
            TAG: "enum",
            "class": _qualified(type(value)),
            "name": value.name,
            "value": _encode(value.value, f"{path}/value", hint, depth + 1),
        }
    if isinstance(value, _NATIVE):
        return value
    if isinstance(value, argparse.Namespace):
        return {TAG: "namespace", "fields": _encode(vars(value), path, hint, depth + 1)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {
            TAG: "dataclass",
            "class": _qualified(type(value)),
            "fields": _encode(fields, path, hint, depth + 1),
        }
    if isinstance(value, pathlib.PurePath):
        flavour = "windows" if isinstance(value, pathlib.PureWindowsPath) else "posix"
        return {TAG: "path", "flavour": flavour, "path": str(value)}
    if isinstance(value, (set, frozenset)):
        members = [_encode(v, f"{path}/<item>", hint, depth + 1) for v in value]
        return {TAG: "frozenset" if isinstance(value, frozenset) else "set", "items": members}
    if isinstance(value, (list, tuple)):  # subclasses (namedtuple, torch.Size) come back plain
        encoded = [_encode(v, f"{path}/{i}", hint, depth + 1) for i, v in enumerate(value)]
        return encoded if isinstance(value, list) else tuple(encoded)
    if isinstance(value, dict):
        items = {
            _key(k, path, hint): _encode(v, f"{path}/{k}", hint, depth + 1)
            for k, v in value.items()
        }
        if type(value) is dict:
            return {TAG: "dict", "items": items} if TAG in value else items
        return {TAG: "mapping", "class": _qualified(type(value)), "items": items}
    remedy = hint(path, value) if hint is not None else ""
    raise UnsupportedStateError(
        f"cannot save the {type(value).__qualname__} at {path or '<root>'!r}: crashproof stores "
        "tensors, numbers, strings, lists, tuples, dicts, argparse.Namespace, dataclasses, enums, "
        "paths and sets, never a pickle. "
        + (remedy or "Replace it with one of those (a name, a number, a dict of its settings).")
    )


def _key(key: Any, path: str, hint: Callable[[str, Any], str] | None) -> Any:
    """A dict key as stored: scalars stay (the format tags non-string keys itself)."""
    if isinstance(key, (str, int, float, bool, type(None))) and not isinstance(key, enum.Enum):
        return key
    if isinstance(key, tuple) and all(isinstance(k, (str, int, float, bool)) for k in key):
        return key
    remedy = hint(path, key) if hint is not None else ""
    raise UnsupportedStateError(
        f"cannot save the dict key {key!r} ({type(key).__qualname__}) under {path or '<root>'!r}: "
        "keys must be strings, numbers, booleans, None or tuples of those. " + remedy
    )


def decode_safe(tree: Any, like: Any = None, where: str = "checkpoint") -> Any:
    """The value :func:`encode_safe` encoded; ``like``, the live value at the same place (or
    None), decides the classes of dataclasses, enums and dict subclasses (see the table)."""
    return _decode(tree, like, where, 0)


def _decode(node: Any, like: Any, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CorruptCheckpointError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    if isinstance(node, list):
        return [_decode(v, _item(like, i), f"{where}/{i}", depth + 1) for i, v in enumerate(node)]
    if isinstance(node, tuple):
        return tuple(
            _decode(v, _item(like, i), f"{where}/{i}", depth + 1) for i, v in enumerate(node)
        )
    if not isinstance(node, dict):
        return node
    if TAG not in node:
        return _decode_items(node, like, where, depth)
    try:
        return _decode_tagged(node, like, where, depth)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed {str(node)[:200]}: {exc}") from None


def _decode_tagged(node: dict[str, Any], like: Any, where: str, depth: int) -> Any:
    kind = node[TAG]
    if kind == "dict":  # a user's dict that holds TAG itself
        return _decode_items(node["items"], like, where, depth)
    if kind == "namespace":
        return argparse.Namespace(**_decode(node["fields"], _vars(like), where, depth + 1))
    if kind == "dataclass":
        live_fields = _vars(like) if dataclasses.is_dataclass(like) else None
        fields = _decode(node["fields"], live_fields, where, depth + 1)
        if _same_class(like, node["class"]) and dataclasses.is_dataclass(like):
            rebuilt = copy.copy(like)  # no __init__/__post_init__: only the saved fields change
            for name, value in fields.items():
                object.__setattr__(rebuilt, name, value)
            return rebuilt
        return fields
    if kind == "enum":
        value = _decode(node["value"], None, where, depth + 1)
        if _same_class(like, node["class"]):
            return type(like)[str(node["name"])]
        return value
    if kind == "path":
        flavour, text = node["flavour"], str(node["path"])
        native = "windows" if isinstance(pathlib.Path(), pathlib.PureWindowsPath) else "posix"
        if flavour == native:
            return pathlib.Path(text)
        return (
            pathlib.PureWindowsPath(text) if flavour == "windows" else pathlib.PurePosixPath(text)
        )
    if kind in ("set", "frozenset"):
        members = [_decode(v, None, where, depth + 1) for v in node["items"]]
        return set(members) if kind == "set" else frozenset(members)
    if kind == "mapping":
        items = _decode_items(node["items"], like, where, depth)
        if node["class"] == _qualified(OrderedDict):
            return OrderedDict(items)
        if _same_class(like, node["class"]) and isinstance(like, dict):
            return type(like)(items)
        return items
    raise ValueError(f"unknown kind {kind!r}")


def _decode_items(items: dict[Any, Any], like: Any, where: str, depth: int) -> dict[Any, Any]:
    return {k: _decode(v, _field(like, k), f"{where}/{k}", depth + 1) for k, v in items.items()}


def _same_class(like: Any, name: Any) -> bool:
    return like is not None and _qualified(type(like)) == name


def _item(like: Any, i: int) -> Any:
    return like[i] if isinstance(like, (list, tuple)) and i < len(like) else None


def _field(like: Any, key: Any) -> Any:
    if isinstance(like, Mapping):
        return like.get(key)
    return None


def _vars(like: Any) -> dict[str, Any] | None:
    if isinstance(like, argparse.Namespace):
        return vars(like)
    if dataclasses.is_dataclass(like) and not isinstance(like, type):
        return {f.name: getattr(like, f.name) for f in dataclasses.fields(like)}
    return None
