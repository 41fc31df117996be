"""An FSDP2 trainer for the resharding tests, run by torchrun on CPU with gloo.

Restores if there is a checkpoint (and saves it again with ``--save-first``), trains ``--train N`` more steps (AdamW, a model whose
dimensions do not divide evenly among 3 or 4 ranks) and saves. Rank 0 writes the whole
(consolidated) model and optimizer state to a safetensors file as restored (``--dump-restored``)
and at the end (``--dump``), to compare runs on different numbers of ranks.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import crashproof as cp


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.LayerNorm(3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def dump(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | None) -> None:
    """Rank 0 writes the whole model and optimizer state to ``path`` (every rank takes part)."""
    if path is None:
        return
    whole = StateDictOptions(full_state_dict=True)
    model_state = get_model_state_dict(model, options=whole)
    optim_state = get_optimizer_state_dict(model, optimizer, options=whole)
    if dist.get_rank() == 0:
        tensors = {f"model/{k}": v for k, v in model_state.items()}
        for fqn, entry in optim_state["state"].items():
            tensors.update({f"optimizer/{fqn}/{k}": v for k, v in entry.items()})
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--train", type=int, default=0)
    p.add_argument("--dump", default=None)
    p.add_argument("--dump-restored", default=None)
    p.add_argument("--save-first", action="store_true", help="save before training, too")
    args = p.parse_args()
    dist.init_process_group("gloo")
    model, optimizer = build()
    state = cp.TrainState(model=model, optimizer=optimizer)
    with cp.CheckpointManager(args.root, handle_signals=False, async_save=False) as ckpt:
        step = ckpt.restore(state)
        print(f"rank {dist.get_rank()}: starting at step {step}", flush=True)
        dump(model, optimizer, args.dump_restored)
        if args.save_first:
            ckpt.save(step, state)
        for _ in range(args.train):
            step += 1
            gen = torch.Generator().manual_seed(step * 100 + dist.get_rank())
            loss = model(torch.randn(8, 5, generator=gen)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if args.train:
            ckpt.save(step, state)
    dump(model, optimizer, args.dump)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
