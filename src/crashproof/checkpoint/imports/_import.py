"""Bringing a checkpoint from elsewhere into a crashproof root: what the source is
(:func:`read_source`), and writing it as a committed checkpoint (:func:`import_checkpoint`).

The checkpoint is written by the one writer there is: a :class:`CheckpointManager` on the root
(so the root's lock, the commit protocol, checksums and fsyncs are the same as a training run's),
saving synchronously a :class:`TrainState` whose capture is the imported tree. Its retention keeps
everything: an import never removes a checkpoint, and a step the root holds already is refused
before anything is written. The tree is checked first with the checks ``crashproof verify``
makes, so what is written is what a restore accepts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from crashproof.checkpoint.format import MAX_STEP, parse_step_dir
from crashproof.checkpoint.imports._foreign import Foreign, fixed_rng, from_mapping
from crashproof.checkpoint.imports._hf_dir import HF_WEIGHTS, read_hf_dir, read_safetensors
from crashproof.checkpoint.imports._torch_file import load_torch_file
from crashproof.checkpoint.manager import CheckpointManager
from crashproof.checkpoint.root import committed_steps
from crashproof.errors import ConfigError, CrashproofError
from crashproof.policy import KeepAll
from crashproof.state import TrainState, check_structure, set_reproducible_defaults
from crashproof.storage import Storage, storage_for

__all__ = ["Imported", "import_checkpoint", "read_source"]

SOURCES = (
    "a torch.save file (.pt, .pth, .bin), a Lightning .ckpt, a .safetensors file, or a Hugging "
    "Face save_pretrained or Trainer checkpoint directory (with " + ", ".join(HF_WEIGHTS[:3]) + ")"
)
"""What ``crashproof import`` reads, for the messages."""


def read_source(path: str, *, trust_pickle: bool = False) -> Foreign:
    """Read the foreign checkpoint at ``path``: :class:`ConfigError` for a path that is none of
    :data:`SOURCES` (or needs ``trust_pickle``), :class:`CorruptCheckpointError` for one whose
    files are damaged, OSError for one the file system refuses."""
    if not os.path.lexists(path):
        raise ConfigError(f"{path}: no such file or directory; give {SOURCES}")
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        if any(name in names for name in HF_WEIGHTS):
            return read_hf_dir(path, trust_pickle=trust_pickle)
        if "manifest.json" in names or any(parse_step_dir(n) is not None for n in names):
            raise ConfigError(
                f"{path}: is a crashproof checkpoint or root already; nothing to import "
                "(crashproof ls lists it)"
            )
        held = (
            f" (it holds {', '.join(names[:8])}{', ...' if len(names) > 8 else ''})"
            if names
            else " (it is empty)"
        )
        raise ConfigError(
            f"{path}: a directory with no known checkpoint layout{held}; expected a Hugging Face "
            f"directory holding one of {', '.join(HF_WEIGHTS)}, or give the checkpoint file "
            "itself"
        )
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: not a regular file nor a directory; give {SOURCES}")
    if path.endswith(".safetensors"):
        return Foreign(path, "safetensors file", model=read_safetensors(path))
    kind = "Lightning checkpoint" if path.endswith(".ckpt") else "torch.save file"
    return from_mapping(load_torch_file(path, trust_pickle=trust_pickle), path, what=kind)


@dataclass(frozen=True)
class Imported:
    """What an import wrote (``crashproof import --json`` prints it)."""

    source: str
    layout: str
    step: int
    step_from: str
    checkpoint: str
    parts: list[str]
    tensors: int
    bytes: int
    extras: list[str]
    left_out: list[str]
    newer: list[int]
    """Steps the root holds after this one: a restore without ``step=`` loads the newest."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _ImportedState(TrainState):
    """A TrainState whose capture is a tree built beforehand: the manager saves it as it saves
    a training run's (no live objects behind it; restore is never called on it)."""

    def __init__(self, tree: dict[str, Any]) -> None:
        super().__init__()
        self._tree = tree

    def capture(self) -> dict[str, Any]:
        return self._tree


def import_checkpoint(found: Foreign, root: str, step: int | None = None) -> Imported:
    """Write ``found`` as the checkpoint of ``step`` (default: the step the source records,
    else 0) under ``root``, created if need be. Refused (:class:`ConfigError`) before anything
    is written: a step out of range, a step ``root`` holds already, state a restore would refuse.
    A root another process writes raises :class:`~crashproof.errors.RootLockedError`."""
    if step is not None:
        step_from = "--step"
    elif found.step is not None:
        step, step_from = found.step, found.step_from
    else:
        step, step_from = 0, "the source records no step"
    if not 0 <= step <= MAX_STEP:
        raise ConfigError(f"--step {step}: checkpoint steps are whole numbers from 0 to 2**62")
    tree = _tree(found)
    try:
        check_structure(tree, found.source)
    except CrashproofError as exc:
        raise ConfigError(
            f"{exc}; a restore would refuse this state, so it is not imported"
        ) from None
    path, storage = storage_for(root)
    if parse_step_dir(os.path.basename(path.rstrip("/"))) is not None:
        raise ConfigError(
            f"{root}: is one checkpoint, not a checkpoint root: give the directory it is in"
        )
    _refuse_taken(storage, path, step)  # before the root is created or locked
    manager = CheckpointManager(
        root, keep=KeepAll(), async_save=False, handle_signals=False, check_finite=False,
        replicate=False,
    )  # fmt: skip
    try:
        _refuse_taken(storage, path, step)  # again, as the root's writer now
        metadata = {"imported_from": {"source": os.path.abspath(found.source),
                                      "layout": found.layout, "step_from": step_from}}  # fmt: skip
        with _copied_not_computed():
            manager.save(step, _ImportedState(tree), metadata=metadata)
    finally:
        manager.close()
    tensors = {id(t): t for t in found.model.values() if isinstance(t, torch.Tensor)}
    return Imported(
        source=found.source, layout=found.layout, step=step, step_from=step_from,
        checkpoint=storage.describe(storage.join(path, f"step_{step:010d}")),
        parts=found.parts(), tensors=len(found.model),
        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        extras=sorted(found.extra), left_out=list(found.left_out),
        newer=sorted(s for s, _ in committed_steps(storage, path) if s > step),
    )  # fmt: skip


@contextlib.contextmanager
def _copied_not_computed() -> Iterator[None]:
    """While the import saves: the environment that asks MKL for reproducible results. A
    checkpoint records whether the process that saved it had it (a resume warns when not); an
    import computes nothing, its values are copied, so the importing process's MKL settings
    must not make every resume from it warn."""
    wanted: dict[str, str] = {}
    set_reproducible_defaults(wanted)
    before = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _tree(found: Foreign) -> dict[str, Any]:
    """The tree a TrainState's capture would have made of these parts."""
    model: dict[str, Any] = {}
    for name, value in found.model.items():
        if isinstance(value, torch.Tensor) or name.rsplit(".", 1)[-1] == "_extra_state":
            model[name] = value
        else:  # a state dict holds tensors: a restore refuses anything else there
            found.left_out.append(f"model entry {name!r}: a {type(value).__name__}, not a tensor")
    found.model = model
    if not model:
        raise ConfigError(f"{found.source}: holds no model tensors to import")
    tree: dict[str, Any] = {"rng": fixed_rng(), "model": model}
    for part in ("optimizer", "scheduler", "scaler"):
        if getattr(found, part) is not None:
            tree[part] = getattr(found, part)
    tree["classes"] = {}  # unknown: a restore into any class is not refused by name
    tree["extra"] = dict(found.extra)
    return tree


def _refuse_taken(storage: Storage, root: str, step: int) -> None:
    taken = [s for s, _ in committed_steps(storage, root)]  # none where there is no root yet
    if step in taken:
        raise ConfigError(
            f"{storage.describe(root)} holds a checkpoint of step {step} already; an import never "
            "replaces one: give another --step, or another root"
        )
