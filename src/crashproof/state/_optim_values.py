"""An optimizer's saved values against the live optimizer's: hyperparameters and per-parameter
state of the kinds the live ones are (:mod:`crashproof.state._kinds`).

:func:`~crashproof.state._check.check_optimizer` has already matched the layout (groups,
parameters, hyperparameter names, per-element shapes); this judges the values torch's
``load_state_dict`` takes without looking and the next ``step()`` trips over: a string learning
rate, a one-element ``betas``, AdamW state without ``exp_avg_sq``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from crashproof.errors import CorruptCheckpointError
from crashproof.state._kinds import check_same_kind

__all__ = ["check_optimizer_values"]

# Not hyperparameters: the parameters themselves, and their optional names.
_NOT_COMPARED = frozenset({"params", "param_names"})


def check_optimizer_values(
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    params: Mapping[Any, torch.Tensor],
    per_element: frozenset[str],
    where: str,
) -> None:
    """:class:`StateMismatchError` where a saved hyperparameter, or the saved state of a
    parameter the live optimizer has state for, is not of the live one's kind (same keys);
    :class:`CorruptCheckpointError` where a torch optimizer's saved per-parameter states of one
    group disagree among themselves on which per-element entries they hold (torch creates them
    all at a parameter's first step), which is judged even for an optimizer that never stepped.
    ``params``: saved parameter id to live parameter."""
    for i, (group, live) in enumerate(
        zip(saved["param_groups"], optimizer.param_groups, strict=True)
    ):
        common = [k for k in live if k in group and k not in _NOT_COMPARED]
        check_same_kind(
            {k: live[k] for k in common},
            {k: group[k] for k in common},
            f"{where}: param group {i}",
        )
    state = saved["state"]
    for param_id, param_state in state.items():
        live_state = optimizer.state.get(params[param_id])
        if live_state:
            # 'step' may be a number or a tensor (torch converts it on load; _well_formed judges
            # it); entries torch creates when first needed may be None on either side.
            check_same_kind(
                {k: v for k, v in live_state.items() if k != "step"},
                {k: v for k, v in param_state.items() if k != "step"},
                f"{where}: state of parameter {param_id}",
                exact_keys=True,
                none_is_unset=True,
            )
    if type(optimizer).__module__.startswith("torch.optim"):
        _check_groups_agree(saved["param_groups"], state, per_element | {"step"}, where)


def _check_groups_agree(
    groups: list[dict[str, Any]], state: Mapping[Any, Any], names: frozenset[str], where: str
) -> None:
    for i, group in enumerate(groups):
        held = [(pid, names & set(state[pid])) for pid in group["params"] if state.get(pid)]
        every = set().union(*(keys for _, keys in held)) if held else set()
        for pid, keys in held:
            if keys != every:
                raise CorruptCheckpointError(
                    f"{where}: param group {i}: the state of parameter {pid} lacks "
                    f"{sorted(every - keys)}, which the group's other parameters hold: not a "
                    "state torch writes (it creates every entry at a parameter's first step)"
                )
