"""Hugging Face ``datasets`` streaming ``IterableDataset``: what its own ``state_dict`` does not
bring back, found out and said (or put right) by crashproof.

- A buffer-shuffled one (``.shuffle(seed=..., buffer_size=N)``) saves its shards' positions but
  not the buffer's content, and its shuffling generator starts over: a resumed run refills the
  buffer, never sees again this epoch the samples the buffer held at the save, may yield others
  twice (seen with datasets 5.2), and draws another order than the uninterrupted run. :func:`warn_inexact_streaming` says so when it is given.
- Read in the main process (``num_workers=0``), the dataset keeps the position it was loaded with
  for good, and applies it again at the start of every later iteration of the same epoch number:
  each later epoch would restart at the saved position (or be empty). :func:`forget_saved_position`
  drops it once the resumed iteration has started. (Worker processes get a fresh copy of the
  dataset each epoch, so ``num_workers > 0`` is not concerned.)

Nothing here imports ``datasets``: a dataset of its class means it is imported already.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from torch.utils.data import DataLoader

__all__ = [
    "forget_saved_position",
    "hf_iterable",
    "replays_saved_position",
    "warn_inexact_streaming",
]


def hf_iterable(data: Any) -> Any | None:
    """The Hugging Face ``IterableDataset`` ``data`` is, or that its loader reads; else None."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    cls = getattr(sys.modules.get("datasets"), "IterableDataset", None)
    return dataset if isinstance(cls, type) and isinstance(dataset, cls) else None


def shuffle_buffer_size(dataset: Any) -> int | None:
    """The size of the shuffle buffer in the dataset's pipeline of example iterables, if any."""
    pending = [getattr(dataset, "_ex_iterable", None)]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            size = getattr(node, "buffer_size", None)
            return size if isinstance(size, int) else 0
        pending.append(getattr(node, "ex_iterable", None))
        pending.extend(getattr(node, "ex_iterables", None) or ())
    return None


def warn_inexact_streaming(data: Any) -> None:
    """Warn when ``data`` is, or reads, a buffer-shuffled Hugging Face ``IterableDataset``: a
    resume from its state cannot continue the uninterrupted run's sample sequence."""
    dataset = hf_iterable(data)
    if dataset is None:
        return
    size = shuffle_buffer_size(dataset)
    if size is None:
        return
    workers = getattr(data, "num_workers", 0)
    warnings.warn(
        f"TrainState(data=...): this Hugging Face IterableDataset is shuffled with a buffer "
        f"(.shuffle(buffer_size={size})), whose state is not saved: datasets keeps the shards' "
        "positions only, so a resumed run refills the buffer, skips for the rest of the epoch the "
        f"samples it held at the save (up to {size}), may see others twice, and goes on in "
        "another order than an uninterrupted run"
        + (
            " (and datasets may fail to load such a state in the loader's worker processes)"
            if isinstance(workers, int) and workers > 0
            else ""
        )
        + ". For an exact resume, shuffle before streaming: Dataset.shuffle(seed=...) then "
        ".to_iterable_dataset(num_shards=...), or a map-style Dataset over "
        "crashproof.ResumableSampler(shuffle=True) (docs/checkpointing.md, 'Hugging Face datasets')",
        stacklevel=3,
    )


def replays_saved_position(loader: DataLoader[Any]) -> bool:
    """Whether ``loader`` reads a Hugging Face ``IterableDataset`` in the main process, which
    would apply a loaded position again at each later epoch (see the module docstring)."""
    return loader.num_workers == 0 and hf_iterable(loader) is not None


def forget_saved_position(loader: DataLoader[Any]) -> None:
    """Make the loader's Hugging Face ``IterableDataset`` start its next iteration from the
    start of its epoch, not from the position it was loaded with."""
    dataset = hf_iterable(loader)
    if dataset is not None and hasattr(dataset, "_starting_state_dict"):
        dataset._starting_state_dict = None
