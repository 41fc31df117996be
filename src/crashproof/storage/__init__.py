"""Storage backends behind one small interface; see :mod:`crashproof.storage._base`."""

from __future__ import annotations

from crashproof.storage._base import ReadStream, Storage, WriteStream, read_all, write_all
from crashproof.storage._local import LocalStorage
from crashproof.storage._memory import MemoryStorage

__all__ = [
    "LocalStorage",
    "MemoryStorage",
    "ReadStream",
    "Storage",
    "WriteStream",
    "read_all",
    "storage_for",
    "write_all",
]


def storage_for(root: str) -> tuple[str, Storage]:
    """The path and backend for a checkpoint root: the local filesystem for plain paths and file://."""
    if root.startswith("file://"):
        return root[len("file://") :], LocalStorage()
    if "://" in root:
        raise ValueError(
            f"{root!r}: remote storage URIs are not supported yet; use a local or mounted path, "
            "or pass storage= explicitly"
        )
    return root, LocalStorage()
