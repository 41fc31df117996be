"""``CrashproofCallback`` with real Lightning: a killed fit resumes bit for bit, Lightning's own
checkpoint content is stored safely, conflicts are explained.

The fits are ``examples/lightning_train.py`` (dropout, shuffled data, AdamW with a step LR
schedule, validation every epoch, a datamodule with state, hyper-parameters as a Namespace and a
dataclass), through ``lightning_trainer.py``, which kills itself at chosen steps and dumps the
final model and optimizer state.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import pathlib
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from crashproof.errors import ConfigError, UnsupportedStateError
from crashproof.integrations._safe_values import TAG, decode_safe, encode_safe
from tests.conftest import EXAMPLES
from tests.integrations.launch import finish, start

L = pytest.importorskip("lightning")

TRAINER = Path(__file__).with_name("lightning_trainer.py")


def _equal(expected: Any, found: Any, where: str = "") -> int:
    """Assert two state trees equal, every tensor bit for bit; returns how many tensors."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(found, torch.Tensor) and expected.dtype == found.dtype, where
        assert torch.equal(expected, found), f"{where} differs"
        return 1
    if isinstance(expected, dict):
        assert expected.keys() == found.keys(), where
        return sum(_equal(v, found[k], f"{where}/{k}") for k, v in expected.items())
    if isinstance(expected, (list, tuple)):
        assert len(expected) == len(found), where
        return sum(
            _equal(a, b, f"{where}/{i}")
            for i, (a, b) in enumerate(zip(expected, found, strict=True))
        )
    assert expected == found, f"{where}: {expected!r} != {found!r}"
    return 0


def test_a_fit_killed_twice_under_crashproof_run_ends_bit_identical(tmp_path: Path) -> None:
    # 96 samples in batches of 8: 12 steps an epoch, 4 epochs; a save every 6 steps. The kill at
    # 16 resumes from 12, the last batch of epoch 0 (its validation and epoch end not done); the
    # kill at 22 from 18, mid-epoch 1.
    common = ["--every", "6"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE"}
    uninterrupted = subprocess.Popen(  # beside the supervised run: the machine has two cores
        [sys.executable, str(TRAINER), "--root", str(tmp_path / "a"), "--dump", str(tmp_path / "a.pt"), *common],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    (tmp_path / "markers").mkdir()
    supervised = subprocess.run(
        [
            sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "1",
            "--max-restarts", "3", "--preload", "lightning.pytorch", "--metrics-port", "-1",
            "--run-dir", str(tmp_path / "run"), str(TRAINER), "--root", str(tmp_path / "b"),
            "--dump", str(tmp_path / "b.pt"), "--kill-at", "16", "--kill-at", "22",
            "--kill-marker", str(tmp_path / "markers"), *common,
        ],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    said = uninterrupted.communicate(timeout=240)[0]
    assert uninterrupted.returncode == 0, said
    assert supervised.returncode == 0, supervised.stdout[-4000:] + supervised.stderr[-4000:]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    # From 12 and 18, or from the checkpoint before one whose asynchronous save was still being
    # written when the kill came (a step takes milliseconds; a loaded machine writes slower).
    restored = [e["step"] for e in events if e["event"] == "restore"]
    assert len(restored) == 2 and restored[0] in (6, 12) and restored[1] in (12, 18), restored
    assert "You're resuming from a checkpoint" not in supervised.stdout + supervised.stderr
    expected = torch.load(tmp_path / "a.pt")
    assert _equal(expected, torch.load(tmp_path / "b.pt")) == 16  # 4 weights, 3 AdamW tensors each
    assert expected["optimizer"]["state"][0]["step"] == 48


def test_a_ddp_fit_killed_under_crashproof_run_ends_bit_identical(tmp_path: Path) -> None:
    # Two ranks (DDP over gloo, one Lightning device per crashproof run rank): 96 samples in
    # batches of 8 per rank, 6 steps an epoch, 4 epochs; a save every 5 steps; killed at 8 (mid
    # epoch 1). The uninterrupted fit runs beside, under crashproof run too.
    def launch(name: str, *args: str) -> tuple[subprocess.Popen[str], Path]:
        return start(
            TRAINER, tmp_path / f"run-{name}", "--devices", "2", "--every", "5",
            "--root", str(tmp_path / name), "--dump", str(tmp_path / f"{name}.pt"), *args,
            options=["--max-restarts", "2", "--preload", "lightning.pytorch"],
        )  # fmt: skip

    uninterrupted = launch("a")
    (tmp_path / "markers").mkdir()
    code, events, output = finish(
        launch("b", "--kill-at", "8", "--kill-marker", str(tmp_path / "markers"))
    )
    assert code == 0, output[-8000:]
    code, _, said = finish(uninterrupted)
    assert code == 0, said[-4000:]
    assert len([e for e in events if e["event"] == "restart"]) == 1
    # From step 5 (or from the start, where its asynchronous save was cut short by the kill).
    assert {e["step"] for e in events if e["event"] == "restore"} <= {5}
    expected = torch.load(tmp_path / "a.pt")
    assert _equal(expected, torch.load(tmp_path / "b.pt")) == 16
    assert expected["optimizer"]["state"][0]["step"] == 24


@dataclass
class Config:
    width: int = 3
    where: pathlib.Path = pathlib.Path("runs/x")


class Colour(enum.Enum):
    RED = "red"


class Smoothing:
    """An object of the user's: it pickles (so Lightning keeps it), crashproof refuses it."""

    def __init__(self, k: float = 0.1) -> None:
        self.k = k


def test_safe_values_round_trip_and_refuse_what_they_cannot_store() -> None:
    value = {
        "args": argparse.Namespace(lr=0.1, layers=[1, 2], kind=Colour.RED),
        "config": Config(),
        "tags": {"a", "b"},
        "frozen": frozenset({1}),
        "order": OrderedDict(b=1, a=2),
        "path": pathlib.Path("/tmp/x"),
        TAG: "a user's key that looks like ours",
        "tensor": torch.arange(3),
        7: (1, "x"),
    }
    stored = encode_safe(value)
    like = {"args": argparse.Namespace(kind=Colour.RED), "config": Config(width=0)}
    back = decode_safe(stored, like=like)
    assert back["args"] == value["args"] and back["config"] == Config()
    assert type(back["order"]) is OrderedDict and list(back["order"]) == ["b", "a"]
    assert back["tags"] == {"a", "b"} and back["frozen"] == frozenset({1})
    assert back["path"] == pathlib.Path("/tmp/x") and back[TAG] == value[TAG]
    assert torch.equal(back["tensor"], value["tensor"]) and back[7] == (1, "x")
    # without a live value of its class, nothing is made of a saved class name: plain values
    plain = decode_safe(stored)
    assert plain["config"] == {"width": 3, "where": pathlib.Path("runs/x")}
    assert plain["args"].kind == "red"
    with pytest.raises(UnsupportedStateError, match=r"'hparams/loss'.*\bignore"):
        encode_safe({"loss": lambda x: x}, "hparams", hint=lambda path, v: "ignore it")


def _fit(root: Path, *, epochs: int = 1, callbacks: list[Any] | None = None) -> tuple[Any, Any]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import lightning_train
    finally:
        sys.path.remove(str(EXAMPLES))
    return lightning_train.main(["--root", str(root), "--epochs", str(epochs)], callbacks or [])


class Recorder(L.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def on_load_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.loaded = checkpoint


def test_lightning_state_survives_a_resume_and_conflicts_are_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crashproof.integrations.lightning import CrashproofCallback

    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored when the test ends (seed_everything)
    root = tmp_path / "root"
    callback = CrashproofCallback(root)
    assert not callback.has_checkpoint()
    trainer, model = _fit(root)  # one epoch, 12 steps; the finished state is saved at its end
    assert callback.has_checkpoint()

    # Fit again: it resumes from the end, the hooks see Lightning's content as it was saved
    recorder = Recorder()
    again, _ = _fit(root, callbacks=[recorder])
    assert recorder.loaded is not None and again.global_step == 12
    hparams = recorder.loaded["hyper_parameters"]
    assert hparams["args"] == model.hparams["args"]  # a Namespace again
    assert type(hparams["optim"]) is type(model.optim) and hparams["optim"] == model.optim
    assert recorder.loaded["Data"] == {"served": 1}  # the datamodule's own state
    assert recorder.loaded["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1

    # A hyper-parameter no checkpoint can hold is refused before the first step, by name
    class Unsavable(type(model)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"loss_fn": Smoothing()})

    plain = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[CrashproofCallback(tmp_path / "u")])  # fmt: skip
    with pytest.raises(UnsupportedStateError, match=r"'loss_fn'.*ignore=\['loss_fn'\]"):
        plain.fit(Unsavable(), type(trainer.datamodule)())

    # Two resume mechanisms at once are refused, each saying what to do
    lightning_ckpt = tmp_path / "lightning.ckpt"
    trainer.save_checkpoint(lightning_ckpt)
    both = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, callbacks=[CrashproofCallback(root)])  # fmt: skip
    with pytest.raises(ConfigError, match=r"ckpt_path.*holds crashproof checkpoints.*step 12"):
        # (weights_only=False: a .ckpt pickles the Namespace hyper-parameters, torch refuses them)
        both.fit(
            type(model)(), type(trainer.datamodule)(), ckpt_path=lightning_ckpt, weights_only=False
        )
    on_exception = L.Trainer(
        max_epochs=1, logger=False, enable_progress_bar=False,
        callbacks=[CrashproofCallback(tmp_path / "e"),
                   L.pytorch.callbacks.OnExceptionCheckpoint(str(tmp_path))],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="OnExceptionCheckpoint"):
        on_exception.fit(type(model)(), type(trainer.datamodule)())
    with pytest.raises(ConfigError, match="no options of CheckpointManager"):
        CrashproofCallback(root, evrey=5)
