"""A rank SIGKILLed in the middle of a distributed save, with no supervisor to stop the others:
the surviving rank gets a clear error within the manager's timeout (no hang), nothing is
committed, and the previous checkpoint restores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

import crashproof as cp
from crashproof._seams import ENV_CHAOS_STORAGE, read_fired, write_control
from crashproof.checkpoint import committed_steps
from crashproof.storage import LocalStorage
from tests.conftest import free_port

TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import torch
    import crashproof as cp
    from crashproof._seams import read_fired, write_control

    root, control, rank = sys.argv[1], sys.argv[2], int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    torch.manual_seed(0)
    # DDP: the replicated state is written once, spread over the ranks (the save's all-gather)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2048, 2048))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    state = cp.TrainState(model=model, optimizer=optimizer)
    ckpt = cp.CheckpointManager(root, timeout_s=10, handle_signals=False)
    ckpt.save(1, state)
    ckpt.wait()
    print(json.dumps({"rank": rank, "committed": 1}), flush=True)
    optimizer.step()
    if rank == 1:  # the next file rank 1 writes stalls (the storage seam chaos campaigns use)
        write_control(control, [{"id": "mid-save", "rank": 1, "error": "hang", "hang_s": 60}])
    torch.distributed.barrier()
    started = time.monotonic()
    try:
        ckpt.save(2, state)  # returns once the state is copied; the write goes on behind
        if rank == 1:  # die while the shard is being written
            while not read_fired(control):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
        outcome = "committed"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"rank": rank, "outcome": outcome, "seconds": time.monotonic() - started}), flush=True)
    os._exit(0)
    """
)


def test_a_rank_killed_during_a_save_means_no_commit_no_hang_and_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    root, control = str(tmp_path / "ckpt"), str(tmp_path / "storage.json")
    write_control(control, [])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "PYTHONUNBUFFERED": "1", ENV_CHAOS_STORAGE: control}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), root, control],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    started = time.monotonic()
    outputs = [p.communicate(timeout=180) for p in procs]
    assert time.monotonic() - started < 120
    assert procs[1].returncode == -9  # SIGKILL
    lines = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
    [survivor] = [r for r in lines if "outcome" in r]
    assert survivor["outcome"] != "committed", survivor
    assert survivor["outcome"].startswith("CheckpointWriteError"), survivor
    assert "checkpoint of step 2" in survivor["outcome"], survivor  # says which save failed
    assert survivor["seconds"] < 60, survivor  # the manager's timeout, not a hang
    [fired] = read_fired(control)
    assert fired["rank"] == 1  # rank 1 died with its write stalled: in the middle of the save

    assert [s for s, _ in committed_steps(LocalStorage(), root)] == [1]
    model = torch.nn.Linear(2048, 2048)
    with cp.CheckpointManager(root, handle_signals=False) as ckpt:
        assert ckpt.restore(cp.TrainState(model=model)) == 1
    assert [s for s, _ in committed_steps(LocalStorage(), root)] == [1]
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]  # cleaned up on start
