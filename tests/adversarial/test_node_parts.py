"""Hostile node-local checkpoints: a damaged ``nodes`` field, a node's root holding another
node's files too, or part of its own, and ranks that moved between nodes. Each is named as what
it is, by ``crashproof ls`` and ``verify`` and by a restore, and nothing is removed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from crashproof.checkpoint.format import parse_manifest, seal_manifest
from crashproof.errors import CorruptCheckpointError

_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import crashproof as cp

base, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
node = rank // int(os.environ.get("RANKS_PER_NODE", "1"))
os.environ["CRASHPROOF_NODE"] = f"n{node}"
dist.init_process_group("gloo")
torch.manual_seed(rank)
state = cp.TrainState(model=torch.nn.Linear(4, 4))
manager = cp.CheckpointManager(
    os.path.join(base, f"node{node}"), async_save=False, handle_signals=False,
    read_only=mode == "restore", root_scope="node",
)
with manager:
    if mode == "save":
        manager.save(1, state)
    else:
        sys.stdout.write(f"\\\\nrank {rank}: resumed {manager.restore(state)}\\\\n")
        sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
"""

STEP = "step_0000000001"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, warm_ranks: Any) -> Path:
    """A checkpoint of 2 ranks on 2 nodes, each with its own root: ``node0``, ``node1``."""
    base = tmp_path_factory.mktemp("parts")
    script = base / "ranks.py"
    script.write_text(_SCRIPT)
    launch = warm_ranks.run(script, [str(base / "run"), "save"], nproc=2, timeout=120)
    assert launch.exit_codes == [0, 0], launch.output
    return base


def _copy(saved: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved / "run", run)
    return run


def _ls(warm_ranks: Any, root: Path) -> dict[str, Any]:
    listed = warm_ranks.python(["-m", "crashproof.cli", "ls", "--json", str(root)])
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    return dict(row)


@pytest.mark.parametrize(
    "nodes",
    [
        "0,1", [0, 1], [[0], [0]], [[0]], [[1], [0]], [[0, 1], []], [[True], [1]], [[0], [2]],
        [[0.0], [1]], [[[0]], [1]], [[0], [1], [1]], None, {"0": [0]},
    ],
    ids=repr,
)  # fmt: skip
def test_a_nodes_field_that_is_no_partition_of_the_ranks_is_corrupt(
    saved: Path, nodes: Any
) -> None:
    manifest = json.loads((saved / "run" / "node0" / STEP / "manifest.json").read_bytes())
    del manifest["manifest_checksum"]
    manifest["nodes"] = nodes
    with pytest.raises(CorruptCheckpointError, match="field 'nodes' is not a partition"):
        parse_manifest(seal_manifest(manifest), "manifest.json")


def test_each_nodes_root_lists_and_verifies_its_own_part(saved: Path, warm_ranks: Any) -> None:
    for rank in (0, 1):
        root = saved / "run" / f"node{rank}"
        row = _ls(warm_ranks, root)
        assert (row["valid"], row["ranks"], row["world_size"]) == (True, [rank], 2), row
        verified = warm_ranks.python(["-m", "crashproof.cli", "verify", str(root)])
        assert verified.returncode == 0, verified.stdout + verified.stderr
        shown = warm_ranks.python(["-m", "crashproof.cli", "ls", str(root)])
        assert f"ranks {rank}-{rank} of 2" in shown.stdout, shown.stdout


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("other node's files too", "files of 2 nodes"),
        ("its shard removed", "without rank_00000.safetensors"),
        ("its files removed", "holds no node's files"),
        ("its shard truncated", "rank_00000.safetensors"),
    ],
)
def test_a_nodes_root_holding_no_whole_part_of_its_own_is_invalid(
    saved: Path, tmp_path: Path, warm_ranks: Any, damage: str, problem: str
) -> None:
    run = _copy(saved, tmp_path)
    mine, theirs = run / "node0" / STEP, run / "node1" / STEP
    if damage == "other node's files too":
        for name in ("rank_00001.json", "rank_00001.safetensors"):
            shutil.copy(theirs / name, mine / name)
    elif damage == "its shard removed":
        (mine / "rank_00000.safetensors").unlink()
    elif damage == "its files removed":
        for name in ("rank_00000.json", "rank_00000.safetensors"):
            (mine / name).unlink()
    else:
        shard = mine / "rank_00000.safetensors"
        shard.write_bytes(shard.read_bytes()[:-1])
    row = _ls(warm_ranks, run / "node0")
    assert not row["valid"] and problem in row["problem"], row
    verified = warm_ranks.python(["-m", "crashproof.cli", "verify", str(run / "node0")])
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert problem in verified.stdout + verified.stderr
    assert _ls(warm_ranks, run / "node1")["valid"], "the other node's part is whole"


def test_ranks_that_moved_between_nodes_restore_nothing_and_remove_nothing(
    saved: Path, tmp_path: Path, warm_ranks: Any
) -> None:
    run = _copy(saved, tmp_path)
    (run / "node0").rename(run / "swap")
    (run / "node1").rename(run / "node0")
    (run / "swap").rename(run / "node1")
    launch = warm_ranks.run(saved / "ranks.py", [str(run), "restore"], nproc=2, timeout=120)
    assert launch.exit_codes == [0, 0], launch.output
    assert "rank 0: resumed 0" in launch.output and "rank 1: resumed 0" in launch.output
    assert "not whole on every node" in launch.output
    assert (run / "node0" / STEP / "rank_00001.json").exists()
    assert (run / "node1" / STEP / "rank_00000.json").exists()


def test_each_nodes_part_exports_its_first_ranks_state_and_says_whose(
    saved: Path, tmp_path: Path, warm_ranks: Any
) -> None:
    """An export reads one rank's state; a node's disk holds its own ranks' part only, so the
    export of a node's root is its first rank's state, and says so. A part that is not whole is
    refused as invalid, as ``verify`` refuses it."""
    from safetensors.torch import load_file

    for rank in (0, 1):
        out = tmp_path / f"node{rank}.safetensors"
        root = str(saved / "run" / f"node{rank}")
        done = warm_ranks.python(["-m", "crashproof.cli", "export", root, "-o", str(out)])
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"holds ranks {rank} of the 2" in done.stderr
        assert f"exporting rank {rank}'s state" in done.stderr
        torch.manual_seed(rank)  # (as the ranks made their models)
        expected = torch.nn.Linear(4, 4).state_dict()
        exported = load_file(str(out))
        assert exported.keys() == expected.keys()
        assert all(torch.equal(exported[k], expected[k]) for k in expected)
    run = _copy(saved, tmp_path)
    (run / "node1" / STEP / "rank_00001.safetensors").unlink()
    out = tmp_path / "damaged.safetensors"
    done = warm_ranks.python(["-m", "crashproof.cli", "export", str(run / "node1"), "-o", str(out)])
    assert done.returncode != 0 and not out.exists()
    assert "without rank_00001.safetensors" in done.stdout + done.stderr


def test_a_nodes_part_whose_ranks_hold_different_state_is_not_exported_as_one(
    saved: Path, tmp_path: Path, warm_ranks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks on each node, each with a model of its own (not replicated): a node's part
    holds two states, and an export of one would silently drop the other; it is refused, naming
    the ranks and tensors that differ, as for a checkpoint in one root."""
    monkeypatch.setenv("RANKS_PER_NODE", "2")
    run = tmp_path / "run"
    launch = warm_ranks.run(saved / "ranks.py", [str(run), "save"], nproc=4, timeout=120)
    assert launch.exit_codes == [0, 0, 0, 0], launch.output
    out = tmp_path / "out.safetensors"
    done = warm_ranks.python(["-m", "crashproof.cli", "export", str(run / "node1"), "-o", str(out)])
    assert done.returncode != 0 and not out.exists()
    said = done.stdout + done.stderr
    assert "rank 2 and rank 3: model/bias, model/weight" in said, said


@pytest.mark.parametrize("dry_run", [False, True])
def test_prune_of_one_nodes_root_is_refused_and_removes_nothing(
    saved: Path, tmp_path: Path, warm_ranks: Any, dry_run: bool
) -> None:
    """One node's root cannot tell the newest step every node holds (its own newest may be a
    step another node lacks): ``crashproof prune`` there could remove the only step the run can
    resume from, so it refuses, saying which part the root holds and what to do instead."""
    run = _copy(saved, tmp_path)
    for rank in (0, 1):
        root = run / f"node{rank}"
        before = sorted(p.relative_to(root) for p in root.rglob("*"))
        args = ["prune", str(root), "--keep-last", "1", *(["--dry-run"] if dry_run else [])]
        done = warm_ranks.python(["-m", "crashproof.cli", *args])
        assert done.returncode == 2, done.stdout + done.stderr
        said = done.stderr
        assert f"step 1: ranks {rank}-{rank} of 2" in said and "Nothing was removed" in said, said
        assert "CheckpointManager.prune after a restore" in said
        assert "Traceback" not in said and done.stdout == ""
        assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


_KEEP_TWO = """
import os, sys, torch, torch.distributed as dist
import crashproof as cp

base, steps = sys.argv[1], [int(s) for s in sys.argv[2].split(",") if s]
rank = int(os.environ["RANK"])
os.environ["CRASHPROOF_NODE"] = f"n{rank}"
dist.init_process_group("gloo")
torch.manual_seed(rank)
state = cp.TrainState(model=torch.nn.Linear(4, 4))
manager = cp.CheckpointManager(
    os.path.join(base, f"node{rank}"), async_save=False, handle_signals=False,
    root_scope="node", keep=cp.KeepLast(2),
)
with manager:
    sys.stdout.write(f"\\\\nrank {rank}: resumed {manager.restore(state)}\\\\n")
    sys.stdout.flush()
    for step in steps:
        manager.save(step, state)
dist.barrier()
dist.destroy_process_group()
"""


def test_steps_no_rank_can_restore_do_not_crowd_out_the_runs_own(
    tmp_path: Path, warm_ranks: Any
) -> None:
    """The ranks moved between nodes (the two nodes' roots swapped): their steps 6 and 7 are
    whole on no node for this layout, and the run starts over. Retention with KeepLast(2) then
    keeps the two newest steps this run saved, not the stranded 6 and 7 beside only one of its
    own; the stranded ones are kept too, uncounted (the node holding the rest may come back)."""
    script = tmp_path / "keep_two.py"
    script.write_text(_KEEP_TWO)
    run = tmp_path / "run"
    first = warm_ranks.run(script, [str(run), "5,6,7"], nproc=2, timeout=120)
    assert first.exit_codes == [0, 0], first.output
    (run / "node0").rename(run / "swap")
    (run / "node1").rename(run / "node0")
    (run / "swap").rename(run / "node1")
    again = warm_ranks.run(script, [str(run), "1,2"], nproc=2, timeout=120)
    assert again.exit_codes == [0, 0], again.output
    assert "rank 0: resumed 0" in again.output and "not whole on every node" in again.output
    for node in ("node0", "node1"):
        held = sorted(p.name for p in (run / node).glob("step_*"))
        assert held == [f"step_{s:010d}" for s in (1, 2, 6, 7)], (node, held)
    resumed = warm_ranks.run(script, [str(run), ""], nproc=2, timeout=120)
    assert "rank 0: resumed 2" in resumed.output and "rank 1: resumed 2" in resumed.output
