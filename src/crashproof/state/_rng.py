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

from crashproof.errors import StateMismatchError

__all__ = ["capture_rng", "restore_rng"]

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
    """Validate a captured RNG tree before anything is restored."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= state.keys():
        raise StateMismatchError(
            f"{where}: the RNG state is incomplete (keys: {sorted(state) if isinstance(state, dict) else state!r})"
        )
    torch_state = state["torch"]
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8:
        raise StateMismatchError(f"{where}: the torch RNG state is not a uint8 tensor")


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["algorithm"],
            np.asarray(np_state["keys"], dtype=np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
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
