"""Lightning's own checkpoint content in a crashproof checkpoint, and putting it back.

The model and the optimizers are sections of the :class:`~crashproof.TrainState` (so they are
checked against the live ones before anything changes, exported by ``crashproof export``, and
refused when they hold NaN). Everything else Lightning writes into its ``.ckpt`` files, the
loops' progress, callbacks' and the datamodule's state, the precision plugin's, the
hyper-parameters and what ``on_save_checkpoint`` hooks add, is :class:`LightningState`, one
``extra`` of that TrainState: Lightning's own checkpoint dict (``dump_checkpoint``, so a user's
hooks run as they do for a ``.ckpt``), less the tensors saved elsewhere, in the safe encoding of
:mod:`crashproof.integrations._safe_values`. It also carries the train loader's position.

:func:`apply_checkpoint` puts a restored dict back through Lightning's public hooks, in the order
Lightning's own restore uses (module, datamodule, callbacks, precision, loops).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from crashproof.errors import ConfigError
from crashproof.integrations._lightning_data import EpochSampler
from crashproof.integrations._safe_values import decode_safe, encode_safe

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["LightningState", "apply_checkpoint", "check_hyperparameters"]

SAVED_ELSEWHERE = ("state_dict", "optimizer_states", "lr_schedulers")
"""Keys of Lightning's dict held by the TrainState's model, optimizer and scheduler sections."""


def _hint(path: str, value: Any) -> str:
    """How to avoid an unsupported value, by where it sits in Lightning's checkpoint dict."""
    parts = path.split("/")
    if len(parts) > 2 and parts[1] in ("hyper_parameters", "datamodule_hyper_parameters"):
        owner = "LightningModule" if parts[1] == "hyper_parameters" else "LightningDataModule"
        return (
            f"It is the hyper-parameter {parts[2]!r} of the {owner}: leave it out with "
            f"self.save_hyperparameters(ignore=[{parts[2]!r}]) (it is still passed to __init__), "
            "or pass a plain value (a name, a number, a dict of settings) instead."
        )
    if len(parts) > 2 and parts[1] == "callbacks":
        return (
            f"It is in the state of the callback {parts[2]!r}: make its state_dict() return "
            "tensors and plain values."
        )
    return (
        f"It is under {parts[1]!r} of Lightning's checkpoint (a state_dict() or an "
        "on_save_checkpoint hook put it there): store a plain value instead."
    )


def _template(trainer: Trainer) -> dict[str, Any]:
    """The live values a decoded dict is shaped like: they decide the classes of dataclasses,
    enums and dict subclasses among the hyper-parameters (see ``_safe_values``)."""
    template: dict[str, Any] = {"hyper_parameters": dict(trainer.lightning_module.hparams)}
    datamodule = getattr(trainer, "datamodule", None)  # (a property mypy cannot see)
    if datamodule is not None:
        template["datamodule_hyper_parameters"] = dict(datamodule.hparams)
    return template


def check_hyperparameters(trainer: Trainer) -> None:
    """Refuse, before the first step, hyper-parameters no checkpoint could hold (naming each)."""
    encode_safe(_template(trainer), "lightning", hint=_hint)


class LightningState:
    """``extra["lightning"]``: Lightning's checkpoint dict and the train loader's position.

    After a restore, :attr:`loaded` holds the decoded dict and :attr:`loaded_position` the
    saved position, for the callback to put back once Lightning has built what they go into.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.sampler: EpochSampler | None = None
        """The train loader's sampler once crashproof tracks it (None: Lightning's own loader
        state, or a position that cannot be saved)."""
        self.loaded: dict[str, Any] | None = None
        self.loaded_position: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        checkpoint = self._trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in SAVED_ELSEWHERE:
            checkpoint.pop(key, None)
        return {
            "checkpoint": encode_safe(checkpoint, "lightning", hint=_hint),
            "position": self.sampler.state_dict() if self.sampler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = _decoded(state, _template(self._trainer))
        self.loaded_position = state.get("position")

    def __deepcopy__(self, memo: dict[int, Any]) -> _Trial:
        # The restore first loads every extra into a scratch copy; a copy of this one would copy
        # the whole Trainer. Decoding is the part of loading that can fail: tried on its own.
        return _Trial(_template(self._trainer))


class _Trial:
    """What a restore's trial load gets instead of a :class:`LightningState`: decodes only."""

    def __init__(self, template: dict[str, Any]) -> None:
        self._template = template

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _decoded(state, self._template)


def _decoded(state: Any, template: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(state, dict) or not isinstance(state.get("checkpoint"), dict):
        raise ValueError("not the state of crashproof's Lightning callback")
    position = state.get("position")
    if position is not None and not isinstance(position, dict):
        raise ValueError(f"the train loader's position is {type(position).__name__}, not a dict")
    decoded = decode_safe(state["checkpoint"], like=template, where="lightning")
    assert isinstance(decoded, dict)
    return decoded


def apply_checkpoint(trainer: Trainer, loaded: dict[str, Any]) -> None:
    """Put ``loaded`` (Lightning's dict, decoded) back into the trainer, through the hooks
    Lightning's own restore calls; the model and optimizers are restored already."""
    module = trainer.lightning_module
    checkpoint = dict(loaded)
    # The hooks see a whole checkpoint, as from a .ckpt: the restored tensors included.
    checkpoint["state_dict"] = module.state_dict()
    checkpoint["optimizer_states"] = [o.state_dict() for o in trainer.optimizers]
    checkpoint["lr_schedulers"] = [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
    module.on_load_checkpoint(checkpoint)
    datamodule = getattr(trainer, "datamodule", None)  # (a property mypy cannot see)
    if datamodule is not None and type(datamodule).__qualname__ in checkpoint:
        datamodule.load_state_dict(checkpoint[type(datamodule).__qualname__])
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        callback.on_load_checkpoint(trainer, module, checkpoint)
    saved = checkpoint.get("callbacks", {})
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        state = saved.get(callback.state_key, saved.get(getattr(callback, "_legacy_state_key", "")))
        if state:
            callback.load_state_dict(copy.deepcopy(state))
    precision = trainer.precision_plugin
    precision.on_load_checkpoint(checkpoint)
    if type(precision).__qualname__ in checkpoint:
        precision.load_state_dict(checkpoint[type(precision).__qualname__])
    trainer.fit_loop.load_state_dict(checkpoint["loops"]["fit_loop"])
    max_epochs = trainer.max_epochs
    if max_epochs is not None and max_epochs != -1 and trainer.current_epoch > max_epochs:
        raise ConfigError(
            f"the crashproof checkpoint is at epoch {trainer.current_epoch}, past this run's "
            f"Trainer(max_epochs={max_epochs}): raise max_epochs, or start a new root"
        )
