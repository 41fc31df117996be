"""A training loop written with Hugging Face Accelerate, checkpointed and resumed by crashproof.

Accelerate wraps the model (DDP), the optimizer and the scheduler; crashproof captures what
``accelerator.prepare`` returns. The DataLoader is left to crashproof: its
``ResumableSampler`` deals each rank its share and saves the position the loop has received,
which Accelerate's own sharding of a prepared loader would hide. Run it alone or on two ranks::

    python examples/accelerate_train.py --root runs/acc
    crashproof run --nproc-per-node 2 examples/accelerate_train.py --root runs/acc

``--kill-at STEP`` kills the process at that step of the first attempt; ``--dump FILE`` writes
the final weights and optimizer state, to compare an interrupted run with an uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file
from torch import nn

import crashproof as cp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs/acc", help="crashproof's checkpoint root")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="save every N steps")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--dump", default=None)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=args.steps)
    data = torch.utils.data.TensorDataset(torch.randn(96, 16), torch.randint(0, 4, (96,)))
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, sampler=cp.ResumableSampler(len(data), shuffle=True, seed=0)
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    state = cp.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, data=loader)
    ckpt = cp.CheckpointManager(args.root, every=cp.EverySteps(args.every), keep=cp.KeepLast(2))
    step = ckpt.restore(state)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    while step < args.steps:
        for inputs, labels in loader:
            inputs, labels = inputs.to(accelerator.device), labels.to(accelerator.device)
            loss = nn.functional.cross_entropy(model(inputs), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if first_attempt and step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.maybe_save(step, state)
            if step == args.steps:
                break
    ckpt.close()

    if args.dump and accelerator.is_main_process:
        tensors = {
            f"model/{k}": v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()
        }
        for index, values in optimizer.state_dict()["state"].items():
            for name, value in values.items():
                tensors[f"optimizer/{index}/{name}"] = torch.as_tensor(value).clone()
        Path(args.dump).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, args.dump)


if __name__ == "__main__":
    main()
