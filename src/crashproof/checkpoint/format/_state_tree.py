"""Turn a state tree (nested dicts, lists, tuples, scalars, tensors) into JSON and back, no pickle.

Tensors are taken out of the tree and replaced by ``{"$tensor": i}``, an index into a tensor table
that the shard writer stores as raw bytes. Everything else must be representable exactly in JSON:

========================  =============================================
Python value              JSON
========================  =============================================
None, bool, int, str      themselves (ints of any size: Python's json is exact)
float                     itself (``repr`` round-trips exactly); non-finite as ``{"$float": "nan"}``
complex                   ``{"$complex": [real, imag]}``
list                      a list
tuple                     ``{"$tuple": [...]}``
dict with plain str keys  an object (keys starting with ``$`` force the tagged form)
any other dict            ``{"$dict": [[key, value], ...]}`` (keys encoded like values)
bytes                     ``{"$bytes": "<base64>"}``
torch.dtype               ``{"$dtype": "float32"}``
numpy scalar              ``{"$npscalar": "<dtype>", "value": ...}``
numpy array               ``{"$ndarray": i}`` (stored through the tensor table)
DTensor (FSDP2, TP)       ``{"$dtensor": i}``: this rank's piece in the tensor table, its place
                          in the whole tensor in the index (see :mod:`crashproof.checkpoint.restore._dcp_reader`)
========================  =============================================

Anything else raises :class:`UnsupportedStateError` naming the path of the offending value, so a
user learns at the first save, not at the first restore, that their state cannot be stored.
Decoding never constructs any type outside this table.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from crashproof.checkpoint.format._dtypes import dtype_from_name, dtype_name
from crashproof.errors import CorruptCheckpointError, UnsupportedStateError
from crashproof.state import is_dtensor

__all__ = ["JSONValue", "decode_tree", "encode_tree", "tensor_references"]

JSONValue = Any  # JSON-compatible value; a precise recursive alias buys nothing for mypy here

# Deeper trees than this are not real training state; refusing them keeps decoding bounded.
MAX_DEPTH = 64
_TAGS = (
    "$tensor",
    "$dtensor",
    "$ndarray",
    "$tuple",
    "$dict",
    "$float",
    "$complex",
    "$bytes",
    "$dtype",
    "$npscalar",
)


def encode_tree(value: Any, tensors: list[tuple[str, torch.Tensor]], path: str = "") -> JSONValue:
    """Encode ``value``; tensors are appended to ``tensors`` as ``(path, tensor)``."""
    return _encode(value, tensors, path, 0)


def _plain_numbers(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether every item is an exact ``int`` or a finite ``float``, which encode as themselves.

    A shortcut taken at every save: Python's RNG state alone is a tuple of 625 ints, and a
    save's pause is the training loop's."""
    return all(type(v) is int or (type(v) is float and math.isfinite(v)) for v in items)


def _encode(
    value: Any, tensors: list[tuple[str, torch.Tensor]], path: str, depth: int
) -> JSONValue:
    if depth > MAX_DEPTH:
        raise UnsupportedStateError(f"state nested deeper than {MAX_DEPTH} levels at {path!r}")
    # Before the Python scalars: np.float64 subclasses float but must come back as np.float64.
    if isinstance(value, np.generic) and value.dtype.kind in "biufc":
        if isinstance(value.item(), np.generic):  # longdouble: no exact Python equivalent
            raise UnsupportedStateError(
                f"numpy {value.dtype} scalar at {path!r}: extended precision has no exact JSON form; "
                "convert it to float64 in your state_dict()"
            )
        return {
            "$npscalar": value.dtype.str,
            "value": _encode(value.item(), tensors, path, depth + 1),
        }
    if isinstance(value, complex):
        return {
            "$complex": [
                _encode(value.real, tensors, path, depth + 1),
                _encode(value.imag, tensors, path, depth + 1),
            ]
        }
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # also normalises int subclasses such as IntEnum
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
    if is_dtensor(value):  # before plain tensors: a DTensor is one, but only a piece is ours
        dtype_name(value.dtype, where=path)
        tensors.append((path, value))
        return {"$dtensor": len(tensors) - 1}
    if isinstance(value, torch.Tensor):
        if value.is_sparse or value.layout != torch.strided:
            raise UnsupportedStateError(
                f"tensor at {path!r} has layout {value.layout}; only dense tensors are saved. "
                "Convert it with .to_dense() in your state_dict()."
            )
        dtype_name(value.dtype, where=path)  # fail now on an unsupported dtype
        tensors.append((path, value))
        return {"$tensor": len(tensors) - 1}
    if isinstance(value, np.ndarray):
        if value.dtype == np.object_:
            raise UnsupportedStateError(
                f"numpy object array at {path!r} cannot be saved without pickle"
            )
        # numpy calls some negatively strided arrays C-contiguous; torch refuses any negative stride.
        plain = value.flags.c_contiguous and all(s >= 0 for s in value.strides)
        contiguous = value if plain else value.copy(order="C")
        tensors.append((path, torch.from_numpy(contiguous)))
        return {"$ndarray": len(tensors) - 1}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value, where=path)}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list):
        if _plain_numbers(value):
            return list(value)
        return [_encode(v, tensors, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):  # includes torch.Size
        if _plain_numbers(value):
            return {"$tuple": list(value)}
        return {
            "$tuple": [_encode(v, tensors, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]
        }
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, tensors, f"{path}/{k}", depth + 1) for k, v in value.items()}
        return {
            "$dict": [
                [
                    _encode(k, tensors, f"{path}/<key>", depth + 1),
                    _encode(v, tensors, f"{path}/{k}", depth + 1),
                ]
                for k, v in value.items()
            ]
        }
    raise UnsupportedStateError(
        f"cannot save a value of type {type(value).__qualname__} at {path!r}: crashproof stores "
        "tensors and JSON-like values only and never pickles. Give the object state_dict() and "
        "load_state_dict() methods that return such values, or leave it out of the TrainState."
    )


def decode_tree(
    node: JSONValue,
    load_tensor: Callable[[int], torch.Tensor],
    where: str,
    depth: int = 0,
    load_sharded: Callable[[int], torch.Tensor] | None = None,
) -> Any:
    """Rebuild the value encoded by :func:`encode_tree`; ``load_tensor(i)`` supplies tensor ``i``.

    ``load_sharded(i)`` supplies a sharded tensor (a ``$dtensor``); without it, this rank's piece
    comes from ``load_tensor(i)``. ``where`` names the file being decoded, for error messages.
    """
    if depth > MAX_DEPTH:
        raise CorruptCheckpointError(f"{where}: state tree nested deeper than {MAX_DEPTH} levels")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [decode_tree(v, load_tensor, where, depth + 1, load_sharded) for v in node]
    if not isinstance(node, dict):
        raise CorruptCheckpointError(
            f"{where}: unexpected JSON value of type {type(node).__name__}"
        )
    tag = next((k for k in node if k.startswith("$")), None)
    if tag is None:
        return {
            k: decode_tree(v, load_tensor, where, depth + 1, load_sharded) for k, v in node.items()
        }
    try:
        return _decode_tagged(tag, node, load_tensor, where, depth, load_sharded)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(
            f"{where}: malformed {tag} entry {str(node)[:200]}: {exc}"
        ) from None


def _decode_tagged(
    tag: str,
    node: dict[str, Any],
    load_tensor: Callable[[int], torch.Tensor],
    where: str,
    depth: int,
    load_sharded: Callable[[int], torch.Tensor] | None,
) -> Any:
    def sub(v: JSONValue) -> Any:
        return decode_tree(v, load_tensor, where, depth + 1, load_sharded)

    if tag not in _TAGS or (len(node) != 1 and tag != "$npscalar"):
        raise CorruptCheckpointError(f"{where}: unknown or malformed tag {tag!r}")
    body = node[tag]
    if tag == "$tensor":
        return load_tensor(_index(body))
    if tag == "$dtensor":
        return (load_sharded or load_tensor)(_index(body))
    if tag == "$ndarray":
        return _ndarray(load_tensor(_index(body)), where)
    if tag == "$tuple":
        return tuple(sub(v) for v in _list(body))
    if tag == "$dict":
        pairs = [_list(p) for p in _list(body)]
        if any(len(p) != 2 for p in pairs):
            raise CorruptCheckpointError(f"{where}: a $dict entry is not a [key, value] pair")
        return {_hashable(sub(k), where): sub(v) for k, v in pairs}
    if tag == "$float":
        if body not in ("nan", "inf", "-inf"):
            raise CorruptCheckpointError(f"{where}: bad non-finite float {body!r}")
        return float(body)
    if tag == "$complex":
        parts = [sub(v) for v in _list(body)]
        if len(parts) != 2 or not all(isinstance(p, float) for p in parts):
            raise CorruptCheckpointError(f"{where}: a $complex entry is not two floats")
        return complex(parts[0], parts[1])
    if tag == "$bytes":
        return base64.b64decode(str(body), validate=True)
    if tag == "$dtype":
        return dtype_from_name(str(body), where=where)
    # $npscalar: the dtype string comes from the file, so only plain numeric kinds are accepted.
    np_dtype = np.dtype(str(body))
    if np_dtype.kind not in "biufc":
        raise CorruptCheckpointError(f"{where}: numpy scalar of unsupported dtype {body!r}")
    value = sub(node["value"])
    if not isinstance(value, (bool, int, float, complex)):
        raise CorruptCheckpointError(
            f"{where}: numpy scalar value {str(value)[:50]} is not a number"
        )
    try:
        with np.errstate(all="raise"):
            return np_dtype.type(value)
    except (OverflowError, FloatingPointError):
        raise CorruptCheckpointError(f"{where}: {value} does not fit numpy {np_dtype}") from None


def _ndarray(tensor: torch.Tensor, where: str) -> np.ndarray[Any, Any]:
    """The array a ``$ndarray`` entry holds, sharing the tensor's memory.

    A ``meta`` tensor (shapes only: ``crashproof verify``, a tensor not read yet) gives a
    stand-in of the array's shape and dtype that costs no memory (a read-only broadcast of one
    element), so a check of the tree sees an array where the checkpoint has one, and both
    readers refuse a dtype NumPy lacks (bfloat16, float8) alike."""
    try:
        np_dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype
    except TypeError:
        raise CorruptCheckpointError(
            f"{where}: a NumPy array of dtype {tensor.dtype}, which NumPy does not have"
        ) from None
    if tensor.is_meta:
        return np.broadcast_to(np.zeros((), dtype=np_dtype), tuple(tensor.shape))
    return tensor.numpy()


_REFERENCES = ("$tensor", "$dtensor", "$ndarray")


def tensor_references(node: JSONValue, where: str) -> dict[int, str]:
    """Each tensor entry the encoded tree refers to, and the path it is referred to from: the name
    :func:`encode_tree` gave it (for a dict key that is not a plain string or integer, a path
    no tensor is named by). Raises :class:`CorruptCheckpointError` for an entry referred to
    twice: the writer refers to each once, and two references would make two values (an
    optimizer's state and a live weight, two arrays) share one tensor's memory."""
    found: dict[int, str] = {}

    def walk(value: JSONValue, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(
                f"{where}: state tree nested deeper than {MAX_DEPTH} levels"
            )
        if isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}/{i}", depth + 1)
            return
        if not isinstance(value, dict):
            return
        tag = next((k for k in value if k.startswith("$")), None)
        if tag in _REFERENCES and type(value[tag]) is int:
            i = value[tag]
            if i in found:
                raise CorruptCheckpointError(
                    f"{where}: tensor #{i} is referred to twice in the state (at "
                    f"{found[i].lstrip('/')[:100]!r} and {path.lstrip('/')[:100]!r}); each value "
                    "has its own tensor"
                )
            found[i] = path
        elif tag is None:
            for k, v in value.items():
                walk(v, f"{path}/{k}", depth + 1)
        elif tag == "$tuple" and isinstance(value[tag], list):
            walk(value[tag], path, depth)
        elif tag == "$dict" and isinstance(value[tag], list):
            for pair in value[tag]:
                if isinstance(pair, list) and len(pair) == 2:
                    key = pair[0]
                    plain = isinstance(key, (str, int)) and not isinstance(key, bool)
                    walk(pair[0], f"{path}/<key>", depth + 1)
                    walk(pair[1], f"{path}/{key if plain else '<key>'}", depth + 1)

    walk(node, "", 0)
    return {i: path.lstrip("/") for i, path in found.items()}


def _index(body: Any) -> int:
    if not isinstance(body, int) or isinstance(body, bool) or body < 0:
        raise ValueError(f"tensor reference {body!r} is not a non-negative integer")
    return body


def _list(body: Any) -> list[Any]:
    if not isinstance(body, list):
        raise ValueError(f"expected a list, found {type(body).__name__}")
    return body


def _hashable(key: Any, where: str) -> Any:
    try:
        hash(key)
    except TypeError:
        raise CorruptCheckpointError(
            f"{where}: a dict key of type {type(key).__name__} is not hashable"
        ) from None
    return key
