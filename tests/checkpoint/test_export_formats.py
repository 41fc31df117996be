"""Exports other tools read: a checkpoint saved by 2 DDP ranks (torchrun, gloo) exported as a
``torch.distributed.checkpoint`` directory (loaded back with ``torch.distributed.checkpoint.load``)
and as safetensors, one file or sharded with an index; every tensor equal to the saved one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch import nn

from crashproof.checkpoint import load_rank_state, read_manifest
from crashproof.cli import main
from crashproof.storage import LocalStorage
from tests.checkpoint.test_reshard import _save_different_tensors
from tests.conftest import EXAMPLES, free_port
from tests.warm_ranks import WarmRanks, crashproof_cli


@pytest.fixture(scope="module")
def ddp_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, warm_ranks: WarmRanks
) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint of 2 DDP ranks of train_tiny, and its verified state (rank 0)."""
    run = tmp_path_factory.mktemp("ddp")
    args = ["--run-dir", str(run), "--steps", "10", "--every", "5", "--workers", "0", "--sync"]
    launch = warm_ranks.run(EXAMPLES / "train_tiny.py", args, nproc=2)
    assert launch.returncode == 0, launch.output[-3000:]
    ckpt = run / "checkpoints" / "step_0000000010"
    storage = LocalStorage()
    manifest = read_manifest(storage, str(ckpt))
    assert manifest.world_size == 2
    return ckpt.parent, load_rank_state(storage, str(ckpt), manifest, 0)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return crashproof_cli(*args)


def _fresh_model() -> nn.Module:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from train_tiny import build_model
    finally:
        sys.path.remove(str(EXAMPLES))
    torch.manual_seed(123)
    return build_model(16, 64)


def test_dcp_export_loads_with_torch_distributed_checkpoint(
    ddp_checkpoint: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, saved = ddp_checkpoint
    out = tmp_path / "dcp"
    done = _cli("export", str(root), "--format", "dcp", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert (out / ".metadata").exists()

    model = _fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model(torch.zeros(1, 16)).sum().backward()
    optimizer.step()  # creates the moments, to be overwritten by the load
    target = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": torch.tensor(0),
    }
    dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert int(target["step"]) == 10
    for name, tensor in saved["model"].items():
        assert torch.equal(target["model"][name], tensor), name
    for pid, moments in saved["optimizer"]["state"].items():
        for key, value in moments.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(target["optimizer"]["state"][pid][key], value), (pid, key)


def test_safetensors_export_in_one_file_and_sharded_with_an_index(
    ddp_checkpoint: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, saved = ddp_checkpoint
    weights = saved["model"]
    single = tmp_path / "one" / "model.safetensors"
    assert _cli("export", str(root), "-o", str(single)).returncode == 0
    loaded = load_file(single)
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)

    sharded = tmp_path / "many" / "model.safetensors"
    done = _cli("export", str(root), "-o", str(sharded), "--max-shard-size", "4KiB")
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged: dict[str, torch.Tensor] = {}
    for file in files:
        merged.update(load_file(tmp_path / "many" / file))
    assert merged.keys() == weights.keys() == index["weight_map"].keys()
    assert all(torch.equal(merged[k], weights[k]) for k in weights)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    assert index["metadata"]["total_size"] == total


def test_a_bad_shard_size_is_a_usage_error(ddp_checkpoint: tuple[Path, dict[str, Any]]) -> None:
    root, _ = ddp_checkpoint
    done = _cli("export", str(root), "-o", "x.safetensors", "--max-shard-size", "lots")
    assert done.returncode == 2 and "not a size" in done.stderr


def test_sharded_state_is_not_exported_as_if_it_were_replicated(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")  # two real ranks, each with weights of its own
    mp.start_processes(
        _save_different_tensors, args=(root, free_port()), nprocs=2, start_method="forkserver"
    )
    done = _cli("export", root, "--step", "1", "-o", str(tmp_path / "w.safetensors"))
    assert done.returncode == 1
    assert "whose tensors differ" in done.stderr and "sharded" in done.stderr
    assert not (tmp_path / "w.safetensors").exists()


def _cli_here(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``crashproof ARGS`` in this process (``cli.main``): what it returns and prints."""
    saved = signal.getsignal(signal.SIGPIPE)  # main() restores SIGPIPE's default, as a tool does
    try:
        code = main(list(args))
    finally:
        signal.signal(signal.SIGPIPE, saved)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def test_what_chooses_the_state_exported_the_ema_the_optimizer_everything_or_a_key_path(
    ddp_checkpoint: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process: what --what chooses (the command as a process is tested above)."""
    root, state = ddp_checkpoint

    def _cli(*args: str) -> subprocess.CompletedProcess[str]:
        return _cli_here(capsys, *args)

    def export(what: str, name: str, *more: str) -> dict[str, torch.Tensor]:
        out = tmp_path / f"{name}.safetensors"
        proc = _cli("export", str(root), "--what", what, "-o", str(out), *more)
        assert proc.returncode == 0, proc.stderr
        return load_file(out)

    shadow = state["extra"]["ema"]["state_dict"]["shadow"]
    exported = export("extra/ema/state_dict/shadow", "shadow")  # a key path, as inspect shows
    assert exported.keys() == shadow.keys()
    assert all(torch.equal(exported[k], shadow[k]) for k in shadow)
    exported = export("ema", "ema")  # the shortcut: what the user's EMA object saved
    assert exported.keys() == {f"shadow/{k}" for k in shadow}
    optimizer = export("optimizer", "optimizer")
    for param_id, moments in state["optimizer"]["state"].items():
        for name, value in moments.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(optimizer[f"state/{param_id}/{name}"], value)
    everything = export("all", "all")
    assert {k.split("/", 1)[0] for k in everything} >= {"model", "optimizer", "extra", "rng"}
    model = export("model", "model")
    assert all(torch.equal(everything[f"model/{k}"], v) for k, v in model.items())
    # a key the state does not hold: a usage error that lists what is there, nothing written
    out = tmp_path / "nothing.safetensors"
    proc = _cli("export", str(root), "--what", "extra/nosuch", "-o", str(out))
    assert proc.returncode == 2 and not out.exists()
    assert "no 'nosuch' at extra" in proc.stderr and "there: ema" in proc.stderr, proc.stderr
    for nonsense in ("", "/", "model/0.weight/x", "extra/ema/../.."):
        proc = _cli("export", str(root), "--what", nonsense, "-o", str(out))
        assert proc.returncode == 2 and not out.exists(), (nonsense, proc.stderr)
        assert "--what" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    # dcp: the chosen part under its own name
    dcp_dir = tmp_path / "ema_dcp"
    proc = _cli("export", str(root), "--format", "dcp", "--what", "ema", "-o", str(dcp_dir))
    assert proc.returncode == 0, proc.stderr
    assert "(ema, step)" in proc.stdout
    keys = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    assert {f"ema.shadow.{k}" for k in shadow} <= set(keys), sorted(keys)


def test_the_newest_export_takes_the_newest_whole_checkpoint(
    ddp_checkpoint: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """An export reads the files of one rank's state; a newest checkpoint with another file
    damaged (``ls`` calls it invalid) is skipped as ``ls`` would. Asked for by ``--step``, it is
    exported only if what the export reads verifies: here rank 1's file holds part of the model
    for every rank, so it is refused, naming the file."""
    import shutil

    root = tmp_path / "root"
    shutil.copytree(ddp_checkpoint[0], root)
    shard = root / "step_0000000010" / "rank_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    newest = _cli("export", str(root), "-o", str(tmp_path / "newest.safetensors"))
    assert newest.returncode == 0, newest.stderr
    assert "skipping step 10" in newest.stderr and "rank_00001.safetensors" in newest.stderr
    assert "of step 5" in newest.stdout
    asked = _cli("export", str(root), "--step", "10", "-o", str(tmp_path / "ten.safetensors"))
    assert asked.returncode == 1 and "rank_00001.safetensors" in asked.stderr, asked.stderr
    assert not (tmp_path / "ten.safetensors").exists()
