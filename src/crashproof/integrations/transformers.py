"""crashproof for the Hugging Face ``Trainer``: one callback, verified asynchronous checkpoints,
and a resume that happens by itself and lands exactly where the uninterrupted run would be::

    from crashproof.integrations.transformers import CrashproofCallback

    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir="out", save_strategy="no"),
        train_dataset=dataset,
        callbacks=[CrashproofCallback("runs/gpt", every=cp.EverySteps(50))],
    )
    trainer.train()  # resumes from the newest valid checkpoint under runs/gpt, if there is one

How it fits into the Trainer (docs/transformers.md says it for users):

- **Saving** happens where the Trainer saves its own checkpoints: after the step's logging,
  evaluation and the Trainer's own save, so the random state and the log history saved are
  those the next step starts from. A step that ends an epoch is saved after the epoch's own
  logging and evaluation. The last step is always saved when ``train()`` returns.
- **Resuming** goes through the Trainer's own resume path, which skips the data already seen in
  the Trainer's own order (sampler, ``group_by_length``, gradient accumulation) and puts the
  random state back after the skip. crashproof supplies what that path reads: the Trainer's
  state, the model, optimizer, scheduler and scaler, and the random state of every rank, all
  from one verified checkpoint (falling back to an older one when the newest does not verify).
- The Trainer keeps its running loss between logging steps outside its state; crashproof saves
  that too, so the losses logged after a resume are those of the uninterrupted run.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from crashproof.checkpoint import CheckpointManager
from crashproof.errors import ConfigError
from crashproof.integrations._options import manager_options as manager_options_for
from crashproof.integrations._requires import require
from crashproof.integrations._trainer_run import TrainRun, check_trainer

_transformers = require(
    "transformers", extra="transformers", what="crashproof.integrations.transformers"
)
TrainerCallback: Any = _transformers.TrainerCallback

__all__ = ["CrashproofCallback"]


class CrashproofCallback(TrainerCallback):  # type: ignore[misc]
    """Checkpoints a ``transformers.Trainer`` with crashproof, and resumes it by itself.

    Args:
        root: the checkpoint root (a local directory or an fsspec URI), as for
            :class:`crashproof.CheckpointManager`.
        every: when to save (default: the manager's); saves happen at optimizer steps.
        keep: what to keep (default: the manager's).
        trainer_checkpoints: also let the Trainer write its own checkpoints (``save_strategy``):
            off by default, and a ``save_strategy`` other than ``"no"`` is refused without it,
            so that two checkpointing systems are never combined by accident.
        manager_options: every other :class:`crashproof.CheckpointManager` option
            (``async_save``, ``remote``, ``delta``, ...).

    Add it when the Trainer is made (``Trainer(..., callbacks=[...])``). One added later with
    ``trainer.add_callback`` must be bound: ``callback.bind(trainer)``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        every: Any = None,
        keep: Any = None,
        trainer_checkpoints: bool = False,
        **manager_options: Any,
    ) -> None:
        self.root = os.fspath(root)
        self.trainer_checkpoints = trainer_checkpoints
        self.manager_options = manager_options_for(
            "CrashproofCallback", every, keep, manager_options
        )
        self.restored_step: int | None = None
        """The step the last ``train()`` resumed from (None: it started afresh)."""
        self._trainer: Any = None
        self._run: TrainRun | None = None

    @property
    def manager(self) -> CheckpointManager | None:
        """The :class:`crashproof.CheckpointManager` of the ``train()`` call under way (None
        between calls): its ``stats`` say what each save cost the loop."""
        return self._run.manager if self._run is not None else None

    # -- binding to the Trainer ----------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is not None:
            self.bind(trainer)

    def bind(self, trainer: Any) -> None:
        """Attach to ``trainer``: its ``train()`` then resumes and saves through crashproof.

        Done by itself for a callback given to the Trainer's constructor."""
        if self._trainer is trainer:
            return
        if self._trainer is not None:
            raise ConfigError(
                f"CrashproofCallback({self.root!r}) is bound to another Trainer already: give "
                "each Trainer its own callback (and its own root)"
            )
        check_trainer(trainer, trainer_checkpoints=self.trainer_checkpoints, root=self.root)
        self._trainer = trainer
        original_train = trainer.train
        original_step_end = trainer._maybe_log_save_evaluate

        def train(resume_from_checkpoint: Any = None, trial: Any = None, **kwargs: Any) -> Any:
            return self._train(original_train, resume_from_checkpoint, trial, **kwargs)

        def maybe_log_save_evaluate(*args: Any, **kwargs: Any) -> None:
            original_step_end(*args, **kwargs)
            if self._run is not None:
                self._run.after_step_end()

        def loader(name: str) -> Any:
            original = getattr(trainer, name)

            def load(checkpoint: Any, *args: Any, **kwargs: Any) -> None:
                run = self._run
                if run is not None and run.owns(checkpoint):
                    run.load(name)
                else:
                    original(checkpoint, *args, **kwargs)

            return load

        trainer.train = train
        trainer._maybe_log_save_evaluate = maybe_log_save_evaluate
        for name in TrainRun.LOADERS:
            setattr(trainer, name, loader(name))

    def _train(self, original: Any, resume_from_checkpoint: Any, trial: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint not in (None, False):
            raise ConfigError(
                f"trainer.train(resume_from_checkpoint={resume_from_checkpoint!r}) with a "
                f"CrashproofCallback: crashproof resumes by itself from {self.root}, and two "
                "sources of the state cannot both be right. Call trainer.train() without it; to "
                "continue from a Trainer checkpoint directory, bring it into the root first: "
                f"crashproof import {resume_from_checkpoint} {self.root}"
            )
        if trial is not None:
            raise ConfigError(
                "CrashproofCallback does not checkpoint hyper-parameter searches (trial=...): each "
                "trial is a new run. Leave the callback out of the search's Trainer"
            )
        run = TrainRun(self._trainer, self.root, self.manager_options)
        self._run = run
        try:
            resume_dir = run.restore()
            self.restored_step = run.restored_step
            result = original(resume_from_checkpoint=resume_dir, **kwargs)
            run.save_final()
            return result
        finally:
            self._run = None
            run.close()

    # -- events --------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._run is None:
            raise ConfigError(
                "CrashproofCallback was added to a Trainer it is not bound to (added with "
                "add_callback after the Trainer was made?): call callback.bind(trainer) first"
            )
        self._run.training_begins()

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._run is not None:
            self._run.epoch_ending = False

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._run is not None:
            self._run.epoch_ending = True


def _calling_trainer() -> Any:
    """The Trainer whose constructor is calling ``on_init_end``: found on the call stack, since
    callbacks are not handed the Trainer. None if not found (then ``bind`` is needed)."""
    trainer_class = _transformers.Trainer
    frame = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, trainer_class) and frame.f_code.co_name == "__init__":
            return candidate
    return None
