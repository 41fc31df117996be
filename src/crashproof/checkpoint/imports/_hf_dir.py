"""Reading a Hugging Face ``save_pretrained`` directory, or a ``Trainer`` ``checkpoint-N``
directory (the same, plus ``trainer_state.json``, ``optimizer.pt``, ``scheduler.pt``), and a lone
``.safetensors`` file.

Weights are read with safetensors (never pickle); ``pytorch_model.bin`` files, the older layout,
through :func:`load_torch_file` (``weights_only=True``). ``config.json`` and
``generation_config.json`` travel inside the checkpoint as the JSON extras ``hf_config`` and
``hf_generation_config``, so ``crashproof export --format hf`` can write them back.

``save_pretrained`` leaves out tied weights (GPT-2's ``lm_head.weight`` is its input
embedding); a restore into the live model needs every key of its state dict. When transformers
is installed and ``config.json`` names the architecture, the model is built on the meta device
(no memory, no weights) to learn which names share a parameter, and each missing name gets the
tensor of the name present. ``training_args.bin`` (a pickled ``TrainingArguments``) is never
loaded; ``rng_state.pth`` is not imported (see :func:`~._foreign.fixed_rng`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from crashproof.checkpoint.imports._foreign import Foreign, is_state_dict
from crashproof.checkpoint.imports._torch_file import load_torch_file
from crashproof.errors import ConfigError, CorruptCheckpointError

__all__ = ["HF_WEIGHTS", "read_hf_dir", "read_safetensors"]

HF_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The files a save_pretrained directory keeps its weights in, the preferred first."""
_TRAINER_PARTS = (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt"),
                  ("scaler", "scaler.pt"))  # fmt: skip
_CONFIGS = (("hf_config", "config.json"), ("hf_generation_config", "generation_config.json"))


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; :class:`CorruptCheckpointError` naming it when it is
    not one (truncated, another format)."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError as exc:
        raise ConfigError(
            f"{path}: reading safetensors needs the safetensors package ({exc}); install it with "
            "pip install 'crashproof[safetensors]'"
        ) from None
    try:
        return load_file(path, device="cpu")
    except SafetensorError as exc:
        raise CorruptCheckpointError(
            f"{path}: not a readable safetensors file ({exc}); expected a whole file written by "
            "safetensors or save_pretrained (a copy cut short reads like this): copy it again"
        ) from None


def read_hf_dir(directory: str, *, trust_pickle: bool) -> Foreign:
    """A save_pretrained or Trainer checkpoint directory as a :class:`Foreign`."""
    names = set(os.listdir(directory))
    trainer = "trainer_state.json" in names
    layout = (
        "Hugging Face Trainer checkpoint" if trainer else "Hugging Face save_pretrained directory"
    )
    found = Foreign(directory, layout, model=_weights(directory, names, trust_pickle))
    for key, name in _CONFIGS:
        if name in names:
            found.extra[key] = {"value": _json_file(os.path.join(directory, name))}
    if trainer:
        state = _json_file(os.path.join(directory, "trainer_state.json"))
        found.extra["trainer_state"] = {"value": state}
        step = state.get("global_step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            found.step, found.step_from = step, "'global_step' of trainer_state.json"
        if state.get("epoch") is not None:
            found.extra["epoch"] = {"value": state["epoch"]}
        for part, name in _TRAINER_PARTS:
            if name in names:
                path = os.path.join(directory, name)
                loaded = load_torch_file(path, trust_pickle=trust_pickle, what=f"the {part}")
                setattr(found, part, loaded)
        if "rng_state.pth" in names:
            found.left_out.append(
                "rng_state.pth: the imported checkpoint's RNG state is seeded with 0 instead"
            )
        if "training_args.bin" in names:
            found.left_out.append("training_args.bin: a pickled TrainingArguments, never loaded")
    config = found.extra.get("hf_config", {}).get("value")
    if isinstance(config, dict):
        _fill_tied(found, config)
    return found


def _weights(directory: str, names: set[str], trust_pickle: bool) -> dict[str, torch.Tensor]:
    if "model.safetensors" in names:
        return read_safetensors(os.path.join(directory, "model.safetensors"))
    if "model.safetensors.index.json" in names:
        return _sharded(directory, "model.safetensors.index.json", read_safetensors)
    if "pytorch_model.bin" in names:
        return _state_dict(os.path.join(directory, "pytorch_model.bin"), trust_pickle)
    return _sharded(
        directory, "pytorch_model.bin.index.json", lambda p: _state_dict(p, trust_pickle)
    )


def _state_dict(path: str, trust_pickle: bool) -> dict[str, torch.Tensor]:
    loaded = load_torch_file(path, trust_pickle=trust_pickle, what="the model's weights")
    if not is_state_dict(loaded):
        raise CorruptCheckpointError(
            f"{path}: holds a {type(loaded).__name__}, not a state dict of named tensors"
        )
    return dict(loaded)


def _sharded(directory: str, index_name: str, read: Any) -> dict[str, torch.Tensor]:
    """The tensors an index's ``weight_map`` lists, each from the shard it names; a shard must
    be a plain file name in ``directory`` (never a path out of it)."""
    index_path = os.path.join(directory, index_name)
    index = _json_file(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
        isinstance(v, str) and v and v == os.path.basename(v) and v not in (".", "..")
        for v in weight_map.values()
    ):  # fmt: skip
        raise CorruptCheckpointError(
            f"{index_path}: 'weight_map' must map each tensor name to a shard file in the same "
            "directory; found " + json.dumps(weight_map)[:200]
        )
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(directory, shard)
        if not os.path.isfile(path):
            raise CorruptCheckpointError(
                f"{path}: listed by {index_name} but missing; copy the whole directory again"
            )
        held = read(path)
        for name in (n for n, s in weight_map.items() if s == shard):
            if name not in held:
                raise CorruptCheckpointError(
                    f"{path}: does not hold {name!r}, which {index_name} lists there"
                )
            tensors[name] = held[name]
    return tensors


def _json_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{path}: holds a {type(value).__name__}, expected an object")
    return value


def _fill_tied(found: Foreign, config: dict[str, Any]) -> None:
    """Give each tied name save_pretrained left out the tensor of the name it is tied to."""
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        return
    try:
        import transformers
    except ImportError:
        found.left_out.append(
            "tied weights: transformers is not installed, so names save_pretrained leaves out "
            "(such as lm_head.weight) are not filled in"
        )
        return
    model_class = getattr(transformers, str(architectures[0]), None)
    if not isinstance(model_class, type) or not issubclass(model_class, torch.nn.Module):
        return
    verbosity = transformers.logging.get_verbosity()
    # Its notes on the config (token ids beyond a tiny vocabulary): not the import's news.
    transformers.logging.set_verbosity(logging.ERROR)
    try:
        with torch.device("meta"):  # names only: no memory, no initialization of weights
            model = model_class(model_class.config_class.from_dict(dict(config)))  # type: ignore[attr-defined]
    except Exception as exc:  # a config this transformers cannot build: keep what the files hold
        found.left_out.append(f"tied weights: {architectures[0]} could not be built ({exc})")
        return
    finally:
        transformers.logging.set_verbosity(verbosity)
    shared: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:  # fmt: skip
        shared.setdefault(id(tensor), []).append(name)
    for names in shared.values():
        present = [n for n in names if n in found.model]
        for name in names:
            if present and name not in found.model:
                found.model[name] = found.model[present[0]]
