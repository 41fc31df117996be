"""Delta checkpoints: between full checkpoints only what changed is stored, losslessly; a restore
rebuilds every tensor bit for bit and checks it; a bad base makes its deltas fall back; retention
never orphans a delta."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import crashproof as cp
from crashproof.checkpoint.format._names import MANIFEST_NAME, checkpoint_dir_name
from tests.warm_ranks import crashproof_cli


def _model() -> nn.Module:
    model = nn.Sequential(nn.Embedding(500, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    model[1].requires_grad_(False)  # a frozen layer: "same" in every delta
    return model


def _fresh(seed: int = 1) -> tuple[nn.Module, torch.optim.Optimizer, cp.TrainState]:
    torch.manual_seed(seed)
    model = _model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer, cp.TrainState(model=model, optimizer=optimizer)


def _values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    values = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        values.update({f"opt/{i}/{k}": v.clone() for k, v in s.items()})
    return values


def _train(
    root: Path, steps: int, *, seed: int = 0, **manager_args: object
) -> dict[int, dict[str, torch.Tensor]]:
    """Save after every step, keeping every checkpoint; returns every step's values as saved."""
    model, optimizer, state = _fresh(seed)
    saved = {}
    manager_args.setdefault("keep", cp.KeepAll())
    with cp.CheckpointManager(root, handle_signals=False, **manager_args) as ckpt:  # type: ignore[arg-type]
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 500, (8, 3), generator=torch.Generator().manual_seed(step))
            model(tokens).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.save(step, state)
            saved[step] = _values(model, optimizer)
    return saved


def _restored(root: Path, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    model, optimizer, state = _fresh()
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        got = ckpt.restore(state, step)
    return got, _values(model, optimizer)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _kinds(root: Path) -> dict[int, tuple[str, int | None]]:
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        return {i.step: (i.kind, i.base_step) for i in ckpt.list()}


@pytest.mark.parametrize("async_save", [True, False])
def test_every_delta_restores_bit_for_bit(tmp_path: Path, async_save: bool) -> None:
    saved = _train(tmp_path, 9, delta=cp.Delta(full_every=4), async_save=async_save)
    kinds = _kinds(tmp_path)
    assert kinds == {
        1: ("full", None), 2: ("delta", 1), 3: ("delta", 1), 4: ("delta", 1),
        5: ("full", None), 6: ("delta", 5), 7: ("delta", 5), 8: ("delta", 5), 9: ("full", None),
    }  # fmt: skip
    for step in range(1, 10):
        got, values = _restored(tmp_path, step)
        assert got == step and _equal(values, saved[step]), step


def test_a_delta_is_much_smaller_than_its_base(tmp_path: Path) -> None:
    _train(tmp_path, 3, delta=cp.Delta(full_every=10))
    with cp.CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        sizes = {i.step: i.size_bytes for i in ckpt.list()}
    # The frozen layer costs nothing, and each step touches a few embedding rows.
    assert sizes[2] * 3 < sizes[1] and sizes[3] * 3 < sizes[1]


def _corrupt_a_tensor(ckpt_dir: Path) -> None:
    shard = next(ckpt_dir.glob("rank_*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_a_corrupt_base_makes_its_deltas_fall_back_to_an_older_restorable_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _train(tmp_path, 7, delta=cp.Delta(full_every=4), keep=cp.KeepAll())
    _corrupt_a_tensor(tmp_path / checkpoint_dir_name(5))  # the base of 6 and 7
    got, values = _restored(tmp_path)
    assert got == 4 and _equal(values, saved[4])  # 4 is a delta on the intact base 1
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 3  # 7, 6 (base corrupt) and 5 (corrupt)
    assert "the base of this delta is corrupt" in skipped[0]


def test_a_missing_base_makes_its_deltas_fall_back(tmp_path: Path) -> None:
    saved = _train(tmp_path, 7, delta=cp.Delta(full_every=4))
    (tmp_path / checkpoint_dir_name(5) / MANIFEST_NAME).unlink()
    got, values = _restored(tmp_path)
    assert got == 4 and _equal(values, saved[4])
    with pytest.raises(cp.CorruptCheckpointError, match="a delta against step 5"):
        _restored(tmp_path, 7)


def test_a_delta_on_another_base_of_the_same_step_is_refused(tmp_path: Path) -> None:
    _train(tmp_path / "a", 3, delta=cp.Delta(full_every=4))
    _train(tmp_path / "b", 1, seed=7)  # another run's step 1: same names and shapes, other values
    base_a, base_b = (
        tmp_path / "a" / checkpoint_dir_name(1),
        tmp_path / "b" / checkpoint_dir_name(1),
    )
    for f in base_b.iterdir():  # swap in a valid full checkpoint that is not the base
        (base_a / f.name).write_bytes(f.read_bytes())
    data = json.loads((base_a / MANIFEST_NAME).read_text())
    assert data["kind"] == "full"
    with pytest.raises(cp.CorruptCheckpointError, match="not the checkpoint the delta was taken"):
        _restored(tmp_path / "a", 3)


def test_retention_keeps_every_base_a_kept_delta_needs(tmp_path: Path) -> None:
    saved = _train(tmp_path, 7, delta=cp.Delta(full_every=5), keep=cp.KeepLast(2))
    assert _kinds(tmp_path) == {6: ("full", None), 7: ("delta", 6)}
    saved = _train(tmp_path / "b", 4, delta=cp.Delta(full_every=5), keep=cp.KeepLast(1))
    assert _kinds(tmp_path / "b") == {1: ("full", None), 4: ("delta", 1)}
    got, values = _restored(tmp_path / "b")
    assert got == 4 and _equal(values, saved[4])


def test_prune_keeps_the_bases_too(tmp_path: Path) -> None:
    _train(tmp_path, 4, delta=cp.Delta(full_every=5))
    with cp.CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        assert ckpt.prune(cp.KeepLast(1)) == [2, 3]
    assert _kinds(tmp_path) == {1: ("full", None), 4: ("delta", 1)}


def test_ls_json_shows_kind_base_and_size(tmp_path: Path) -> None:
    _train(tmp_path, 2, delta=cp.Delta(full_every=5))
    out = crashproof_cli("ls", tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["step"]: r for r in json.loads(out.stdout)}
    assert rows[2]["kind"] == "delta" and rows[2]["base_step"] == 1
    assert rows[1]["kind"] == "full" and rows[1]["base_step"] is None
    assert 0 < rows[2]["size_bytes"] < rows[1]["size_bytes"]
    text = crashproof_cli("ls", tmp_path).stdout
    assert "delta (base 1)" in text


def test_verify_rebuilds_the_deltas(tmp_path: Path) -> None:
    _train(tmp_path, 3, delta=cp.Delta(full_every=5))
    ok = crashproof_cli("verify", tmp_path, "--step", "3")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    _corrupt_a_tensor(tmp_path / checkpoint_dir_name(1))
    bad = crashproof_cli("verify", tmp_path, "--step", "3")
    assert bad.returncode != 0 and "base" in bad.stdout + bad.stderr


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(cp.ConfigError, match="full_every"):
        cp.Delta(full_every=1)


@pytest.mark.parametrize(
    "damage",
    [
        lambda blob: blob[:-1],  # truncated
        lambda blob: b"\x07" + blob[1:],  # unknown mode
        lambda blob: blob + b"\x00",  # trailing bytes
        lambda blob: blob[:1] + (10**12).to_bytes(8, "little") + blob[9:],  # length beyond the blob
        lambda blob: blob[:9] + bytes(len(blob) - 9),  # a zeroed zstd frame
    ],
)
def test_a_hostile_delta_blob_is_refused_cleanly(damage: object) -> None:
    from crashproof.checkpoint.format._hashing import digest
    from crashproof.checkpoint.format._shard_file import tensor_bytes
    from crashproof.checkpoint.save._delta import DeltaBase, apply_delta, encode_delta

    base = torch.randn(4096)
    now = base * (1 + 1e-3 * torch.randn(4096))
    stored, [entry] = encode_delta(
        [("w", now)], DeltaBase(0, {"w": base}, {"w": digest(tensor_bytes(base))}), cp.Delta()
    )
    blob = bytes(tensor_bytes(stored[0][1]))
    target = base.clone()
    apply_delta(entry, torch.frombuffer(bytearray(blob), dtype=torch.uint8), target, "w")
    assert torch.equal(target, now)
    bad = damage(blob)  # type: ignore[operator]
    with pytest.raises(cp.CorruptCheckpointError):
        apply_delta(entry, torch.frombuffer(bytearray(bad), dtype=torch.uint8), base.clone(), "w")


def _tensor_pairs() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, base, now) pairs on every side of the encoder's choices: planes shorter and longer
    than the sample that decides zstd (64 KiB), a compressible start and a random rest (zstd
    tried, then the plane kept as is), a random start and a compressible rest, 1-, 2-, 4- and
    8-byte elements, NaN payloads and -0.0 changed bit for bit, and tensors left as they were."""
    g = torch.Generator().manual_seed(0)
    pairs = []
    for count in (1, 7, 4096, 65536, 4 * 65536, 4 * 65536 + 1, 300_000):
        for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.uint8):
            base = torch.randn(count, generator=g).to(dtype)
            now = base.clone()
            if count > 8:
                now[: count // 3] = torch.randn(count // 3, generator=g).to(dtype)
            else:
                now[0] += 1
            pairs.append((f"{dtype}-{count}", base, now))
    big = 4 * 65536 + 4096
    for name, head_random in (
        ("compressible-then-random", False),
        ("random-then-compressible", True),
    ):
        base = torch.zeros(big, dtype=torch.uint8)
        noise = torch.randint(0, 256, (big,), generator=g, dtype=torch.uint8)
        now = base.clone()
        if head_random:
            now[:65536] = noise[:65536]
        else:
            now[65536:] = noise[65536:]
        pairs.append((name, base, now))
    nan = torch.full((1000,), float("nan"))
    other_nan = nan.view(torch.int32).bitwise_or(1).view(torch.float32)
    pairs.append(("nan-payload", nan, other_nan))
    pairs.append(("negative-zero", torch.zeros(1000), -torch.zeros(1000)))
    pairs.append(("unchanged", torch.arange(70_000.0), torch.arange(70_000.0)))
    return pairs


def test_the_encoding_rebuilds_every_tensor_bit_for_bit() -> None:
    from crashproof.checkpoint.format._hashing import digest
    from crashproof.checkpoint.format._shard_file import tensor_bytes
    from crashproof.checkpoint.save._delta import DeltaBase, apply_delta, encode_delta

    pairs = _tensor_pairs()
    base = DeltaBase(
        0,
        {name: b for name, b, _ in pairs},
        {name: digest(tensor_bytes(b)) for name, b, _ in pairs},
    )
    stored, entries = encode_delta([(name, now) for name, _, now in pairs], base, cp.Delta())
    by_index = {entry.index: entry for entry in entries}
    kinds = {}
    for i, (name, then, now) in enumerate(pairs):
        entry = by_index.get(i)
        if entry is None:  # stored as is: exactly the tensor
            assert stored[i][1] is now, name
            kinds[name] = "as is"
            continue
        target = then.clone()
        apply_delta(entry, stored[i][1], target, name)
        assert bytes(tensor_bytes(target)) == bytes(tensor_bytes(now)), name
        kinds[name] = entry.encoding
    assert kinds["unchanged"] == "same"
    assert kinds["nan-payload"] == kinds["negative-zero"] == "xor-zstd"  # bits, not values
    assert kinds["compressible-then-random"] == "xor-zstd"
    assert "xor-zstd" in {kinds[f"{torch.float32}-{n}"] for n in (65536, 300_000)}
