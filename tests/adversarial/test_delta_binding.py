"""A delta is bound to the exact base it was taken against, and is rebuilt and checked before a
single live tensor is written.

The reported sequence: full 5, delta 6 on it; 5 gets corrupt; a restart falls back to 4 and saves
a new full 5; it crashes before saving 6. The delta 6 on disk belongs to the old 5. Every restart
must now skip it (restore the new 5) without touching the live tensors on the way, and asking for
it by step must fail with a reason while leaving the live state as it was.

The attacks beyond it: deltas without the binding (written before it was recorded) whose base is
another checkpoint, whose blob decodes to other bytes or not at all, whose ``same`` entries or
shapes disagree with the base, and a base saved again with the very same tensors. Hostile files
have their checksums recomputed, so only the structure stands between them and a restore.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from torch import nn

import crashproof as cp
from crashproof.checkpoint import verify_checkpoint
from crashproof.checkpoint.format._fields import dumps
from crashproof.checkpoint.format._hashing import digest
from crashproof.checkpoint.format._manifest import seal_manifest
from crashproof.checkpoint.format._names import MANIFEST_NAME, checkpoint_dir_name
from crashproof.checkpoint.format._shard_file import shard_checksum
from crashproof.storage import LocalStorage

SHARD, INDEX = "rank_00000.safetensors", "rank_00000.json"


# -- a small run whose deltas hold all three kinds of entries --------------------------------


def _fresh(seed: int = 1) -> tuple[nn.Module, torch.optim.Optimizer, cp.TrainState]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(400, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    model[1].requires_grad_(False)  # frozen: a "same" entry in every delta
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer, cp.TrainState(model=model, optimizer=optimizer)


def _values(state: cp.TrainState) -> dict[str, torch.Tensor]:
    assert state.model is not None and state.optimizer is not None
    values = {f"model/{k}": v.clone() for k, v in state.model.state_dict().items()}
    for i, s in state.optimizer.state_dict()["state"].items():
        values.update({f"opt/{i}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return values


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, data_seed: int = 0
) -> None:
    gen = torch.Generator().manual_seed(1000 * data_seed + step)
    model(torch.randint(0, 400, (8, 3), generator=gen)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _train(
    root: Path, steps: range, *, async_save: bool = False
) -> dict[int, dict[str, torch.Tensor]]:
    model, optimizer, train_state = _fresh(0)
    saved = {}
    with cp.CheckpointManager(
        root,
        handle_signals=False,
        delta=cp.Delta(full_every=2),
        keep=cp.KeepAll(),
        async_save=async_save,
    ) as ckpt:
        for step in steps:
            _step(model, optimizer, step)
            ckpt.save(step, train_state)
            saved[step] = _values(train_state)
    return saved


def _dir(root: Path, step: int) -> Path:
    return root / checkpoint_dir_name(step)


def _manifest(ckpt: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ckpt / MANIFEST_NAME).read_bytes())
    return data


def _flip_a_tensor_byte(ckpt: Path) -> None:
    shard = ckpt / SHARD
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))


def _reseal(ckpt: Path, index: dict[str, Any] | None = None) -> None:
    """Recompute every checksum of a one-rank checkpoint from its bytes (with ``index`` as its
    new rank index), the way an attacker who knows the format would."""
    manifest = _manifest(ckpt)
    index = index if index is not None else json.loads((ckpt / INDEX).read_bytes())
    shard = (ckpt / SHARD).read_bytes()
    for t in index["tensors"]:
        t["checksum"] = digest(shard[t["offset"] : t["offset"] + t["nbytes"]])
    order = sorted(index["tensors"], key=lambda t: t["offset"])
    header = shard[: order[0]["offset"]] if order else shard
    index_bytes = dumps(index)
    (ckpt / INDEX).write_bytes(index_bytes)
    manifest["files"][SHARD] = {
        "size": len(shard),
        "checksum": shard_checksum(header, [t["checksum"] for t in order]),
        "scheme": "tensors",
    }
    manifest["files"][INDEX] = {"size": len(index_bytes), "checksum": digest(index_bytes)}
    (ckpt / MANIFEST_NAME).write_bytes(seal_manifest(manifest))


def _restore(root: Path, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    _, _, state = _fresh()
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        got = ckpt.restore(state, step)
    return got, _values(state)


def _refused_untouched(root: Path, step: int, match: str) -> None:
    """Restoring ``step`` explicitly fails with ``match`` and leaves every live tensor as it was;
    ``crashproof verify`` (``verify_checkpoint``) refuses it for the same reason."""
    _, _, state = _fresh()
    before = _values(state)
    with (
        cp.CheckpointManager(root, handle_signals=False) as ckpt,
        pytest.raises(cp.CorruptCheckpointError, match=match) as restored,
    ):
        ckpt.restore(state, step)
    assert _equal(_values(state), before), "a refused delta wrote into the live tensors"
    with pytest.raises(cp.CorruptCheckpointError, match=match) as verified:
        verify_checkpoint(LocalStorage(), str(_dir(root, step)))
    assert str(verified.value) in str(restored.value)  # one check, one reason


@pytest.fixture
def resaved(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """The reported sequence, up to the crash: full 5 and delta 6 on it; 5 corrupt; a restart
    falls back to 4 and saves a new full 5 from other data; it dies before saving 6."""
    saved = _train(tmp_path, range(1, 7))
    assert {s: _manifest(_dir(tmp_path, s))["kind"] for s in (4, 5, 6)} == {
        4: "delta",
        5: "full",
        6: "delta",
    }
    _flip_a_tensor_byte(_dir(tmp_path, 5))
    model, optimizer, state = _fresh()
    with cp.CheckpointManager(
        tmp_path, handle_signals=False, delta=cp.Delta(full_every=2), keep=cp.KeepAll()
    ) as ckpt:
        assert ckpt.restore(state) == 4  # 6 (its base is corrupt) and 5 skipped
        assert _equal(_values(state), saved[4])
        _step(model, optimizer, 5, data_seed=1)  # other data than the first time
        ckpt.save(5, state)  # the new 5 (the first save after a restart is full); then it dies
    assert not _equal(_values(state), saved[5])
    saved[5] = _values(state)
    assert _manifest(_dir(tmp_path, 5))["kind"] == "full"
    return tmp_path, saved


# -- the reported sequence ------------------------------------------------------------------------


def test_restore_skips_a_delta_on_a_resaved_base_and_restores_the_new_base(
    resaved: tuple[Path, dict[int, dict[str, torch.Tensor]]], caplog: pytest.LogCaptureFixture
) -> None:
    root, saved = resaved
    for _ in range(2):  # and every later restart the same
        with caplog.at_level(logging.WARNING, logger="crashproof.checkpoint"):
            got, values = _restore(root)
        assert got == 5 and _equal(values, saved[5])
    skipped = [
        r.getMessage() for r in caplog.records if "skipping checkpoint step 6" in r.getMessage()
    ]
    assert skipped and "not the checkpoint the delta was taken against" in skipped[0]


def test_a_delta_on_a_resaved_base_asked_for_by_step_leaves_the_live_tensors_alone(
    resaved: tuple[Path, dict[int, dict[str, torch.Tensor]]],
) -> None:
    root, _ = resaved
    _refused_untouched(root, 6, "not the checkpoint the delta was taken against")


def test_a_delta_without_its_base_binding_is_rebuilt_and_checked_before_anything_is_written(
    resaved: tuple[Path, dict[int, dict[str, torch.Tensor]]],
) -> None:
    """A delta written before the base's manifest was recorded: its checksums alone catch the
    other base, during verification, before the live tensors are touched."""
    root, saved = resaved
    manifest = _manifest(_dir(root, 6))
    del manifest["base_manifest"]
    (_dir(root, 6) / MANIFEST_NAME).write_bytes(seal_manifest(manifest))
    _refused_untouched(root, 6, "rebuilt from its base it has checksum")
    got, values = _restore(root)
    assert got == 5 and _equal(values, saved[5])


@pytest.mark.parametrize("async_save", [False, True])
def test_every_delta_records_the_manifest_of_its_own_base(tmp_path: Path, async_save: bool) -> None:
    saved = _train(tmp_path, range(1, 5), async_save=async_save)
    for delta, base in ((2, 1), (4, 3)):
        manifest = _manifest(_dir(tmp_path, delta))
        assert manifest["base_step"] == base
        assert manifest["base_manifest"] == digest(
            (_dir(tmp_path, base) / MANIFEST_NAME).read_bytes()
        )
        got, values = _restore(tmp_path, delta)
        assert got == delta and _equal(values, saved[delta])


def test_a_base_saved_again_with_the_same_tensors_is_another_checkpoint(tmp_path: Path) -> None:
    """The binding is to the checkpoint, not to its step or its values: a base committed again
    (here: the same files, another commit time) does not carry the old deltas."""
    saved = _train(tmp_path, range(1, 3))
    manifest = _manifest(_dir(tmp_path, 1))
    manifest["created_unix"] += 60.0
    (_dir(tmp_path, 1) / MANIFEST_NAME).write_bytes(seal_manifest(manifest))
    _refused_untouched(tmp_path, 2, "not the checkpoint the delta was taken against")
    got, values = _restore(tmp_path)
    assert got == 1 and _equal(values, saved[1])


# -- hostile deltas: every checksum recomputed ------------------------------------------------------


def _delta_entry(
    ckpt: Path, encoding: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The rank index, one of its delta entries of ``encoding`` and the stored blob's entry."""
    index = json.loads((ckpt / INDEX).read_bytes())
    delta = next(d for d in index["deltas"] if d["encoding"] == encoding)
    return index, delta, index["tensors"][delta["index"]]


def _planes(blob: bytes) -> list[tuple[int, int, int]]:
    """(mode, payload start, payload length) of each plane record of an xor-zstd blob."""
    out, pos = [], 0
    while pos < len(blob):
        mode, length = struct.unpack_from("<BQ", blob, pos)
        out.append((mode, pos + 9, length))
        pos += 9 + length
    return out


@pytest.mark.parametrize(
    "mode", [0, 1], ids=["raw-plane-decodes-to-other-bytes", "zstd-plane-undecodable"]
)
def test_a_hostile_blob_is_caught_before_the_live_tensors_are_written(
    tmp_path: Path, mode: int
) -> None:
    saved = _train(tmp_path, range(1, 3))
    ckpt = _dir(tmp_path, 2)
    index, _, blob_entry = _delta_entry(ckpt, "xor-zstd")
    shard = bytearray((ckpt / SHARD).read_bytes())
    blob = bytes(shard[blob_entry["offset"] : blob_entry["offset"] + blob_entry["nbytes"]])
    _, start, length = next(p for p in _planes(blob) if p[0] == mode and p[2] > 8)
    shard[blob_entry["offset"] + start + length // 2] ^= 0x5A
    (ckpt / SHARD).write_bytes(bytes(shard))
    _reseal(ckpt, index)
    _refused_untouched(tmp_path, 2, "rebuilt from its base|cannot be decoded|plane")
    got, values = _restore(tmp_path)
    assert got == 1 and _equal(values, saved[1])


def test_a_same_entry_whose_checksum_is_not_the_bases_is_refused_from_metadata(
    tmp_path: Path,
) -> None:
    _train(tmp_path, range(1, 3))
    ckpt = _dir(tmp_path, 2)
    index, delta, _ = _delta_entry(ckpt, "same")
    delta["checksum"] = digest(b"another base's frozen layer")
    _reseal(ckpt, index)
    _refused_untouched(tmp_path, 2, "recorded unchanged since the base")


@pytest.mark.parametrize(
    "change",
    [
        {"shape": [2**40]},  # far more than the base tensor (or the disk) holds
        {"shape": [400, 31]},
        {"dtype": "float64"},
    ],
    ids=["huge", "other-shape", "other-dtype"],
)
def test_a_delta_that_does_not_fit_its_base_tensor_is_refused_before_any_read(
    tmp_path: Path, change: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _train(tmp_path, range(1, 3))
    ckpt = _dir(tmp_path, 2)
    index, delta, _ = _delta_entry(ckpt, "xor-zstd")
    delta.update(change)
    _reseal(ckpt, index)
    # Refused from metadata alone: no tensor byte of the delta or its base is read.
    from crashproof.checkpoint.format import _shard_file

    def no_read(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a tensor was read before the delta was found not to fit")

    monkeypatch.setattr(_shard_file.ShardRead, "verify", no_read)
    _refused_untouched(tmp_path, 2, "is a delta of a")


def _replace_blob(ckpt: Path, name: str, blob: bytes) -> None:
    """Store ``blob`` as tensor ``name``'s encoded bytes (its size may change): the shard is
    rebuilt, every offset and checksum recomputed."""
    index = json.loads((ckpt / INDEX).read_bytes())
    shard = (ckpt / SHARD).read_bytes()
    order = sorted(index["tensors"], key=lambda t: t["offset"])
    out = bytearray(shard[: order[0]["offset"]])
    for t in order:
        data = blob if t["name"] == name else shard[t["offset"] : t["offset"] + t["nbytes"]]
        if t["name"] == name:
            t["shape"], t["nbytes"] = [len(data)], len(data)
        t["offset"] = len(out)
        out += data
    (ckpt / SHARD).write_bytes(bytes(out))
    _reseal(ckpt, index)


def _frame_stating(size: int, content: bytes) -> bytes:
    """A zstd frame whose header states ``size`` bytes of content and that holds ``content``
    (one raw block): the header is the attacker's to write."""
    header = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", size)  # single segment
    block = (len(content) << 3 | 1).to_bytes(3, "little")  # last block, raw
    return header + block + content


def _bomb(count: int) -> bytes:
    return _frame_stating(1 << 40, b"x")  # 16 bytes on disk asking for a TiB


def _big_frame(count: int) -> bytes:  # a real frame: 256 MiB of one byte, compressed
    return zstandard.ZstdCompressor(level=3).compress(b"\x01" * (256 << 20))


def _unstated(count: int) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * count)


def _holds_more(count: int) -> bytes:  # states the right size, holds 64 KiB more
    return _frame_stating(count, b"\0" * (count + (64 << 10)))


def _holds_less(count: int) -> bytes:
    return _frame_stating(count, b"\0" * (count // 2))


def _two_frames(count: int) -> bytes:
    frame = zstandard.ZstdCompressor().compress(b"\0" * count)
    return frame + frame


def _trailing(count: int) -> bytes:
    return zstandard.ZstdCompressor().compress(b"\0" * count) + b"garbage"


def _cut_short(count: int) -> bytes:
    return zstandard.ZstdCompressor().compress(bytes(range(256)) * (count // 256 + 1))[:-5]


def _not_zstd(count: int) -> bytes:
    return b"\0" * 32


@pytest.mark.parametrize(
    "frame",
    [_bomb, _big_frame, _unstated, _holds_more, _holds_less, _two_frames, _trailing,
     _cut_short, _not_zstd],
)  # fmt: skip
def test_a_zstd_plane_of_any_other_size_is_refused_before_it_is_decompressed(
    tmp_path: Path, frame: Any
) -> None:
    """The reported cases: python-zstandard ignores the maximum output size when a frame states
    its content size, so a 53 KB file made restore and verify allocate 768 MiB, and a 16-byte
    frame stating a TiB ended in a bare MemoryError (no fallback, every restart dying on it).
    Every frame that does not decode to exactly the plane's size, stated or not, is corrupt:
    refused by restore and verify alike, the live tensors untouched, the restore falling back."""
    saved = _train(tmp_path, range(1, 3))
    ckpt = _dir(tmp_path, 2)
    _, delta, blob_entry = _delta_entry(ckpt, "xor-zstd")
    count = 1
    for n in delta["shape"]:
        count *= n
    itemsize = torch.empty(0, dtype=getattr(torch, delta["dtype"])).element_size()
    hostile = frame(count)
    raw = struct.pack("<BQ", 0, count) + b"\0" * count
    blob = struct.pack("<BQ", 1, len(hostile)) + hostile + raw * (itemsize - 1)
    _replace_blob(ckpt, blob_entry["name"], blob)
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < 4 << 20  # a small file on disk
    _refused_untouched(tmp_path, 2, "plane 0")
    got, values = _restore(tmp_path)
    assert got == 1 and _equal(values, saved[1])


def test_a_delta_whose_base_is_gone_or_is_a_delta_is_skipped(tmp_path: Path) -> None:
    saved = _train(tmp_path, range(1, 5))
    manifest = _manifest(_dir(tmp_path, 4))
    manifest["base_step"] = 2  # a delta itself
    (_dir(tmp_path, 4) / MANIFEST_NAME).write_bytes(seal_manifest(manifest))
    _refused_untouched(tmp_path, 4, "a delta against step 2")
    (_dir(tmp_path, 3) / MANIFEST_NAME).unlink()  # 3 is gone (uncommitted): no base for 4
    manifest["base_step"] = 3
    (_dir(tmp_path, 4) / MANIFEST_NAME).write_bytes(seal_manifest(manifest))
    got, values = _restore(tmp_path)
    assert got == 2 and _equal(values, saved[2])


# -- tensors that share memory: each live byte is written, and each delta applied, once -------


class _TiedLM(nn.Module):
    """A language model whose output head is its embedding (weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.mid(self.emb(x))))
        return out


def _tied(seed: int) -> tuple[_TiedLM, torch.optim.Optimizer, nn.Linear, cp.TrainState]:
    """The tied model, and an extra module sharing a parameter with it (an EMA of ``mid`` that
    starts as the very same tensor)."""
    torch.manual_seed(seed)
    model = _TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shadow = nn.Linear(16, 16)
    shadow.weight = model.mid.weight
    state = cp.TrainState(model=model, optimizer=optimizer, extra={"shadow": shadow})
    return model, optimizer, shadow, state


def _tied_values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    values = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        values.update({f"opt/{i}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return values


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("full_every", [2, 4], ids=["full-every-2", "full-every-4"])
def test_tied_weights_are_restored_bit_for_bit_from_every_full_and_delta_checkpoint(
    tmp_path: Path, async_save: bool, full_every: int
) -> None:
    model, optimizer, _, state = _tied(0)
    saved = {}
    with cp.CheckpointManager(
        tmp_path, handle_signals=False, async_save=async_save,
        delta=cp.Delta(full_every=full_every), keep=cp.KeepAll(),
    ) as ckpt:  # fmt: skip
        for step in range(1, 6):
            gen = torch.Generator().manual_seed(step)
            model(torch.randint(0, 64, (8,), generator=gen)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.save(step, state)
            saved[step] = _tied_values(model, optimizer)
        kinds = {c.step: c.kind for c in ckpt.list()}
    assert "delta" in kinds.values() and "full" in kinds.values()
    for step in range(1, 6):
        fresh, fresh_opt, shadow, fresh_state = _tied(1)
        with cp.CheckpointManager(tmp_path, handle_signals=False, read_only=True) as ckpt:
            assert ckpt.restore(fresh_state, step) == step
        assert _equal(_tied_values(fresh, fresh_opt), saved[step]), f"step {step} ({kinds[step]})"
        # the ties survive: still one tensor each, holding the saved values
        assert fresh.head.weight is fresh.emb.weight and shadow.weight is fresh.mid.weight
        assert torch.equal(shadow.weight, saved[step]["model/mid.weight"])


def test_a_tied_delta_asked_for_on_a_corrupt_base_leaves_the_tied_weights_alone(
    tmp_path: Path,
) -> None:
    model, optimizer, _, state = _tied(0)
    with cp.CheckpointManager(
        tmp_path, handle_signals=False, async_save=False, delta=cp.Delta(full_every=4)
    ) as ckpt:
        for step in range(1, 4):
            model(torch.arange(8)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.save(step, state)
    _flip_a_tensor_byte(_dir(tmp_path, 1))
    fresh, fresh_opt, _, fresh_state = _tied(1)
    before = _tied_values(fresh, fresh_opt)
    with (
        cp.CheckpointManager(tmp_path, handle_signals=False) as ckpt,
        pytest.raises(cp.CorruptCheckpointError, match="base"),
    ):
        ckpt.restore(fresh_state, 3)
    assert _equal(_tied_values(fresh, fresh_opt), before)


class _UntiedLM(_TiedLM):
    """The same model with the head its own tensor: the run before weight tying was added."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = nn.Parameter(torch.randn(64, 16))


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_an_untied_checkpoint_is_refused_by_a_tied_model_before_anything_changes(
    tmp_path: Path, kind: str
) -> None:
    """Two saved values for what is one tensor in the live model: loading both would keep
    either of them silently."""
    torch.manual_seed(0)
    untied = _UntiedLM()
    opt = torch.optim.SGD(untied.parameters(), lr=0.1)
    with cp.CheckpointManager(
        tmp_path, handle_signals=False, async_save=False, delta=cp.Delta(full_every=4)
    ) as ckpt:
        for step in (1, 2):
            untied(torch.arange(8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.save(step, cp.TrainState(model=untied))
    step = 2 if kind == "delta" else 1
    fresh, fresh_opt, _, _ = _tied(1)
    before = _tied_values(fresh, fresh_opt)
    with (
        cp.CheckpointManager(tmp_path, handle_signals=False, read_only=True) as ckpt,
        pytest.raises(
            cp.StateMismatchError, match=r"'model/emb.weight' and 'model/head.weight'.*tied"
        ),
    ):
        ckpt.restore(cp.TrainState(model=fresh), step)
    assert _equal(_tied_values(fresh, fresh_opt), before)


def test_an_untied_checkpoint_whose_two_values_are_equal_restores_into_the_tie(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    untied = _UntiedLM()
    with torch.no_grad():
        untied.head.weight.copy_(untied.emb.weight)
    with cp.CheckpointManager(tmp_path, handle_signals=False, async_save=False) as ckpt:
        ckpt.save(1, cp.TrainState(model=untied))
    fresh, _, _, _ = _tied(1)
    with cp.CheckpointManager(tmp_path, handle_signals=False, read_only=True) as ckpt:
        assert ckpt.restore(cp.TrainState(model=fresh)) == 1
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, untied.emb.weight)


# -- a restore or a rollback inside a manager: the next save is full --------------------------


def _linear_run() -> tuple[nn.Linear, torch.optim.Optimizer, cp.TrainState]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, optimizer, cp.TrainState(model=model, optimizer=optimizer)


def _linear_step(model: nn.Linear, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    model(torch.randn(4, 64, generator=gen)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _all_restore_exactly(root: Path, saved: dict[int, dict[str, torch.Tensor]]) -> None:
    for step, values in saved.items():
        model, optimizer, state = _linear_run()
        with cp.CheckpointManager(root, handle_signals=False, read_only=True) as ckpt:
            assert ckpt.restore(state, step) == step
        assert _equal(_tied_values(model, optimizer), values), f"step {step}"


def test_the_save_after_a_rollback_is_full_and_every_checkpoint_restores(tmp_path: Path) -> None:
    model, optimizer, state = _linear_run()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with cp.CheckpointManager(
        tmp_path, handle_signals=False, async_save=False, delta=cp.Delta(full_every=3)
    ) as ckpt:
        for step in (10, 11, 12, 20, 21):  # full 10, deltas 11 and 12, full 20, delta 21
            _linear_step(model, optimizer, step)
            ckpt.save(step, state)
            saved[step] = _tied_values(model, optimizer)
        assert ckpt.rollback(state, before=20, anomaly_step=21) == 12
        del saved[20], saved[21]
        for step in (13, 14):
            _linear_step(model, optimizer, step)
            ckpt.save(step, state)
            saved[step] = _tied_values(model, optimizer)
        kinds = {c.step: (c.kind, c.base_step) for c in ckpt.list()}
    assert kinds[13] == ("full", None)
    assert all(base is None or (base in kinds and base < step) for step, (_, base) in kinds.items())
    _all_restore_exactly(tmp_path, saved)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_save_after_restoring_an_older_step_is_full_and_every_checkpoint_restores(
    tmp_path: Path, async_save: bool
) -> None:
    model, optimizer, state = _linear_run()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with cp.CheckpointManager(
        tmp_path, handle_signals=False, async_save=async_save,
        delta=cp.Delta(full_every=4), keep=cp.KeepAll(),
    ) as ckpt:  # fmt: skip
        for step in (1, 2, 3, 5, 6):  # full 1, deltas 2 3 on it, full 5, delta 6
            _linear_step(model, optimizer, step)
            ckpt.save(step, state)
            saved[step] = _tied_values(model, optimizer)
        assert ckpt.restore(state, step=2) == 2
        for step in (7, 8):
            _linear_step(model, optimizer, step)
            ckpt.save(step, state)
            saved[step] = _tied_values(model, optimizer)
        ckpt.wait()
        kinds = {c.step: (c.kind, c.base_step) for c in ckpt.list()}
    assert kinds[7] == ("full", None) and kinds[8] == ("delta", 7)
    _all_restore_exactly(tmp_path, saved)
