"""Capturing and restoring everything a training step depends on."""

from __future__ import annotations

from crashproof.state._batch import accumulation_steps
from crashproof.state._dtensor import empty_like_piece, is_dtensor, local_piece
from crashproof.state._reproducible import mkl_reproducible, set_reproducible_defaults
from crashproof.state._rng import capture_rng, restore_rng
from crashproof.state._sampler import ResumableSampler
from crashproof.state._structure import check_structure, value_tensor_names
from crashproof.state._train_state import Stateful, TrainState, unwrap_model
from crashproof.state._value import Value

__all__ = [
    "ResumableSampler",
    "Stateful",
    "TrainState",
    "Value",
    "accumulation_steps",
    "capture_rng",
    "check_structure",
    "empty_like_piece",
    "is_dtensor",
    "local_piece",
    "mkl_reproducible",
    "restore_rng",
    "set_reproducible_defaults",
    "unwrap_model",
    "value_tensor_names",
]
