"""What every export format shares in writing its output: a directory written under a fresh name
and renamed into place once complete (:func:`swap_in`); tensors split into numbered safetensors
shards named as transformers names them (:func:`split_shards`, :func:`shard_names`); and an
OSError met on the way named by the output (:func:`writing`). Used by :mod:`._export` and
:mod:`._hf`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence

import torch

from crashproof._files import fresh_name
from crashproof.checkpoint.export._target import check_target

__all__ = [
    "nbytes",
    "shard_names",
    "split_shards",
    "swap_in",
    "writing",
]


def shard_names(stem: str, count: int) -> list[str]:
    """The files of ``count`` shards, named as transformers names them:
    ``<stem>-00001-of-00003.safetensors``."""
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


@contextlib.contextmanager
def writing(out: str) -> Iterator[None]:
    """Writing the export ``out``: an OSError met is re-raised as one whose ``filename`` is
    ``out`` (errno kept; the file it was met on in its text), so that a caller tells a failure
    to write the output (``crashproof export``: exit 74 naming ``-o``) from a failure to read
    the checkpoint."""
    try:
        yield
    except OSError as exc:
        if exc.filename == out and type(exc) is OSError:
            raise
        reason = exc.strerror or str(exc) or type(exc).__name__
        at = f" at {exc.filename}" if exc.filename not in (None, out) else ""
        raise OSError(exc.errno, f"{reason}{at}", out) from exc


def swap_in(tmp: str, out_dir: str, *, force: bool, protected: Sequence[str]) -> None:
    """Rename ``tmp`` to ``out_dir``, the earlier export there (checked again, now) removed."""
    check_target(out_dir, kind="dir", force=force, protected=protected)
    if not os.path.lexists(out_dir) or not os.listdir(out_dir):
        os.replace(tmp, out_dir)  # onto nothing, or onto an empty directory
        return
    old = fresh_name(out_dir, "old")
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)  # put the earlier export back
        raise
    shutil.rmtree(old)  # the earlier export, holding only what it wrote (check_target)


def split_shards(
    tensors: list[tuple[str, torch.Tensor]], max_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        if shards[-1] and size + nbytes(tensor) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes(tensor)
    return shards


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
