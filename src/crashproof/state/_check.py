"""Check a saved state tree against the live training state before a restore changes anything.

A restore is all-or-nothing: :meth:`TrainState.check` runs every check here first, and only
then does anything live change. The manager checks the verified values of every tensor that has
no live destination (optimizer state, RNG states, extras' tensors); only tensors it reads
straight into live memory (the model's) are shape-only (``meta``) stand-ins then.
Two kinds of failure:

- :class:`CorruptCheckpointError`: a section is malformed (a type crashproof never writes there:
  ``param_groups`` not a list, an RNG state that no generator accepts). The manager skips such a
  checkpoint for the next newest, as for a flipped bit.
- :class:`StateMismatchError`: the section is well formed but does not fit the live component
  (another architecture, optimizer class, scheduler class, scaler setting, renamed field).

What cannot be checked by looking (a user's ``Stateful.load_state_dict``, a module's
``set_extra_state``, a scheduler's nested schedulers) is loaded into a scratch copy of the object:
a deep copy in which the model's, the optimizer's and the object's own tensors are ``meta``
stand-ins, so it costs no tensor memory. An object that cannot be deep-copied (it holds a lock or a
process group) is loaded unchecked. This module does not restore anything itself.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from crashproof.errors import CorruptCheckpointError, StateMismatchError
from crashproof.state._classes import check_classes, class_name
from crashproof.state._dtensor import is_dtensor, local_piece
from crashproof.state._kinds import check_same_kind
from crashproof.state._module_load import trial_module_load
from crashproof.state._optim_values import check_optimizer_values
from crashproof.state._structure import EXTRA_STATE, check_state_dict

__all__ = [
    "Scratch",
    "check_classes",
    "check_module",
    "check_optimizer",
    "check_scaler",
    "check_scheduler",
    "class_name",
    "live_tensors_of",
    "trial_load",
    "trial_value",
]

log = logging.getLogger(__name__)

# Optimizer state entries that torch.optim keeps per element of the parameter (same shape).
_PER_ELEMENT_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
     "sum", "exp_inf", "ax", "prev", "step_size", "grad_avg"}
)  # fmt: skip
# Param-group keys that are not the optimizer's own: torch's LR schedulers add "initial_lr", and
# "param_names" is optional; neither says anything about the optimizer's class.
_FOREIGN_GROUP_KEYS = frozenset({"params", "param_names", "initial_lr"})
# A meta tensor this small is given zeros for a trial load (a load may call .item() on a step
# count); larger ones stay meta, which copy_() into a meta stand-in accepts.
_TRIAL_MATERIALIZE = 1 << 12


# -- model ----------------------------------------------------------------------------------


def check_module(module: nn.Module, saved: Any, where: str, scratch: Scratch | None = None) -> bool:
    """Every key of ``module.state_dict()`` is saved with the same shape and dtype, and no
    others; then, where loading runs code of the model's own (hooks, ``set_extra_state``), the
    load is tried on a scratch copy (see :mod:`crashproof.state._module_load`). False when that
    code could not be tried (the model cannot be copied): the caller protects the live tensors."""
    check_state_dict(saved, where)
    live = module.state_dict()
    lazy = [k for k, t in live.items() if isinstance(t, torch.Tensor) and nn.parameter.is_lazy(t)]
    if lazy:  # no shape to check a saved tensor against, nor memory to read it into
        raise StateMismatchError(
            f"{where}: {lazy[:10]} are uninitialized (lazy modules): run one forward pass on a "
            "batch to create them, then restore. Nothing was changed."
        )
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        raise StateMismatchError(
            f"{where}: keys differ from the live model: missing in checkpoint {missing[:10]}, "
            f"unexpected in checkpoint {unexpected[:10]}. Was the model's architecture changed?"
        )
    for key, tensor in live.items():
        value = saved[key]
        if key.rsplit(".", 1)[-1] == EXTRA_STATE:
            continue  # any value get_extra_state returned: set_extra_state judges it, below
        if value.shape != tensor.shape or value.dtype != tensor.dtype:
            raise StateMismatchError(
                f"{where}: tensor {key!r} expected {tensor.dtype}{list(tensor.shape)}, "
                f"checkpoint has {value.dtype}{list(value.shape)}"
            )
        if _elements_share_memory(tensor):
            raise StateMismatchError(
                f"{where}: the live model's tensor {key!r} is a view whose elements share memory "
                f"(strides {list(tensor.stride())}, as expand() makes): nothing can be loaded "
                "into it, by crashproof or by load_state_dict. Register it as a tensor of its "
                "own (.contiguous() or .clone()), or as a non-persistent buffer. Nothing was "
                "changed."
            )
    return trial_module_load(module, saved, where, scratch)


def _elements_share_memory(tensor: torch.Tensor) -> bool:
    """Whether writing ``tensor`` element by element would write one memory location twice (an
    expanded or overlapping view): every in-place copy into it fails, half-way through a
    ``load_state_dict``."""
    if tensor.is_meta or tensor.layout != torch.strided or tensor.numel() <= 1:
        return False
    if is_dtensor(tensor):
        tensor = local_piece(tensor)[0]
    if any(
        stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape, strict=True)
    ):
        return True
    overlap = getattr(torch, "_debug_has_internal_overlap", None)  # 1: yes, 2: too hard to tell
    try:
        return overlap is not None and overlap(tensor) == 1
    except (RuntimeError, TypeError):  # a tensor subclass it does not know: judged by strides
        return False


# -- optimizer ------------------------------------------------------------------------------


def check_optimizer(optimizer: torch.optim.Optimizer, saved: Any, where: str) -> None:
    """The saved optimizer state (well formed: see
    :func:`~crashproof.state._structure.check_structure`) has the live optimizer's parameter
    layout, and its param groups hold exactly the live optimizer's hyperparameters (AdamW's state
    restored into SGD would fail at the next step for want of ``momentum``), of the kinds the
    live ones are (:mod:`crashproof.state._optim_values`)."""
    saved_groups, saved_state = saved["param_groups"], saved["state"]
    live_groups = optimizer.param_groups
    if len(saved_groups) != len(live_groups):
        raise StateMismatchError(
            f"{where}: {len(saved_groups)} param groups saved, the optimizer has {len(live_groups)}"
        )
    params: dict[Any, torch.Tensor] = {}
    for i, (s, g) in enumerate(zip(saved_groups, live_groups, strict=True)):
        if len(s["params"]) != len(g["params"]):
            raise StateMismatchError(
                f"{where}: param group {i} has {len(s['params'])} parameters saved, the optimizer has {len(g['params'])}"
            )
        params.update(zip(s["params"], g["params"], strict=True))
    _check_group_keys(optimizer, saved_groups, where)
    own_state = type(optimizer).__module__.startswith("torch.optim")
    for param_id, param_state in saved_state.items():
        param = params[param_id]
        for name, value in param_state.items():
            if own_state and not _well_formed(name, value):
                raise CorruptCheckpointError(
                    f"{where}: state {name!r} of parameter {param_id} is {str(value)[:80]}, not "
                    f"what {type(optimizer).__name__} keeps there (a number or one-element "
                    "tensor for 'step', a tensor for per-element state)"
                )
            if not isinstance(value, torch.Tensor):
                continue
            # Per-element state has the parameter's shape. Known names must match exactly; for
            # others (factored states such as Adafactor's row_var) only a same-sized tensor must.
            per_element = name in _PER_ELEMENT_STATE or (value.numel() == param.numel() > 1)
            if per_element and value.shape != param.shape:
                raise StateMismatchError(
                    f"{where}: state {name!r} of parameter {param_id} has shape {list(value.shape)}, "
                    f"the parameter has {list(param.shape)}; was the model or the parameter order changed?"
                )
    check_optimizer_values(optimizer, saved, params, _PER_ELEMENT_STATE, where)


def _well_formed(name: Any, value: Any) -> bool:
    """Whether a torch optimizer's per-parameter state entry has the type torch keeps there."""
    if name == "step":
        if isinstance(value, torch.Tensor):
            return value.numel() == 1 and not value.dtype.is_complex
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name in _PER_ELEMENT_STATE:
        return value is None or isinstance(value, torch.Tensor)
    return True


def _check_group_keys(
    optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]], where: str
) -> None:
    """Each saved group, once loaded, has exactly the live group's keys. A key the optimizer's
    ``__setstate__`` fills in (checkpoints from an older torch lack ``fused``) counts as there."""
    loaded = _groups_as_loaded(optimizer, saved_groups)
    for i, (group, live) in enumerate(zip(loaded, optimizer.param_groups, strict=True)):
        missing = sorted(set(live) - set(group) - _FOREIGN_GROUP_KEYS)
        unexpected = sorted(set(group) - set(live) - _FOREIGN_GROUP_KEYS)
        if missing or unexpected:
            raise StateMismatchError(
                f"{where}: param group {i}: hyperparameters differ from this run's "
                f"{type(optimizer).__name__}: missing in checkpoint {missing}, unexpected in "
                f"checkpoint {unexpected}. Was it saved by another optimizer class? Create the "
                "optimizer the saving run used, or start a new run directory."
            )


def _groups_as_loaded(
    optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The param groups ``optimizer.load_state_dict`` would leave, computed on a shallow scratch
    copy (its own dicts, no state): the live optimizer is not touched."""
    groups = [
        {**s, "params": live["params"]}
        for s, live in zip(saved_groups, optimizer.param_groups, strict=True)
    ]
    scratch = copy.copy(optimizer)
    scratch.__dict__["defaults"] = dict(optimizer.defaults)
    try:
        scratch.__setstate__({"state": defaultdict(dict), "param_groups": groups})
    except Exception:  # an optimizer whose __setstate__ needs more: compare the saved keys
        return [dict(s) for s in saved_groups]
    return scratch.param_groups


# -- scheduler, scaler, extras --------------------------------------------------------------


def check_scheduler(scheduler: Any, saved: Any, where: str, scratch: Scratch) -> None:
    """A scheduler's state holds its attributes: the saved public ones must be the live ones
    (another class, a renamed field), nested containers alike; then it must load."""
    live = scheduler.state_dict()
    if isinstance(live, dict) and not isinstance(saved, dict):
        raise CorruptCheckpointError(
            f"{where}: saved state is {type(saved).__name__}, expected a dict"
        )
    if isinstance(live, dict):
        # Exactly the public fields; private ones only where both have them (torch adds and
        # renames those between versions).
        def public(d: dict[Any, Any]) -> dict[Any, Any]:
            return {k: v for k, v in d.items() if not str(k).startswith("_")}

        private = [k for k in live.keys() & saved.keys() if str(k).startswith("_")]
        for live_part, saved_part in (
            (public(live), public(saved)),
            ({k: live[k] for k in private}, {k: saved[k] for k in private}),
        ):
            check_same_kind(live_part, saved_part, where, exact_keys=True, same_length=True)
    trial_load(scheduler, saved, where, scratch)


def check_scaler(scaler: Any, saved: Any, where: str, scratch: Scratch) -> None:
    """An AMP GradScaler: enabled in both runs or in neither, every field a number. Any other
    scaler is loaded into a scratch copy."""
    if not isinstance(scaler, torch.amp.GradScaler):
        trial_load(scaler, saved, where, scratch)
        return
    if not isinstance(saved, dict):
        raise CorruptCheckpointError(
            f"{where}: saved state is {type(saved).__name__}, expected a dict"
        )
    live = scaler.state_dict()
    if bool(live) != bool(saved):
        saved_as, live_as = ("enabled", "disabled") if saved else ("disabled", "enabled")
        raise StateMismatchError(
            f"{where}: the checkpoint's GradScaler was {saved_as}, this run's is {live_as}: "
            f"expected keys {sorted(live)}, found {sorted(saved)}. Create it with "
            f"enabled={bool(saved)}, or leave the scaler out of the TrainState to drop its state."
        )
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or unexpected:
        raise StateMismatchError(
            f"{where}: GradScaler keys differ: missing in checkpoint {missing}, unexpected "
            f"{unexpected}"
        )
    for key, value in saved.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CorruptCheckpointError(
                f"{where}: {key!r} is {value!r}, expected a number like {live[key]!r}"
            )
        if key in ("growth_interval", "_growth_tracker") and not isinstance(value, int):
            raise CorruptCheckpointError(f"{where}: {key!r} is {value!r}, expected an integer")


# -- scratch copies -------------------------------------------------------------------------


class Scratch:
    """Makes scratch copies of live objects: deep copies in which the given tensors (the model's,
    the optimizer's) are ``meta`` stand-ins, and the given objects (a dataset) are shared."""

    def __init__(self, tensors: Iterable[torch.Tensor], shared: Iterable[Any] = ()) -> None:
        self._tensors = list(tensors)
        self._shared = [s for s in shared if s is not None]

    def copy(self, obj: Any, tensors: Mapping[int, Any] | None = None) -> Any:
        """A scratch copy of ``obj``, or None when it cannot be deep-copied; ``tensors`` gives
        some live tensors (by ``id``) other stand-ins than ``meta`` ones."""
        memo: dict[int, Any] = {id(s): s for s in self._shared}
        memo.update(tensors or {})
        for t in [*self._tensors, *_tensors_in(_state_dict_or_none(obj))]:
            if id(t) not in memo:
                memo[id(t)] = _meta_like(t)
        try:
            return copy.deepcopy(obj, memo)
        except Exception as exc:
            log.debug("cannot copy %s to check a restore on it first: %s", class_name(obj), exc)
            return None


def trial_load(
    obj: Any,
    saved: Any,
    where: str,
    scratch: Scratch | None,
    *,
    error: type[StateMismatchError | CorruptCheckpointError] = StateMismatchError,
) -> None:
    """``obj.load_state_dict(saved)`` on a scratch copy: ``error`` if it raises
    (:class:`CorruptCheckpointError` where the fit was checked already: malformed values)."""
    _trial(obj, "load_state_dict", saved, where, scratch, error)


def _trial(
    obj: Any,
    method: str,
    saved: Any,
    where: str,
    scratch: Scratch | None,
    error: type[StateMismatchError | CorruptCheckpointError] = StateMismatchError,
) -> None:
    copied = (scratch or Scratch(())).copy(obj)
    if copied is None:
        return
    try:
        getattr(copied, method)(trial_value(saved))
    except StateMismatchError as exc:  # it says itself what does not fit (a Value's kind)
        raise StateMismatchError(f"{where}: {exc} Nothing was changed.") from exc
    except Exception as exc:
        live = _state_dict_or_none(obj) if method == "load_state_dict" else None
        keys = ""
        if isinstance(live, dict) and isinstance(saved, dict):
            keys = (
                f" (this run's {type(obj).__name__} has fields {sorted(map(str, live))[:20]}, the "
                f"checkpoint {sorted(map(str, saved))[:20]})"
            )
        hint = (
            "Was its class or a field renamed?"
            if error is StateMismatchError
            else "The checkpoint's values are malformed."
        )
        raise error(
            f"{where}: the saved state does not load into this run's {type(obj).__name__}: "
            f"{method} raised {type(exc).__name__}: {exc}{keys}. {hint} Nothing was changed."
        ) from exc


def _state_dict_or_none(obj: Any) -> Any:
    if isinstance(obj, nn.Module) or not hasattr(obj, "state_dict"):
        return None
    try:
        return obj.state_dict()
    except Exception:
        return None


def _meta_like(t: torch.Tensor) -> Any:
    if is_dtensor(t):
        return t  # shared: a DTensor has no meta stand-in as cheap
    stand_in = torch.empty_like(t, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(stand_in, requires_grad=t.requires_grad)
    return stand_in


def _tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if depth > 64:
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors_in(v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v, depth + 1)


def trial_value(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` for a trial load (which may change it, as LambdaLR's pops a key):
    small ``meta`` tensors become zeros, so a load may read them."""
    if depth > 64:
        return value
    if isinstance(value, torch.Tensor):
        if value.is_meta and value.numel() <= _TRIAL_MATERIALIZE:
            return torch.zeros(value.shape, dtype=value.dtype)
        return value
    if isinstance(value, dict):
        return {k: trial_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [trial_value(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(trial_value(v, depth + 1) for v in value)
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def live_tensors_of(*objects: Any) -> Iterator[torch.Tensor]:
    """The tensors of modules (parameters, buffers) and optimizers (params, state) in ``objects``."""
    for obj in objects:
        if isinstance(obj, nn.Module):
            yield from obj.parameters()
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                yield from _tensors_in(group)
            yield from _tensors_in(dict(obj.state))
