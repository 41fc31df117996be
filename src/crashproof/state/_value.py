"""``Value``: a mutable value shared between the training loop and its checkpoints.

``TrainState(extra={"lr": 20.0})`` saves a *copy*: the loop's later ``lr /= 4`` is not what the
next checkpoint holds, and a restore puts the saved number into the dict, not into the loop's
variable. A ``Value`` is one object both hold: the loop reads and writes ``lr.value``, the
checkpoint saves and restores it. It also carries state from batch to batch, such as an RNN's
hidden state (tensors, or a tuple of them), which an exact resume needs like any other state.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch

from crashproof.state._kinds import check_same_kind

__all__ = ["Value"]

T = TypeVar("T")


class Value(Generic[T]):
    """One value (a number, string, JSON-like structure, tensor or tuple of tensors) that the
    loop changes and every checkpoint saves: ``TrainState(extra={"lr": lr})`` with
    ``lr = crashproof.Value(20.0)``, then ``lr.value /= 4`` in the loop."""

    def __init__(self, value: T) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Value({self.value!r})"

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "tuple": isinstance(self.value, tuple)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        value = state["value"]
        if state.get("tuple") and isinstance(value, list):
            value = tuple(value)  # saved as a list (an LSTM's (h, c)): given back as it was
        # Refused before anything changes: a value of another kind (a string for a number, a
        # tensor of another shape) would only fail in the loop. A Value(None) takes anything.
        check_same_kind(self.value, value, "Value")
        if isinstance(self.value, torch.Tensor) and isinstance(value, torch.Tensor):
            value = value.to(self.value.device)
        self.value = value
