"""Export a checkpoint to standard formats, for tools that do not know crashproof.

- **safetensors**: the model's weights; one file, or, above ``max_shard_bytes``, several files
  named ``<stem>-00001-of-0000N.safetensors`` plus ``<stem>.safetensors.index.json`` (the
  ``weight_map`` layout Hugging Face tools read).
- **dcp**: a ``torch.distributed.checkpoint`` directory with the model and optimizer state (and
  the LR scheduler's, the AMP scaler's, the step), readable by ``torch.distributed.checkpoint.load``
  on any number of ranks (DCP reshards on load).

The state comes from the checkpoint itself, every byte verified first. A checkpoint saved by
several ranks exports its replicated state (DDP: every rank holds the same tensors, checked from
the indexes' checksums) and its sharded tensors (FSDP2, DTensor) whole, put together from every
rank's pieces (see :mod:`crashproof.checkpoint._sharded`); state split between ranks by hand is
refused (see :mod:`crashproof.checkpoint._reshard`).
Every output appears under its final name only once complete.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any

import torch

from crashproof.checkpoint._dtypes import dtype_name, safetensors_code
from crashproof.checkpoint._reader import RankRead, read_manifest
from crashproof.checkpoint._reshard import source_rank
from crashproof.checkpoint._shard import write_shard
from crashproof.checkpoint._sharded import load_sharded, restore_targets
from crashproof.errors import ConfigError, CorruptCheckpointError
from crashproof.storage import LocalStorage, Storage

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "export_dcp", "export_safetensors", "model_tensors"]

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
"""Above this, a safetensors export is split (Hugging Face's default shard size, 5 GB)."""

_DCP_PARTS = ("model", "optimizer", "scheduler", "scaler")


def saved_state(storage: Storage, ckpt_dir: str) -> dict[str, Any]:
    """The state tree of the checkpoint (one rank's, the same on every rank), verified."""
    manifest = read_manifest(storage, ckpt_dir)
    rank = source_rank(storage, ckpt_dir, manifest, 0, 1)  # refuses state split by hand
    reader = RankRead(storage, ckpt_dir, manifest, rank)
    try:
        reader.verify()
        pieces = reader.sharded_entries()
        whole = restore_targets(pieces, {})  # no live counterparts: whole tensors
        if pieces:
            load_sharded(storage, ckpt_dir, manifest, whole)
        tree: Any = reader.finish(whole)
    finally:
        reader.close()
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{storage.describe(ckpt_dir)}: the state is not a mapping")
    tree["step"] = manifest.step
    return tree


def model_tensors(storage: Storage, ckpt_dir: str) -> dict[str, torch.Tensor]:
    """The model's tensors of a checkpoint, verified."""
    model = saved_state(storage, ckpt_dir).get("model")
    if not isinstance(model, dict):
        raise CorruptCheckpointError(
            f"{storage.describe(ckpt_dir)}: holds no model state to export"
        )
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def export_safetensors(
    storage: Storage,
    ckpt_dir: str,
    out_path: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Write the model weights of ``ckpt_dir`` as safetensors at ``out_path``; returns the tensors
    and the files written (one, or the shards and their index)."""
    if max_shard_bytes < 1:
        raise ConfigError(f"max shard size {max_shard_bytes}: must be positive")
    tensors = model_tensors(storage, ckpt_dir)
    for name, tensor in tensors.items():
        if safetensors_code(dtype_name(tensor.dtype, where=name)) is None:
            raise ConfigError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store"
            )
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    shards = _split(sorted(tensors.items()), max_shard_bytes)
    if len(shards) == 1:
        _write_safetensors(out_path, shards[0])
        return tensors, [out_path]
    stem = out_path[: -len(".safetensors")] if out_path.endswith(".safetensors") else out_path
    names = [f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards, strict=True):
        _write_safetensors(name, shard)
    index = {
        "metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
        "weight_map": {
            tensor_name: os.path.basename(file)
            for file, shard in zip(names, shards, strict=True)
            for tensor_name, _ in shard
        },
    }
    index_path = f"{stem}.safetensors.index.json"
    _write_atomically(index_path, json.dumps(index, indent=2, sort_keys=True).encode())
    return tensors, [*names, index_path]


def export_dcp(storage: Storage, ckpt_dir: str, out_dir: str) -> dict[str, Any]:
    """Write ``ckpt_dir``'s model, optimizer, scheduler and scaler state as a
    ``torch.distributed.checkpoint`` directory ``out_dir`` (replacing it); returns what was
    written. Runs in this process alone (no process group needed)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    tree = saved_state(storage, ckpt_dir)
    state: dict[str, Any] = {k: tree[k] for k in _DCP_PARTS if k in tree}
    if "model" not in state:
        raise CorruptCheckpointError(
            f"{storage.describe(ckpt_dir)}: holds no model state to export"
        )
    state["step"] = torch.tensor(tree["step"])
    tmp = f"{os.path.abspath(out_dir)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
        if os.path.lexists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return state


def _split(
    tensors: list[tuple[str, torch.Tensor]], max_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        if shards[-1] and size + _nbytes(tensor) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += _nbytes(tensor)
    return shards


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    local = LocalStorage()
    local.remove(tmp)
    try:
        write_shard(local, tmp, tensors, metadata={"format": "pt"})
        os.replace(tmp, path)
    finally:
        local.remove(tmp)


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
