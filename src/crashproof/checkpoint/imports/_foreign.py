"""A checkpoint from elsewhere, as read: its parts named the way :class:`~crashproof.TrainState`
names them, and the mapping of a ``torch.save`` dict (a training loop's own, or Lightning's) onto
them.

A :class:`TrainState` restore looks up ``model``, ``optimizer``, ``scheduler``, ``scaler`` and
``extra[KEY]`` in a checkpoint's tree (see ``state/_train_state.py``), so each foreign part is put
under the name a restore of the matching live object reads. What has no such place is kept as a
named extra when the format can hold it (``{"value": ...}`` for JSON-like values,
``{"state_dict": ...}`` for tensor trees, as an extra object's state is saved), and otherwise
left out and said so: an import never drops a part silently.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from crashproof.checkpoint.format import encode_tree
from crashproof.errors import ConfigError, CrashproofError
from crashproof.state import TrainState, check_structure

__all__ = ["Foreign", "fixed_rng", "from_mapping", "is_state_dict"]

# The names training loops give each part in the dict they torch.save, most common first.
_MODEL_KEYS = ("model", "model_state_dict", "state_dict", "model_state", "module")
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optimizer_state", "optim")
_SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "lr_scheduler_state_dict")
_SCALER_KEYS = ("scaler", "grad_scaler", "scaler_state_dict", "amp")
_STEP_KEYS = ("global_step", "step", "iteration")


@dataclass
class Foreign:
    """What an import read from ``source``, in :class:`TrainState`'s terms."""

    source: str
    layout: str
    """What ``source`` was found to be, for the messages: "torch.save file", "Lightning
    checkpoint", "Hugging Face save_pretrained directory"..."""
    model: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Saved as a TrainState's extras are: ``{"value": json}`` or ``{"state_dict": tree}``."""
    step: int | None = None
    step_from: str = ""
    """Where :attr:`step` was read (``"global_step" of the Lightning checkpoint``)."""
    left_out: list[str] = field(default_factory=list)
    """What was not imported, and why: said by ``crashproof import``."""

    def parts(self) -> list[str]:
        """The TrainState parts this import fills."""
        named = (("optimizer", self.optimizer), ("scheduler", self.scheduler),
                 ("scaler", self.scaler))  # fmt: skip
        return ["model"] + [name for name, part in named if part is not None]

    def strip_prefix(self, prefix: str) -> None:
        """Take ``prefix`` off the model's names that have it (``module.`` of a DDP-wrapped
        model, the attribute a LightningModule keeps its network in); refused when no name has
        it, or when two names would become one."""
        if not any(name.startswith(prefix) for name in self.model):
            raise ConfigError(
                f"--strip-prefix {prefix!r}: no tensor name of {self.source} starts with it; "
                f"its names begin {', '.join(sorted(self.model)[:3])}"
            )
        stripped: dict[str, torch.Tensor] = {}
        for name, tensor in self.model.items():
            new = name[len(prefix) :] if name.startswith(prefix) else name
            if not new or new in stripped:
                raise ConfigError(
                    f"--strip-prefix {prefix!r}: {name!r} would become {new!r}, "
                    "which another name of the model has (or is empty)"
                )
            stripped[new] = tensor
        self.model = stripped

    def keep_extra(self, key: str, value: Any) -> None:
        """Keep ``value`` as the extra ``key``, or say it was left out when the format cannot
        store it (an object only full unpickling made)."""
        plain = _json_copy(value)
        if plain is not None:
            self.extra[key] = {"value": plain}
            return
        try:
            encode_tree(value, [], f"extra/{key}")  # the check a save would make, up front
        except CrashproofError as exc:
            self.left_out.append(f"{key!r}: {exc}")
            return
        self.extra[key] = {"state_dict": value}


def _json_copy(value: Any) -> Any:
    """``value`` as plain JSON (a Lightning ``AttributeDict`` becomes a dict), or None when it is
    not JSON-like (tensors, int keys, objects) or holds a non-finite number."""
    if isinstance(value, torch.Tensor):
        return None
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return None


def is_state_dict(value: Any) -> bool:
    """A module's state dict: a non-empty mapping of string keys to tensors."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def _is_lightning(obj: Mapping[str, Any]) -> bool:
    return "state_dict" in obj and bool(
        {"pytorch-lightning_version", "optimizer_states", "loops"} & obj.keys()
    )


def from_mapping(obj: Any, source: str, *, what: str = "torch.save file") -> Foreign:
    """A loaded ``torch.save`` object as a :class:`Foreign`: a bare state dict is the model; a
    Lightning checkpoint or a training loop's dict is mapped part by part; a whole module (what
    only ``--trust-pickle`` loads) gives its state dict."""
    if isinstance(obj, torch.nn.Module):
        return Foreign(source, f"{what} (a pickled {type(obj).__name__})", model=obj.state_dict())
    if is_state_dict(obj):
        return Foreign(source, f"{what} (a state dict)", model=dict(obj))
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) for k in obj):
        raise ConfigError(
            f"{source}: holds a {type(obj).__name__}, not a state dict nor a dict of training "
            f"state; expected a mapping of parameter names to tensors, or a dict with one of "
            f"{', '.join(map(repr, _MODEL_KEYS))}"
        )
    rest = dict(obj)
    if _is_lightning(obj):
        found = Foreign(
            source, "Lightning checkpoint", model=_model(rest.pop("state_dict"), source)
        )
        found.optimizer = _single(found, rest.pop("optimizer_states", []), "optimizer_states")
        found.scheduler = _single(found, rest.pop("lr_schedulers", []), "lr_schedulers")
        found.scaler = rest.pop("native_amp_scaling_state", None)
    else:
        key = next((k for k in _MODEL_KEYS if is_state_dict(rest.get(k))), None)
        if key is None:
            raise ConfigError(
                f"{source}: a dict with keys {', '.join(sorted(obj)[:12])}, none of them a "
                f"state dict; expected the model's under one of {', '.join(_MODEL_KEYS)}"
            )
        found = Foreign(
            source, f"{what} (a dict of training state)", model=_model(rest.pop(key), source)
        )
        found.optimizer = _pop_first(rest, _OPTIMIZER_KEYS)
        found.scheduler = _pop_first(rest, _SCHEDULER_KEYS)
        found.scaler = _pop_first(rest, _SCALER_KEYS)
    _check_optimizer(found)
    for key in _STEP_KEYS:
        value = rest.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            found.step, found.step_from = value, f"{key!r} of the {found.layout.split(' (')[0]}"
            del rest[key]  # the checkpoint's step from now on
            break
    for key, value in rest.items():  # the epoch, hyperparameters, counters, an EMA's weights
        found.keep_extra(key, value)
    return found


def _model(value: Any, source: str) -> dict[str, torch.Tensor]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"{source}: the model's state is a {type(value).__name__}, not a state dict of "
            "named tensors"
        )
    return dict(value)


def _pop_first(rest: dict[str, Any], keys: tuple[str, ...]) -> Any:
    key = next((k for k in keys if isinstance(rest.get(k), Mapping)), None)
    return None if key is None else rest.pop(key)


def _single(found: Foreign, states: Any, key: str) -> Any:
    """The one state of a Lightning list (``optimizer_states``); several are left out: a
    TrainState holds one optimizer and one scheduler, and which is which is the user's call."""
    if isinstance(states, list) and len(states) == 1:
        return states[0]
    if isinstance(states, list) and states:
        found.left_out.append(
            f"{key}: {len(states)} of them (a TrainState holds one); import a dict with the "
            "one you mean under 'optimizer' / 'scheduler'"
        )
    return None


def _check_optimizer(found: Foreign) -> None:
    """An optimizer's part must be a torch optimizer's state dict (``state``, ``param_groups``),
    or a restore would refuse the whole checkpoint as corrupt: judged by the same checks, and
    kept as the extra ``optimizer`` instead when it is something else (a loop's own dict)."""
    if found.optimizer is None:
        return
    try:
        check_structure({"rng": fixed_rng(), "optimizer": found.optimizer}, found.source)
    except CrashproofError as exc:
        found.left_out.append(f"the optimizer's state, kept as the extra 'optimizer': {exc}")
        found.keep_extra("optimizer", found.optimizer)
        found.optimizer = None


def fixed_rng() -> dict[str, Any]:
    """The RNG state an imported checkpoint holds: every generator seeded with 0, laid out as a
    capture lays it out. A restore sets the generators from the checkpoint; a fixed seed makes
    that the same for every import of the same source (never the importing process's state).
    The process's own generators are not touched."""
    rng: dict[str, Any] = dict(TrainState().capture()["rng"])
    rng.pop("cuda", None)  # no device state: the importing process's would mean nothing
    rng["python"] = random.Random(0).getstate()
    _, keys, pos, has_gauss, cached = np.random.RandomState(0).get_state(legacy=True)
    rng["numpy"] = {**rng["numpy"], "keys": [int(k) for k in keys], "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}  # fmt: skip
    rng["torch"] = torch.Generator().manual_seed(0).get_state()
    return rng
