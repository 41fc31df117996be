"""``TrainState``: everything a training step depends on, captured and restored as one.

Capture produces a plain tree of dicts, lists, scalars and tensors (the live tensors, not copies:
the checkpoint pipeline decides when to copy). Restore validates the whole tree against the live
objects first and only then changes anything, so a checkpoint that does not fit (another model,
another optimizer layout) raises :class:`StateMismatchError` and leaves the live state untouched.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from crashproof.errors import (
    ConfigError,
    CorruptCheckpointError,
    StateMismatchError,
)
from crashproof.state._check import (
    Scratch,
    check_classes,
    check_module,
    check_optimizer,
    check_scaler,
    check_scheduler,
    live_tensors_of,
    trial_load,
)
from crashproof.state._classes import recorded_classes
from crashproof.state._data import refuse_accelerate_loader, track_loader
from crashproof.state._dtensor import is_dtensor
from crashproof.state._finite import finite_names, parameter_names
from crashproof.state._kinds import check_same_kind
from crashproof.state._module_load import custom_loaders, under
from crashproof.state._rng import capture_rng, restore_rng
from crashproof.state._sampler import ResumableSampler
from crashproof.state._stateful_data import resume_without_draws
from crashproof.state._streaming_hf import warn_inexact_streaming
from crashproof.state._structure import check_structure, is_json_like

__all__ = ["Stateful", "TrainState"]


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
        self.untried: list[str] = []
        """After :meth:`check`: the modules whose own loading code could not be tried on a
        scratch copy (they cannot be copied); a restore protects the live tensors otherwise."""
        for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None and not isinstance(obj, Stateful):
                raise ConfigError(
                    f"TrainState({name}=...): {type(obj).__name__} has no state_dict()/load_state_dict()"
                )
        refuse_accelerate_loader(data)
        warn_inexact_streaming(data)
        if data is not None and not isinstance(data, Stateful):
            if not isinstance(data, torch.utils.data.DataLoader):
                raise ConfigError(
                    f"TrainState(data=...): {type(data).__name__} is neither a DataLoader nor has state_dict()"
                )
            self.sampler = track_loader(data)
        # A ResumableSampler alone is a position nothing advances unless the loop reports what
        # it consumed (record_received): watched at each capture.
        self._bare_position: tuple[int, int] | None = None
        self._bare_warned = not isinstance(data, ResumableSampler)
        for key, value in self.extra.items():
            if not isinstance(value, Stateful) and not is_json_like(value):
                raise ConfigError(
                    f"TrainState(extra={{{key!r}: ...}}): {type(value).__name__} has no state_dict()/"
                    "load_state_dict() and is not a JSON-like value (number, string, list, dict)"
                )

    # -- capture -------------------------------------------------------------------------------

    def capture(self) -> dict[str, Any]:
        """The current state as a tree of plain values and (live, uncopied) tensors."""
        self._check_bare_sampler_moves()
        return self._capture(keep_created_state=False)

    @property
    def epoch(self) -> int | None:
        """The data's epoch (a :class:`ResumableSampler`'s, tracked or alone; None: no such
        data). After a restore, the epoch an epoch loop resumes from."""
        sampler = self.sampler or (self.data if isinstance(self.data, ResumableSampler) else None)
        return sampler.epoch if sampler is not None else None

    @property
    def batch_in_epoch(self) -> int | None:
        """How many batches of the current epoch the loop has received (a tracked DataLoader's;
        None otherwise): after a restore, the batch an epoch loop resumes at."""
        if self.sampler is None or not isinstance(self.data, torch.utils.data.DataLoader):
            return None
        loader = self.data
        per_rank = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None) or 1
        return self.sampler.batches_received(per_rank)

    def _check_bare_sampler_moves(self) -> None:
        """Warn once when a ``ResumableSampler`` given alone as ``data`` has not moved between two
        saves: the loop consumed data nothing reported, and a resume would start it over."""
        if self._bare_warned:
            return
        sampler = self.data
        assert isinstance(sampler, ResumableSampler)
        position = (sampler.epoch, sampler.consumed)
        if self._bare_position is not None and position == self._bare_position:
            self._bare_warned = True
            warnings.warn(
                f"TrainState(data=sampler): the ResumableSampler has not moved since the last "
                f"save (epoch {position[0]}, position {position[1]}): nothing reports what the "
                "loop consumes, so a resume would start the data over. Pass the DataLoader built "
                "on it (TrainState(data=loader)), or, in a loop without one, call "
                "sampler.record_received(samples_per_rank) for each batch (docs/checkpointing.md,"
                " 'Loops without a DataLoader')",
                stacklevel=4,
            )
        self._bare_position = position

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
        # The classes, so a restore into another optimizer, scheduler (or nested scheduler) or
        # scaler class is refused by name: their state dicts do not say.
        tree["classes"] = recorded_classes(
            {"optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler}
        )
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
        from the saved ones by :mod:`crashproof.checkpoint.restore._dcp_reader`. Not a module's extra state
        (``get_extra_state`` returns a new value, no live memory). Tensors sharing memory (tied
        weights) are all listed; the reader writes such memory once.
        """
        live: dict[str, torch.Tensor] = {}
        modules = [(f"extra/{k}/state_dict/", v) for k, v in self.extra.items()]
        if self.model is not None:
            modules.insert(0, ("model/", unwrap_model(self.model)))
        for prefix, module in modules:
            if isinstance(module, nn.Module):
                # Not the tensors of modules whose loading runs code of their own: the trial
                # load runs that code on their values first (see _module_load).
                own = custom_loaders(module)
                live.update(
                    {f"{prefix}{k}": v for k, v in module.state_dict().items() if not under(k, own)}
                )
        return {
            k: v
            for k, v in live.items()
            if isinstance(v, torch.Tensor)
            and not is_dtensor(v)
            and k.rsplit("/", 1)[-1].rsplit(".", 1)[-1] != "_extra_state"
        }

    def must_be_finite(self, tree: Mapping[str, Any], *, step: int | None = None) -> frozenset[str]:
        """Names (as in a checkpoint) of the tensors of ``tree`` (from :meth:`capture`) that must
        never be saved holding NaN or inf; raises :class:`NonFiniteStateError` at once for a
        Python float that is NaN or inf in the optimizer's state or param groups.

        The model's parameters (what is captured, whatever a state-dict hook names it: see
        :func:`~crashproof.state._finite.parameter_names`) and every tensor and float of the optimizer's state and param
        groups, at any depth (LBFGS keeps lists of tensors and a float loss; a learning rate
        may be a tensor). Buffers may hold infinities by design (attention masks).
        """
        names: set[str] = set()
        if self.model is not None and "model" in tree:
            names.update(parameter_names(unwrap_model(self.model), tree["model"], "model"))
        if "optimizer" in tree:
            names.update(finite_names(tree["optimizer"], "optimizer", step))
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

    def ddp_regroups_gradients(self) -> bool:
        """Whether the model's DDP regroups its gradient buckets after a process's first step
        (it does unless ``find_unused_parameters=True`` without ``static_graph``): with three
        ranks or more, a bucket's sum goes around the ranks in pieces, so that first step adds
        each gradient in another order than the uninterrupted run did at that step."""
        ddp = self._ddp()
        return ddp is not None and (not ddp.find_unused_parameters or bool(ddp.static_graph))

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

    def restore(
        self, tree: Mapping[str, Any], *, where: str = "checkpoint", checked: bool = False
    ) -> None:
        """Load ``tree`` (as made by :meth:`capture`); all-or-nothing on validation errors.

        ``checked``: :meth:`check` already passed on this tree's values (the checkpoint manager
        checks before it writes the live tensors, with those tensors as stand-ins), so only the
        loading is left, which then cannot fail on content."""
        if not checked:
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
        self._bare_position = None  # the position was set: judged from the next save on
        if self.sampler is not None:
            self.sampler.load_state_dict(tree["data"])
        elif self.data is not None:
            self.data.load_state_dict(tree["data"])
            resume_without_draws(self.data, tree["data"])
        for key, value in self.extra.items():
            entry = tree["extra"][key]
            if isinstance(value, Stateful):
                value.load_state_dict(entry["state_dict"])
            else:
                self.extra[key] = entry["value"]
        restore_rng(tree["rng"])

    def check(self, tree: Mapping[str, Any], *, where: str = "checkpoint") -> None:
        """Raise unless ``tree`` fits every live component; changes nothing live.

        :class:`StateMismatchError` when a well-formed section does not fit (another model,
        optimizer class or hyperparameters, scheduler class, scaler setting, data order, a
        renamed field of an extra); :class:`CorruptCheckpointError` when a section is malformed
        (the manager then falls back to the next newest checkpoint). Each message names the
        component, the key, what was expected and what was found.
        """
        check_structure(tree, where)  # what verify checks too: malformed is corrupt
        for name in ("model", "optimizer", "scheduler", "scaler", "data"):
            if getattr(self, name) is not None and name not in tree:
                raise StateMismatchError(
                    f"{where}: holds no {name} state, but this TrainState has a {name}"
                )
        live_classes = {
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
        }
        check_classes(tree.get("classes"), live_classes, where)
        scratch = self._scratch()
        self.untried = []
        if self.model is not None and not check_module(
            unwrap_model(self.model), tree["model"], f"{where}: model", scratch
        ):
            self.untried.append("model")
        if self.optimizer is not None:
            check_optimizer(self.optimizer, tree["optimizer"], f"{where}: optimizer")
            if not self.sharded:  # its layout fits: a load that fails now is malformed state
                trial_load(
                    self.optimizer, tree["optimizer"], f"{where}: optimizer", scratch,
                    error=CorruptCheckpointError,
                )  # fmt: skip
        if self.scheduler is not None:
            check_scheduler(self.scheduler, tree["scheduler"], f"{where}: scheduler", scratch)
        if self.scaler is not None:
            check_scaler(self.scaler, tree["scaler"], f"{where}: scaler", scratch)
        if self.sampler is not None:
            try:
                self.sampler.check_state_dict(tree["data"])
            except (StateMismatchError, CorruptCheckpointError) as exc:
                raise type(exc)(f"{where}: {exc}") from None
        elif self.data is not None:
            trial_load(self.data, tree["data"], f"{where}: data", scratch)
        self._check_extra(tree.get("extra", {}), where, scratch)

    def _check_extra(self, saved_extra: Any, where: str, scratch: Scratch) -> None:
        missing = sorted(set(self.extra) - set(saved_extra))
        if missing:
            raise StateMismatchError(
                f"{where}: has no extra state for {missing}; saved extra keys: {sorted(saved_extra)}"
            )
        for key, value in self.extra.items():
            entry = saved_extra[key]
            here = f"{where}: extra[{key!r}]"
            wanted = "state_dict" if isinstance(value, Stateful) else "value"
            if wanted not in entry:
                raise StateMismatchError(
                    f"{here}: was saved as {sorted(entry)}, expected {wanted!r}: this run's is "
                    f"{'an object with state_dict()' if wanted == 'state_dict' else 'a JSON value'}"
                )
            if isinstance(value, nn.Module):
                if not check_module(value, entry["state_dict"], here, scratch):
                    self.untried.append(f"extra[{key!r}]")
            elif isinstance(value, Stateful):
                trial_load(value, entry["state_dict"], here, scratch)
            else:
                check_same_kind(value, entry["value"], here)

    def _scratch(self) -> Scratch:
        """Makes the scratch copies trial loads go into: every tensor of the model, the optimizer
        and module extras gets a meta stand-in, and a dataset is shared, not copied."""
        modules = [v for v in self.extra.values() if isinstance(v, nn.Module)]
        return Scratch(
            live_tensors_of(self.model, self.optimizer, *modules),
            shared=[getattr(self.data, "dataset", None)],
        )
