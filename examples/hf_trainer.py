"""A Hugging Face ``Trainer`` run checkpointed by crashproof, resumed by itself after a failure.

A tiny GPT-2 built from its config (nothing downloaded) learns a small text, character by
character, on CPU, with dropout on. Run it alone, or under ``crashproof run`` on several ranks::

    python examples/hf_trainer.py --root runs/hf
    crashproof run --nproc-per-node 2 examples/hf_trainer.py --root runs/hf

Killed and started again, ``trainer.train()`` resumes from the newest checkpoint under
``--root`` and ends with the weights an uninterrupted run ends with, bit for bit.
``--dump FILE`` writes the final weights, optimizer state and log history to compare runs;
``--kill-at STEP`` kills the process (SIGKILL) at that step of the first attempt, to try it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import crashproof as cp
from crashproof.integrations.transformers import CrashproofCallback

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the "
    "winter of despair, we had everything before us, we had nothing before us. "
) * 4
BLOCK = 32


class CharDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Overlapping blocks of the text's bytes, labels equal to inputs (the model shifts them)."""

    def __init__(self, text: str) -> None:
        self.ids = torch.tensor(list(text.encode()), dtype=torch.long)

    def __len__(self) -> int:
        return (len(self.ids) - BLOCK) // 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.ids[i * 8 : i * 8 + BLOCK]
        return {"input_ids": block, "labels": block}


class KillAt(TrainerCallback):  # type: ignore[misc]
    """SIGKILL this process after optimizer step ``step``, on the first attempt only."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and getattr(state, "global_step", 0) == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def build_trainer(
    root: str,
    *,
    out: str | None = None,
    epochs: float = 3,
    every: int = 4,
    accumulate: int = 1,
    more_callbacks: list[TrainerCallback] | None = None,
) -> Trainer:
    """The Trainer of this example, checkpointed by crashproof under ``root``."""
    torch.manual_seed(0)  # the model's initial weights
    config = GPT2Config(
        vocab_size=256, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    training_args = TrainingArguments(
        output_dir=out or root.rstrip("/") + "-out",  # the Trainer's logs; never inside a root
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate,
        num_train_epochs=epochs,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        logging_steps=2,
        save_strategy="no",  # crashproof checkpoints instead of the Trainer
        report_to=[],
        use_cpu=True,
        seed=1,
        disable_tqdm=True,
    )
    callback = CrashproofCallback(root, every=cp.EverySteps(every), keep=cp.KeepLast(2))
    return Trainer(
        model=GPT2LMHeadModel(config),
        args=training_args,
        train_dataset=CharDataset(TEXT),
        callbacks=[callback, *(more_callbacks or [])],
    )


def dump(trainer: Trainer, path: str) -> None:
    """The final weights and optimizer state (safetensors) and log history (``PATH.json``)."""
    tensors = {f"model/{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}
    for index, values in trainer.optimizer.state_dict()["state"].items():
        for name, value in values.items():
            tensors[f"optimizer/{index}/{name}"] = torch.as_tensor(value).clone()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path)
    history = [  # without the run's timings, which differ between any two runs
        {k: v for k, v in entry.items() if not k.startswith("train_") and k != "total_flos"}
        for entry in trainer.state.log_history
    ]
    Path(path + ".json").write_text(
        json.dumps({"global_step": trainer.state.global_step, "log_history": history})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs/hf", help="crashproof's checkpoint root")
    parser.add_argument("--out", default=None, help="the Trainer's output_dir (default: ROOT-out)")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--every", type=int, default=4, help="save every N optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--dump", default=None, help="write final weights and state here")
    args = parser.parse_args()

    trainer = build_trainer(
        args.root,
        out=args.out,
        epochs=args.epochs,
        every=args.every,
        accumulate=args.accumulate,
        more_callbacks=[KillAt(args.kill_at)] if args.kill_at is not None else [],
    )
    trainer.train()

    if args.dump and trainer.args.process_index == 0:
        dump(trainer, args.dump)


if __name__ == "__main__":
    main()
