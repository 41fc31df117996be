"""What the Lightning callback checks before it saves or restores anything.

Three kinds of trouble are found at set-up, each with a message saying what to change:

- a Lightning without the internals the callback needs (named with the installed version);
- a strategy whose state is not the plain model and optimizer crashproof saves (FSDP,
  DeepSpeed: they shard or own the optimizer state);
- two resume mechanisms at once: a second ``CrashproofCallback``, Lightning's
  ``OnExceptionCheckpoint`` (which makes ``fit`` resume from its own file), or
  ``fit(ckpt_path=...)`` while the root holds a crashproof checkpoint. Lightning's
  ``ModelCheckpoint`` is no conflict (it never resumes by itself): it is only pointed out.
"""

from __future__ import annotations

import logging
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from crashproof.checkpoint import CheckpointManager
from crashproof.errors import ConfigError

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["check_ckpt_path", "check_trainer"]

log = logging.getLogger("crashproof.integrations.lightning")

_INTERNALS = (
    ("_checkpoint_connector", "dump_checkpoint", "to take Lightning's checkpoint dict"),
    ("fit_loop", "_data_fetcher", "to restart the train loader's iteration at its position"),
)


def check_trainer(trainer: Trainer, callback: object) -> None:
    """Raise :class:`ConfigError` unless ``trainer`` can be checkpointed by ``callback``."""
    for owner, name, why in _INTERNALS:
        if not hasattr(getattr(trainer, owner, None), name):
            raise ConfigError(
                f"crashproof.integrations.lightning needs trainer.{owner}.{name} {why}; "
                f"lightning {version('lightning')} has none. It was written against Lightning 2.4 to "
                "2.6: install one of those, or report the version you need"
            )
    strategy = trainer.strategy
    plain = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
    if (
        not plain
        or strategy.restore_checkpoint_after_setup
        or not strategy.lightning_restore_optimizer
    ):
        raise ConfigError(
            f"CrashproofCallback: the {type(strategy).__name__} strategy keeps its model or "
            "optimizer state in a form of its own; the callback supports one device and DDP "
            "(strategy='ddp'). For FSDP, use crashproof's TrainState and CheckpointManager in a "
            "loop of your own (docs/checkpointing.md, 'Sharded state')"
        )
    others = [c for c in trainer.callbacks if type(c) is type(callback) and c is not callback]  # type: ignore[attr-defined]
    if others:
        raise ConfigError(
            "Trainer(callbacks=...) holds two CrashproofCallbacks: one run has one checkpoint "
            "root, written by one callback"
        )
    if any(isinstance(c, OnExceptionCheckpoint) for c in trainer.callbacks):  # type: ignore[attr-defined]
        raise ConfigError(
            "Trainer(callbacks=...) holds Lightning's OnExceptionCheckpoint next to "
            "CrashproofCallback: it makes fit() resume from its own file, and crashproof resumes "
            "from its checkpoints; two states would be combined. Remove OnExceptionCheckpoint: "
            "crashproof's newest checkpoint is what a failed fit resumes from"
        )
    if trainer.is_global_zero and any(
        isinstance(c, ModelCheckpoint)
        for c in trainer.callbacks  # type: ignore[attr-defined]
    ):
        log.info(
            "Lightning's ModelCheckpoint is on too (Trainer(enable_checkpointing=True), the "
            "default): it goes on writing its .ckpt files (pickles), and fit() never resumes "
            "from them: crashproof resumes from its own checkpoints. Keep it for best-k model "
            "files; else pass Trainer(enable_checkpointing=False)"
        )


def check_ckpt_path(trainer: Trainer, manager: CheckpointManager, root: str) -> None:
    """Refuse ``fit(ckpt_path=...)`` when the root holds a crashproof checkpoint: Lightning
    has loaded that file already, and crashproof would load its own over parts of it."""
    ckpt_path: Any = trainer.ckpt_path
    if not ckpt_path:
        return
    steps = [info.step for info in manager.list() if info.valid]
    if steps:
        raise ConfigError(
            f"fit(ckpt_path={str(ckpt_path)!r}) was given, and {root} holds crashproof "
            f"checkpoints (newest: step {max(steps)}): both would be restored, one over the "
            "other. To resume, drop ckpt_path (the callback resumes by itself); to start from "
            f"that file, use a new root. A script that does both: "
            f"fit(..., ckpt_path=None if callback.has_checkpoint() else PATH)"
        )
    log.info("fit(ckpt_path=...) on an empty crashproof root: crashproof saves from there on")
