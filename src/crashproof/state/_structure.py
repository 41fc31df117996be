"""Is a saved state tree well formed? The checks that need no live object.

``crashproof verify`` has no live model to compare a checkpoint with, but it must refuse every
checkpoint a restore refuses as corrupt. :func:`check_structure` is that half of the checks:
what crashproof writes in each section (the RNG states, the recorded classes, a state dict of
named tensors, an optimizer's groups and state, the extras' entries), judged by the tree alone.
:meth:`TrainState.check` runs it first, then compares with the live objects
(:mod:`crashproof.state._check`); :func:`~crashproof.checkpoint.verify_checkpoint` runs it on
every rank's tree. Anything it refuses is a :class:`CorruptCheckpointError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from crashproof.errors import CorruptCheckpointError
from crashproof.state._rng import check_rng

__all__ = ["EXTRA_STATE", "check_structure", "is_json_like", "value_tensor_names"]

EXTRA_STATE = "_extra_state"
_JSON_SCALARS = (type(None), bool, int, float, str)


def value_tensor_names(name: str) -> bool:
    """Whether tensor ``name`` of a checkpoint is judged by its value by :func:`check_structure`
    (the RNG states): a reader that verifies without keeping tensors keeps these."""
    return name.startswith("rng/")


def check_structure(tree: Any, where: str) -> None:
    """Raise :class:`CorruptCheckpointError` unless every section of ``tree`` has the form
    crashproof writes there. Sections whose form depends on a live object's class (scheduler,
    scaler, data) are judged against it by :meth:`TrainState.check`."""
    if not isinstance(tree, Mapping):
        raise CorruptCheckpointError(f"{where}: the state is {type(tree).__name__}, not a dict")
    check_rng(tree.get("rng"), where)
    classes = tree.get("classes")
    if classes is not None and (
        not isinstance(classes, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in classes.items())
    ):
        raise CorruptCheckpointError(f"{where}: 'classes' is malformed: {str(classes)[:200]}")
    if "model" in tree:
        check_state_dict(tree["model"], f"{where}: model")
    if "optimizer" in tree:
        _check_optimizer(tree["optimizer"], f"{where}: optimizer")
    if "extra" in tree:
        _check_extra(tree["extra"], where)


def check_state_dict(saved: Any, where: str) -> None:
    """A module's state dict: string keys, a tensor under each (any value under an
    ``_extra_state`` key: ``get_extra_state`` returns what it likes)."""
    if not isinstance(saved, Mapping) or not all(isinstance(k, str) for k in saved):
        raise CorruptCheckpointError(
            f"{where}: saved state is {type(saved).__name__}, not a state dict of named tensors"
        )
    for key, value in saved.items():
        if key.rsplit(".", 1)[-1] != EXTRA_STATE and not isinstance(value, torch.Tensor):
            raise CorruptCheckpointError(
                f"{where}: {key!r} is saved as {type(value).__name__}, expected a tensor"
            )


def _check_optimizer(saved: Any, where: str) -> None:
    """An optimizer's state dict: ``param_groups``, a list of dicts each listing its parameters'
    ids (each once), and ``state``, per-parameter dicts keyed by ids the groups list."""
    if not isinstance(saved, Mapping) or "param_groups" not in saved or "state" not in saved:
        raise CorruptCheckpointError(f"{where}: not an optimizer state dict (param_groups, state)")
    groups, state = saved["param_groups"], saved["state"]
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CorruptCheckpointError(
            f"{where}: 'param_groups' must be a list of dicts each with a 'params' list, found "
            f"{str(groups)[:200]}"
        )
    if not isinstance(state, Mapping) or not all(isinstance(s, Mapping) for s in state.values()):
        raise CorruptCheckpointError(
            f"{where}: 'state' must map parameter ids to dicts, found {str(state)[:200]}"
        )
    listed: set[Any] = set()
    for i, group in enumerate(groups):
        for param_id in group["params"]:
            if not isinstance(param_id, (int, str)) or isinstance(param_id, bool):
                raise CorruptCheckpointError(
                    f"{where}: param group {i} lists {param_id!r}, not a parameter id"
                )
            if param_id in listed:
                raise CorruptCheckpointError(
                    f"{where}: parameter id {param_id!r} is listed twice by the param groups"
                )
            listed.add(param_id)
    for param_id in state:
        if param_id not in listed:
            raise CorruptCheckpointError(
                f"{where}: state for parameter id {param_id!r} that no param group lists"
            )


def _check_extra(saved: Any, where: str) -> None:
    """The extras: by name, ``{"state_dict": ...}`` (an object's) or ``{"value": ...}`` (a
    JSON-like value's)."""
    if not isinstance(saved, dict):
        raise CorruptCheckpointError(
            f"{where}: 'extra' is {type(saved).__name__}, not a dict of named entries"
        )
    for key, entry in saved.items():
        here = f"{where}: extra[{key!r}]"
        if (
            not isinstance(entry, dict)
            or len(entry) != 1
            or not entry.keys()
            & {
                "state_dict",
                "value",
            }
        ):
            raise CorruptCheckpointError(
                f"{here}: expected {{'state_dict': ...}} or {{'value': ...}}, found {str(entry)[:200]}"
            )
        if "value" in entry and not is_json_like(entry["value"]):
            raise CorruptCheckpointError(
                f"{here}: saved value is not JSON-like: {str(entry['value'])[:200]}"
            )


def is_json_like(value: Any, depth: int = 0) -> bool:
    if depth > 64:
        return False
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_json_like(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_like(v, depth + 1) for k, v in value.items())
    return False
