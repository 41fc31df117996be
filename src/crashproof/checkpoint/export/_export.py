"""Export a checkpoint to standard formats, for tools that do not know crashproof.

What is exported is chosen with ``what``: ``model`` (the default for safetensors), ``ema`` (the
``extra`` named ``ema``), ``optimizer``, ``all``, or any key path into the state as
``crashproof inspect`` shows it (``extra/ema/state_dict/shadow``, ``optimizer/state``).

- **safetensors**: the chosen state's tensors (the model's weights by default); one file, or, above ``max_shard_bytes``, several files
  named ``<stem>-00001-of-0000N.safetensors`` plus ``<stem>.safetensors.index.json`` (the
  ``weight_map`` layout Hugging Face tools read).
- **dcp**: a ``torch.distributed.checkpoint`` directory with the model and optimizer state (and
  the LR scheduler's, the AMP scaler's, the step), readable by ``torch.distributed.checkpoint.load``
  on any number of ranks (DCP reshards on load).

The state comes from the checkpoint itself, every byte verified first. A checkpoint saved by
several ranks exports its replicated state (DDP: every rank holds the same tensors, checked from
the indexes' checksums) and its sharded tensors (FSDP2, DTensor) whole, put together from every
rank's pieces (see :mod:`crashproof.checkpoint.restore._dcp_reader`); state split between ranks by hand is
refused (see :mod:`crashproof.checkpoint.restore._rank_mapping`).

An export never deletes what it did not write: every output is written beside its target under a
fresh name and renamed into place once complete; an existing target is replaced only when it is
empty, or when it carries the mark of an earlier export and ``force`` is given; the checkpoint
root, its ancestors and the current directory never are (the checks, and the marks, are
:mod:`crashproof.checkpoint.export._target`'s).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from crashproof._files import fresh_name, write_atomically
from crashproof._version import __version__
from crashproof.checkpoint.export._output import (
    nbytes,
    shard_names,
    split_shards,
    swap_in,
    writing,
)
from crashproof.checkpoint.export._target import (
    MARK_KEY,
    MARKER,
    check_target,
    file_mark,
    files_under,
    listed_shards,
    protected_roots,
    remove_earlier,
)
from crashproof.checkpoint.format import (
    Manifest,
    dtype_name,
    held_part,
    safetensors_code,
    write_shard,
)
from crashproof.checkpoint.restore import (
    RankRead,
    cut_to_node,
    read_manifest,
    source_rank,
    source_ranks,
)
from crashproof.errors import ConfigError, CorruptCheckpointError
from crashproof.storage import LocalStorage, Storage

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "WHAT_SHORTCUTS",
    "export_dcp",
    "export_safetensors",
    "model_tensors",
    "write_safetensors_file",
    "write_sharded",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
"""Above this, a safetensors export is split (Hugging Face's default shard size, 5 GB)."""
_DCP_PARTS = ("model", "optimizer", "scheduler", "scaler")

log = logging.getLogger(__name__)


def saved_state(storage: Storage, ckpt_dir: str) -> dict[str, Any]:
    """The state tree of the checkpoint (one rank's, the same on every rank), verified."""
    manifest = read_manifest(storage, ckpt_dir)
    if manifest.nodes is not None:  # one node's part of a checkpoint on node-local roots
        rank, manifest = _node_part_rank(storage, ckpt_dir, manifest)
    else:
        rank = source_rank(storage, ckpt_dir, manifest, 0, 1)  # refuses state split by hand
    reader = RankRead(storage, ckpt_dir, manifest, rank)
    try:
        reader.verify()
        pieces = reader.sharded_entries()
        whole: dict[str, torch.Tensor] = {}
        if pieces:  # no live counterparts: whole tensors, of the size their pieces tile
            from crashproof.checkpoint.restore import (
                CrashproofReader,
                load_sharded,
                restore_targets,
            )

            saved = CrashproofReader(ckpt_dir, storage=storage, manifest=manifest)
            whole = restore_targets(pieces, {}, saved)
            load_sharded(storage, ckpt_dir, manifest, whole, reader=saved)
        tree: Any = reader.finish(whole)
    finally:
        reader.close()
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{storage.describe(ckpt_dir)}: the state is not a mapping")
    tree["step"] = manifest.step
    return tree


def _node_part_rank(storage: Storage, ckpt_dir: str, manifest: Manifest) -> tuple[int, Manifest]:
    """The rank an export reads in one node's part of a checkpoint saved on node-local roots (the
    part's first), and the manifest cut to the part. The part's ranks must hold the same state,
    as every rank of a checkpoint in one root must; the other nodes' ranks are on their own
    disks, so the export says whose state it is (under DDP, every rank's)."""
    where = storage.describe(ckpt_dir)
    ranks = held_part(manifest, storage.list(ckpt_dir), where)  # (a part whole, or refused)
    part = cut_to_node(manifest, ranks[0])
    source_ranks(storage, ckpt_dir, part, 1, among=ranks)  # refuses state split by hand
    log.warning(
        "%s holds ranks %s of the %d that saved it on node-local roots: exporting rank %d's state "
        "(replicated state, such as a DDP model's, is every rank's; other ranks' state held "
        "apart from it is on the other nodes' disks)",
        where,
        ", ".join(map(str, ranks)),
        manifest.world_size,
        ranks[0],
    )
    return ranks[0], part


WHAT_SHORTCUTS = {"model": "model", "ema": "extra/ema", "optimizer": "optimizer", "all": ""}
"""``what``'s names for the parts users keep; anything else is a key path (``extra/ema/shadow``)."""


def model_tensors(storage: Storage, ckpt_dir: str) -> dict[str, torch.Tensor]:
    """The model's tensors of a checkpoint, verified."""
    return _chosen_tensors(storage, ckpt_dir, "model")[0]


def select_state(tree: dict[str, Any], what: str, where: str) -> Any:
    """The part of a state tree ``what`` names (a shortcut of :data:`WHAT_SHORTCUTS` or a key
    path, ``/`` between keys); a part it does not hold is a ``ConfigError`` listing what is
    there at the level the path left off."""
    path = WHAT_SHORTCUTS.get(what, what)
    if what != "all" and not path.strip("/"):
        raise ConfigError(
            f"{where}: --what {what!r}: name a part (model, ema, optimizer, all) or a key path"
        )
    node: Any = tree
    walked: list[str] = []
    for key in filter(None, path.strip("/").split("/")):
        if isinstance(node, dict) and key in {str(k) for k in node}:
            node = next(v for k, v in node.items() if str(k) == key)
        elif isinstance(node, list | tuple) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            at = "/".join(walked) or "the top level"
            held = sorted(str(k) for k in node) if isinstance(node, dict) else []
            raise ConfigError(
                f"{where}: --what {what}: no {key!r} at {at} of this checkpoint's state"
                + (f"; there: {', '.join(held)}" if held else "")
                + " (crashproof inspect lists every key path)"
            )
        walked.append(key)
    if what in WHAT_SHORTCUTS and isinstance(node, dict) and len(node) == 1:
        # an extra is saved as {"state_dict": ...} (a Stateful) or {"value": ...}: the shortcut
        # means what the user put there
        ((key, inner),) = node.items()
        if walked[:1] == ["extra"] and key in ("state_dict", "value"):
            node = inner
    return node


def flat_tensors(node: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors under ``node``, named by their key path below it (a flat mapping of tensors,
    such as a state dict, keeps its own names); and the paths of the values that are not
    tensors (numbers, strings: safetensors holds tensors only)."""
    tensors: dict[str, torch.Tensor] = {}
    others: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            tensors[path or "tensor"] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}" if path else str(key))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, f"{path}/{i}" if path else str(i))
        else:
            others.append(path)

    walk(node, prefix)
    return tensors, others


def chosen_tensors(tree: dict[str, Any], what: str, where: str) -> dict[str, torch.Tensor]:
    """The tensors of ``tree``'s part ``what`` (see :func:`select_state`), each of a dtype
    safetensors stores; the values that are not tensors are left out, and logged."""
    tensors, others = flat_tensors(select_state(tree, what, where))
    if not tensors:
        raise ConfigError(f"{where}: --what {what}: holds no tensors to export")
    if others:
        log.warning(
            "--what %s: %d values that are not tensors are not exported (safetensors holds "
            "tensors only): %s",
            what,
            len(others),
            ", ".join(others[:10]) + (", ..." if len(others) > 10 else ""),
        )
    for name, tensor in tensors.items():
        if safetensors_code(dtype_name(tensor.dtype, where=name)) is None:
            raise ConfigError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store"
            )
    return tensors


def _chosen_tensors(
    storage: Storage, ckpt_dir: str, what: str
) -> tuple[dict[str, torch.Tensor], int]:
    tree = saved_state(storage, ckpt_dir)
    step = int(tree.pop("step"))  # added by saved_state: not part of the saved state
    return chosen_tensors(tree, what, f"{storage.describe(ckpt_dir)} (step {step})"), step


def export_safetensors(
    storage: Storage,
    ckpt_dir: str,
    out_path: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    force: bool = False,
    what: str = "model",
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Write the tensors of ``ckpt_dir``'s state that ``what`` chooses (the model weights by
    default; see :func:`select_state`) as safetensors at ``out_path``; returns the tensors and
    the files written (one, or the shards and their index). Values that are not tensors are left
    out, and logged. ``force``: replace an earlier
    export's files (see :func:`check_target`), whichever layout it had: the files of the earlier
    export this one does not overwrite (marked shards its marked index lists, the index, a
    single file) are removed once the new files are in place. An OSError writing the output is
    raised with ``filename`` set to ``out_path`` (see :func:`~._output.writing`)."""
    if max_shard_bytes < 1:
        raise ConfigError(f"max shard size {max_shard_bytes}: must be positive")
    protected = protected_roots(storage, ckpt_dir)
    check_target(out_path, kind="file", force=force, protected=protected)
    tensors, step = _chosen_tensors(storage, ckpt_dir, what)
    shards = split_shards(sorted(tensors.items()), max_shard_bytes)
    mark = f"step {step} of {storage.describe(ckpt_dir)}, crashproof {__version__}"
    stem = out_path[: -len(".safetensors")] if out_path.endswith(".safetensors") else out_path
    index_path = f"{stem}.safetensors.index.json"
    if len(shards) == 1:
        if file_mark(index_path) is not None:  # a sharded export here: replaced with --force
            check_target(index_path, kind="file", force=force, protected=protected)
        earlier = listed_shards(index_path)
        with writing(out_path):
            os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
            write_safetensors_file(out_path, shards[0], mark)
            remove_earlier(index_path, earlier - {os.path.abspath(out_path)})
        return tensors, [out_path]
    names = shard_names(stem, len(shards))
    for name in [*names, index_path]:  # every file checked before the first is written
        check_target(name, kind="file", force=force, protected=protected)
    earlier = listed_shards(index_path)
    with writing(out_path):
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        write_sharded(names, shards, index_path, mark)
        # A single-file export at out_path (check_target let it through: marked, --force) and
        # the shards of a sharded one that this one did not overwrite.
        remove_earlier(out_path, earlier - {os.path.abspath(n) for n in names})
    return tensors, [*names, index_path]


def export_dcp(
    storage: Storage,
    ckpt_dir: str,
    out_dir: str,
    *,
    force: bool = False,
    what: str | None = None,
) -> dict[str, Any]:
    """Write ``ckpt_dir``'s model, optimizer, scheduler and scaler state (or the part ``what``
    chooses, under its last key's name; ``all``: the whole state) as a
    ``torch.distributed.checkpoint`` directory ``out_dir``; returns what was written. ``out_dir``
    must be new or empty, or an earlier export replaced with ``force`` (see
    :func:`check_target`). Runs in this process alone (no process group needed)."""
    protected = protected_roots(storage, ckpt_dir)
    check_target(out_dir, kind="dir", force=force, protected=protected)
    tree = saved_state(storage, ckpt_dir)
    state: dict[str, Any]
    if what is None:
        state = {k: tree[k] for k in _DCP_PARTS if k in tree}
        if "model" not in state:
            raise CorruptCheckpointError(
                f"{storage.describe(ckpt_dir)}: holds no model state to export"
            )
    elif what == "all":
        state = {k: v for k, v in tree.items() if k != "step"}
    else:
        where = f"{storage.describe(ckpt_dir)} (step {tree['step']})"
        path = WHAT_SHORTCUTS.get(what, what).strip("/")
        state = {path.rsplit("/", 1)[-1]: select_state(tree, what, where)}
    state["step"] = torch.tensor(tree["step"])
    with writing(out_dir):
        _write_dcp(state, int(tree["step"]), storage.describe(ckpt_dir), out_dir, force, protected)
    return state


def _write_dcp(
    state: dict[str, Any], step: int, source: str, out_dir: str, force: bool,
    protected: Sequence[str],
) -> None:  # fmt: skip
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    tmp = fresh_name(out_dir, "tmp")
    os.mkdir(tmp)  # fails rather than reuse anything: the name is new
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            try:
                save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
            except CheckpointException as exc:  # a BaseException wrapping each rank's error
                raise _first_failure(exc) from None
        mark = {
            "command": "export",
            "format": "dcp",
            "step": step,
            "source": source,
            "crashproof": __version__,
            "files": sorted(files_under(tmp)),
        }
        write_atomically(os.path.join(tmp, MARKER), json.dumps(mark, indent=2).encode())
        swap_in(tmp, out_dir, force=force, protected=protected)
    finally:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp)  # ours: a fresh name, created above


def _first_failure(exc: BaseException) -> BaseException:
    """The error a rank's DCP write met (the ``OSError`` of a full disk), out of the
    ``CheckpointException`` torch wraps it in (``exc`` itself when it holds none)."""
    failures = getattr(exc, "failures", {})
    for error, _ in failures.values():
        if isinstance(error, Exception):
            return error
    return exc


def write_sharded(
    names: Sequence[str],
    shards: Sequence[list[tuple[str, torch.Tensor]]],
    index_path: str,
    mark: str,
) -> None:
    """Write each shard to its name, then the index naming, for every tensor, its shard file
    (``weight_map``) and the total size: the layout ``from_pretrained`` reads. The index is
    written last, so one that exists lists only shards complete on disk."""
    for name, shard in zip(names, shards, strict=True):
        write_safetensors_file(name, shard, mark)
    index = {
        "metadata": {
            "total_size": sum(nbytes(t) for shard in shards for _, t in shard),
            MARK_KEY: mark,
        },
        "weight_map": {
            tensor_name: os.path.basename(file)
            for file, shard in zip(names, shards, strict=True)
            for tensor_name, _ in shard
        },
    }
    write_atomically(index_path, json.dumps(index, indent=2, sort_keys=True).encode())


def write_safetensors_file(path: str, tensors: list[tuple[str, torch.Tensor]], mark: str) -> None:
    """Write ``tensors`` as the safetensors file ``path``, marked as an export's: beside it under
    a fresh name, then renamed into place."""
    tmp = fresh_name(path, "tmp")
    write_shard(LocalStorage(), tmp, tensors, metadata={"format": "pt", MARK_KEY: mark})
    try:  # write_shard removes its file when it fails; from here on, the file is ours to remove
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise
