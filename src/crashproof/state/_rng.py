"""Capture and restore every random number generator a training step may draw from.

Python's ``random``, NumPy's legacy global generator, torch's CPU generator and, when CUDA is in
use, the generator of every CUDA device. Generators the user creates themselves (a
``torch.Generator`` or ``numpy.random.Generator`` object) are theirs to put in ``extra``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from crashproof.errors import CorruptCheckpointError

__all__ = ["capture_rng", "check_rng", "restore_rng"]

log = logging.getLogger(__name__)


def capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    algorithm, keys, pos, has_gauss, cached_gaussian = np_state
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "algorithm": str(algorithm),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    # Only when CUDA is already in use: querying it would otherwise initialise a context.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [t.cpu() for t in torch.cuda.get_rng_state_all()]
    return state


def check_rng(state: Any, where: str) -> None:
    """Validate a captured RNG tree before anything is restored: each entry is loaded into a
    scratch generator of its kind (the global ones are untouched). A checkpoint crashproof wrote
    always passes, so any failure is a :class:`CorruptCheckpointError` (a hand-edited entry)."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= state.keys():
        raise CorruptCheckpointError(
            f"{where}: the RNG state is incomplete (keys: {sorted(state) if isinstance(state, dict) else state!r})"
        )
    try:
        random.Random().setstate(_python_state(state["python"]))
    except Exception as exc:  # whatever random raises: malformed
        raise CorruptCheckpointError(
            f"{where}: rng/python is not a state of Python's random module ({exc}): "
            f"{str(state['python'])[:100]}"
        ) from None
    try:
        np.random.RandomState().set_state(_numpy_state(state["numpy"]))
    except Exception as exc:  # whatever NumPy raises (IndexError for short keys): malformed
        raise CorruptCheckpointError(
            f"{where}: rng/numpy is not a state of NumPy's generator ({type(exc).__name__}: "
            f"{exc}): {str(state['numpy'])[:100]}"
        ) from None
    _check_generator_state(state["torch"], torch.get_rng_state(), f"{where}: rng/torch")
    try:
        torch.Generator().set_state(state["torch"])
    except RuntimeError as exc:
        raise CorruptCheckpointError(
            f"{where}: rng/torch is not a generator's state ({exc})"
        ) from None
    cuda_states = state.get("cuda")
    if cuda_states is None:
        return
    if not isinstance(cuda_states, list):
        raise CorruptCheckpointError(
            f"{where}: rng/cuda is {type(cuda_states).__name__}, not a list"
        )
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    for device, device_state in enumerate(cuda_states):
        # The live state's size is known only where CUDA is in use (asking would initialise it).
        like = torch.cuda.get_rng_state(0) if in_use else None
        _check_generator_state(device_state, like, f"{where}: rng/cuda/{device}")


def _python_state(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError("expected (version, internal state, gauss_next)")
    version, internal, gauss_next = value
    if not isinstance(internal, (tuple, list)) or not all(
        type(v) is int for v in internal
    ):  # fmt: skip
        raise TypeError("the internal state is not a sequence of integers")
    if gauss_next is not None and type(gauss_next) is not float:
        raise TypeError(f"gauss_next is {gauss_next!r}, not a float or None")
    return (version, tuple(internal), gauss_next)


def _numpy_state(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, dict):
        raise TypeError("expected a dict")
    keys = value["keys"]
    if not isinstance(keys, list) or not all(type(k) is int for k in keys):
        raise TypeError("'keys' is not a list of integers")
    scalars = (value["pos"], value["has_gauss"], value["cached_gaussian"])
    if not all(type(v) in (int, float) for v in scalars) or value["algorithm"] != "MT19937":
        raise TypeError("'algorithm', 'pos', 'has_gauss' or 'cached_gaussian' is malformed")
    return (
        value["algorithm"],
        np.asarray(keys, dtype=np.uint32),
        value["pos"],
        value["has_gauss"],
        value["cached_gaussian"],
    )


def _check_generator_state(value: Any, like: torch.Tensor | None, where: str) -> None:
    # Never a stand-in (a tensor not read, a piece of a sharded one): its value is what is checked.
    if (
        not isinstance(value, torch.Tensor)
        or value.is_meta
        or value.dtype != torch.uint8
        or value.dim() != 1
    ):
        raise CorruptCheckpointError(
            f"{where}: expected a 1-d uint8 tensor, found "
            f"{f'{value.dtype}{list(value.shape)}' if isinstance(value, torch.Tensor) else type(value).__name__}"
        )
    if like is not None and value.shape != like.shape:
        raise CorruptCheckpointError(
            f"{where}: holds {value.numel()} bytes, a generator's state here has {like.numel()}"
        )


def restore_rng(state: dict[str, Any]) -> None:
    """Set every global generator from ``state`` (checked by :func:`check_rng` first)."""
    random.setstate(_python_state(state["python"]))
    np.random.set_state(_numpy_state(state["numpy"]))
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count != len(cuda_states):
            log.warning(
                "checkpoint holds CUDA RNG states of %d devices, this process sees %d; restoring "
                "the first %d, so GPU randomness will not match the original run exactly",
                len(cuda_states), count, min(count, len(cuda_states)),
            )  # fmt: skip
        for device, device_state in enumerate(cuda_states[:count]):
            torch.cuda.set_rng_state(device_state, device)
    elif cuda_states:
        log.warning("checkpoint holds CUDA RNG states but CUDA is not available here; not restored")
