"""Restoring on another world size (gloo, DDP; ranks forked from a warm process with torchrun's
environment, :mod:`tests.warm_ranks`): 4 ranks -> 2 -> 3 -> 2 -> 1. Replicated
state reloads on any number of ranks: after every change each rank holds the model, optimizer
(AdamW's moments and step) and EMA tensors the checkpoint holds; the data position is global, so
across every change no sample of an epoch is repeated or skipped and every step consumed exactly
its global batch. State that differs between ranks (sharded) is refused with a clear error
instead of being loaded wrongly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

import crashproof as cp
from crashproof.checkpoint import load_rank_state, read_manifest
from crashproof.storage import LocalStorage
from tests.conftest import EXAMPLES, free_port
from tests.warm_ranks import WarmRanks

N_SAMPLES, BATCH, STEPS = 200, 16, 25


def _launch(ranks: WarmRanks, run_dir: Path, log: Path, nproc: int, *extra: str) -> str:
    args = [
        "--run-dir", str(run_dir), "--steps", str(STEPS), "--every", "5", "--keep", "100",
        "--workers", "0", "--sync", "--step-log", str(log), *extra,
    ]  # fmt: skip
    return ranks.run(EXAMPLES / "train_tiny.py", args, nproc=nproc).output


def _records(log: Path, nproc: int) -> list[dict[int, list[int]]]:
    """Per rank: step -> sample ids (the last record of a step wins)."""
    paths = [log] if nproc == 1 else [Path(f"{log}.rank{r}") for r in range(nproc)]
    out = []
    for path in paths:
        steps: dict[int, list[int]] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps[record["step"]] = record["ids"]
        out.append(steps)
    return out


def _saved_tensors(run: Path, step: int) -> tuple[int, dict[str, torch.Tensor]]:
    """The number of ranks that wrote checkpoint ``step``, and its model, optimizer and EMA
    tensors as crashproof's reader reads them (every byte verified), named as ``train_tiny.py``'s
    dumps name them."""
    storage, ckpt = LocalStorage(), str(run / "checkpoints" / f"step_{step:010d}")
    manifest = read_manifest(storage, ckpt)
    tree = load_rank_state(storage, ckpt, manifest, 0)
    tensors = {f"model/{k}": v for k, v in tree["model"].items()}
    for pid, entry in tree["optimizer"]["state"].items():
        tensors.update({f"optimizer/{pid}/{k}": v for k, v in entry.items()})
    shadow = tree["extra"]["ema"]["state_dict"]["shadow"]
    tensors.update({f"ema/{k}": v for k, v in shadow.items()})
    return manifest.world_size, tensors


def _assert_restored_state_is_the_checkpoints(run: Path, dump: Path, nproc: int, step: int) -> None:
    """Every rank's state as restored (``--dump-restored``) equals what checkpoint ``step`` holds,
    which was written by another number of ranks."""
    saved_by, saved = _saved_tensors(run, step)
    assert saved_by != nproc, f"step {step} was saved by {saved_by} ranks, restored by {nproc}"
    steps = {k: int(v) for k, v in saved.items() if re.fullmatch(r"optimizer/\d+/step", k)}
    assert steps and set(steps.values()) == {step}, steps  # AdamW has state, as many steps old
    for rank in range(nproc):
        restored = load_file(dump if nproc == 1 else f"{dump}.rank{rank}")
        assert sorted(restored) == sorted(saved), f"rank {rank} of {nproc}"
        for name, tensor in saved.items():
            assert torch.equal(restored[name], tensor), f"{name} on rank {rank} of {nproc}"


def test_resumes_on_other_world_sizes_neither_repeat_nor_skip_data(
    tmp_path: Path, warm_ranks: WarmRanks
) -> None:
    run = tmp_path / "run"
    # (ranks, step it starts at, step of its last checkpoint, step it crashes at): 4 -> 2, 2 -> 3,
    # 3 -> 2 and 2 -> 1, each resumed from a checkpoint the previous world size wrote.
    segments = [
        (4, 0, 5, "7"), (2, 5, 10, "12"), (3, 10, 15, "17"), (2, 15, 20, "22"), (1, 20, STEPS, None)
    ]  # fmt: skip
    for n, (nproc, start, _, crash_at) in enumerate(segments):
        dump = tmp_path / f"restored{n}.safetensors"
        output = _launch(
            warm_ranks, run, tmp_path / f"log{n}", nproc, "--dump-restored", str(dump),
            *(["--crash-at", crash_at] if crash_at else []),
        )  # fmt: skip
        assert f"starting at step {start}" in output, output[-2000:]
        if start:  # every rank holds the model and optimizer state the other world size saved
            _assert_restored_state_is_the_checkpoints(run, dump, nproc, start)
    newest = cp.CheckpointManager(str(run / "checkpoints"), handle_signals=False).list()[0]
    assert newest.step == STEPS and newest.world_size == 1 and newest.valid

    # The whole job's sample order: the sampler's, epoch after epoch, dealt out per step.
    sampler = cp.ResumableSampler(N_SAMPLES, shuffle=True, seed=0, rank=0, world_size=1)
    epoch, position = 0, 0
    for n, (nproc, start, end, _) in enumerate(segments):
        records = _records(tmp_path / f"log{n}", nproc)
        for step in range(start + 1, end + 1):
            if -(-(N_SAMPLES - position) // nproc) < BATCH:  # drop_last: this epoch is done
                epoch, position = epoch + 1, 0
            sampler.epoch = epoch
            expected = sampler._order()[position : position + BATCH * nproc].tolist()
            got = [i for rank in records for i in rank[step]]
            assert len(got) == BATCH * nproc, f"step {step}: {len(got)} samples"
            assert sorted(got) == sorted(expected), f"step {step} (world size {nproc})"
            position += BATCH * nproc


def _save_different_tensors(rank: int, root: str, port: int) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    torch.manual_seed(rank)  # each rank its own weights: sharded, not replicated
    model = torch.nn.Linear(4, 4)
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        ckpt.save(1, cp.TrainState(model=model))
    torch.distributed.destroy_process_group()


def test_state_that_differs_between_ranks_is_refused_on_another_world_size(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    mp.start_processes(
        _save_different_tensors, args=(root, free_port()), nprocs=2, start_method="forkserver"
    )
    ckpt = cp.CheckpointManager(root, handle_signals=False)
    with pytest.raises(cp.StateMismatchError, match=r"saved by 2 ranks whose tensors differ"):
        ckpt.restore(cp.TrainState(model=torch.nn.Linear(4, 4)))
    ckpt.close()


def test_a_constant_global_batch_across_world_sizes_takes_the_same_samples_per_step(
    tmp_path: Path, warm_ranks: WarmRanks
) -> None:
    # --global-batch 32 with micro-batches of 16: 1 micro-batch per step on 2 ranks, 2 on 1 rank.
    run, global_batch = tmp_path / "run", 2 * BATCH
    segments = [(2, 0, 10, "12"), (1, 10, STEPS, None)]
    for nproc, start, _, crash_at in segments:
        output = _launch(
            warm_ranks, run, tmp_path / f"log{nproc}", nproc, "--global-batch", str(global_batch),
            *(["--crash-at", crash_at] if crash_at else []),
        )  # fmt: skip
        assert f"starting at step {start}" in output, output[-2000:]
    sampler = cp.ResumableSampler(N_SAMPLES, shuffle=True, seed=0, rank=0, world_size=1)
    epoch, position = 0, 0
    for nproc, start, end, _ in segments:
        records = _records(tmp_path / f"log{nproc}", nproc)
        for step in range(start + 1, end + 1):
            expected: list[int] = []
            for _ in range(global_batch // (BATCH * nproc)):  # this world size's micro-batches
                if -(-(N_SAMPLES - position) // nproc) < BATCH:
                    epoch, position = epoch + 1, 0
                sampler.epoch = epoch
                expected += sampler._order()[position : position + BATCH * nproc].tolist()
                position += BATCH * nproc
            got = [i for rank in records for i in rank[step]]
            assert len(got) == global_batch, f"step {step}: {len(got)} samples"
            assert sorted(got) == sorted(expected), f"step {step} (world size {nproc})"


def test_accumulation_steps_refuses_numbers_that_do_not_add_up() -> None:
    assert cp.accumulation_steps(64, 16, world_size=2) == 2
    assert cp.accumulation_steps(64, 16, world_size=4) == 1
    with pytest.raises(cp.ConfigError, match=r"world sizes that fit: \[1, 2, 4\]"):
        cp.accumulation_steps(64, 16, world_size=3)
