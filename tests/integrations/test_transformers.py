"""The Hugging Face Trainer under crashproof: killed, resumed by itself, bit for bit.

``examples/hf_trainer.py`` trains a tiny GPT-2 (built from its config, dropout on) with the real
``transformers.Trainer``; a :class:`CrashproofCallback` checkpoints it. A run killed part-way and
started again must end with the weights, optimizer state and log history (losses, learning
rates, gradient norms) of a run never interrupted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from crashproof.errors import ConfigError
from tests.conftest import EXAMPLES
from tests.integrations.launch import finish, start

pytest.importorskip("transformers")
sys.path.insert(0, str(EXAMPLES))
from transformers import TrainerCallback, TrainingArguments

import hf_trainer
from crashproof.integrations.transformers import CrashproofCallback


def _same_run(expected: str, actual: str, *, summaries: int = 0) -> None:
    a, b = load_file(expected), load_file(actual)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:5]}"
    history_a = json.loads(Path(expected + ".json").read_text())
    history_b = json.loads(Path(actual + ".json").read_text())
    assert history_b["global_step"] == history_a["global_step"]
    extra = history_b["log_history"][len(history_a["log_history"]) :]
    assert history_b["log_history"][: len(history_a["log_history"])] == history_a["log_history"]
    assert len(extra) == summaries


def test_a_trainer_killed_under_crashproof_run_resumes_bit_identical(tmp_path: Path) -> None:
    # Two ranks (DDP over gloo), gradient accumulation, two epochs of 11 optimizer steps; killed
    # after step 7 (mid-epoch, 3 steps after the checkpoint of step 4).
    common = ["--epochs", "2", "--accumulate", "2", "--every", "4"]
    expected, actual = str(tmp_path / "expected.st"), str(tmp_path / "actual.st")
    uninterrupted = start(
        "hf_trainer.py", tmp_path / "run-a", "--root", str(tmp_path / "a"), *common,
        "--dump", expected,
    )  # fmt: skip
    killed = start(
        "hf_trainer.py", tmp_path / "run-b", "--root", str(tmp_path / "b"), *common, "--kill-at", "7",
        "--dump", actual,
    )  # fmt: skip
    code, events, output = finish(killed)
    assert code == 0, output
    code, _, said = finish(uninterrupted)
    assert code == 0, said
    restarts = [e for e in events if e["event"] == "restart"]
    assert len(restarts) == 1, output
    # From step 4 (an asynchronous save of step 4 still being written at the kill, on a slow
    # machine, leaves nothing: then the run starts over, which must end the same too).
    assert {e["step"] for e in events if e["event"] == "restore"} <= {4}, output
    _same_run(expected, actual)


class _FailAt(TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError(f"failing at step {self.step}")


def test_a_resume_falls_back_past_a_corrupt_checkpoint_and_stays_exact(tmp_path: Path) -> None:
    expected, actual = str(tmp_path / "expected.st"), str(tmp_path / "actual.st")
    hf_trainer.dump(_train(tmp_path / "a", epochs=1), expected)  # 42 steps

    root = tmp_path / "b"
    with pytest.raises(RuntimeError, match="failing at step 30"):
        hf_trainer.build_trainer(str(root), epochs=1, more_callbacks=[_FailAt(30)]).train()
    steps = sorted(p.name for p in root.glob("step_*"))
    assert steps == ["step_0000000024", "step_0000000028"]
    shard = root / steps[-1] / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # a flipped bit deep in the tensors
    shard.write_bytes(bytes(data))

    trainer = hf_trainer.build_trainer(str(root), epochs=1)
    callback = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, CrashproofCallback)
    )
    trainer.train()
    assert callback.restored_step == 24  # step 28 did not verify
    assert callback.manager is None  # closed with its train() call
    hf_trainer.dump(trainer, actual)
    _same_run(expected, actual)

    # Started again once finished, a run resumes at its last step and trains no further (the
    # Trainer adds one more summary line to its log history: this call's).
    again = hf_trainer.build_trainer(str(root), epochs=1)
    again.train()
    hf_trainer.dump(again, actual)
    _same_run(expected, actual, summaries=1)

    # The model's config travels with the checkpoint: an export loads with from_pretrained.
    from transformers import AutoModelForCausalLM

    from crashproof.cli import main

    assert main(["export", str(root), "--format", "hf", "-o", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, tensor in again.model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name


def _train(root: Path, **kwargs: Any) -> Any:
    trainer = hf_trainer.build_trainer(str(root), **kwargs)
    trainer.train()
    return trainer


def test_settings_that_conflict_are_refused_with_what_to_do(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    data = hf_trainer.CharDataset(hf_trainer.TEXT)

    def args(**kwargs: Any) -> TrainingArguments:
        return TrainingArguments(
            output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, **kwargs
        )

    # The Trainer's own checkpoints (on by default) beside crashproof's: refused, unless asked.
    with pytest.raises(ConfigError, match="save_strategy='no'"):
        Trainer(
            model=model,
            args=args(),
            train_dataset=data,
            callbacks=[CrashproofCallback(tmp_path / "r")],
        )
    Trainer(
        model=model, args=args(), train_dataset=data,
        callbacks=[CrashproofCallback(tmp_path / "r", trainer_checkpoints=True)],
    )  # fmt: skip

    quiet = args(save_strategy="no")
    trainer = Trainer(
        model=model, args=quiet, train_dataset=data, callbacks=[CrashproofCallback(tmp_path / "r")]
    )
    with pytest.raises(ConfigError, match="crashproof import"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-10"))

    late = Trainer(model=model, args=quiet, train_dataset=data)
    late.add_callback(CrashproofCallback(tmp_path / "r"))
    with pytest.raises(ConfigError, match=r"bind\(trainer\)"):
        late.train()

    with pytest.raises(ConfigError, match="model_init"):
        Trainer(
            model_init=lambda: model, args=quiet, train_dataset=data,
            callbacks=[CrashproofCallback(tmp_path / "r")],
        )  # fmt: skip

    with pytest.raises(ConfigError, match="no options of CheckpointManager"):
        CrashproofCallback(tmp_path / "r", evry=5)  # a typo: said at once, not at train()

    shared = CrashproofCallback(tmp_path / "r")
    Trainer(model=model, args=quiet, train_dataset=data, callbacks=[shared])
    with pytest.raises(ConfigError, match="another Trainer"):
        Trainer(model=model, args=quiet, train_dataset=data, callbacks=[shared])
