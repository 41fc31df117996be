"""Promise: every rank writes into the one root rank 0 locked, or none writes at all.

A root that is a local directory on each node (or a path that differs between ranks) would let
rank 0 commit checkpoints holding only its own node's shards, and the first restore after a lost
node would find nothing whole and start over from step 0. Opening the manager refuses it on
every rank, naming the ranks and hosts that do not see rank 0's root, before anything is saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import crashproof as cp

base, mode, rank = sys.argv[1], sys.argv[2], int(os.environ["RANK"])
dist.init_process_group("gloo")
# "apart": rank 1 gives a directory of its own (a node-local disk looks the same to crashproof)
root = os.path.join(base, f"rank{rank}" if mode == "apart" and rank == 1 else "shared")
try:
    with cp.CheckpointManager(root, async_save=False, handle_signals=False) as m:
        m.save(1, cp.TrainState(model=torch.nn.Linear(4, 4)))
    print(f"rank {rank}: saved", flush=True)
except cp.CheckpointWriteError as exc:
    print(f"rank {rank}: refused: {exc}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_root_not_shared_by_every_rank_is_refused_on_every_rank(
    tmp_path: Path, warm_ranks: Any
) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(_SCRIPT)
    apart = warm_ranks.run(script, [str(tmp_path / "a"), "apart"], nproc=2, timeout=120)
    assert apart.exit_codes == [0, 0], apart.output
    assert apart.output.count("refused") == 2 and "saved" not in apart.output, apart.output
    assert "rank(s) 1 (on " in apart.output and "not one directory shared" in apart.output
    assert not list((tmp_path / "a").glob("*/checkpoints/step_*")), "a checkpoint was committed"
    shared = warm_ranks.run(script, [str(tmp_path / "b"), "shared"], nproc=2, timeout=120)
    assert shared.output.count("saved") == 2, shared.output
