"""Refuse a checkpoint whose parameters or optimizer state hold NaN or inf.

The check runs on the writer's hashing thread, on each chunk of a tensor as it is written, so it
costs no wall time of its own; it uses NumPy, which computes on the calling thread alone. (A torch
op on a background thread starts a second OpenMP team, and two teams spinning on two cores slowed
training markedly in an A/B run.) A sum is the fast test (NaN and inf propagate through it; a
fraction of a memcpy's time); only a chunk whose sum is not finite, which overflow can also cause, is
checked element by element. bfloat16 is widened to float32; float8 formats are checked by their bit
patterns (NaN and, in e5m2, inf; the ``fnuz`` formats' one NaN is 0x80).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from crashproof.checkpoint.format import tensor_bytes
from crashproof.errors import NonFiniteStateError

__all__ = ["FiniteCheck"]

_NUMPY = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.float32,  # checked as its real and imaginary parts
    torch.complex128: np.float64,
}


# float8: (mask, pattern) such that ``byte & mask == pattern`` is NaN or inf.
_FLOAT8 = {
    getattr(torch, name): bits
    for name, bits in (
        ("float8_e4m3fn", (0x7F, 0x7F)),  # S.1111.111 is NaN; no inf
        ("float8_e5m2", (0x7C, 0x7C)),  # exponent all ones: inf or NaN
        ("float8_e4m3fnuz", (0xFF, 0x80)),  # negative zero's pattern is the one NaN
        ("float8_e5m2fnuz", (0xFF, 0x80)),
    )
    if hasattr(torch, name)
}


def _finite(chunk: memoryview, dtype: torch.dtype) -> bool:
    values: np.ndarray[Any, Any]
    if dtype in _FLOAT8:
        mask, pattern = _FLOAT8[dtype]
        return not bool(((np.frombuffer(chunk, dtype=np.uint8) & mask) == pattern).any())
    if dtype == torch.bfloat16:
        values = (np.frombuffer(chunk, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif dtype in _NUMPY:
        values = np.frombuffer(chunk, dtype=_NUMPY[dtype])
    else:
        return True
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is what the test catches
        total = np.add.reduce(
            values, dtype=np.float64 if values.dtype == np.float64 else np.float32
        )
    return bool(np.isfinite(total)) or bool(np.isfinite(values).all())


class FiniteCheck:
    """Checks the tensors of one save that must be finite, as the writer hands them over."""

    def __init__(
        self, step: int, tensors: Sequence[tuple[str, torch.Tensor]], names: frozenset[str]
    ) -> None:
        self._step, self._tensors = step, tensors
        self._dtypes = {i: t.dtype for i, (name, t) in enumerate(tensors) if name in names}
        self._failed: set[int] = set()

    def __call__(self, index: int, chunk: memoryview) -> None:
        """A chunk of tensor ``index`` as written (called by ``write_shard``'s hashing thread)."""
        dtype = self._dtypes.get(index)
        if dtype is not None and not _finite(chunk, dtype):
            self._failed.add(index)

    def tensor(self, index: int) -> None:
        """Check tensor ``index`` whole, now: a delta stores it encoded, not as its bytes."""
        dtype = self._dtypes.pop(index, None)
        if dtype is not None and not _finite(tensor_bytes(self._tensors[index][1]), dtype):
            self._failed.add(index)

    def raise_if_failed(self) -> None:
        if not self._failed:
            return
        name, tensor = self._tensors[min(self._failed)]
        flat = tensor.reshape(-1)
        if tensor.dtype in _FLOAT8:  # torch has no isfinite for most float8 formats
            flat = flat.float()
        bad = sum(
            int((~flat[i : i + (1 << 22)].isfinite()).sum())
            for i in range(0, flat.numel(), 1 << 22)
        )  # on the way to an error only: torch's own ops are fine here
        raise NonFiniteStateError(
            f"tensor {name!r} holds {bad} NaN or infinite value(s) of {tensor.numel()} at step "
            f"{self._step}: a checkpoint of diverged weights is refused. Resume from an earlier "
            "checkpoint; crashproof.NumericsGuard catches such steps before they are applied"
        )
