"""The ``crashproof`` command line against real checkpoints: ls, verify, inspect, prune, export.

ls, verify, a missing root and one export go through the installed console script in a real
process; the rest call ``crashproof.cli.main`` in-process to keep the file fast (each process
imports torch).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import crashproof
from crashproof.checkpoint import verify_checkpoint
from crashproof.cli import main

STEPS = (1, 2, 3)
SHARD = "rank_00000.safetensors"


@dataclass
class Run:
    root: Path
    models: dict[int, dict[str, torch.Tensor]]
    """The model's state_dict at each saved step."""
    created_between: tuple[float, float]

    def ckpt(self, step: int) -> Path:
        return self.root / f"step_{step:010d}"

    def shard(self, step: int) -> Path:
        return self.ckpt(step) / SHARD


@pytest.fixture
def run(tmp_path: Path) -> Run:
    """A root with checkpoints of steps 1, 2 and 3 of a small model trained with AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = crashproof.TrainState(model=model, optimizer=opt)
    root = tmp_path / "run"
    models = {}
    started = time.time()
    with crashproof.CheckpointManager(str(root)) as manager:
        for step in STEPS:
            model(torch.randn(3, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            manager.save(step, state)
            models[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return Run(root, models, (started, time.time()))


@pytest.fixture(autouse=True)
def _keep_sigpipe() -> Iterator[None]:
    """``main`` resets SIGPIPE to the default; give pytest its handler back."""
    saved = signal.getsignal(signal.SIGPIPE)
    yield
    signal.signal(signal.SIGPIPE, saved)


def _console_script() -> list[str]:
    script = Path(sys.executable).parent / "crashproof"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "crashproof.cli"]  # installed without its scripts directory


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_console_script(), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _tensor_range(shard: Path, name: str) -> tuple[int, int]:
    """Absolute byte range of tensor ``name`` in a safetensors file."""
    raw = shard.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + header_len])[name]["data_offsets"]
    return 8 + header_len + begin, 8 + header_len + end


def flip_bit(shard: Path, tensor: str = "model/0.weight") -> None:
    """Flip one bit in the middle of ``tensor``'s bytes: same size, wrong content."""
    begin, end = _tensor_range(shard, tensor)
    data = bytearray(shard.read_bytes())
    data[(begin + end) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def truncate(shard: Path) -> None:
    os.truncate(shard, shard.stat().st_size - 16)


# -- ls -------------------------------------------------------------------------------------------


def test_ls_prints_a_table_row_per_checkpoint_newest_first(run: Run) -> None:
    truncate(run.shard(1))
    result = cli("ls", run.root)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.strip().splitlines()
    assert header.split()[:2] == ["step", "created"]
    assert "valid" in header
    assert [int(r.split()[0]) for r in rows] == [3, 2, 1]
    assert rows[0].split()[-1] == "yes"
    assert rows[1].split()[-1] == "yes"
    assert "full" in rows[0]
    assert "NO" in rows[2].split()
    assert SHARD in rows[2]


def test_ls_json_lists_one_typed_object_per_checkpoint(run: Run) -> None:
    truncate(run.shard(1))
    result = cli("ls", run.root, "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert isinstance(listed, list)
    assert [entry["step"] for entry in listed] == [3, 2, 1]
    for entry in listed:
        assert {"step", "path", "created", "size_bytes", "kind", "valid"} <= set(entry)
        assert type(entry["step"]) is int
        assert type(entry["size_bytes"]) is int
        assert type(entry["valid"]) is bool
        assert entry["path"] == str(run.ckpt(entry["step"]).resolve())
    for entry in listed[:2]:
        assert entry["valid"] is True
        assert entry["kind"] == "full"
        assert isinstance(entry["created"], float)
        low, high = run.created_between
        assert low - 1 <= entry["created"] <= high + 1
        files = {p.name: p.stat().st_size for p in run.ckpt(entry["step"]).iterdir()}
        data_bytes = sum(size for name, size in files.items() if name != "manifest.json")
        assert data_bytes <= entry["size_bytes"] <= sum(files.values())
    assert listed[2]["valid"] is False
    assert SHARD in listed[2]["problem"]


# -- verify ---------------------------------------------------------------------------------------


def test_verify_exits_0_when_every_checkpoint_is_valid(run: Run) -> None:
    result = cli("verify", run.root)
    assert result.returncode == 0, result.stdout + result.stderr
    for step in STEPS:
        assert f"step {step}: valid" in result.stdout


def test_verify_exits_1_and_names_the_file_with_a_flipped_bit(run: Run) -> None:
    flip_bit(run.shard(2))
    result = cli("verify", run.root)
    assert result.returncode == 1
    assert "step 3: valid" in result.stdout
    assert "step 1: valid" in result.stdout
    bad = next(line for line in result.stdout.splitlines() if line.startswith("step 2:"))
    assert "INVALID" in bad
    assert str(run.shard(2).resolve()) in bad


def test_verify_of_a_missing_step_exits_2(run: Run) -> None:
    result = cli("verify", run.root, "--step", "7")
    assert result.returncode == 2
    assert "no checkpoint of step 7" in result.stderr
    assert result.stdout == ""


def _removed_when_read(monkeypatch: pytest.MonkeyPatch, name: str, step_dir: Path) -> None:
    """Play a run's retention removing ``step_dir`` (renamed aside, then deleted, as a writer
    does) just as the command's ``name`` function of ``crashproof.cli._checkpoints`` reads."""
    from crashproof.cli import _checkpoints
    from crashproof.storage import LocalStorage

    original = getattr(_checkpoints, name)

    def removing(*args: Any, **kwargs: Any) -> Any:
        LocalStorage().remove(str(step_dir))
        return original(*args, **kwargs)

    monkeypatch.setattr(_checkpoints, name, removing)


def test_a_checkpoint_removed_while_verified_is_no_invalid_checkpoint(
    run: Run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run writing the root removes old checkpoints (its retention) while ``verify`` or ``ls``
    reads them: a monitoring ``verify`` must not call that a damaged checkpoint (exit 1). A
    checkpoint that is still there but damaged still is one."""
    _removed_when_read(monkeypatch, "verify_checkpoint", run.ckpt(2))
    assert main(["verify", str(run.root)]) == 0
    said = capsys.readouterr()
    assert said.out.splitlines() == ["step 3: valid", "step 1: valid"]
    assert "step 2 was removed while it was verified" in said.err
    monkeypatch.undo()

    (run.ckpt(1) / "manifest.json").unlink()  # damaged, and still there
    assert main(["verify", str(run.root)]) == 1
    assert "step 1: INVALID" in capsys.readouterr().out


def test_verify_latest_takes_the_newest_there_is_when_its_newest_is_removed(
    run: Run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _removed_when_read(monkeypatch, "verify_checkpoint", run.ckpt(3))
    assert main(["verify", "--latest", str(run.root)]) == 0
    assert capsys.readouterr().out.splitlines() == ["step 2: valid"]
    # asked for one step, which was removed: no other step is verified in its place
    _removed_when_read(monkeypatch, "verify_checkpoint", run.ckpt(2))
    assert main(["verify", "--latest", "--step", "2", str(run.root)]) == 2
    said = capsys.readouterr()
    assert said.out == "" and "were removed while they were verified" in said.err


def test_ls_leaves_out_a_checkpoint_removed_while_listed(
    run: Run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for flags in (["--json"], ["--json", "--verify"]):
        root = run.root.parent / f"copy{len(flags)}"
        shutil.copytree(run.root, root)
        _removed_when_read(monkeypatch, "list_checkpoints", root / "step_0000000002")
        assert main(["ls", *flags, str(root)]) == 0
        said = capsys.readouterr()
        assert [row["step"] for row in json.loads(said.out)] == [3, 1], flags
        assert all(row["valid"] for row in json.loads(said.out))
        assert "step 2 was removed while it was listed" in said.err
        monkeypatch.undo()


def test_a_file_named_like_a_checkpoint_is_no_storage_refusal_and_blocks_nothing(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``step_*`` that is a file (not crashproof's) is named as no committed checkpoint; it is
    never read as the storage refusing a read (exit 74, "fix the access"), and the commands go
    on to the real checkpoints: inspect and export take the newest that reads."""
    (run.root / "step_0000000004").write_text("x")
    assert main(["verify", str(run.root)]) == 1
    said = capsys.readouterr()
    assert "step 4: INVALID" in said.out and "never committed" in said.out
    assert "step 3: valid" in said.out and "refused" not in said.out + said.err
    assert main(["verify", "--step", "3", str(run.root)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(run.root)]) == 0
    said = capsys.readouterr()
    assert "skipping step 4" in said.err and "step 3, kind full" in said.out
    assert main(["inspect", "--step", "4", str(run.root)]) == 1
    capsys.readouterr()
    out = tmp_path / "w.safetensors"
    assert main(["export", str(run.root), "-o", str(out)]) == 0
    assert "of step 3" in capsys.readouterr().out and out.exists()


def test_nonexistent_root_exits_2_with_a_message_on_stderr(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-root"
    result = cli("ls", missing)
    assert result.returncode == 2
    assert result.stdout == ""
    assert str(missing) in result.stderr
    assert "no checkpoints" in result.stderr
    assert "Traceback" not in result.stderr
    assert not missing.exists(), "looking at a root must not create it"


@pytest.mark.parametrize(
    "args",
    [
        ["verify"],
        ["inspect"],
        ["prune", "--keep-last", "1"],
        ["export", "-o", "out.safetensors"],
    ],
)
def test_every_command_exits_2_on_a_nonexistent_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    missing = tmp_path / "no-such-root"
    command, *options = args
    assert main([command, str(missing), *options]) == 2
    captured = capsys.readouterr()
    assert str(missing) in captured.err
    assert captured.out == ""


# -- inspect --------------------------------------------------------------------------------------


def test_inspect_shows_tensor_names_shapes_and_dtypes(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(run.root), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 2" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if "model/" in line}
    assert set(rows) == {f"model/{k}" for k in run.models[2]}
    for name, tensor in run.models[2].items():
        row = rows[f"model/{name}"]
        assert row[1] == "float32"
        assert str(list(tensor.shape)) in " ".join(row)
    assert "optimizer/state/0/exp_avg" in out


def test_inspect_json_reports_manifest_and_tensors(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(run.root), "--step", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["manifest"]["step"] == 2
    assert report["manifest"]["kind"] == "full"
    assert set(report["manifest"]["files"]) == {SHARD, "rank_00000.json"}
    (rank,) = report["ranks"]
    assert rank["rank"] == 0
    assert {"model", "optimizer"} <= set(rank["components"])
    tensors = {t["name"]: t for t in rank["tensors"]}
    for name, tensor in run.models[2].items():
        entry = tensors[f"model/{name}"]
        assert entry["dtype"] == "float32"
        assert entry["shape"] == list(tensor.shape)
        assert entry["nbytes"] == tensor.numel() * 4


# -- prune ----------------------------------------------------------------------------------------


def test_prune_dry_run_removes_nothing_then_prune_keeps_only_the_newest(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["prune", str(run.root), "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove step 2" in out
    assert "would remove step 1" in out
    assert all(run.ckpt(step).is_dir() for step in STEPS)

    assert main(["prune", str(run.root), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "removing step 2" in out
    assert "removing step 1" in out
    assert sorted(p.name for p in run.root.iterdir()) == [run.ckpt(3).name]
    verify_checkpoint(crashproof.LocalStorage(), str(run.ckpt(3)))


def test_prune_keeps_the_newest_valid_checkpoint_when_the_newest_is_truncated(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    truncate(run.shard(3))
    assert main(["prune", str(run.root), "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert run.ckpt(2).is_dir(), "the newest valid checkpoint was pruned"
    verify_checkpoint(crashproof.LocalStorage(), str(run.ckpt(2)))
    assert not run.ckpt(1).exists()


def test_prune_keeps_the_newest_valid_checkpoint_when_the_newest_has_a_flipped_bit(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_bit(run.shard(3))
    # CheckpointManager.prune makes the same choice as the command.
    with crashproof.CheckpointManager(str(run.root)) as manager:
        assert manager.prune(crashproof.KeepLast(1), dry_run=True) == [1]
    assert main(["prune", str(run.root), "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert run.ckpt(2).is_dir(), "the newest valid checkpoint was pruned"
    verify_checkpoint(crashproof.LocalStorage(), str(run.ckpt(2)))
    assert not run.ckpt(1).exists()


# -- export ---------------------------------------------------------------------------------------


def test_export_writes_the_newest_model_weights_as_safetensors(run: Run, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    result = cli("export", run.root, "--format", "safetensors", "-o", out)
    assert result.returncode == 0, result.stderr
    assert "step 3" in result.stdout
    exported = load_file(str(out))
    assert set(exported) == set(run.models[3])
    for name, tensor in run.models[3].items():
        assert torch.equal(exported[name], tensor), name
    assert not torch.equal(exported["0.weight"], run.models[2]["0.weight"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == [out.name]


def test_export_step_writes_that_steps_weights(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "step2.safetensors"
    assert main(["export", str(run.root), "--step", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    exported = load_file(str(out))
    assert set(exported) == set(run.models[2])
    for name, tensor in run.models[2].items():
        assert torch.equal(exported[name], tensor), name


def test_export_of_a_corrupt_step_exits_1_and_writes_nothing(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_bit(run.shard(2))
    out = tmp_path / "out.safetensors"
    assert main(["export", str(run.root), "--step", "2", "-o", str(out)]) == 1
    assert SHARD in capsys.readouterr().err
    assert not out.exists()
    assert list(tmp_path.glob("out.safetensors*")) == []


def test_export_without_step_skips_a_corrupt_newest_checkpoint(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_bit(run.shard(3))
    out = tmp_path / "out.safetensors"
    assert main(["export", str(run.root), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "skipping step 3" in captured.err
    assert "step 2" in captured.out
    exported = load_file(str(out))
    for name, tensor in run.models[2].items():
        assert torch.equal(exported[name], tensor), name
