"""``NumericsGuard``: catch a non-finite or spiking loss or gradient before the step is applied.

Called once per step between ``backward()`` and ``optimizer.step()``::

    if guard.check(step + 1, loss, model):   # False: do not apply this step
        optimizer.step()
    optimizer.zero_grad()

It reads the loss and the global gradient norm (one fused norm over all gradients), compares
them with what the run has shown (a spike: more than ``spike_factor`` times the median of the last
``window`` losses), and makes every rank reach the same verdict (one small all-reduce), so no
rank applies a step that another skips. Per kind of anomaly the action is to skip the step,
to skip it and scale the learning rate down for a while, or to stop with a report; too many
anomalies in a row always stop. With an AMP ``GradScaler``, non-finite *gradients* are the
scaler's business (it skips those steps and lowers its scale): only a non-finite loss counts.

Rolling back to an earlier checkpoint and skipping the data window that caused the anomaly is
not done here yet: see ``docs/numerics.md``.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from crashproof.checkpoint._group import Group, default_group
from crashproof.errors import ConfigError, NumericsError
from crashproof.telemetry._events import emit

__all__ = ["Action", "NumericsGuard", "Verdict"]

log = logging.getLogger("crashproof.guard")

Action = Literal["skip", "reduce_lr", "stop"]
_ACTIONS = ("skip", "reduce_lr", "stop")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the guard saw at one step: ``kind`` and ``action`` are the same on every rank (they
    agree); ``loss`` and ``grad_norm`` are this rank's."""

    step: int
    kind: Literal["ok", "nonfinite", "spike"]
    loss: float
    grad_norm: float | None
    action: Action | None


@dataclass(kw_only=True)
class NumericsGuard:
    on_nonfinite: Action = "skip"
    """What to do when the loss (or, without a GradScaler, the gradient norm) is NaN or inf."""
    on_spike: Action = "skip"
    """What to do when the loss exceeds ``spike_factor`` times its rolling median."""
    spike_factor: float = 10.0
    window: int = 100
    """Losses the rolling median is taken over."""
    min_history: int = 20
    """Finite losses to see before spikes are judged."""
    lr_factor: float = 0.5
    """``reduce_lr``: multiply every learning rate by this ..."""
    lr_steps: int = 100
    """... for this many steps, then put it back."""
    max_in_a_row: int = 10
    """Anomalies in a row after which the guard stops whatever the actions say."""
    group: Group | None = None
    """The ranks that must agree; default: the default process group, if initialised."""
    anomalies: list[Verdict] = field(default_factory=list)
    """Every anomaly seen, in order (also in the run's event log)."""
    _losses: deque[float] = field(default_factory=deque, repr=False)
    _in_a_row: int = 0
    _lr_restore: tuple[int, list[float]] | None = None

    def __post_init__(self) -> None:
        for name in ("on_nonfinite", "on_spike"):
            if getattr(self, name) not in _ACTIONS:
                raise ConfigError(
                    f"NumericsGuard({name}={getattr(self, name)!r}): use one of {', '.join(_ACTIONS)}"
                )
        if (
            self.spike_factor <= 1
            or not 0 < self.lr_factor < 1
            or not 1 <= self.min_history <= self.window
        ):
            raise ConfigError(
                "NumericsGuard: spike_factor must be > 1, lr_factor in (0, 1), and "
                "1 <= min_history <= window"
            )
        self._losses = deque(maxlen=self.window)

    def check(
        self,
        step: int,
        loss: torch.Tensor | float,
        model: nn.Module | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> bool:
        """Judge the step about to be applied; True: apply it, False: skip it.

        ``model`` gives the gradients to check (after ``backward()``); ``optimizer`` is needed
        for ``reduce_lr``; with ``scaler`` (AMP), non-finite gradients are left to it.
        """
        self._restore_lr_when_due(step, optimizer)
        value = (
            float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
        )
        # With a scaler, gradients may be inf by design: their norm decides nothing.
        norm = _grad_norm(model) if model is not None and scaler is None else None
        nonfinite = not math.isfinite(value) or (norm is not None and not math.isfinite(norm))
        spike = (
            not nonfinite
            and len(self._losses) >= self.min_history
            and value > self.spike_factor * statistics.median(self._losses)
            and statistics.median(self._losses) > 0
        )
        if self.group is None:
            self.group = default_group()  # once: creating a group is itself a collective
        group = self.group
        if group.world_size > 1:
            nonfinite, spike = (bool(v) for v in group.max([int(nonfinite), int(spike)]))
        if not (nonfinite or spike):
            self._losses.append(value)
            self._in_a_row = 0
            return True
        kind: Literal["nonfinite", "spike"] = "nonfinite" if nonfinite else "spike"
        action = self.on_nonfinite if nonfinite else self.on_spike
        self._in_a_row += 1
        if self._in_a_row >= self.max_in_a_row:
            action = "stop"
        verdict = Verdict(step, kind, value, norm, action)
        self.anomalies.append(verdict)
        emit(
            "numerics",
            step=step,
            kind=kind,
            loss=_json_float(value),
            grad_norm=_json_float(norm),
            action=action,
        )
        log.warning(
            "step %d: %s loss %s, gradient norm %s: %s",
            step,
            kind,
            value,
            norm,
            "skipping the step" if action != "stop" else "stopping",
        )
        if action == "stop":
            history = statistics.median(self._losses) if self._losses else float("nan")
            raise NumericsError(
                f"step {step}: {kind} loss {value} (gradient norm {norm}; median of the last "
                f"{len(self._losses)} losses {history:.4g}); {self._in_a_row} anomalies in a row. "
                "The step was not applied; the newest checkpoint predates it. Lower the learning "
                "rate or check the data around this step, then resume."
            )
        if action == "reduce_lr":
            self._reduce_lr(step, optimizer)
        return False

    def _reduce_lr(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Scale every learning rate by ``lr_factor`` until ``lr_steps`` steps from now.

        A scheduler that sets absolute rates each step (OneCycle, cosine, lambda) overrides the
        cut at its next step: with those, prefer ``skip``, or lower the rate in the schedule.
        """
        if optimizer is None:
            raise ConfigError("NumericsGuard(reduce_lr) needs check(..., optimizer=...)")
        if self._lr_restore is None:  # cut once; a further anomaly only extends the period
            for g in optimizer.param_groups:
                g["lr"] = float(g["lr"]) * self.lr_factor
        self._lr_restore = (step + self.lr_steps, [float(g["lr"]) for g in optimizer.param_groups])

    def _restore_lr_when_due(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        if self._lr_restore is None or optimizer is None or step < self._lr_restore[0]:
            return
        for g, reduced in zip(optimizer.param_groups, self._lr_restore[1], strict=True):
            if float(g["lr"]) == reduced:  # untouched since the cut (no scheduler took over)
                g["lr"] = reduced / self.lr_factor
        self._lr_restore = None


def _grad_norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads)
    return float(torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).item())


def _json_float(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return str(value)  # JSON has no NaN or inf
