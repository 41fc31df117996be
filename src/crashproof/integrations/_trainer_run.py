"""One ``Trainer.train()`` call under crashproof: the restore before it, the saves during it.

The Trainer's own resume path is kept (it skips the data already seen, in the Trainer's own
order, and puts the random state back after the skip); what it would read from a checkpoint
directory comes from one verified crashproof checkpoint instead:

1. Before the Trainer's loop starts, the optimizer is made (the Trainer's public
   ``create_optimizer``, which its loop then reuses) and the whole checkpoint is restored in one
   verified read: model, optimizer, scaler, random state, and, kept aside, the Trainer's state
   and the scheduler's (the scheduler does not exist yet: the Trainer makes it later).
2. ``train`` is called with a directory holding only that Trainer state (``trainer_state.json``):
   the Trainer works out the epoch and the batches to skip from it, as on its own resume.
3. The Trainer's loaders are pointed here for that directory: the scheduler's state is loaded
   once the Trainer has made it (and the optimizer's learning rates, which making the scheduler
   resets), and the random state is put back where the Trainer puts its own back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import torch

from crashproof.checkpoint import CheckpointManager
from crashproof.errors import ConfigError
from crashproof.state import TrainState, capture_rng, restore_rng

__all__ = ["TrainRun", "check_trainer"]

log = logging.getLogger("crashproof.integrations")

# The Trainer's methods crashproof takes over (checked to exist: a Trainer that renamed them
# would otherwise silently resume from nothing).
_NEEDED = (
    "train",
    "create_optimizer",
    "_maybe_log_save_evaluate",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
)


def check_trainer(trainer: Any, *, trainer_checkpoints: bool, root: str) -> None:
    """Refuse, explaining, what cannot be combined with crashproof's checkpoints."""
    missing = [name for name in _NEEDED if not callable(getattr(trainer, name, None))]
    if missing:
        import transformers

        raise ConfigError(
            f"CrashproofCallback: this Trainer ({type(trainer).__name__}, transformers "
            f"{transformers.__version__}) has no {', '.join(missing)}; crashproof's Trainer "
            "integration is tested with transformers 5.x"
        )
    args = trainer.args
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy != "no" and not trainer_checkpoints:
        raise ConfigError(
            f"TrainingArguments(save_strategy={strategy!r}) makes the Trainer write checkpoints "
            f"of its own beside crashproof's in {root}. Set save_strategy='no' (crashproof saves "
            "on its own schedule: CrashproofCallback(every=...)), or pass "
            "CrashproofCallback(..., trainer_checkpoints=True) to keep both (crashproof's are "
            "the ones a run resumes from)"
        )
    for flag, what in (
        ("is_deepspeed_enabled", "DeepSpeed"),
        ("is_fsdp_enabled", "FSDP"),
        ("is_fsdp_xla_enabled", "FSDP on XLA"),
    ):
        if getattr(trainer, flag, False):
            raise ConfigError(
                f"CrashproofCallback does not yet checkpoint a Trainer using {what}: its "
                "optimizer and model state are sharded by it. Use the Trainer without it, or "
                "crashproof's CheckpointManager with FSDP2 (fully_shard) directly"
            )
    _warn_inexact(trainer)
    if trainer.model_init is not None:
        raise ConfigError(
            "CrashproofCallback with Trainer(model_init=...): the Trainer makes a new model at "
            "every train(), so a resumed state would be thrown away. Pass model=... instead"
        )


def _warn_inexact(trainer: Any) -> None:
    """Say so where the Trainer's own resume cannot be exact (docs/transformers.md)."""
    if getattr(trainer.data_collator, "mlm", False):
        log.warning(
            "CrashproofCallback: the data collator masks at random (mlm=True); the Trainer puts "
            "the random state back only after fetching the first batches past a resume, so "
            "their masks will differ from an uninterrupted run's (docs/transformers.md)"
        )
    if trainer.args.dataloader_num_workers > 0:
        log.warning(
            "CrashproofCallback: with dataloader_num_workers=%d, randomness inside the workers "
            "(random transforms) differs after a resume: their seeds are drawn when the resumed "
            "epoch starts (docs/transformers.md)",
            trainer.args.dataloader_num_workers,
        )


class _Stash:
    """An extra of the TrainState: saves what ``capture`` gives; a restore keeps what it loads.

    A scratch copy (the restore's trial load) keeps nothing of the live objects."""

    def __init__(self, capture: Any, required: tuple[str, ...]) -> None:
        self._capture = capture
        self._required = required
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self._capture() if self._capture is not None else {}

    def load_state_dict(self, state: Any) -> None:
        missing = [k for k in self._required if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"the saved state has no {missing}")
        self.loaded = dict(state)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Stash:
        return _Stash(None, self._required)


def _inner(optimizer: Any) -> Any:
    """The torch optimizer under Accelerate's wrapper (its state dict is the wrapped one's)."""
    return getattr(optimizer, "optimizer", optimizer) if optimizer is not None else None


class TrainRun:
    """The restore before one ``train()`` call and the saves during it."""

    LOADERS = (
        "_load_from_checkpoint",
        "_load_optimizer_and_scheduler",
        "_load_scaler",
        "_load_rng_state",
    )

    def __init__(self, trainer: Any, root: str, manager_options: dict[str, Any]) -> None:
        self.trainer = trainer
        self.manager = CheckpointManager(root, **manager_options)
        self.restored_step: int | None = None
        self.epoch_ending = False
        self._resume_dir: str | None = None
        self._rng: dict[str, Any] | None = None
        self._param_groups: list[dict[str, Any]] = []
        self._decided = -1  # the last step maybe_save was asked about
        self._saved = -1
        self._trainer_stash = _Stash(self._capture_trainer, ("state_json", "tr_loss"))
        self._scheduler_stash = _Stash(self._capture_scheduler, ("class", "state"))
        self._state: TrainState | None = None

    # -- restore -------------------------------------------------------------------------------

    def restore(self) -> str | None:
        """Restore the newest valid checkpoint; the directory to hand ``train`` (None: none)."""
        trainer = self.trainer
        trainer.create_optimizer()
        state = self._train_state(trainer.model, trainer.optimizer)
        step = self.manager.restore(state)
        loaded = self._trainer_stash.loaded
        if loaded is None:
            return None
        self.restored_step = step
        self._rng = capture_rng()  # as restored: put back where the Trainer puts its own back
        self._param_groups = [
            {k: v for k, v in group.items() if k != "params"}
            for group in _inner(trainer.optimizer).param_groups
        ]
        trainer.current_flos = float(loaded.get("current_flos", 0.0))
        self._resume_dir = tempfile.mkdtemp(prefix=f"crashproof-step-{step}-")
        with open(os.path.join(self._resume_dir, "trainer_state.json"), "w") as out:
            out.write(loaded["state_json"])
        return self._resume_dir

    def owns(self, checkpoint: Any) -> bool:
        return self._resume_dir is not None and checkpoint == self._resume_dir

    def load(self, loader: str) -> None:
        """Stand in for the Trainer's loader ``loader`` on the directory :meth:`restore` made."""
        trainer = self.trainer
        if loader == "_load_optimizer_and_scheduler":
            # Making the scheduler set the learning rates to its first step's: back to the saved.
            for group, saved in zip(
                _inner(trainer.optimizer).param_groups, self._param_groups, strict=True
            ):
                group.update(saved)
            saved_scheduler = self._scheduler_stash.loaded
            if saved_scheduler is not None and trainer.lr_scheduler is not None:
                live = type(trainer.lr_scheduler).__qualname__
                if saved_scheduler["class"] not in ("", live):
                    raise ConfigError(
                        f"the checkpoint of step {self.restored_step} under "
                        f"{self.manager.root} holds a {saved_scheduler['class']} learning-rate "
                        f"scheduler, this Trainer made a {live}: set the same lr_scheduler_type"
                    )
                trainer.lr_scheduler.load_state_dict(saved_scheduler["state"])
        elif loader == "_load_rng_state" and self._rng is not None:
            restore_rng(self._rng)
        # _load_from_checkpoint, _load_scaler: restored already, with everything else

    # -- saves ---------------------------------------------------------------------------------

    def training_begins(self) -> None:
        """The Trainer has wrapped the model (DDP) and made the scheduler: what saves capture."""
        trainer = self.trainer
        wrapped = trainer.model_wrapped
        model = (
            wrapped
            if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
            else trainer.model
        )
        self._state = self._train_state(model, trainer.optimizer)
        loaded = self._trainer_stash.loaded
        if loaded is not None:
            # The running loss since the last logging step, which the Trainer's loop has just
            # reset: the next logged loss is then the uninterrupted run's.
            trainer._tr_loss = loaded["tr_loss"].to(trainer.args.device).clone()
            trainer._globalstep_last_logged = int(loaded.get("globalstep_last_logged", 0))

    def after_step_end(self) -> None:
        """After the Trainer's logging, evaluation and own save of a step (or of an epoch)."""
        trainer, step = self.trainer, self.trainer.state.global_step
        if step == self._decided or step == 0 or self._state is None:
            return
        control = trainer.control
        if not self.epoch_ending and (
            control.should_epoch_stop
            or control.should_training_stop
            or float(trainer.state.epoch or 0.0).is_integer()
        ):
            return  # the epoch's own logging and evaluation come next: save after them
        self._decided = step
        if self.manager.maybe_save(step, self._state):
            self._saved = step

    def save_final(self) -> None:
        step = self.trainer.state.global_step
        if self._state is not None and step > 0 and step != self._saved:
            self.manager.save(step, self._state)
            self._saved = step

    def close(self) -> None:
        try:
            self.manager.close()
        finally:
            if self._resume_dir is not None:
                shutil.rmtree(self._resume_dir, ignore_errors=True)

    # -- the state -----------------------------------------------------------------------------

    def _train_state(self, model: Any, optimizer: Any) -> TrainState:
        extra: dict[str, Any] = {
            "trainer": self._trainer_stash,
            "lr_scheduler": self._scheduler_stash,
        }
        config: Any = getattr(self.trainer.model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            # For `crashproof export --format hf`: the model's config.json, beside its weights.
            extra["hf_config"] = json.loads(config.to_json_string())
        return TrainState(
            model=model,
            optimizer=_inner(optimizer),
            scaler=getattr(self.trainer.accelerator, "scaler", None),
            extra=extra,
        )

    def _capture_trainer(self) -> dict[str, Any]:
        trainer = self.trainer
        _update_callback_states(trainer)
        return {
            # A string: the log history may hold NaN or inf, which JSON values may not.
            "state_json": json.dumps(dataclasses.asdict(trainer.state), sort_keys=True),
            "current_flos": float(getattr(trainer, "current_flos", 0.0)),
            "tr_loss": getattr(trainer, "_tr_loss", torch.zeros(())),
            "globalstep_last_logged": int(getattr(trainer, "_globalstep_last_logged", 0)),
        }

    def _capture_scheduler(self) -> dict[str, Any]:
        scheduler = self.trainer.lr_scheduler
        if scheduler is None:
            return {"class": "", "state": {}}
        return {"class": type(scheduler).__qualname__, "state": scheduler.state_dict()}


def _update_callback_states(trainer: Any) -> None:
    """What the Trainer does before writing its state: callbacks that keep state of their own
    (``ExportableState``, e.g. early stopping) put it into ``state.stateful_callbacks``."""
    from transformers.trainer_callback import ExportableState

    found: dict[str, list[Any]] = {}
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(callback, ExportableState):
            found.setdefault(type(callback).__name__, []).append(callback.state())
    for name, states in found.items():
        trainer.state.stateful_callbacks[name] = states if len(states) > 1 else states[0]
