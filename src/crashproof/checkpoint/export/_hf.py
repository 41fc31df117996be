"""Export to a Hugging Face ``save_pretrained`` directory, which ``from_pretrained`` loads.

The directory holds the model's weights as ``model.safetensors`` (above ``max_shard_bytes``:
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``, as transformers
shards), and the model's ``config.json`` (and ``generation_config.json``) when the checkpoint
carries them: as the JSON extras :data:`HF_CONFIG` and :data:`HF_GENERATION_CONFIG`. An import of
a Hugging Face directory puts them there; a training script does with
``TrainState(model=model, extra={"hf_config": json.loads(model.config.to_json_string())})``
(the text of ``config.json``: ``to_dict()`` is no JSON value, its ``id2label`` has int keys).
Without a config the weights are written all the same, and the caller says what is missing.

Tied weights (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are written under each
name, each with its own bytes: safetensors refuses tensors that share memory, and
``from_pretrained`` loads either layout (it ties them again from the config).

The directory is written under a fresh name beside ``out_dir`` and renamed into place once
complete, with the :data:`~._target.MARKER` of an export (``"format": "hf"``): ``--force``
replaces only such a directory, holding only the files an hf export writes.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from crashproof._files import fresh_name, write_atomically
from crashproof._version import __version__
from crashproof.checkpoint.export._export import (
    DEFAULT_MAX_SHARD_BYTES,
    chosen_tensors,
    saved_state,
    write_safetensors_file,
    write_sharded,
)
from crashproof.checkpoint.export._output import shard_names, split_shards, swap_in, writing
from crashproof.checkpoint.export._target import MARKER, check_target, files_under, protected_roots
from crashproof.errors import ConfigError
from crashproof.storage import Storage

__all__ = ["HF_CONFIG", "HF_GENERATION_CONFIG", "HfExport", "export_hf"]

HF_CONFIG = "hf_config"
"""The extra whose JSON value is the model's ``config.json``."""
HF_GENERATION_CONFIG = "hf_generation_config"
"""The extra whose JSON value is the model's ``generation_config.json``."""
_CONFIG_FILES = ((HF_CONFIG, "config.json"), (HF_GENERATION_CONFIG, "generation_config.json"))


@dataclass(frozen=True)
class HfExport:
    """What :func:`export_hf` wrote."""

    step: int
    tensors: dict[str, torch.Tensor]
    files: list[str]
    """The names written in the directory (the marker aside)."""

    @property
    def has_config(self) -> bool:
        return "config.json" in self.files


def export_hf(
    storage: Storage,
    ckpt_dir: str,
    out_dir: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    force: bool = False,
    what: str = "model",
) -> HfExport:
    """Write ``ckpt_dir``'s model (or the part ``what`` chooses, as for safetensors) as a
    ``save_pretrained`` directory ``out_dir``, which must be new or empty, or an earlier hf
    export replaced with ``force`` (see :func:`check_target`). An OSError writing it is raised
    with ``filename`` set to ``out_dir``."""
    if max_shard_bytes < 1:
        raise ConfigError(f"max shard size {max_shard_bytes}: must be positive")
    protected = protected_roots(storage, ckpt_dir)
    check_target(out_dir, kind="dir", force=force, protected=protected)
    tree = saved_state(storage, ckpt_dir)
    step = int(tree.pop("step"))
    source = storage.describe(ckpt_dir)
    tensors = chosen_tensors(tree, what, f"{source} (step {step})")
    configs = {name: value for key, name in _CONFIG_FILES
               if (value := _json_extra(tree, key)) is not None}  # fmt: skip
    mark = f"step {step} of {source}, crashproof {__version__}"
    with writing(out_dir):
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        tmp = fresh_name(out_dir, "tmp")
        os.mkdir(tmp)  # fails rather than reuse anything: the name is new
        try:
            _write_weights(tmp, tensors, max_shard_bytes, mark)
            for name, value in configs.items():
                text = json.dumps(value, indent=2, sort_keys=True) + "\n"
                write_atomically(os.path.join(tmp, name), text.encode())
            files = sorted(files_under(tmp))
            record = {"command": "export", "format": "hf", "step": step, "source": source,
                      "crashproof": __version__, "files": files}  # fmt: skip
            write_atomically(os.path.join(tmp, MARKER), json.dumps(record, indent=2).encode())
            swap_in(tmp, out_dir, force=force, protected=protected)
        finally:
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                shutil.rmtree(tmp)  # ours: a fresh name, created above
    return HfExport(step, tensors, files)


def _write_weights(
    directory: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int, mark: str
) -> None:
    shards = split_shards(sorted(tensors.items()), max_shard_bytes)
    if len(shards) == 1:
        write_safetensors_file(os.path.join(directory, "model.safetensors"), shards[0], mark)
        return
    names = shard_names(os.path.join(directory, "model"), len(shards))
    write_sharded(names, shards, os.path.join(directory, "model.safetensors.index.json"), mark)


def _json_extra(tree: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The JSON object the checkpoint carries as the extra ``key`` (None when it has none); an
    extra of that name that is not one is refused, naming it."""
    extra = tree.get("extra")
    entry = extra.get(key) if isinstance(extra, dict) else None
    if entry is None:
        return None
    value = entry.get("value") if isinstance(entry, dict) else None
    if not isinstance(value, dict):
        raise ConfigError(
            f"the checkpoint's extra {key!r} is not a JSON object (a config, as "
            f"json.loads(model.config.to_json_string()) gives); found {str(entry)[:100]}"
        )
    return value
