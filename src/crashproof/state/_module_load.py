"""Modules whose loading runs code of their own, and the trial load that runs it first.

``model.load_state_dict`` copies tensors, but it also runs whatever a module adds to loading:
load-state-dict pre- and post-hooks, an overridden ``_load_from_state_dict`` (a version check, a
renamed key, lazy materialisation), ``set_extra_state``. Any of it may refuse a checkpoint, and
a refusal after the live tensors were written would leave the model half restored. So before
anything live changes, the whole ``load_state_dict`` runs on a scratch copy of the model in which

- the tensors of every module whose loading runs such code (and its submodules) are the
  checkpoint's own values: that code sees what it will see on the live model (a
  ``set_extra_state`` that derives a cache from the module's just-loaded weights);
- every other tensor is a ``meta`` stand-in: it costs no memory, and plain copying checks
  nothing a shape comparison did not.

Cost: the tensors of those subtrees are read into new memory rather than straight into the live
ones (:meth:`TrainState.live_tensors` leaves them out), once: the trial uses those very tensors,
and the live load copies from them. Models that add nothing to loading pay nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from crashproof.errors import StateMismatchError
from crashproof.state._dtensor import is_dtensor

if TYPE_CHECKING:
    from crashproof.state._check import Scratch

__all__ = ["custom_loaders", "trial_module_load", "under"]


def _runs_own_code(module: nn.Module, *, root: bool) -> bool:
    kind = type(module)
    return bool(
        module._load_state_dict_pre_hooks
        or module._load_state_dict_post_hooks
        or kind._load_from_state_dict is not nn.Module._load_from_state_dict
        or kind.set_extra_state is not nn.Module.set_extra_state
        or (root and kind.load_state_dict is not nn.Module.load_state_dict)
    )


def custom_loaders(module: nn.Module) -> list[str]:
    """The topmost submodules whose loading runs code of their own, as state-dict key prefixes
    (``""``: the module itself; ``"1.lin"``)."""
    found: list[str] = []
    for name, sub in module.named_modules(remove_duplicate=False):
        if not under(name, found) and _runs_own_code(sub, root=sub is module):
            found.append(name)
    return found


def under(key: str, prefixes: list[str]) -> bool:
    """Whether state-dict key (or module name) ``key`` belongs to one of the ``prefixes``."""
    return any(p == "" or key == p or key.startswith(p + ".") for p in prefixes)


def trial_module_load(
    module: nn.Module, saved: Mapping[str, Any], where: str, scratch: Scratch | None
) -> bool:
    """Run ``module.load_state_dict(saved)`` on a scratch copy (see the module's docstring);
    :class:`StateMismatchError` if it raises. False when there is nothing to try it on: no
    module runs code of its own, or the model cannot be copied (it holds a lock): the caller
    then protects the live tensors otherwise."""
    from crashproof.state._check import Scratch, trial_value

    prefixes = custom_loaders(module)
    if not prefixes:
        return True
    live = module.state_dict(keep_vars=True)
    if any(is_dtensor(t) for t in live.values()):
        # A copy would share the live DTensors (they have no cheap stand-in), and keeping a
        # copy would gather them: a sharded model's loading code is not tried (guarantees.md).
        return True
    real: dict[int, Any] = {}
    for key, tensor in live.items():
        value = saved.get(key)
        if (
            under(key, prefixes)
            and isinstance(tensor, torch.Tensor)
            and isinstance(value, torch.Tensor)
            and not value.is_meta
        ):
            real[id(tensor)] = (
                nn.Parameter(value, requires_grad=tensor.requires_grad)
                if isinstance(tensor, nn.Parameter)
                else value
            )
    copied = (scratch or Scratch(())).copy(module, real)
    if copied is None:
        return False
    try:
        with warnings.catch_warnings():  # copying into a meta stand-in is the point here
            warnings.filterwarnings("ignore", message=".*to a meta parameter", category=UserWarning)
            copied.load_state_dict(trial_value(saved), strict=True)
    except Exception as exc:
        raise StateMismatchError(
            f"{where}: the saved state does not load into this run's {type(module).__name__} "
            f"(loading runs code of {', '.join(repr(p or type(module).__name__) for p in prefixes[:5])}): "
            f"{type(exc).__name__}: {exc}. Nothing was changed."
        ) from exc
    return True
