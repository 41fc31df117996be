"""The tensor dtypes a checkpoint may hold, by name, and their safetensors codes.

The name table is an allowlist: a dtype read from a file is looked up here and never evaluated.
"""

from __future__ import annotations

import torch

from crashproof.errors import CorruptCheckpointError, UnsupportedStateError

__all__ = ["dtype_from_name", "dtype_name", "safetensors_code"]

_BY_NAME: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
# Dtypes that only newer torch builds have; registered when present.
for _name in (
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
):
    if hasattr(torch, _name):
        _BY_NAME[_name] = getattr(torch, _name)
_BY_DTYPE = {dtype: name for name, dtype in _BY_NAME.items()}

# safetensors' codes; dtypes it lacks are stored under it as raw bytes ("U8").
_SAFETENSORS = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip


def dtype_name(dtype: torch.dtype, *, where: str) -> str:
    """The stored name of ``dtype``; raises for a dtype crashproof does not store."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensor at {where!r} has dtype {dtype}, which crashproof does not store; "
            f"supported: {', '.join(sorted(_BY_NAME))}"
        ) from None


def dtype_from_name(name: str, *, where: str) -> torch.dtype:
    """The dtype stored as ``name``; a name outside the allowlist means a corrupt file."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CorruptCheckpointError(f"{where}: unknown tensor dtype {name!r}") from None


def safetensors_code(name: str) -> str | None:
    """safetensors' code for the dtype stored as ``name``, or None when it has none."""
    return _SAFETENSORS.get(name)
