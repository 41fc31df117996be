"""Make a DataLoader report the position the training loop has *received*.

A DataLoader's sampler runs ahead of the loop: with workers it is drawn ``prefetch_factor *
num_workers`` batches early. To save the true position, ``TrainState(data=loader)`` gives the
loader instance a subclass of its own class whose iterator tells the :class:`ResumableSampler`
about each batch as it is handed to the loop. The loader object, its settings and its behaviour
are otherwise unchanged.

Two more things keep the resumed run identical to an uninterrupted one:

- ``DataLoader.__iter__`` draws a base seed for its workers from torch's global RNG when it has no
  ``generator``. A resumed run calls ``iter()`` at a different point of the RNG stream, so that draw
  would shift every random number after it. We give each iteration a generator seeded from the
  sampler's seed and epoch instead: the workers' seed is reproducible and the global stream untouched.
- Randomness *inside* worker processes (augmentations in ``Dataset.__getitem__``) follows the
  worker's own history and is exact on resume only when drawn from a generator seeded by the
  sample index; see ``docs/exactness.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from crashproof.errors import ConfigError
from crashproof.state._sampler import ResumableSampler

__all__ = [
    "find_resumable_sampler",
    "own_iter",
    "refuse_accelerate_loader",
    "replace_iter",
    "track_loader",
]


def find_resumable_sampler(loader: DataLoader[Any]) -> ResumableSampler | None:
    if isinstance(loader.sampler, ResumableSampler):
        return loader.sampler
    inner = getattr(loader.batch_sampler, "sampler", None)
    return inner if isinstance(inner, ResumableSampler) else None


class _TrackedIterator:
    """The loader's own iterator, reporting each batch the loop receives to the sampler.

    When the sampler's position is set from outside (a restore or a skipped window, e.g. a
    ``NumericsGuard`` rollback) the iteration in progress starts over from the new position, so
    a loop holding this iterator goes on with the right data without creating a new one.
    """

    def __init__(self, loader: Any, sampler: ResumableSampler, batch_size: int) -> None:
        self._loader, self._sampler, self._batch_size = loader, sampler, batch_size
        if loader._crashproof_open == (sampler.epoch, sampler.generation):
            warnings.warn(
                f"a second iterator of a crashproof-tracked DataLoader while the previous one "
                f"had not finished epoch {sampler.epoch} (position {sampler.consumed} of "
                f"{sampler.n}): the batches the first one took are gone from this epoch. If it "
                "was a peek (next(iter(loader)), to learn the batch size), that batch is skipped "
                "now and again at every resume, and the resumed run will differ from an "
                "uninterrupted one: look at the dataset or loader.batch_size instead",
                stacklevel=3,
            )
        self._start()

    def _start(self) -> None:
        loader, sampler = self._loader, self._sampler
        if not loader._crashproof_own_generator:
            generator = torch.Generator()
            generator.manual_seed(
                (sampler.seed * 7_919 + sampler.epoch * 104_729 + 1) & ((1 << 63) - 1)
            )
            loader.generator = generator
        self._inner = own_iter(loader)
        self._start_epoch, self._generation = sampler.epoch, sampler.generation

    def __iter__(self) -> _TrackedIterator:
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __next__(self) -> Any:
        if self._sampler.generation != self._generation:
            self._start()
        try:
            batch = next(self._inner)
        except StopIteration:
            if self._sampler.epoch == self._start_epoch:
                self._sampler.finish_epoch()
            self._loader._crashproof_open = None
            raise
        self._sampler.record_received(self._batch_size)
        # an iteration of this epoch is under way: another iterator now would be a second one
        self._loader._crashproof_open = (self._sampler.epoch, self._sampler.generation)
        return batch


def own_iter(loader: Any) -> Any:
    """The iterator of the loader's own class (the one :func:`replace_iter` subclassed)."""
    return super(loader._crashproof_base, loader).__iter__()


_SUBCLASSES: dict[tuple[type, Callable[[Any], Any]], type] = {}


def replace_iter(loader: Any, iter_fn: Callable[[Any], Any], prefix: str = "") -> None:
    """Give this ``loader`` instance (not its class) ``iter_fn`` as ``__iter__``: its class
    becomes a subclass of the one it had, made once per class and function, and ``iter_fn``
    reaches the original iterator through :func:`own_iter`. Nothing else about the loader
    changes. Done once: a loader given one already keeps it."""
    base = type(loader)
    if getattr(base, "_crashproof_base", None) is base:
        return
    subclass = _SUBCLASSES.get((base, iter_fn))
    if subclass is None:
        subclass = type(f"{prefix}{base.__name__}", (base,), {"__iter__": iter_fn})
        setattr(subclass, "_crashproof_base", subclass)  # noqa: B010 - read by own_iter's super()
        _SUBCLASSES[base, iter_fn] = subclass
    loader.__class__ = subclass


def _tracked_iter(self: Any) -> _TrackedIterator:
    batch_size = self.batch_size or getattr(self.batch_sampler, "batch_size", None) or 1
    return _TrackedIterator(self, self._crashproof_sampler, batch_size)


def refuse_accelerate_loader(data: Any) -> None:
    """A DataLoader prepared by Accelerate deals batches to the ranks itself (and its
    ``state_dict`` is empty unless made stateful): refused, saying what to do instead."""
    if type(data).__module__.startswith("accelerate."):  # on one process too: a trap for two
        raise ConfigError(
            f"TrainState(data=loader): this DataLoader was prepared by Accelerate "
            f"({type(data).__name__}), which deals the batches out to the ranks itself, so "
            "the position the loop has received cannot be saved. Leave the DataLoader out of "
            "accelerator.prepare, give it sampler=crashproof.ResumableSampler(len(dataset), "
            "shuffle=..., seed=...) (it deals each rank its share), and move each batch to "
            "accelerator.device in the loop (docs/accelerate.md)"
        )


def track_loader(loader: DataLoader[Any]) -> ResumableSampler:
    """Make ``loader`` report received batches to its :class:`ResumableSampler`; returns it."""
    sampler = find_resumable_sampler(loader)
    if sampler is None:
        raise ConfigError(
            "TrainState(data=loader): the DataLoader's sampler is not a crashproof.ResumableSampler, "
            "so its position cannot be saved. Pass sampler=crashproof.ResumableSampler(len(dataset), "
            "shuffle=..., seed=...) to the DataLoader, or pass a loader with state_dict()/load_state_dict() "
            "such as torchdata's StatefulDataLoader."
        )
    if loader.batch_size is None and getattr(loader.batch_sampler, "batch_size", None) is None:
        raise ConfigError(
            "TrainState(data=loader): the loader's batch sampler has no batch_size; use batch_size="
        )
    if getattr(loader, "_crashproof_sampler", None) is None:
        setattr(loader, "_crashproof_own_generator", loader.generator is not None)  # noqa: B010
        replace_iter(loader, _tracked_iter, "Resumable")
        setattr(loader, "_crashproof_sampler", sampler)  # noqa: B010
        setattr(loader, "_crashproof_open", None)  # noqa: B010 - (epoch, generation) under way
    return sampler
