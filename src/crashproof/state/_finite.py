"""Which captured tensors ``check_finite`` judges: the model's parameters, found by what is
captured rather than by name, and the optimizer's state and param groups at any depth."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from crashproof.errors import NonFiniteStateError
from crashproof.state._structure import EXTRA_STATE

__all__ = ["finite_names", "parameter_names"]


def parameter_names(module: nn.Module, captured: Mapping[str, Any], prefix: str) -> set[str]:
    """Names (``prefix/key``) of the tensors of ``captured`` (``module``'s captured state dict)
    that must be finite: every tensor but the buffers' (which may hold infinities by design)
    and extra state. Judged by memory as well as by name, so a state-dict hook that renames a
    parameter (``weight`` saved as ``w``) or converts it does not let it through unchecked."""
    buffer_names = {k for k, _ in module.named_buffers(remove_duplicate=False)}
    buffer_memory = {_memory(b) for b in module.buffers()} - {None}
    names = {f"{prefix}/{k}" for k, _ in module.named_parameters(remove_duplicate=False)}
    for key, value in captured.items():
        if (
            isinstance(value, torch.Tensor)
            and key not in buffer_names
            and key.rsplit(".", 1)[-1] != EXTRA_STATE
            and _memory(value) not in buffer_memory
        ):
            names.add(f"{prefix}/{key}")
    return names


def _memory(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...]] | None:
    try:
        return (t.data_ptr(), t.dtype, tuple(t.shape))
    except Exception:  # a DTensor or a meta tensor: judged by name only
        return None


def finite_names(value: Any, path: str, step: int | None, depth: int = 0) -> Iterator[str]:
    """The names of the tensors under ``value`` (named as the checkpoint names them); raises
    :class:`NonFiniteStateError` for a NaN or infinite Python or NumPy float among them."""
    if depth > 64:
        return
    if isinstance(value, (torch.Tensor, np.ndarray)):
        yield path
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from finite_names(v, f"{path}/{k}", step, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from finite_names(v, f"{path}/{i}", step, depth + 1)
    elif isinstance(value, (float, complex, np.floating, np.complexfloating)) and not np.isfinite(
        value
    ):
        at = "" if step is None else f" at step {step}"
        raise NonFiniteStateError(
            f"{path!r} is {value!r}{at}: a checkpoint of diverged optimizer state is refused. "
            "Resume from an earlier checkpoint; crashproof.NumericsGuard catches such steps "
            "before they are applied"
        )
