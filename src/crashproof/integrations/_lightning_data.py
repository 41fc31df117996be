"""The train loader's position, and the random numbers around it, made exact under Lightning.

Lightning resumes mid-epoch with the batch counters right, but a plain ``DataLoader`` starts the
epoch's order over (a ``RandomSampler`` draws a new permutation from torch's global generator),
and every ``iter()`` of a loader draws its workers' seed from that generator too, shifting every
random number after it. So the callback, once Lightning has built the train loader:

- gives the loader's batch sampler a :class:`~crashproof.ResumableSampler` (:class:`EpochSampler`)
  in place of its ``RandomSampler``, ``SequentialSampler`` or ``DistributedSampler``: each epoch's
  order then depends only on a seed and the epoch, and the loader goes on from a position;
- has crashproof track the loader (``TrainState(data=loader)``): it reports each batch the loop
  receives to the sampler and makes each ``iter()`` without touching the global generator.

Loaders with a ``state_dict()`` of their own (torchdata's ``StatefulDataLoader``) are left
alone: Lightning saves and restores their state itself. Anything else (an ``IterableDataset``,
a batch sampler of the user's) cannot be made exact: :func:`make_resumable` says why.

:class:`RandomState` holds the process's global generators, which the callback puts back at
moments Lightning would otherwise let draws slip in (a resumed fit's start, after validation).
"""

from __future__ import annotations

import contextlib
import random
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from crashproof.state import ResumableSampler, Stateful, TrainState

__all__ = [
    "EpochSampler",
    "RandomState",
    "has_own_state",
    "make_resumable",
    "quiet_lightning_doubt",
]


class EpochSampler(ResumableSampler):
    """A :class:`~crashproof.ResumableSampler` whose epoch Lightning sets.

    Lightning calls ``set_epoch`` at the start of every epoch, also after a limited epoch
    (``limit_train_batches``) or one whose last partial batch was dropped: the new epoch starts
    at its beginning without the warning a hand-written loop deserves there. The same epoch
    keeps the position (a fit resumed mid-epoch). ``len()`` is the whole epoch's, as Lightning
    counts its batches from it, also when the iteration resumes part way.

    ``before_iteration``, when set, is called once, as the next iteration starts: in a loader
    without workers, right before its first batch is read.
    """

    before_iteration: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[int]:
        hook, self.before_iteration = self.before_iteration, None
        if hook is not None:
            hook()
        return super().__iter__()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0
            self.generation += 1

    def __len__(self) -> int:
        return -(-self.n // self.world_size)


def make_resumable(
    loader: Any, *, seed: int, rank: int, world_size: int, epoch: int
) -> EpochSampler | str:
    """Make ``loader``'s position resumable (see the module's docstring); returns its new
    sampler, or why it cannot be (a sentence to finish "the train loader ...")."""
    if not isinstance(loader, DataLoader):
        return f"is a {type(loader).__qualname__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "reads an IterableDataset, whose position only the dataset itself could save"
    batch_sampler = loader.batch_sampler
    if loader.batch_size is None or type(batch_sampler) is not BatchSampler:
        return "has a batch_sampler of its own"
    inner = batch_sampler.sampler
    if isinstance(inner, EpochSampler):
        inner.set_epoch(epoch)
        return inner
    shuffle: bool
    if isinstance(inner, RandomSampler):
        if inner.replacement or inner._num_samples is not None:
            return "draws with replacement or a number of samples of its own (RandomSampler)"
        shuffle = True
    elif isinstance(inner, SequentialSampler):
        shuffle = False
    elif isinstance(inner, (DistributedSampler, ResumableSampler)):  # DDP: Lightning's
        shuffle, seed = inner.shuffle, inner.seed
    else:
        return f"has a sampler of its own ({type(inner).__qualname__})"
    try:
        size = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return "reads a dataset without a length"
    sampler = EpochSampler(size, shuffle, seed, rank=rank, world_size=world_size)
    sampler.set_epoch(epoch)
    # BatchSampler reads .sampler when an iteration starts: every later iteration uses ours.
    batch_sampler.sampler = sampler
    TrainState(data=loader)  # crashproof tracks the loader: received batches, draw-free iter()
    return sampler


_LIGHTNING_DOUBT = "You're resuming from a checkpoint that ended before the epoch ended"


def quiet_lightning_doubt() -> Callable[[], None]:
    """Silence Lightning's warning that a mid-epoch resume of a loader without state_dict()
    is unreliable (true of the loader it built, not of the one crashproof tracks); returns the
    function that lets it speak again."""
    warnings.filterwarnings("ignore", message=re.escape(_LIGHTNING_DOUBT))
    entry = warnings.filters[0]

    def restore() -> None:
        with contextlib.suppress(ValueError):  # (warnings.resetwarnings() took it already)
            warnings.filters.remove(entry)  # type: ignore[attr-defined]

    return restore


def has_own_state(loader: Any) -> bool:
    """Whether Lightning saves this loader's position itself (it has a state_dict())."""
    return isinstance(loader, Stateful)


class RandomState:
    """The process's global random generators at one moment: Python's, NumPy's, torch's CPU
    generator and every initialised CUDA device's."""

    def __init__(self) -> None:
        self._python = random.getstate()
        self._numpy = np.random.get_state()
        self._torch = torch.random.get_rng_state()
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]

    def put_back(self) -> None:
        random.setstate(self._python)
        np.random.set_state(self._numpy)
        torch.random.set_rng_state(self._torch)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
