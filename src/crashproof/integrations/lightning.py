"""``CrashproofCallback``: a Lightning ``fit`` that saves crashproof checkpoints and resumes
from the newest valid one by itself, bit for bit.

::

    import crashproof as cp
    from crashproof.integrations.lightning import CrashproofCallback

    trainer = L.Trainer(callbacks=[CrashproofCallback("runs/x", every=cp.EverySteps(50))])
    trainer.fit(model, datamodule)          # resumes from runs/x when it holds a checkpoint

A checkpoint holds the LightningModule and its optimizers and LR schedulers (the TrainState's
sections), Lightning's own checkpoint content (loops' progress, callbacks', the datamodule's and
the precision plugin's state, hyper-parameters, in a safe encoding: no pickle), every global
random generator and the train loader's position. When each part is saved and put back, and
why: the hooks below and docs/lightning.md.

This module imports Lightning (``pip install 'crashproof[lightning]'``); ``import crashproof``
never imports it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from crashproof.integrations._requires import require

require("lightning.pytorch", extra="lightning", what="crashproof.integrations.lightning")

from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402

from crashproof.checkpoint import CheckpointManager  # noqa: E402
from crashproof.errors import ConfigError  # noqa: E402
from crashproof.integrations._lightning_checks import check_ckpt_path, check_trainer  # noqa: E402
from crashproof.integrations._lightning_data import (  # noqa: E402
    RandomState,
    has_own_state,
    make_resumable,
    quiet_lightning_doubt,
)
from crashproof.integrations._lightning_state import (  # noqa: E402
    LightningState,
    apply_checkpoint,
    check_hyperparameters,
)
from crashproof.integrations._options import manager_options as manager_options_for  # noqa: E402
from crashproof.policy import RetentionPolicy, SavePolicy  # noqa: E402
from crashproof.state import TrainState  # noqa: E402

__all__ = ["CrashproofCallback"]

log = logging.getLogger("crashproof.integrations.lightning")


class CrashproofCallback(Callback):
    """Save crashproof checkpoints during ``Trainer.fit`` and resume from the newest valid one.

    Args:
        root: the checkpoint root (a directory, or a URI crashproof's storage takes).
        every: when to save (``crashproof.EverySteps(n)``, ``EverySeconds``, ``Young``...), in
            optimizer steps (``trainer.global_step``); default ``EverySteps(1000)``.
        keep: which checkpoints to keep (``crashproof.KeepLast(3)``...); default the newest 5.
        **manager_options: any other option of :class:`crashproof.CheckpointManager`
            (``async_save``, ``remote``, ``delta``, ``handle_signals``...).

    ``restored_step`` is the step the current fit resumed from (0: it started afresh).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        every: SavePolicy | None = None,
        keep: RetentionPolicy | None = None,
        **manager_options: Any,
    ) -> None:
        self._options = manager_options_for("CrashproofCallback", every, keep, manager_options)
        self.root = os.fspath(root)
        self.manager: CheckpointManager | None = None
        """The run's manager, from ``setup`` to the end of ``fit``."""
        self.restored_step = 0
        self._state: TrainState | None = None
        self._lightning: LightningState | None = None
        self._restored_random: RandomState | None = None
        self._random_at_batch_end: RandomState | None = None
        self._tracked: Any = None  # the train loader whose position is saved
        self._last_step = -1  # trainer.global_step at the previous batch end
        self._saved_step = -1
        self._speak_again: Callable[[], None] | None = None  # Lightning's resume warning

    def has_checkpoint(self) -> bool:
        """Whether the root holds a valid checkpoint (what a ``fit`` would resume from)."""
        with CheckpointManager(self.root, read_only=True, handle_signals=False) as reader:
            return any(info.valid for info in reader.list())

    # -- set-up and restore ----------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_trainer(trainer, self)
        # Here, not earlier: under DDP the process group exists from now on, and the manager
        # coordinates the ranks' saves over it.
        self.manager = CheckpointManager(self.root, **self._options)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        manager = self._manager()
        check_hyperparameters(trainer)
        check_ckpt_path(trainer, manager, self.root)
        self._lightning = LightningState(trainer)
        self._state = _train_state(trainer, self._lightning)
        self.restored_step = manager.restore(self._state)
        if not self.restored_step:
            return
        # The generators as saved: Lightning draws from them before training goes on (sanity
        # check, the loader's first iterator); they are put back from on_train_start on.
        self._restored_random = RandomState()
        assert self._lightning.loaded is not None
        apply_checkpoint(trainer, self._lightning.loaded)
        if trainer.global_step != self.restored_step:
            log.warning(
                "restored crashproof step %d, but Lightning's global_step is %d",
                self.restored_step,
                trainer.global_step,
            )
        self._last_step = self._saved_step = self.restored_step

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        lightning = self._lightning
        assert lightning is not None
        self._track(trainer, lightning.loaded_position)
        # Lightning made the loader's iterator in setup_data, with the sampler it had: made
        # again, over the resumable one (which draws nothing from the global generators).
        iter(trainer.fit_loop._data_fetcher)  # type: ignore[arg-type]
        if self._restored_random is not None:
            self._restored_random.put_back()
            # Lightning's restart logic may draw again before training goes on (it makes the
            # validation loader's iterator to skip a validation): put back once more as late as
            # possible, before the first batch is read (a loader without workers reads it in
            # this process, perhaps drawing) or, failing that, as the first batch starts.
            sampler = lightning.sampler
            if sampler is not None and getattr(self._tracked, "num_workers", 1) == 0:
                sampler.before_iteration = self._put_back_restored
        self._random_at_batch_end = RandomState()

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._put_back_restored()

    def _put_back_restored(self) -> None:
        restored, self._restored_random = self._restored_random, None
        if restored is not None:
            restored.put_back()
            if self._lightning is not None and self._lightning.sampler is not None:
                self._lightning.sampler.before_iteration = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # reload_dataloaders_every_n_epochs: a new loader, before this epoch's iter()
        if trainer.train_dataloader is not self._tracked:
            self._track(trainer, None)

    def _track(self, trainer: Trainer, position: dict[str, Any] | None) -> None:
        lightning = self._lightning
        assert lightning is not None
        loader = trainer.train_dataloader
        self._tracked = loader
        lightning.sampler = None
        if has_own_state(loader):
            return  # Lightning saves and restores its position itself (fit loop state)
        found = make_resumable(
            loader,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            epoch=trainer.current_epoch,
        )
        if isinstance(found, str):
            log.warning(
                "the train loader %s: a fit resumed mid-epoch starts that epoch's data over, and "
                "is not the same as an uninterrupted one. Give the DataLoader a map-style dataset "
                "and shuffle=True/False, or use torchdata's StatefulDataLoader",
                found,
            )
            return
        lightning.sampler = found
        if self._speak_again is None:
            self._speak_again = quiet_lightning_doubt()
        if position is not None:
            found.load_state_dict(position)  # StateMismatchError: another dataset size or seed

    # -- saving ----------------------------------------------------------------------------------

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self._last_step:  # the optimizer stepped: no gradients accumulating now
            self._last_step = step
            assert self._state is not None
            if self._manager().maybe_save(step, self._state):
                self._saved_step = step
        self._random_at_batch_end = RandomState()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Validation inside fit draws from the global generators (its loader's iter(), the
        # model's own randomness). A fit resumed from a checkpoint of the batch before does not
        # repeat it (Lightning's restart logic), so training's numbers must not depend on it.
        if trainer.training or trainer.sanity_checking or self._random_at_batch_end is None:
            return
        if trainer.state.fn == "fit":
            self._random_at_batch_end.put_back()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The finished state, so that a fit run again once it is done has nothing left to do.
        step = trainer.global_step
        if step > 0 and step != self._saved_step and self._state is not None:
            self._manager().save(step, self._state)
            self._saved_step = step

    # -- the end ---------------------------------------------------------------------------------

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        # A save in flight is finished (close waits for it) or, if it cannot be, never
        # committed: its temporary directory is no checkpoint. Nothing may hide the exception.
        try:
            self._close()
        except Exception as error:  # the training's own exception comes first
            log.error("closing the checkpoint manager after %r failed: %s", exception, error)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        if self._speak_again is not None:
            self._speak_again()
            self._speak_again = None
        manager, self.manager = self.manager, None
        self._state = self._random_at_batch_end = None
        if manager is not None:
            manager.close()

    def _manager(self) -> CheckpointManager:
        if self.manager is None:
            raise ConfigError("CrashproofCallback: used outside Trainer.fit (no setup('fit'))")
        return self.manager


def _train_state(trainer: Trainer, lightning: LightningState) -> TrainState:
    """The TrainState of a fit: the module and its first optimizer and scheduler as sections,
    any further ones and Lightning's own content as extras."""
    optimizers = list(trainer.optimizers)
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    extra: dict[str, Any] = {"lightning": lightning}
    extra.update({f"optimizer_{i}": o for i, o in enumerate(optimizers[1:], 1)})
    extra.update({f"scheduler_{i}": s for i, s in enumerate(schedulers[1:], 1)})
    return TrainState(
        model=trainer.lightning_module,
        optimizer=optimizers[0] if optimizers else None,
        scheduler=schedulers[0] if schedulers else None,
        extra=extra,
    )
