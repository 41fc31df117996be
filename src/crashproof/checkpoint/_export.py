"""Export a checkpoint's model weights to standard formats."""

from __future__ import annotations

import os
from typing import Any

import torch

from crashproof.checkpoint._dtypes import dtype_name, safetensors_code
from crashproof.checkpoint._reader import load_rank_state, read_manifest
from crashproof.checkpoint._shard import write_shard
from crashproof.errors import ConfigError, CorruptCheckpointError
from crashproof.storage import LocalStorage, Storage

__all__ = ["export_safetensors", "model_tensors"]


def model_tensors(storage: Storage, ckpt_dir: str) -> dict[str, torch.Tensor]:
    """The model's tensors of a checkpoint (rank 0's copy), verified."""
    manifest = read_manifest(storage, ckpt_dir)
    tree: Any = load_rank_state(storage, ckpt_dir, manifest, 0)
    model = tree.get("model") if isinstance(tree, dict) else None
    if not isinstance(model, dict):
        raise CorruptCheckpointError(
            f"{storage.describe(ckpt_dir)}: holds no model state to export"
        )
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def export_safetensors(storage: Storage, ckpt_dir: str, out_path: str) -> dict[str, torch.Tensor]:
    """Write the model weights of ``ckpt_dir`` to the safetensors file ``out_path`` (atomically)."""
    tensors = model_tensors(storage, ckpt_dir)
    for name, tensor in tensors.items():
        if safetensors_code(dtype_name(tensor.dtype, where=name)) is None:
            raise ConfigError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store"
            )
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    local = LocalStorage()
    local.remove(tmp)
    try:
        write_shard(local, tmp, sorted(tensors.items()), metadata={"format": "pt"})
        os.replace(tmp, out_path)
    finally:
        local.remove(tmp)
    return tensors
