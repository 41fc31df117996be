"""Loaders with a state of their own (torchdata's ``StatefulDataLoader``): the iterator a
resumed run makes again draws nothing from torch's global RNG.

A ``DataLoader`` without a ``generator`` of its own draws its workers' base seed (and a
shuffling sampler's seed) from torch's global generator each time an iterator is made. In an
uninterrupted run the epoch's iterator was made before the checkpoint, so its draws are already
in the RNG state the checkpoint holds; a resumed run makes that iterator again after the restore,
and its draws would shift every random number after them (dropout, noise, augmentation on the
main process): the samples come back in their order, but the weights differ. The loader's own
state brings back the seeds that iterator drew (``StatefulDataLoader`` saves its base seed and
its sampler's state), so the iterator made again needs no draw: crashproof puts torch's global
RNG back as it was once it is made. An iterator that starts a new epoch (the saved state says
the previous one had finished) draws as it would have in the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from crashproof.state._data import own_iter, replace_iter
from crashproof.state._streaming_hf import forget_saved_position, replays_saved_position

__all__ = ["resume_without_draws"]


def resume_without_draws(data: Any, state: Any) -> None:
    """After ``data.load_state_dict(state)``: ``data``'s next ``iter()`` leaves torch's global
    RNG as it found it, unless ``state`` says its iterator had finished (a new epoch's iterator
    draws in the uninterrupted run too). A Hugging Face ``IterableDataset`` read in the main
    process is made to start each later epoch at its beginning (see :mod:`._streaming_hf`).
    Loaders that are not ``DataLoader``s are left alone."""
    if not isinstance(data, DataLoader):
        return
    finished = isinstance(state, Mapping) and state.get("_iterator_finished") is True
    replays = replays_saved_position(data)
    if finished and not replays:
        return
    replace_iter(data, _iter_after_restore)
    setattr(data, "_crashproof_without_draws", not finished)  # noqa: B010 - read by __iter__ below
    # when to drop the dataset's loaded position: "after" this iter() (it starts a new epoch,
    # the loaded position is that of a finished one), "next": at the iter() after this one
    forget = None if not replays else "after" if finished else "next"
    setattr(data, "_crashproof_forget", forget)  # noqa: B010


def _iter_after_restore(self: Any) -> Any:
    forget = getattr(self, "_crashproof_forget", None)
    if forget == "before":  # the resumed iteration is over: the next one starts at the start
        self._crashproof_forget = forget = None
        forget_saved_position(self)
    if getattr(self, "_crashproof_without_draws", False):
        self._crashproof_without_draws = False
        saved = torch.random.get_rng_state()
        try:
            iterator = own_iter(self)
        finally:
            torch.random.set_rng_state(saved)
    else:
        iterator = own_iter(self)
    if forget == "after":  # (the dataset applies it lazily, at the iterator's first item)
        self._crashproof_forget = None
        forget_saved_position(self)
    elif forget == "next":
        self._crashproof_forget = "before"
    return iterator
