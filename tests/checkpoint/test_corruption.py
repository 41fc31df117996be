"""A damaged or hostile newest checkpoint is detected, skipped, and never trusted.

Each case saves checkpoints at steps 1 and 2 of a small model trained with AdamW, damages step 2,
and checks that verification rejects it, that restore falls back to step 1 bit for bit and logs
why, that asking for step 2 explicitly names the bad file, that nothing outside the checkpoint
root is opened, that no huge buffer is allocated, and that step 1 is left byte-identical.

Manifests and rank indexes are covered by checksums, so to reach the parsers' own bounds checks
the hostile cases rewrite the index and then fix its size and checksum in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from crashproof import (
    CheckpointManager,
    CorruptCheckpointError,
    StateMismatchError,
    TrainState,
    UnsafeCheckpointError,
)
from crashproof.checkpoint import committed_steps, verify_checkpoint
from crashproof.checkpoint._restorer import Restorer
from crashproof.checkpoint.format._fields import dumps
from crashproof.checkpoint.format._hashing import digest
from crashproof.checkpoint.format._manifest import seal_manifest
from crashproof.policy import KeepEvery, KeepLast
from crashproof.storage import LocalStorage

MANIFEST = "manifest.json"
INDEX = "rank_00000.json"
SHARD = "rank_00000.safetensors"
STEP1 = "step_0000000001"
STEP2 = "step_0000000002"
# Anything crashproof allocates while reading these tiny checkpoints is far below this.
ALLOCATION_LIMIT = 64 * 1024 * 1024


# -- the run under test ----------------------------------------------------------------------


def _model(hidden: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    opt.zero_grad()
    model(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
    opt.step()


def _tensors(state: TrainState) -> dict[str, torch.Tensor]:
    """Clones of every model and optimizer tensor of ``state``, by a stable name."""
    assert state.model is not None and state.optimizer is not None
    out = {f"model/{k}": v.detach().clone() for k, v in state.model.state_dict().items()}
    for pid, pstate in state.optimizer.state_dict()["state"].items():
        for name, value in pstate.items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer/{pid}/{name}"] = value.detach().clone()
    return out


def _assert_same_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


def _fresh_state(hidden: int = 3) -> TrainState:
    """A differently initialised model whose optimizer already has (different) state."""
    torch.manual_seed(999)
    model = _model(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, torch.Generator().manual_seed(7))
    return TrainState(model=model, optimizer=opt)


@dataclass
class Run:
    root: str
    step1: Path
    step2: Path
    expected1: dict[str, torch.Tensor]
    expected2: dict[str, torch.Tensor]
    outside: Path  # a directory next to the root, for files that must never be read
    storage: LocalStorage


@dataclass(frozen=True)
class Template:
    root: Path
    expected1: dict[str, torch.Tensor]
    expected2: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """Checkpoints of steps 1 and 2, saved once; each test gets its own copy (saves fsync)."""
    torch.manual_seed(1234)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    root = tmp_path_factory.mktemp("template") / "ckpts"
    with CheckpointManager(str(root)) as manager:
        _train_step(model, opt, gen)
        manager.save(1, state)
        expected1 = _tensors(state)
        _train_step(model, opt, gen)
        manager.save(2, state)
        expected2 = _tensors(state)
    # The two checkpoints differ, so "restored step 1" is a meaningful assertion.
    assert not torch.equal(expected1["model/0.weight"], expected2["model/0.weight"])
    assert not torch.equal(expected1["optimizer/0/exp_avg"], expected2["optimizer/0/exp_avg"])
    assert sorted(p.name for p in root.iterdir()) == [STEP1, STEP2]
    return Template(root, expected1, expected2)


@pytest.fixture
def run(template: Template, tmp_path: Path) -> Run:
    root = tmp_path / "ckpts"
    shutil.copytree(template.root, root)
    outside = tmp_path / "outside"
    outside.mkdir()
    return Run(
        str(root),
        root / STEP1,
        root / STEP2,
        template.expected1,
        template.expected2,
        outside,
        LocalStorage(),
    )


def _dir_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


# -- corruption helpers -------------------------------------------------------------------------


def _flip(name: str, position: Callable[[bytes], int], bit: int = 0) -> Callable[[Run], None]:
    def corrupt(run: Run) -> None:
        path = run.step2 / name
        data = bytearray(path.read_bytes())
        data[position(bytes(data))] ^= 1 << bit
        path.write_bytes(bytes(data))

    return corrupt


def _truncate(name: str, size: Callable[[int], int]) -> Callable[[Run], None]:
    def corrupt(run: Run) -> None:
        path = run.step2 / name
        path.write_bytes(path.read_bytes()[: size(path.stat().st_size)])

    return corrupt


def _remove(name: str) -> Callable[[Run], None]:
    def corrupt(run: Run) -> None:
        (run.step2 / name).unlink()

    return corrupt


def _replace_manifest(data: bytes) -> Callable[[Run], None]:
    def corrupt(run: Run) -> None:
        (run.step2 / MANIFEST).write_bytes(data)

    return corrupt


def _edit_manifest(mutate: Callable[[dict[str, Any], Run], None]) -> Callable[[Run], None]:
    def corrupt(run: Run) -> None:
        path = run.step2 / MANIFEST
        obj = json.loads(path.read_bytes())
        mutate(obj, run)
        path.write_bytes(seal_manifest(obj))  # well-sealed: only the parser stands in the way

    return corrupt


def _list_in_manifest(obj: dict[str, Any], name: str, data: bytes) -> None:
    obj["files"][name] = {"size": len(data), "checksum": digest(data)}


def _edit_index(mutate: Callable[[dict[str, Any], Run], None]) -> Callable[[Run], None]:
    """Rewrite the rank index and fix its size and checksum in the manifest, so that only the
    index parser (and what comes after it) stands between the hostile content and a read."""

    def corrupt(run: Run) -> None:
        path = run.step2 / INDEX
        obj = json.loads(path.read_bytes())
        mutate(obj, run)
        data = dumps(obj)
        path.write_bytes(data)
        _edit_manifest(lambda m, _: _list_in_manifest(m, INDEX, data))(run)

    return corrupt


def _tensor_entry(obj: dict[str, Any], name: str) -> dict[str, Any]:
    entry: dict[str, Any] = next(t for t in obj["tensors"] if t["name"] == name)
    return entry


def _shard_size(run: Run) -> int:
    return (run.step2 / SHARD).stat().st_size


def _set_tensor(name: str, **fields: Callable[[dict[str, Any], Run], Any]) -> Callable[[Run], None]:
    def mutate(obj: dict[str, Any], run: Run) -> None:
        entry = _tensor_entry(obj, name)
        for key, make in fields.items():
            entry[key] = make(entry, run)

    return _edit_index(mutate)


def _symlink_outside(name: str) -> Callable[[Run], None]:
    """Replace ``name`` by a symlink to an identical copy outside the checkpoint directory: if
    the link were followed, the checkpoint would verify."""

    def corrupt(run: Run) -> None:
        target = run.outside / name
        shutil.copyfile(run.step2 / name, target)
        (run.step2 / name).unlink()
        (run.step2 / name).symlink_to(target)

    return corrupt


def _list_outside_file(make_name: Callable[[Run, Path], str]) -> Callable[[Run], None]:
    """List a file outside the directory in the manifest, with its true size and checksum."""

    def corrupt(run: Run) -> None:
        secret = run.outside / "secret.bin"
        secret.write_bytes(b"outside the checkpoint " * 10)
        _edit_manifest(
            lambda m, r: _list_in_manifest(m, make_name(r, secret), secret.read_bytes())
        )(run)

    return corrupt


def _rename_shard_in_manifest(new_name: str) -> Callable[[Run], None]:
    def corrupt(run: Run) -> None:
        def mutate_manifest(m: dict[str, Any], _: Run) -> None:
            m["files"][new_name] = m["files"].pop(SHARD)

        def mutate_index(obj: dict[str, Any], _: Run) -> None:
            obj["shard_file"] = new_name

        _edit_index(mutate_index)(run)
        _edit_manifest(mutate_manifest)(run)

    return corrupt


def _index_position(marker: bytes) -> Callable[[bytes], int]:
    return lambda data: data.index(marker) + len(marker)


def _tensor_data_position(tensor_name: str) -> Callable[[Run], None]:
    """Flip the first byte of ``tensor_name``'s data, located through the index."""

    def corrupt(run: Run) -> None:
        index = json.loads((run.step2 / INDEX).read_bytes())
        offset = _tensor_entry(index, tensor_name)["offset"]
        _flip(SHARD, lambda _: offset)(run)

    return corrupt


def _random_bytes(n: int) -> bytes:
    return random.Random(0).randbytes(n)


def _wrong_shape(**changes: Any) -> Callable[[Run], None]:
    def mutate(obj: dict[str, Any], _: Run) -> None:
        obj.update(changes)

    return _edit_manifest(mutate)


def _state_edit(mutate: Callable[[dict[str, Any]], None]) -> Callable[[Run], None]:
    return _edit_index(lambda obj, _: mutate(obj["state"]))


# -- the cases --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    corrupt: Callable[[Run], None]
    names: str  # the file the error messages must name
    unsafe: bool = False  # verification must raise UnsafeCheckpointError specifically


def _case(
    case_id: str,
    corrupt: Callable[[Run], None],
    names: str,
    *,
    unsafe: bool = False,
) -> Any:
    return pytest.param(Case(corrupt, names, unsafe), id=case_id)


_BIG = 2**40

CASES = [
    # A flipped bit in each kind of file.
    # (The manifest checks itself first: a flip in a file's entry is the manifest's damage.)
    _case("flip-manifest-shard-checksum", _flip(MANIFEST, _index_position(b'"rank_00000.safetensors":{"checksum":"')), MANIFEST),
    _case("flip-manifest-index-size", _flip(MANIFEST, lambda d: d.index(b"}", d.index(b'"rank_00000.json"')) - 1), MANIFEST),
    _case("flip-manifest-created-time", _flip(MANIFEST, _index_position(b'"created_unix":')), MANIFEST),
    _case("flip-manifest-metadata-key", _flip(MANIFEST, _index_position(b'"metadata"')), MANIFEST),
    _case("flip-manifest-format-name", _flip(MANIFEST, _index_position(b'"format":"crash')), MANIFEST),
    _case("flip-manifest-world-size", _flip(MANIFEST, _index_position(b'"world_size":'), bit=1), MANIFEST),
    _case("flip-index-middle", _flip(INDEX, lambda d: len(d) // 2), INDEX),
    _case("flip-index-tensor-offset", _flip(INDEX, _index_position(b'"offset":')), INDEX),
    _case("flip-shard-header-length", _flip(SHARD, lambda _: 0), SHARD),
    _case("flip-shard-header-json", _flip(SHARD, lambda d: d.index(b'"shape"') + 2), SHARD),
    _case("flip-shard-weight-data", _tensor_data_position("model/0.weight"), SHARD),
    _case("flip-shard-last-byte", _flip(SHARD, lambda d: len(d) - 1, bit=7), SHARD),
    # Truncated files.
    _case("truncate-manifest-half", _truncate(MANIFEST, lambda n: n // 2), MANIFEST),
    _case("truncate-manifest-empty", _truncate(MANIFEST, lambda n: 0), MANIFEST),
    _case("truncate-index-half", _truncate(INDEX, lambda n: n // 2), INDEX),
    _case("truncate-index-one-byte", _truncate(INDEX, lambda n: n - 1), INDEX),
    _case("truncate-shard-half", _truncate(SHARD, lambda n: n // 2), SHARD),
    _case("truncate-shard-one-byte", _truncate(SHARD, lambda n: n - 1), SHARD),
    _case("truncate-shard-header-only", _truncate(SHARD, lambda n: 8), SHARD),
    # Missing files.
    _case("missing-manifest", _remove(MANIFEST), MANIFEST),
    _case("missing-index", _remove(INDEX), INDEX),
    _case("missing-shard", _remove(SHARD), SHARD),
    # Garbage and wrongly shaped manifests.
    _case("manifest-random-bytes", _replace_manifest(_random_bytes(4096)), MANIFEST),
    _case("manifest-json-list", _replace_manifest(b"[]"), MANIFEST),
    _case("manifest-json-null", _replace_manifest(b"null"), MANIFEST),
    _case("manifest-json-string", _replace_manifest(b'"crashproof-checkpoint"'), MANIFEST),
    _case("manifest-json-empty-object", _replace_manifest(b"{}"), MANIFEST),
    _case("manifest-deeply-nested", _replace_manifest(b"[" * 200_000 + b"]" * 200_000), MANIFEST),
    _case("manifest-files-is-list", _wrong_shape(files=[INDEX, SHARD]), MANIFEST),
    _case("manifest-file-entry-not-object", _edit_manifest(lambda m, _: m["files"].update({SHARD: 6756})), MANIFEST),
    _case("manifest-negative-size", _edit_manifest(lambda m, _: m["files"][SHARD].update(size=-1)), MANIFEST),
    _case("manifest-bool-size", _edit_manifest(lambda m, _: m["files"][SHARD].update(size=True)), MANIFEST),
    _case("manifest-missing-step", _edit_manifest(lambda m, _: m.pop("step")), MANIFEST),
    _case("manifest-step-is-string", _wrong_shape(step="2"), MANIFEST),
    _case("manifest-future-version", _wrong_shape(format_version=2), MANIFEST),
    _case("manifest-unknown-kind", _wrong_shape(kind="delta"), MANIFEST),
    _case("manifest-other-hash", _wrong_shape(hash_algorithm="sha256"), MANIFEST),
    _case("manifest-big-endian", _wrong_shape(byte_order="big"), MANIFEST),
    _case("manifest-created-nan", _replace_manifest(b'{"format":"crashproof-checkpoint","format_version":1,"kind":"full","created_unix":NaN}'), MANIFEST),
    _case("manifest-created-huge-int", _wrong_shape(created_unix=10**400), MANIFEST),
    _case("manifest-world-size-2", _wrong_shape(world_size=2), MANIFEST),
    _case("manifest-world-size-0", _wrong_shape(world_size=0), MANIFEST),
    _case("manifest-huge-index-size", _edit_manifest(lambda m, _: m["files"][INDEX].update(size=2**50)), INDEX),
    # Names that try to leave the checkpoint directory.
    _case("manifest-lists-dotdot-path", _list_outside_file(lambda r, p: "../../outside/secret.bin"), MANIFEST, unsafe=True),
    _case("manifest-lists-absolute-path", _list_outside_file(lambda r, p: str(p)), MANIFEST, unsafe=True),
    _case("manifest-lists-subdir-path", _list_outside_file(lambda r, p: "sub/secret.bin"), MANIFEST, unsafe=True),
    _case("manifest-lists-dotdot", _list_outside_file(lambda r, p: ".."), MANIFEST, unsafe=True),
    _case("manifest-lists-empty-name", _list_outside_file(lambda r, p: ""), MANIFEST, unsafe=True),
    _case("manifest-shard-renamed-dotdot", _rename_shard_in_manifest(f"../{STEP1}/{SHARD}"), MANIFEST, unsafe=True),
    _case("index-shard-file-dotdot", _edit_index(lambda o, _: o.update(shard_file=f"../{STEP1}/{SHARD}")), INDEX, unsafe=True),
    _case("index-shard-file-absolute", _edit_index(lambda o, r: o.update(shard_file=str(r.step1 / SHARD))), INDEX, unsafe=True),
    _case("index-shard-file-unlisted", _edit_index(lambda o, _: o.update(shard_file="rank_00001.safetensors")), INDEX),
    # Rank indexes whose byte ranges are out of bounds or hostile (checksums fixed).
    _case("index-offset-at-end", _set_tensor("model/0.weight", offset=lambda e, r: _shard_size(r)), INDEX, unsafe=True),
    _case("index-range-one-past-end", _set_tensor("model/0.weight", offset=lambda e, r: _shard_size(r) - e["nbytes"] + 1), INDEX, unsafe=True),
    _case("index-offset-huge", _set_tensor("model/0.weight", offset=lambda e, r: 2**62), INDEX, unsafe=True),
    _case("index-gigantic-tensor", _set_tensor("model/0.weight", shape=lambda e, r: [_BIG], nbytes=lambda e, r: _BIG * 4), INDEX, unsafe=True),
    _case("index-gigantic-tensor-and-manifest-size",
          lambda r: (_set_tensor("model/0.weight", shape=lambda e, r: [_BIG], nbytes=lambda e, r: _BIG * 4)(r),
                     _edit_manifest(lambda m, _: m["files"][SHARD].update(size=_BIG * 8))(r)),
          SHARD),
    _case("index-nbytes-disagrees-with-shape", _set_tensor("model/0.weight", nbytes=lambda e, r: e["nbytes"] * 2), INDEX),
    _case("index-negative-offset", _set_tensor("model/0.weight", offset=lambda e, r: -8), INDEX),
    _case("index-negative-dim", _set_tensor("model/0.weight", shape=lambda e, r: [-3, -4]), INDEX),
    _case("index-shape-overflows-int64", _set_tensor("model/0.weight", shape=lambda e, r: [2**62] * 3, nbytes=lambda e, r: 2**62 * 3 * 4), INDEX),
    _case("index-too-many-dims", _set_tensor("model/0.weight", shape=lambda e, r: [1] * 65), INDEX),
    _case("index-unknown-dtype", _set_tensor("model/0.weight", dtype=lambda e, r: "float128"), INDEX),
    _case("index-empty-tensor-with-huge-dims",
          _set_tensor("model/0.weight", shape=lambda e, r: [0, 2**62, 2**62], nbytes=lambda e, r: 0,
                      checksum=lambda e, r: digest(b"")),
          INDEX, unsafe=True),
    _case("index-overlapping-tensors",
          _set_tensor("model/0.bias", offset=lambda e, r: e["offset"] - 4), SHARD),
    _case("index-wrong-tensor-checksum",
          _set_tensor("model/0.weight", checksum=lambda e, r: digest(b"something else")), SHARD),
    _case("index-state-refers-to-missing-tensor",
          _state_edit(lambda s: s["model"].update({"0.weight": {"$tensor": 999}})), INDEX),
    _case("index-state-npscalar-overflow",
          _state_edit(lambda s: s.update(extra={"$npscalar": "|i1", "value": 1000})), INDEX),
    _case("index-state-npscalar-not-a-number",
          _state_edit(lambda s: s.update(extra={"$npscalar": "<f8", "value": "1.5"})), INDEX),
    # Symbolic links to identical copies outside the directory.
    _case("symlink-shard", _symlink_outside(SHARD), SHARD),
    _case("symlink-index", _symlink_outside(INDEX), INDEX),
    _case("symlink-manifest", _symlink_outside(MANIFEST), MANIFEST),
]  # fmt: skip


def _record_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    opened: list[str] = []
    original = LocalStorage.open

    def recording_open(self: LocalStorage, path: str) -> Any:
        opened.append(os.path.abspath(path))
        return original(self, path)

    monkeypatch.setattr(LocalStorage, "open", recording_open)
    return opened


def _forbid_huge_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any torch.empty / np.empty above ALLOCATION_LIMIT bytes fail the test."""
    torch_empty, np_empty = torch.empty, np.empty

    def checked_torch_empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        nbytes = int(np.prod([int(d) for d in shape], dtype=object)) * dtype.itemsize
        # Meta tensors (shapes checked before any read) allocate no memory at all.
        if str(kwargs.get("device")) != "meta":
            assert nbytes <= ALLOCATION_LIMIT, f"torch.empty of {nbytes} bytes"
        return torch_empty(*size, **kwargs)

    def checked_np_empty(shape: Any, dtype: Any = float, *args: Any, **kwargs: Any) -> Any:
        dims = [shape] if isinstance(shape, int) else list(shape)
        nbytes = int(np.prod(dims, dtype=object)) * np.dtype(dtype).itemsize
        assert nbytes <= ALLOCATION_LIMIT, f"np.empty of {nbytes} bytes"
        return np_empty(shape, dtype, *args, **kwargs)

    monkeypatch.setattr(torch, "empty", checked_torch_empty)
    monkeypatch.setattr(np, "empty", checked_np_empty)


def _is_inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, os.path.abspath(root)]) == os.path.abspath(root)


@pytest.mark.parametrize("case", CASES)
def test_corrupt_newest_checkpoint_is_rejected_and_restore_falls_back(
    case: Case,
    run: Run,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _dir_digest(run.step1)
    case.corrupt(run)
    opened = _record_opens(monkeypatch)
    _forbid_huge_allocations(monkeypatch)

    # restore() skips step 2, loads step 1 exactly, and says why it skipped step 2.
    state = _fresh_state()
    with caplog.at_level(logging.WARNING, logger="crashproof.checkpoint"):
        assert CheckpointManager(run.root).restore(state) == 1
    _assert_same_tensors(_tensors(state), run.expected1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 2" in w and case.names in w for w in warnings), warnings

    # Asking for step 2 explicitly is an error naming the bad file; nothing is loaded.
    state = _fresh_state()
    untouched = _tensors(state)
    with pytest.raises(CorruptCheckpointError) as explicit:
        CheckpointManager(run.root).restore(state, step=2)
    assert case.names in str(explicit.value)
    _assert_same_tensors(_tensors(state), untouched)

    # Nothing outside the checkpoint root was opened, and step 1 is byte-identical.
    outside = [p for p in opened if not _is_inside(p, run.root)]
    assert not outside
    assert _dir_digest(run.step1) == before

    # The verify API rejects step 2 too, naming the file.
    with pytest.raises(CorruptCheckpointError) as verified:
        verify_checkpoint(run.storage, str(run.step2))
    assert case.names in str(verified.value)
    if case.unsafe:
        assert isinstance(verified.value, UnsafeCheckpointError)
    assert verify_checkpoint(run.storage, str(run.step1)).step == 1


# -- sweeps: every (sampled) single-bit flip -----------------------------------------------------


def test_single_bit_flips_in_manifest_are_always_detected(run: Run) -> None:
    """The manifest carries its own checksum: a flip anywhere in it (a file's entry, a time, a
    version string, a key's name) fails verification and restore falls back to step 1."""
    path = run.step2 / MANIFEST
    original = path.read_bytes()
    state = _fresh_state()  # every restore below overwrites all of it
    detected = harmless = 0
    for pos in range(len(original)):
        bit = pos % 3  # one flip per byte keeps this fast; the bits vary along the file
        data = bytearray(original)
        data[pos] ^= 1 << bit
        path.write_bytes(bytes(data))
        try:
            verify_checkpoint(run.storage, str(run.step2))
            valid = True
        except CorruptCheckpointError:
            valid = False
        step = CheckpointManager(run.root).restore(state)
        assert step == (2 if valid else 1), (pos, bit, bytes(data[max(pos - 20, 0) : pos + 5]))
        _assert_same_tensors(_tensors(state), run.expected2 if valid else run.expected1)
        detected += not valid
        harmless += valid
    path.write_bytes(original)
    assert detected > 0 and harmless == 0


@pytest.mark.parametrize("name", [INDEX, SHARD])
def test_single_bit_flips_in_index_and_shard_are_always_detected(run: Run, name: str) -> None:
    path = run.step2 / name
    original = path.read_bytes()
    positions = sorted({0, 7, 8, len(original) - 1, *range(0, len(original), len(original) // 40)})
    for pos in positions:
        for bit in (0, 5):
            data = bytearray(original)
            data[pos] ^= 1 << bit
            path.write_bytes(bytes(data))
            with pytest.raises(CorruptCheckpointError, match=name):
                verify_checkpoint(run.storage, str(run.step2))
            with pytest.raises(CorruptCheckpointError, match=name):
                CheckpointManager(run.root).restore(_fresh_state(), step=2)
    path.write_bytes(original)
    state = _fresh_state()
    assert CheckpointManager(run.root).restore(state) == 2
    _assert_same_tensors(_tensors(state), run.expected2)


# -- things in the root that are not (damaged) checkpoints ---------------------------------------


def test_stray_files_in_checkpoint_dir_do_not_invalidate_it(run: Run) -> None:
    (run.step2 / "notes.txt").write_text("written by a curious human")
    (run.step2 / "rank_00001.json").write_bytes(b"not listed in the manifest")
    (run.step2 / "subdir").mkdir()
    (run.step2 / "subdir" / "x").write_bytes(b"x")
    assert verify_checkpoint(run.storage, str(run.step2)).step == 2
    state = _fresh_state()
    assert CheckpointManager(run.root).restore(state) == 2
    _assert_same_tensors(_tensors(state), run.expected2)


def test_stray_entries_in_root_are_not_checkpoints(run: Run) -> None:
    root = Path(run.root)
    (root / "step_0000000009.txt").write_text("not a checkpoint")
    (root / "step_abc").mkdir()
    (root / "README").write_text("hello")
    state = _fresh_state()
    assert CheckpointManager(run.root).restore(state) == 2
    _assert_same_tensors(_tensors(state), run.expected2)


def test_uncommitted_newer_checkpoint_without_manifest_is_skipped(run: Run) -> None:
    """A step directory that never got its manifest (e.g. copied by hand, half) is not used."""
    partial = Path(run.root) / "step_0000000003"
    partial.mkdir()
    shutil.copyfile(run.step2 / INDEX, partial / INDEX)
    shutil.copyfile(run.step2 / SHARD, partial / SHARD)
    state = _fresh_state()
    assert CheckpointManager(run.root).restore(state) == 2
    _assert_same_tensors(_tensors(state), run.expected2)


def test_temp_dir_of_crashed_save_is_never_chosen_and_is_removed_by_a_new_manager(
    run: Run,
) -> None:
    root = Path(run.root)
    manager = CheckpointManager(run.root)
    # A complete-looking step-3 checkpoint that was never published: even with a manifest
    # that verifies, a temp directory must not be restored from.
    tmp = root / ".tmp-step_0000000003-0123456789ab"
    shutil.copytree(run.step2, tmp)
    trash = root / f".trash-{STEP2}-deadbeef"
    shutil.copytree(run.step1, trash)
    assert [step for step, _ in committed_steps(run.storage, run.root)] == [2, 1]
    state = _fresh_state()
    assert manager.restore(state) == 2
    _assert_same_tensors(_tensors(state), run.expected2)
    manager.close()

    CheckpointManager(run.root).close()
    assert not tmp.exists()
    assert not trash.exists()
    assert sorted(p.name for p in root.iterdir()) == [STEP1, STEP2]


def test_checkpoint_whose_manifest_disagrees_with_its_directory_name_is_skipped(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    shutil.copytree(run.step1, Path(run.root) / "step_0000000003")
    state = _fresh_state()
    with caplog.at_level(logging.WARNING, logger="crashproof.checkpoint"):
        assert CheckpointManager(run.root).restore(state) == 2
    _assert_same_tensors(_tensors(state), run.expected2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 3" in w and "step 1" in w for w in warnings), warnings
    # Asked for explicitly, it is corrupt, and nothing is loaded.
    state = _fresh_state()
    untouched = _tensors(state)
    with pytest.raises(CorruptCheckpointError, match="step 1"):
        CheckpointManager(run.root).restore(state, step=3)
    _assert_same_tensors(_tensors(state), untouched)


# -- a valid checkpoint that does not fit the live state ----------------------------------------


def test_restore_into_model_of_different_shape_raises_and_changes_nothing(run: Run) -> None:
    state = _fresh_state(hidden=5)
    assert state.optimizer is not None
    before = _tensors(state)
    lr_before = [g["lr"] for g in state.optimizer.param_groups]
    rng_before = torch.get_rng_state()
    with pytest.raises(StateMismatchError, match=r"0\.weight"):
        CheckpointManager(run.root).restore(state)
    _assert_same_tensors(_tensors(state), before)
    assert [g["lr"] for g in state.optimizer.param_groups] == lr_before
    assert torch.equal(torch.get_rng_state(), rng_before)
    # And it does not quietly fall back to an older checkpoint either.
    with pytest.raises(StateMismatchError, match=r"0\.weight"):
        CheckpointManager(run.root).restore(state, step=1)
    _assert_same_tensors(_tensors(state), before)


# -- a reader racing the writer's retention --------------------------------------------------


def _racing_reader(
    monkeypatch: pytest.MonkeyPatch, root: Path, writer: CheckpointManager, steps: list[int]
) -> CheckpointManager:
    """A read-only manager whose first candidate read comes after ``writer`` committed ``steps``
    (and its retention removed what it lets go): the reader's listing is out of date."""
    reader = CheckpointManager(root, handle_signals=False, read_only=True)
    load = Restorer._load_candidate
    raced: list[bool] = []

    def late(self: Restorer, *args: Any, **kwargs: Any) -> Any:
        if self is reader._restorer and not raced:
            raced.append(True)
            for step in steps:
                writer.save(step, _fresh_state())
            writer.wait()
        return load(self, *args, **kwargs)

    monkeypatch.setattr(Restorer, "_load_candidate", late)
    return reader


@pytest.mark.parametrize("newer", [[2], [2, 3]], ids=["one-newer", "two-newer"])
def test_a_reader_whose_candidate_vanished_restores_the_newer_checkpoint_not_step_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, newer: list[int]
) -> None:
    """The reported race: the reader lists step 1; the writer commits 2 and removes 1; the read
    of 1 finds it missing. The reader lists again instead of starting over from step 0."""
    with CheckpointManager(
        tmp_path, handle_signals=False, async_save=False, keep=KeepLast(1)
    ) as writer:
        writer.save(1, _fresh_state())
        reader = _racing_reader(monkeypatch, tmp_path, writer, newer)
        with reader:
            assert reader.restore(_fresh_state()) == newer[-1]
    assert [s for s, _ in committed_steps(LocalStorage(), str(tmp_path))] == [newer[-1]]


def test_a_reader_does_not_fall_back_past_a_newer_checkpoint_when_its_candidate_vanished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention that keeps an old milestone (1) but removes 2 once 3 is committed: the reader
    listed [2, 1]; 2 vanished; it restores 3, not 1."""
    with CheckpointManager(
        tmp_path, handle_signals=False, async_save=False, keep=KeepLast(1) | KeepEvery(1000)
    ) as writer:
        writer.save(1000, _fresh_state())
        writer.save(1001, _fresh_state())
        reader = _racing_reader(monkeypatch, tmp_path, writer, [1002])
        with reader:
            assert reader.restore(_fresh_state()) == 1002


def test_a_step_asked_for_that_vanished_is_an_error_not_step_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(
        tmp_path, handle_signals=False, async_save=False, keep=KeepLast(1)
    ) as writer:
        writer.save(1, _fresh_state())
        reader = _racing_reader(monkeypatch, tmp_path, writer, [2])
        with reader, pytest.raises(CorruptCheckpointError, match="missing"):
            reader.restore(_fresh_state(), step=1)
