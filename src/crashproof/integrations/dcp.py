"""``torch.distributed.checkpoint`` (DCP) writing and reading crashproof checkpoints.

A storage writer and reader pair: ``dcp.save`` and ``dcp.async_save`` write a crashproof
checkpoint (atomic commit, every byte checksummed, nothing pickled; ``crashproof verify`` and
``crashproof inspect`` read it), and ``dcp.load`` reads one, with DCP's planner resharding across
world sizes as usual::

    import torch.distributed.checkpoint as dcp
    from crashproof.integrations.dcp import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter("ckpts", step=100))
    dcp.load(state_dict, storage_reader=StorageReader("ckpts", step=100))

:func:`save` and :func:`load` do the same and raise crashproof's own errors
(:class:`~crashproof.errors.CorruptCheckpointError`, ...) where DCP wraps every failure in its
``CheckpointException``. docs/dcp.md has the guarantees, the limits and a torchtitan recipe.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from crashproof.checkpoint.restore import dcp_failures
from crashproof.errors import CrashproofError
from crashproof.integrations._dcp_reader import StorageReader
from crashproof.integrations._dcp_writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter", "crashproof_error", "load", "save"]


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    **dcp_options: Any,
) -> Metadata:
    """``dcp.save(state_dict, storage_writer=StorageWriter(path, step=..., ...), **dcp_options)``
    (``process_group``, ``planner``, ``no_dist``), raising crashproof's error where one failed
    the save (:func:`crashproof_error`). Returns DCP's metadata of the save."""
    writer = StorageWriter(path, step=step, overwrite=overwrite, metadata=metadata)
    with _unwrapped():
        saved: Metadata = dcp_save(state_dict, storage_writer=writer, **dcp_options)
    return saved


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    **dcp_options: Any,
) -> None:
    """``dcp.load(state_dict, storage_reader=StorageReader(path, step=...), **dcp_options)``
    (``process_group``, ``planner``, ``no_dist``), in place, raising crashproof's error where one
    failed the load: :class:`~crashproof.errors.CorruptCheckpointError` naming a damaged file."""
    with _unwrapped():
        reader = StorageReader(path, step=step)
        dcp_load(state_dict, storage_reader=reader, **dcp_options)


def crashproof_error(exc: BaseException) -> CrashproofError | None:
    """The crashproof error behind a DCP failure, if any.

    DCP catches what a storage writer or reader raises on each rank and raises a
    ``CheckpointException`` holding them by rank; this is the first rank's crashproof error
    (``exc`` itself when it is one), e.g. to tell a corrupt checkpoint from another failure::

        try:
            dcp.load(state_dict, storage_reader=StorageReader(path))
        except CheckpointException as exc:
            cause = crashproof_error(exc)
            ...
    """
    if isinstance(exc, CrashproofError):
        return exc
    return next((e for e in dcp_failures(exc) if isinstance(e, CrashproofError)), None)


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    try:
        yield
    except CheckpointException as exc:  # a BaseException: an interrupt is not one
        cause = crashproof_error(exc)
        if cause is None:
            raise
        raise cause from exc
