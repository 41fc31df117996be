"""DTensors (FSDP2's parameters, tensor parallelism): which values are, and each rank's piece.

A DTensor is a whole tensor spread over ranks; a rank saves only the piece it holds, with the
piece's place in the whole (the same chunk description ``torch.distributed.checkpoint`` uses), so
a restore on any number of ranks can cut the pieces it needs (see :mod:`crashproof.checkpoint.restore._dcp_reader`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["empty_like_piece", "is_dtensor", "local_piece"]

_DTensor: type | None
try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed support: there are no DTensors
    _DTensor = None


def is_dtensor(value: Any) -> bool:
    return _DTensor is not None and isinstance(value, _DTensor)


def local_piece(tensor: Any) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's piece of a DTensor, the whole tensor's shape, and where the piece starts."""
    local = tensor.to_local()
    chunks = tensor.__create_chunk_list__()
    offset = tuple(int(o) for o in chunks[0].offsets) if chunks else (0,) * local.dim()
    return local, tuple(int(n) for n in tensor.shape), offset


def empty_like_piece(tensor: Any) -> Any:
    """A new DTensor with ``tensor``'s whole shape, placements and mesh, its piece uninitialised."""
    assert _DTensor is not None
    return _DTensor.from_local(  # type: ignore[attr-defined]
        torch.empty_like(tensor.to_local()),
        tensor.device_mesh,
        tensor.placements,
        shape=tensor.shape,
        stride=tensor.stride(),
        run_check=False,
    )
