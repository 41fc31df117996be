"""A trainer SIGKILLed at any moment of its memory snapshots (mid-copy, mid-checksum, mid-commit)
never leaves a snapshot that restores to something it did not save.

The agent's memory host runs in the test; a trainer process snapshots a state whose every value is
its step, as fast as it can, and is killed at a random moment. A new manager then restores what
the host offers: a step every tensor of which holds that step, or (one slot, killed while
overwriting it) nothing from memory at all. With two slots the previous snapshot survives."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import crashproof as cp
from crashproof.supervisor._memory_host import MemoryHost

REPO = Path(__file__).resolve().parents[2]
TRIALS = 3


def _state() -> cp.TrainState:
    # 16 MiB: a copy and a checksum long enough for a random kill to land inside them.
    return cp.TrainState(
        model=nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(4)))
    )


def _fill(state: cp.TrainState, value: float) -> None:
    assert state.model is not None
    with torch.no_grad():
        for p in state.model.parameters():
            p.fill_(value)


def _trainer(root: str, slots: int) -> None:
    """Snapshot as fast as it can; says "committed" once two snapshots are."""
    state = _state()
    ckpt = cp.CheckpointManager(
        root, every=cp.EverySteps(10**9), memory_every=cp.EverySteps(1), staging_buffers=slots,
        handle_signals=False,
    )  # fmt: skip
    said = False
    for step in range(1, 10**6):
        _fill(state, float(step))
        ckpt.maybe_save(step, state)
        if ckpt.stats.memory_snapshots >= 2 and not said:
            print("committed", flush=True)
            said = True


if __name__ == "__main__":
    _trainer(sys.argv[1], int(sys.argv[2]))


@pytest.mark.parametrize("slots", [1, 2])
def test_a_kill_anywhere_in_a_snapshot_restores_a_whole_step_or_none(
    memory_host: MemoryHost, tmp_path: Path, slots: int
) -> None:
    rng = random.Random(slots)
    from_memory = 0
    for trial in range(TRIALS):
        root = str(tmp_path / f"ck{trial}")
        trainer = subprocess.Popen(
            [sys.executable, __file__, root, str(slots)], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        try:
            assert trainer.stdout is not None
            assert trainer.stdout.readline() == "committed\n", "the trainer committed nothing"
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            trainer.kill()  # SIGKILL
            trainer.wait(10)
        state = _state()
        _fill(state, -1.0)
        with cp.CheckpointManager(root, every=cp.EverySteps(10**9), handle_signals=False) as ckpt:
            step = ckpt.restore(state)
            kind = ckpt._restorer.last_kind
        assert state.model is not None
        params = [p.detach() for p in state.model.parameters()]
        values = {float(p.min()) for p in params} | {float(p.max()) for p in params}
        if step:  # nothing on disk: a restored step came from memory, and whole
            assert kind == "memory" and values == {float(step)}, (step, values)
            from_memory += 1
        else:
            assert slots == 1 and values == {-1.0}  # killed overwriting the only slot
    if slots == 2:
        assert from_memory == TRIALS  # the slot not being written always holds a whole step


def test_a_save_after_a_restore_from_memory_alone_keeps_that_snapshot_until_it_commits(
    memory_host: MemoryHost, tmp_path: Path
) -> None:
    """The state a trainer resumed from, held in the agent's memory alone (no disk or tier has
    its step), is the one thing a kill during the next save would fall back to. With one
    staging slot, that save must not copy over it: it writes from the live tensors, and returns
    once committed, so at no moment is the newest whole state older than the one resumed from."""
    root = str(tmp_path / "ck")
    state = _state()
    _fill(state, 14.0)
    every = cp.EverySteps(10**9)
    with cp.CheckpointManager(
        root, every=every, memory_every=cp.EverySteps(1), handle_signals=False
    ) as ckpt:
        ckpt.maybe_save(14, state)
        ckpt.wait()
        assert ckpt.stats.memory_snapshots == 1 and not ckpt.list()

    _fill(state, -1.0)
    with cp.CheckpointManager(root, every=every, handle_signals=False) as ckpt:
        assert ckpt.restore(state) == 14 and ckpt._restorer.last_kind == "memory"
        _fill(state, 21.0)
        assert ckpt.save(21, state)
        # save() has returned: step 21 is on disk already (what a kill now would restore).
        assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_0000000021"]

    # The agent never stopped offering step 14 whole ...
    _fill(state, -1.0)
    with cp.CheckpointManager(root, every=every, handle_signals=False) as ckpt:
        assert ckpt.restore(state, 14) == 14 and ckpt._restorer.last_kind == "memory"
        assert state.model is not None
        values = {float(v) for p in state.model.parameters() for v in (p.min(), p.max())}
        assert values == {14.0}
        # ... and after a restore of a step the disk holds, saves stage into the slot again.
        assert ckpt.restore(state) == 21 and ckpt._restorer.last_kind == "local"
        _fill(state, 28.0)
        ckpt.save(28, state)
    with cp.CheckpointManager(root, every=every, handle_signals=False) as ckpt:
        assert ckpt.restore(state) == 28 and ckpt._restorer.last_kind == "memory"
