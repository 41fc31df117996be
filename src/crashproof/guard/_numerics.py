"""``NumericsGuard``: catch a non-finite or spiking loss or gradient before the step is applied.

Called once per step between ``backward()`` and ``optimizer.step()``::

    for step in guard.steps(start, total_steps):   # range(), but it goes back after a rollback
        ...
        if guard.check(step + 1, loss, model):       # False: do not apply this step
            optimizer.step()
        optimizer.zero_grad()
        ckpt.maybe_save(step + 1, state)

It reads the loss and the global gradient norm (one fused norm over all gradients), compares
them with what the run has shown (a spike: more than ``spike_factor`` times the median of the last
``window`` losses), and makes every rank reach the same verdict (one small all-reduce), so no
rank applies a step that another skips. Per kind of anomaly the action is to skip the step,
to skip it and scale the learning rate down for a while, to roll back to the newest checkpoint
taken before the trouble began and leave out the data that caused it (:mod:`._rollback`), or to
stop with a report; too many anomalies in a row always stop. With an AMP ``GradScaler``,
non-finite *gradients* are the scaler's business (it skips those steps and lowers its scale):
only a non-finite loss counts.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from crashproof.checkpoint import Group, default_group
from crashproof.errors import ConfigError, NumericsError
from crashproof.guard._injection import injected_nan
from crashproof.guard._rollback import DataLedger, SkippedData
from crashproof.telemetry import emit

if TYPE_CHECKING:  # the checkpoint package imports the guard: no import cycle at run time
    from crashproof.checkpoint import CheckpointManager
    from crashproof.state import TrainState

__all__ = ["Action", "NumericsGuard", "Verdict"]

log = logging.getLogger("crashproof.guard")

Action = Literal["skip", "reduce_lr", "rollback", "stop"]
_ACTIONS = ("skip", "reduce_lr", "rollback", "stop")


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
    checkpoints: CheckpointManager | None = None
    """``rollback``: the manager whose checkpoints to go back to ..."""
    state: TrainState | None = None
    """... and the state to restore (its ``ResumableSampler`` lets the bad data be skipped)."""
    replay_first: bool = False
    """``rollback``: replay the same data the first time (a transient fault does not recur);
    skip it only when the anomaly comes back at the same data. Default: skip it at once."""
    onset_factor: float = 2.0
    """A spike began at the first of the losses before it above this times the median: the
    checkpoints from there on are not rolled back to, and those steps' data is skipped too."""
    max_rollbacks: int = 3
    """Rollbacks without getting past the furthest anomaly, after which the guard stops."""
    group: Group | None = None
    """The ranks that must agree; default: the default process group, if initialised."""
    anomalies: list[Verdict] = field(default_factory=list)
    """Every anomaly seen, in order (also in the run's event log)."""
    skipped: list[SkippedData] = field(default_factory=list)
    """Every stretch of data left out after a rollback (also in the run's event log)."""
    rolled_back_to: int | None = None
    """Set by a ``check`` that rolled back: the step the state is now at. The loop goes on with
    step ``rolled_back_to + 1`` (:meth:`steps` does that)."""
    _history: deque[tuple[int, float]] = field(default_factory=deque, repr=False)
    _in_a_row: int = 0
    _lr_restore: tuple[int, list[float], int] | None = None
    _ledger: DataLedger | None = field(default=None, repr=False)
    _replayed: set[tuple[object, ...]] = field(default_factory=set, repr=False)
    _furthest_anomaly: int = 0
    _rollbacks_in_a_row: int = 0

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
            or not 1 < self.onset_factor <= self.spike_factor
            or self.max_rollbacks < 1
        ):
            raise ConfigError(
                "NumericsGuard: spike_factor must be > 1, lr_factor in (0, 1), "
                "1 <= min_history <= window, 1 < onset_factor <= spike_factor, max_rollbacks >= 1"
            )
        if "rollback" in (self.on_nonfinite, self.on_spike) and (
            self.checkpoints is None or self.state is None
        ):
            raise ConfigError(
                "NumericsGuard(..., 'rollback'): pass checkpoints=<CheckpointManager> and "
                "state=<TrainState>, the checkpoints to go back to and the state to restore"
            )
        self._history = deque(maxlen=self.window)
        sampler = self.state.sampler if self.state is not None else None
        self._ledger = DataLedger(sampler, keep=self.window)

    def state_dict(self) -> dict[str, Any]:
        """The statistics later verdicts depend on: the recent losses, the anomalies in a row and
        a learning-rate cut in progress. Put the guard in ``TrainState(extra={"guard": guard})``
        so a resumed run judges spikes exactly as the uninterrupted run did (without, it starts
        with no history). What the guard remembers of rollbacks is deliberately not included: a
        rollback restores the state, and must not forget that it happened."""
        return {
            "history": [[step, loss] for step, loss in self._history],
            "in_a_row": self._in_a_row,
            "lr_restore": list(self._lr_restore) if self._lr_restore is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history.clear()
        self._history.extend((int(step), float(loss)) for step, loss in state["history"])
        self._in_a_row = int(state["in_a_row"])
        cut = state["lr_restore"]
        self._lr_restore = (
            (int(cut[0]), [float(v) for v in cut[1]], int(cut[2])) if cut is not None else None
        )

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """``range(start, stop)`` that goes back to the restored step after a rollback."""
        step = start
        while step < stop:
            yield step
            back, self.rolled_back_to = self.rolled_back_to, None
            step = back if back is not None else step + 1

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
        self._check_loop_went_back(step)
        assert self._ledger is not None
        data = self._ledger.record(step)
        self._restore_lr_when_due(step, optimizer)
        value = (
            float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
        )
        if injected_nan(step):  # the chaos seam (docs/chaos.md): inert without its env variable
            value = math.nan
        # With a scaler, gradients may be inf by design: their norm decides nothing.
        norm = _grad_norm(model) if model is not None and scaler is None else None
        nonfinite = not math.isfinite(value) or (norm is not None and not math.isfinite(norm))
        median = statistics.median(loss for _, loss in self._history) if self._history else 0.0
        spike = (
            not nonfinite
            and len(self._history) >= self.min_history
            and median > 0
            and value > self.spike_factor * median
        )
        if self.group is None:
            self.group = default_group()  # once: creating a group is itself a collective
        group = self.group
        if group.world_size > 1:
            nonfinite, spike = (bool(v) for v in group.max([int(nonfinite), int(spike)]))
        if not (nonfinite or spike):
            self._history.append((step, value))
            self._in_a_row = 0
            if step > self._furthest_anomaly:
                self._rollbacks_in_a_row = 0
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
            {"stop": "stopping", "rollback": "rolling back"}.get(action, "skipping the step"),
        )
        if action == "stop":
            raise NumericsError(
                f"step {step}: {kind} loss {value} (gradient norm {norm}; median of the last "
                f"{len(self._history)} losses {median:.4g}); {self._in_a_row} anomalies in a row. "
                "The step was not applied; the newest checkpoint predates it. Lower the learning "
                "rate or check the data around this step, then resume."
            )
        if action == "reduce_lr":
            self._reduce_lr(step, optimizer)
        if action == "rollback":
            self._rollback(step, kind, data, median)
        return False

    def _check_loop_went_back(self, step: int) -> None:
        if self.rolled_back_to is None:
            return
        expected, self.rolled_back_to = self.rolled_back_to + 1, None
        if step != expected:
            raise ConfigError(
                f"NumericsGuard rolled the state back to step {expected - 1}, but the loop went "
                f"on with step {step}: iterate with `for step in guard.steps(start, total)` (or "
                "set the loop's step from guard.rolled_back_to), or the step numbers and the "
                "checkpoints would no longer match the state"
            )

    def _rollback(
        self, step: int, kind: str, data: tuple[tuple[int, int, int], ...], median: float
    ) -> None:
        """Restore the newest checkpoint before the trouble began; skip its data unless replaying."""
        assert self.checkpoints is not None and self.state is not None and self._ledger is not None
        self._rollbacks_in_a_row += 1
        if self._rollbacks_in_a_row > self.max_rollbacks:
            raise NumericsError(
                f"step {step}: {kind} again after {self.max_rollbacks} rollbacks without getting "
                f"past step {self._furthest_anomaly}; stopping rather than looping. Data skipped "
                f"so far: {[s.windows for s in self.skipped]}. Lower the learning rate or inspect "
                "the data around this step."
            )
        self._furthest_anomaly = max(self._furthest_anomaly, step)
        onset = self._spike_onset(step, median) if kind == "spike" else step
        seen_at = (kind, *data) if data else (kind, "step", step)
        can_skip = self._ledger.sampler is not None
        skip = can_skip and (not self.replay_first or seen_at in self._replayed)
        if not skip and seen_at in self._replayed:  # replayed already, and nothing to skip
            raise NumericsError(
                f"step {step}: {kind} again at the same step after a rollback, and the data "
                "cannot be skipped (TrainState(data=...) has no crashproof.ResumableSampler); "
                "stopping rather than looping"
            )
        self._replayed.add(seen_at)
        windows = self._ledger.between(onset, step) if skip else ()
        restored = self.checkpoints.rollback(self.state, before=onset, anomaly_step=step)
        if restored is None:  # nothing to go back to: the step is skipped instead
            log.warning(
                "step %d: %s, but no valid checkpoint of a step before %d to roll back to: "
                "skipping the step instead",
                step,
                kind,
                onset,
            )
            emit(
                "numerics_rollback", step=step, kind=kind, rolled_back_to=None, first_step=onset,
                skipped=[],
            )  # fmt: skip
            return
        # After the restore, which set the sampler back to the checkpoint's position and windows.
        for window in windows:
            assert self._ledger.sampler is not None
            self._ledger.sampler.skip(*window)
        self._ledger.forget_after(restored)
        while self._history and self._history[-1][0] > restored:
            self._history.pop()
        if self._lr_restore is not None and self._lr_restore[2] > restored:
            self._lr_restore = None  # the checkpoint's rates predate the cut
        self.rolled_back_to = restored
        if windows:
            self.skipped.append(SkippedData(step, onset, windows, restored))
        emit(
            "numerics_rollback",
            step=step,
            kind=kind,
            rolled_back_to=restored,
            first_step=onset,
            skipped=[list(w) for w in windows],
        )
        log.warning(
            "step %d: %s; rolled back to checkpoint step %d%s",
            step,
            kind,
            restored,
            f", skipping the data of steps {onset}-{step} ({list(windows)})"
            if windows
            else ", replaying the same data",
        )

    def _spike_onset(self, step: int, median: float) -> int:
        """The first step of the run of raised losses (above ``onset_factor`` x median) before
        ``step``: where the spike began."""
        onset = step
        for earlier, loss in reversed(self._history):
            if earlier != onset - 1 or loss <= self.onset_factor * median:
                break
            onset = earlier
        return onset

    def _reduce_lr(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Scale every learning rate by ``lr_factor`` until ``lr_steps`` steps from now.

        A scheduler that sets absolute rates each step (OneCycle, cosine, lambda) overrides the
        cut at its next step: with those, prefer ``skip``, or lower the rate in the schedule.
        """
        if optimizer is None:
            raise ConfigError("NumericsGuard(reduce_lr) needs check(..., optimizer=...)")
        cut_at = step
        if self._lr_restore is None:  # cut once; a further anomaly only extends the period
            for g in optimizer.param_groups:
                g["lr"] = float(g["lr"]) * self.lr_factor
        else:
            cut_at = self._lr_restore[2]
        self._lr_restore = (
            step + self.lr_steps,
            [float(g["lr"]) for g in optimizer.param_groups],
            cut_at,
        )

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
