"""A notice that reaches one rank only (signals arrive at different steps, or on one host) stops
every rank at the same step, with one emergency checkpoint of that step: the ranks agree on
stopping before any of them leaves its training loop, so no rank's emergency save meets its
peers' training collectives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from crashproof.checkpoint import committed_steps
from crashproof.storage import LocalStorage
from tests.conftest import free_port

TRAINER = textwrap.dedent(
    """
    import datetime, json, os, signal, sys, time
    import torch
    import torch.distributed as dist
    import crashproof as cp

    root, rank = sys.argv[1], int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    model = torch.nn.Linear(8, 8)
    state = cp.TrainState(model=model)
    ckpt = cp.CheckpointManager(root, every=cp.EverySteps(1000), timeout_s=20)
    sums = []
    try:
        for step in range(1, 400):
            # a training step's collective: a mismatch with an emergency save's shows up here
            value = torch.tensor([float(step)])
            dist.all_reduce(value)
            sums.append(value.item() == 2 * step)
            time.sleep(0.004)
            if rank == 1 and step == 37:
                os.kill(os.getpid(), signal.SIGUSR1)  # the notice reaches rank 1 alone
            ckpt.maybe_save(step, state)
        outcome = {"rank": rank, "finished": True}
    except cp.PreemptedExit as stop:
        outcome = {"rank": rank, "stopped_at": stop.step, "source": stop.notice.source}
    except Exception as exc:
        outcome = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    outcome["collectives_matched"] = all(sums)
    print(json.dumps(outcome), flush=True)
    os._exit(0)
    """
)


def test_a_notice_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    root = str(tmp_path / "ckpt")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), root],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    results = [
        json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]) for out, _ in outputs
    ]
    assert all("stopped_at" in r for r in results), outputs
    steps = {r["stopped_at"] for r in results}
    assert len(steps) == 1, results
    (step,) = steps
    assert step >= 37
    assert [r["source"] for r in results] == ["another rank", "SIGUSR1"]
    assert all(r["collectives_matched"] for r in results)
    assert [s for s, _ in committed_steps(LocalStorage(), root)] == [step]
