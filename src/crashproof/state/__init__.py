"""Capturing and restoring everything a training step depends on."""

from __future__ import annotations

from crashproof.state._batch import accumulation_steps
from crashproof.state._sampler import ResumableSampler
from crashproof.state._train_state import Stateful, TrainState, unwrap_model

__all__ = ["ResumableSampler", "Stateful", "TrainState", "accumulation_steps", "unwrap_model"]
