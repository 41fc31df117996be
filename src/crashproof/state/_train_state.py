"""``TrainState``: everything a training step depends on, captured and restored as one.

Capture produces a plain tree of dicts, lists, scalars and tensors (the live tensors, not copies:
the checkpoint pipeline decides when to copy). Restore validates the whole tree against the live
objects first and only then changes anything, so a checkpoint that does not fit (another model,
another optimizer layout) raises :class:`StateMismatchError` and leaves the live state untouched.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from crashproof.errors import ConfigError, StateMismatchError
from crashproof.state._data import track_loader
from crashproof.state._dtensor import is_dtensor
from crashproof.state._rng import capture_rng, check_rng, restore_rng
from crashproof.state._sampler import ResumableSampler

__all__ = ["Stateful", "TrainState"]

_JSON_SCALARS = (type(None), bool, int, float, str)
# Optimizer state entries that torch.optim keeps per element of the parameter (same shape).
_PER_ELEMENT_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
     "sum", "exp_inf", "ax", "prev", "step_size", "grad_avg"}
)  # fmt: skip


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose state_dict has plain keys: under DDP/FSDP1 wrappers and torch.compile."""
    while True:
        if (
            isinstance(model, nn.parallel.DistributedDataParallel)
            or type(model).__name__ == "DataParallel"
        ):
            inner = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            inner = model._orig_mod
        else:
            return model
        assert isinstance(inner, nn.Module)
        model = inner


class TrainState:
    """The complete state of a training run.

    Args:
        model: the model (plain, DDP-wrapped or compiled); saved without wrapper prefixes.
        optimizer: any ``torch.optim.Optimizer``.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        scaler: an AMP ``GradScaler``.
        data: a ``DataLoader`` whose sampler is a :class:`ResumableSampler`, or any object with
            ``state_dict``/``load_state_dict`` (e.g. torchdata's ``StatefulDataLoader``).
        extra: named extra state: objects with ``state_dict``/``load_state_dict`` (an EMA model)
            or JSON-like values (token counters). Values are replaced in this dict on restore.

    The RNG state of Python, NumPy, torch and every CUDA device is always included.
    """

    def __init__(
        self,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        data: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.data = data
        self.extra: dict[str, Any] = extra if extra is not None else {}
        self.sampler: ResumableSampler | None = None
        for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None and not isinstance(obj, Stateful):
                raise ConfigError(
                    f"TrainState({name}=...): {type(obj).__name__} has no state_dict()/load_state_dict()"
                )
        if data is not None and not isinstance(data, Stateful):
            if not isinstance(data, torch.utils.data.DataLoader):
                raise ConfigError(
                    f"TrainState(data=...): {type(data).__name__} is neither a DataLoader nor has state_dict()"
                )
            self.sampler = track_loader(data)
        for key, value in self.extra.items():
            if not isinstance(value, Stateful) and not _is_json_like(value):
                raise ConfigError(
                    f"TrainState(extra={{{key!r}: ...}}): {type(value).__name__} has no state_dict()/"
                    "load_state_dict() and is not a JSON-like value (number, string, list, dict)"
                )

    # -- capture -------------------------------------------------------------------------------

    def capture(self) -> dict[str, Any]:
        """The current state as a tree of plain values and (live, uncopied) tensors."""
        return self._capture(keep_created_state=False)

    @contextlib.contextmanager
    def restore_layout(self) -> Iterator[dict[str, Any]]:
        """The live state as :meth:`capture` gives it, but with a sharded optimizer's state even
        before its first step: the layout (DTensor placements) a restore cuts saved pieces into.
        torch's helper creates that state by stepping the optimizer (zero gradients, zero
        learning rate, so its step hooks do run); it is removed again on exit."""
        unstepped = self.optimizer is not None and not self.optimizer.state
        try:
            yield self._capture(keep_created_state=True)
        finally:
            if unstepped and self.optimizer is not None:
                self.optimizer.state.clear()

    def _capture(self, *, keep_created_state: bool) -> dict[str, Any]:
        tree: dict[str, Any] = {"rng": capture_rng()}
        if self.sharded:
            # FSDP2 / DTensor parameters: torch's state-dict helpers give the optimizer's state
            # keyed by parameter names, so it can be resharded like the model.
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            assert self.model is not None
            tree["model"] = get_model_state_dict(self.model)
            if self.optimizer is not None:
                unstepped = not self.optimizer.state
                optimizer_tree = get_optimizer_state_dict(self.model, self.optimizer)
                if unstepped and not keep_created_state:
                    # torch's helper creates the state of an optimizer that never stepped by
                    # stepping it (zero gradients, zero learning rate): undo that, a checkpoint
                    # must not change the run (Adam would count one step too many). The step's
                    # hooks, if the optimizer has any, have run all the same.
                    self.optimizer.state.clear()
                    optimizer_tree = {**optimizer_tree, "state": {}}
                tree["optimizer"] = optimizer_tree
        else:
            if self.model is not None:
                tree["model"] = unwrap_model(self.model).state_dict()
            if self.optimizer is not None:
                tree["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            tree["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            tree["scaler"] = self.scaler.state_dict()
        if self.sampler is not None:
            tree["data"] = self.sampler.state_dict()
        elif self.data is not None:
            tree["data"] = self.data.state_dict()
        tree["extra"] = {
            key: {"state_dict": value.state_dict()}
            if isinstance(value, Stateful)
            else {"value": value}
            for key, value in self.extra.items()
        }
        return tree

    @property
    def sharded(self) -> bool:
        """Whether the model's parameters are DTensors (``fully_shard``, tensor parallelism)."""
        return self.model is not None and any(is_dtensor(p) for p in self.model.parameters())

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors a restore may read straight into, by their names in a checkpoint.

        The model's parameters and buffers, and those of ``extra`` modules (an EMA model): the
        restore then needs no second copy of them in memory. Not DTensors: their pieces are cut
        from the saved ones by :mod:`crashproof.checkpoint._sharded`.
        """
        live: dict[str, torch.Tensor] = {}
        if self.model is not None:
            live.update({f"model/{k}": v for k, v in unwrap_model(self.model).state_dict().items()})
        for key, value in self.extra.items():
            if isinstance(value, nn.Module):
                live.update(
                    {f"extra/{key}/state_dict/{k}": v for k, v in value.state_dict().items()}
                )
        return {k: v for k, v in live.items() if not is_dtensor(v)}

    def must_be_finite(self, tree: Mapping[str, Any]) -> frozenset[str]:
        """Names (as in a checkpoint) of the tensors of ``tree`` (from :meth:`capture`) that must
        never be saved holding NaN or inf.

        The model's parameters and the optimizer's state: buffers may hold infinities by design
        (attention masks), parameters and moments may not.
        """
        names: set[str] = set()
        if self.model is not None:
            params = unwrap_model(self.model).named_parameters(remove_duplicate=False)
            names.update(f"model/{k}" for k, _ in params)
        for param_id, param_state in tree.get("optimizer", {}).get("state", {}).items():
            names.update(f"optimizer/state/{param_id}/{k}" for k in param_state)
        return frozenset(names)

    def replicated_names(self, names: Iterable[str]) -> frozenset[str]:
        """Of ``names`` (tensors as named in a checkpoint), those every rank holds identically,
        so a save may write them once, spread over the ranks: a DDP job's parameters and the
        optimizer's state of those parameters. Not its buffers: DDP hands rank 0's to the others
        at the start of a forward pass, and BatchNorm's running statistics then move with each
        rank's own batch, so at a save they differ. Nor parameters DDP is told to ignore, nor
        optimizer state of parameters outside the DDP module, nor any optimizer state under a
        ``ZeroRedundancyOptimizer`` (it shards it). Empty when the job is not DDP. The writer
        still checks, by checksum, that every rank's copy of what it deduplicates is the same."""
        ddp = self._ddp()
        if ddp is None:
            return frozenset()
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        module = unwrap_model(ddp)
        synced = {
            id(p): f"model/{name}"
            for name, p in module.named_parameters(remove_duplicate=False)
            if name not in ignored
        }
        replicated = set(synced.values())
        # Not imported here: importing torch.distributed.optim compiles TorchScript classes
        # (0.2-0.7 s, paid by the first save after every restart). An optimizer of that class
        # means its module is loaded already.
        zero_module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
        zero = getattr(zero_module, "ZeroRedundancyOptimizer", None)
        sharded_optimizer = zero is not None and isinstance(self.optimizer, zero)
        state_of: tuple[str, ...] = ()
        if self.optimizer is not None and not sharded_optimizer:
            # optimizer.state_dict() numbers the parameters across its groups, in order
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            state_of = tuple(
                f"optimizer/state/{i}/" for i, p in enumerate(params) if id(p) in synced
            )
        return frozenset(n for n in names if n in replicated or n.startswith(state_of))

    def _ddp(self) -> nn.parallel.DistributedDataParallel | None:
        """The model's DDP wrapper, also under ``torch.compile(DDP(model))``."""
        model = self.model
        while model is not None:
            if isinstance(model, nn.parallel.DistributedDataParallel):
                return model
            inner = getattr(model, "_orig_mod", None)
            model = inner if isinstance(inner, nn.Module) else None
        return None

    def per_rank_names(self) -> frozenset[str]:
        """Names (as in a checkpoint) of the model's buffers: tensors the ranks of a DDP job may
        hold differently (see :meth:`replicated_names`), so a restore on another number of ranks
        takes them from one saved rank instead of requiring every rank's to agree."""
        if self._ddp() is None:
            return frozenset()
        assert self.model is not None
        buffers = unwrap_model(self.model).named_buffers(remove_duplicate=False)
        return frozenset(f"model/{k}" for k, _ in buffers)

    # -- restore -------------------------------------------------------------------------------

    def restore(self, tree: Mapping[str, Any], *, where: str = "checkpoint") -> None:
        """Load ``tree`` (as made by :meth:`capture`); all-or-nothing on validation errors."""
        self.check(tree, where=where)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            assert self.model is not None
            set_model_state_dict(self.model, tree["model"])
            if self.optimizer is not None:
                set_optimizer_state_dict(self.model, self.optimizer, tree["optimizer"])
                if not tree["optimizer"]["state"]:  # saved before its first step (see capture)
                    self.optimizer.state.clear()
        else:
            if self.model is not None:
                unwrap_model(self.model).load_state_dict(tree["model"], strict=True)
            if self.optimizer is not None:
                self.optimizer.load_state_dict(tree["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(tree["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(tree["scaler"])
        if self.sampler is not None:
            self.sampler.load_state_dict(tree["data"])
        elif self.data is not None:
            self.data.load_state_dict(tree["data"])
        for key, value in self.extra.items():
            entry = tree["extra"][key]
            if isinstance(value, Stateful):
                value.load_state_dict(entry["state_dict"])
            else:
                self.extra[key] = entry["value"]
        restore_rng(tree["rng"])

    def check(self, tree: Mapping[str, Any], *, where: str = "checkpoint") -> None:
        """Raise :class:`StateMismatchError` unless ``tree`` fits every live component."""
        for name in ("model", "optimizer", "scheduler", "scaler", "data"):
            if getattr(self, name) is not None and name not in tree:
                raise StateMismatchError(
                    f"{where}: holds no {name} state, but this TrainState has a {name}"
                )
        check_rng(tree.get("rng"), where)
        if self.model is not None:
            check_module(unwrap_model(self.model), tree["model"], f"{where}: model")
        if self.optimizer is not None:
            check_optimizer(self.optimizer, tree["optimizer"], f"{where}: optimizer")
        if self.sampler is not None:
            self.sampler.check_state_dict(tree["data"])
        saved_extra = tree.get("extra", {})
        missing = sorted(set(self.extra) - set(saved_extra))
        if missing:
            raise StateMismatchError(
                f"{where}: has no extra state for {missing}; saved extra keys: {sorted(saved_extra)}"
            )
        for key, value in self.extra.items():
            entry = saved_extra[key]
            wanted = "state_dict" if isinstance(value, Stateful) else "value"
            if not isinstance(entry, dict) or wanted not in entry:
                raise StateMismatchError(
                    f"{where}: extra[{key!r}] was saved as {sorted(entry) if isinstance(entry, dict) else entry!r}, expected {wanted!r}"
                )
            if isinstance(value, nn.Module):
                check_module(value, entry["state_dict"], f"{where}: extra[{key!r}]")


def _is_json_like(value: Any) -> bool:
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json_like(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_like(v) for k, v in value.items())
    return False


def check_module(module: nn.Module, saved: Any, where: str) -> None:
    """Every key of ``module.state_dict()`` is saved with the same shape and dtype, and no others."""
    if not isinstance(saved, Mapping):
        raise StateMismatchError(
            f"{where}: saved state is {type(saved).__name__}, not a state dict"
        )
    live = module.state_dict()
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        raise StateMismatchError(
            f"{where}: keys differ from the live model: missing in checkpoint {missing[:10]}, "
            f"unexpected in checkpoint {unexpected[:10]}. Was the model's architecture changed?"
        )
    for key, tensor in live.items():
        value = saved[key]
        if not isinstance(value, torch.Tensor):
            raise StateMismatchError(
                f"{where}: {key!r} is saved as {type(value).__name__}, expected a tensor"
            )
        if value.shape != tensor.shape or value.dtype != tensor.dtype:
            raise StateMismatchError(
                f"{where}: tensor {key!r} expected {tensor.dtype}{list(tensor.shape)}, "
                f"checkpoint has {value.dtype}{list(value.shape)}"
            )


def check_optimizer(optimizer: torch.optim.Optimizer, saved: Any, where: str) -> None:
    """The saved optimizer state has the live optimizer's parameter layout."""
    if not isinstance(saved, Mapping) or "param_groups" not in saved or "state" not in saved:
        raise StateMismatchError(f"{where}: not an optimizer state dict")
    live_groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(live_groups):
        raise StateMismatchError(
            f"{where}: {len(saved_groups)} param groups saved, the optimizer has {len(live_groups)}"
        )
    params: dict[int, torch.Tensor] = {}
    for i, (s, g) in enumerate(zip(saved_groups, live_groups, strict=True)):
        if len(s["params"]) != len(g["params"]):
            raise StateMismatchError(
                f"{where}: param group {i} has {len(s['params'])} parameters saved, the optimizer has {len(g['params'])}"
            )
        params.update(zip(s["params"], g["params"], strict=True))
    for param_id, param_state in saved["state"].items():
        if param_id not in params:
            raise StateMismatchError(
                f"{where}: state for parameter id {param_id!r} that no param group lists"
            )
        param = params[param_id]
        for name, value in param_state.items():
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
