"""DTensors (FSDP2's parameters, tensor parallelism): which values are, and each rank's piece.

A DTensor is a whole tensor spread over ranks; a rank saves only the piece it holds, with the
piece's place in the whole (the same chunk description ``torch.distributed.checkpoint`` uses), so
a restore on any number of ranks can cut the pieces it needs (see :mod:`crashproof.checkpoint.restore._dcp_reader`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["empty_like_piece", "is_dtensor", "local_piece"]


def _dtensor_class() -> type | None:
    """DTensor's class once ``torch.distributed.tensor`` is imported, else None: no value can be
    a DTensor before its module is imported, and importing it takes a second (its operator
    tables), which a process without DTensors is spared. None too for a torch built without
    distributed support."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls if isinstance(cls, type) else None


def is_dtensor(value: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(value, cls)


def local_piece(tensor: Any) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's piece of a DTensor, the whole tensor's shape, and where the piece starts."""
    local = tensor.to_local()
    chunks = tensor.__create_chunk_list__()
    offset = tuple(int(o) for o in chunks[0].offsets) if chunks else (0,) * local.dim()
    return local, tuple(int(n) for n in tensor.shape), offset


def empty_like_piece(tensor: Any) -> Any:
    """A new DTensor with ``tensor``'s whole shape, placements and mesh, its piece uninitialised."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        torch.empty_like(tensor.to_local()),
        tensor.device_mesh,
        tensor.placements,
        shape=tensor.shape,
        stride=tensor.stride(),
        run_check=False,
    )
