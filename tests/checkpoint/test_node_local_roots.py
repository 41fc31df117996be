"""Promise: on node-local roots (each node's own disk) a checkpoint commits only once every node
holds its part, a restore takes only a step every node holds, and the resumed run ends bit-for-bit
equal to the run that never stopped.

Four real gloo ranks form two simulated nodes (``CRASHPROOF_NODE``), each node with a root of its
own; the model is wrapped in DDP, so each node's ranks also share its replicated tensors among
themselves (deduplicated within the node, never across).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

_SCRIPT = """
import hashlib, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import crashproof as cp

base, until, scope, layout = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
remote = sys.argv[5] if len(sys.argv) > 5 else None
rank = int(os.environ["RANK"])
node = rank // int(os.environ.get("RANKS_PER_NODE", "2"))
os.environ["CRASHPROOF_NODE"] = f"n{node}"
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 8), find_unused_parameters=True)  # (bit-exact: docs/exactness.md)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = cp.TrainState(model=model, optimizer=opt)
root = os.path.join(base, f"node{node}" if layout == "per-node" else "one")
try:
    manager = cp.CheckpointManager(
        root, every=cp.EverySteps(1), keep=cp.KeepLast(2), handle_signals=False,
        root_scope=scope, remote=remote,
    )
except cp.CheckpointWriteError as exc:
    sys.stdout.write(f"\\nrank {rank}: refused: {exc}\\n")  # (one write: not interleaved)
    sys.stdout.flush()
    sys.exit(0)
with manager:
    start = manager.restore(state)
    print(f"rank {rank}: resumed {start}", flush=True)
    for step in range(start + 1, until + 1):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        manager.maybe_save(step, state)
momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in [*model.parameters(), *momentum]))
sys.stdout.write(f"\\nrank {rank}: final {digest.hexdigest()}\\n")  # (one write: not interleaved)
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
"""


def _run(warm_ranks: Any, script: Path, base: Path, until: int, scope: str = "auto",
         layout: str = "per-node", *remote: str) -> str:  # fmt: skip
    args = [str(base), str(until), scope, layout, *remote]
    launch = warm_ranks.run(script, args, nproc=4, timeout=180)
    assert launch.exit_codes == [0, 0, 0, 0], launch.output
    return launch.output


def _finals(output: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"rank (\d): final ([0-9a-f]{64})", output)}


def _resumed(output: str) -> set[int]:
    return {int(s) for s in re.findall(r"rank \d: resumed (\d+)", output)}


def _names(step_dir: Path) -> set[str]:
    return {p.name for p in step_dir.iterdir()}


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "ranks.py"
    path.write_text(_SCRIPT)
    return path


def test_each_node_commits_its_part_and_a_resume_takes_only_what_every_node_holds(
    tmp_path: Path, warm_ranks: Any, script: Path
) -> None:
    reference = _finals(_run(warm_ranks, script, tmp_path / "ref", 6))
    assert len(reference) == 4

    base = tmp_path / "run"
    _run(warm_ranks, script, base, 4)
    node0, node1 = base / "node0", base / "node1"
    for node, ranks in ((node0, (0, 1)), (node1, (2, 3))):
        # Retention ran on each node's root: the same two steps on both.
        assert sorted(p.name for p in node.glob("step_*")) == ["step_0000000003", "step_0000000004"]
        expected = {"manifest.json"} | {
            f"rank_{r:05d}.{ext}" for r in ranks for ext in ("json", "safetensors")
        }
        assert _names(node / "step_0000000004") == expected
        for index in (node / "step_0000000004").glob("rank_*.json"):
            for tensor in json.loads(index.read_text())["tensors"]:
                if tensor.get("file"):  # a replicated tensor written once: by a node-mate
                    assert (node / "step_0000000004" / tensor["file"]).exists(), tensor
    manifest0 = (node0 / "step_0000000004" / "manifest.json").read_bytes()
    assert manifest0 == (node1 / "step_0000000004" / "manifest.json").read_bytes()
    assert json.loads(manifest0)["nodes"] == [[0, 1], [2, 3]]

    listed = warm_ranks.python(["-m", "crashproof.cli", "ls", "--json", str(node1)])
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["step"], r["valid"], r["ranks"]) for r in rows] == [
        (4, True, [2, 3]),
        (3, True, [2, 3]),
    ]
    verified = warm_ranks.python(["-m", "crashproof.cli", "verify", str(node0)])
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # The DDP model is every rank's: a node's part exports it (its two ranks' states agree).
    exported = tmp_path / "node1.safetensors"
    done = warm_ranks.python(["-m", "crashproof.cli", "export", str(node1), "-o", str(exported)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "holds ranks 2, 3 of the 4" in done.stderr and exported.exists()

    # A kill after every node prepared step 4 (its manifest written) and before node 1 published
    # it: every part is durable, so start-up recovery publishes node 1's and the run resumes there.
    (node1 / "step_0000000004").rename(node1 / ".tmp-step_0000000004-deadbeef-3")
    out = _run(warm_ranks, script, base, 6)
    assert _resumed(out) == {4}, out
    assert _finals(out) == reference

    # A kill before node 1 prepared step 6 (no manifest in its temporary directory): node 0's
    # part alone is no checkpoint. Every rank resumes from step 5, though node 0 holds step 6.
    prepared = node1 / ".tmp-step_0000000006-deadbeef-5"
    (node1 / "step_0000000006").rename(prepared)
    (prepared / "manifest.json").unlink()
    out = _run(warm_ranks, script, base, 6)
    assert _resumed(out) == {5}, out
    assert "not whole on every node" in out
    assert _finals(out) == reference
    assert not prepared.exists(), "the leftover of a save that never committed stays"

    # A damaged shard on one node: every rank falls back to the step before, together.
    shard = node0 / "step_0000000006" / "rank_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    out = _run(warm_ranks, script, base, 6)
    assert _resumed(out) == {5}, out
    assert _finals(out) == reference


def test_a_node_back_without_its_disk_takes_its_part_from_a_tier_or_else_starts_over(
    tmp_path: Path, warm_ranks: Any, script: Path
) -> None:
    """Each node copies its own part to its prefix of the tier (in parallel, no node copying
    another's); a node that lost its disk downloads its part from there. Without a tier, the
    run starts over and says why."""
    base, tier = tmp_path / "run", tmp_path / "tier"
    reference = _finals(_run(warm_ranks, script, base, 3, "auto", "per-node", str(tier)))
    for prefix, ranks in (("node-00000", (0, 1)), ("node-00002", (2, 3))):
        newest = tier / prefix / "step_0000000003"
        expected = {"manifest.json"} | {
            f"rank_{r:05d}.{ext}" for r in ranks for ext in ("json", "safetensors")
        }
        assert _names(newest) == expected, prefix
    shutil.rmtree(base / "node1")
    out = _run(warm_ranks, script, base, 3, "auto", "per-node", str(tier))
    assert _resumed(out) == {3}, out
    assert _finals(out) == reference
    assert _names(base / "node1" / "step_0000000003") == {
        "manifest.json", "rank_00002.json", "rank_00002.safetensors", "rank_00003.json",
        "rank_00003.safetensors",
    }  # fmt: skip

    # A part damaged on one node's disk: every node downloads its part of the same step again
    # (no node can tell the damage was not its own), rather than fall back a step.
    shard = base / "node0" / "step_0000000003" / "rank_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    out = _run(warm_ranks, script, base, 3, "auto", "per-node", str(tier))
    assert _resumed(out) == {3}, out
    assert _finals(out) == reference

    shutil.rmtree(base / "node1")
    out = _run(warm_ranks, script, base, 3)
    assert _resumed(out) == {0}, out
    assert "not whole on every node" in out
    assert _finals(out) == reference


def test_another_layout_of_ranks_is_refused_on_every_rank_and_changes_nothing(
    tmp_path: Path, warm_ranks: Any, script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each node's disk holds its own ranks' part only: a run with another world size, or other
    ranks per node, or on one node (its root then taken as shared), can read none of them. It must say so rather than start from step 0 with
    the checkpoints still on the disks, and leave them as they were."""
    base = tmp_path / "run"
    _run(warm_ranks, script, base, 3)  # 4 ranks, 2 per node
    saved = {p: p.read_bytes() for p in base.glob("node*/step_*/*")}
    assert len(saved) == 2 * 2 * (1 + 2 * 2)  # 2 steps on 2 nodes: a manifest, 2 ranks' files
    for nproc, per_node, now in ((2, 1, "2 ranks on 2 nodes (ranks 0 | 1)"),
                                 (4, 1, "4 ranks on 4 nodes (ranks 0 | 1 | 2 | 3)"),
                                 (4, 4, "4 ranks on 1 node (ranks 0-3)")):  # fmt: skip
        monkeypatch.setenv("RANKS_PER_NODE", str(per_node))
        launch = warm_ranks.run(script, [str(base), "5", "auto", "per-node"], nproc=nproc)
        assert all(code != 0 for code in launch.exit_codes), launch.output
        assert "resumed" not in launch.output
        # (Every rank failed; the ranks' tracebacks interleave, so the text is looked for once.)
        assert "ConfigError: checkpoint step 3 (" in launch.output, launch.output
        assert "by 4 ranks on 2 nodes (ranks 0-1 | 2-3)" in launch.output
        assert f"this run has {now}" in launch.output
        assert "crashproof run --nnodes 2 --nproc-per-node 2" in launch.output
        assert {p: p.read_bytes() for p in base.glob("node*/step_*/*")} == saved
    monkeypatch.delenv("RANKS_PER_NODE")
    assert _resumed(_run(warm_ranks, script, base, 5)) == {3}

    # Saved on one node (its root holds every rank's files), resumed on two: the second node's
    # disk holds nothing of it. And one node's root holding an older checkpoint saved on one
    # node beside a newer node's part: the older one restores (the part is passed over).
    one = tmp_path / "one"
    monkeypatch.setenv("RANKS_PER_NODE", "4")
    _run(warm_ranks, script, one, 1)
    monkeypatch.delenv("RANKS_PER_NODE")
    launch = warm_ranks.run(script, [str(one), "2", "auto", "per-node"], nproc=4)
    assert all(code != 0 for code in launch.exit_codes), launch.output
    assert "saved in one root by 4 ranks on 1 node (ranks 0-3)" in launch.output
    assert "this run has 4 ranks on 2 nodes (ranks 0-1 | 2-3)" in launch.output
    shutil.copytree(base / "node0" / "step_0000000005", one / "node0" / "step_0000000005")
    monkeypatch.setenv("RANKS_PER_NODE", "4")
    assert _resumed(_run(warm_ranks, script, one, 1)) == {1}


@pytest.mark.parametrize(
    ("scope", "layout", "says"),
    [
        ("shared", "per-node", "root_scope='node'"),  # the hint to the user
        ("node", "one", "it is shared, not a disk of each node's own"),
    ],
)
def test_a_root_that_is_not_what_root_scope_says_is_refused_on_every_rank(
    tmp_path: Path, warm_ranks: Any, script: Path, scope: str, layout: str, says: str
) -> None:
    out = _run(warm_ranks, script, tmp_path / "run", 1, scope, layout)
    assert out.count("refused") == 4, out
    assert says in out, out
    assert not list((tmp_path / "run").rglob("step_*")), "a checkpoint was committed"


_REFUSING = """
import os, sys, torch, torch.distributed as dist
import crashproof as cp
from crashproof.storage import LocalStorage

base, phase = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
node = rank // int(os.environ.get("RANKS_PER_NODE", "2"))
os.environ["CRASHPROOF_NODE"] = f"n{node}"


class Refusing(LocalStorage):
    # Node 1's disk refuses the second save's commit: writing its manifest (prepare) or
    # renaming its directory (commit), as a full or failing disk would.
    def create(self, path):
        if phase == "prepare" and "step_0000000002" in path and path.endswith("manifest.json"):
            raise OSError(5, "Input/output error (refused by the test)", path)
        return super().create(path)

    def publish(self, tmp_dir, final_dir, *, commit_marker=None):
        if phase == "publish" and final_dir.endswith("step_0000000002"):
            raise OSError(5, "Input/output error (refused by the test)", final_dir)
        return super().publish(tmp_dir, final_dir, commit_marker=commit_marker)


dist.init_process_group("gloo")
state = cp.TrainState(model=torch.nn.Linear(4, 4))
root = os.path.join(base, f"node{rank // 2}")
storage = Refusing() if rank // 2 == 1 and phase != "restore" else None
with cp.CheckpointManager(root, async_save=False, handle_signals=False, root_scope="node",
                          storage=storage) as manager:
    if phase == "restore":
        sys.stdout.write(f"\\nrank {rank}: resumed {manager.restore(state)}\\n")
    else:
        manager.save(1, state)
        try:
            manager.save(2, state)
            sys.stdout.write(f"\\nrank {rank}: committed\\n")
        except cp.CheckpointWriteError as exc:
            sys.stdout.write(f"\\nrank {rank}: not committed: {exc}\\n")
    sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("phase", ["prepare", "publish"])
def test_a_node_failing_either_phase_fails_the_save_everywhere_and_leaves_no_part(
    tmp_path: Path, warm_ranks: Any, phase: str
) -> None:
    """Node 1 cannot write its manifest (prepare), or cannot rename its directory once every
    node prepared (commit; node 0 has published by then): the save fails on every rank, no
    node keeps a part of step 2, step 1 stays, and a restart resumes from it."""
    script = tmp_path / "refusing.py"
    script.write_text(_REFUSING)
    base = tmp_path / "run"
    launch = warm_ranks.run(script, [str(base), phase], nproc=4, timeout=180)
    assert launch.exit_codes == [0, 0, 0, 0], launch.output
    assert len(re.findall(r"rank \d: not committed", launch.output)) == 4, launch.output
    assert "refused by the test" in launch.output
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (base / node).iterdir() if p.name.startswith(("step_", ".tmp"))) == [
            "step_0000000001"
        ], (node, launch.output)  # fmt: skip
    launch = warm_ranks.run(script, [str(base), "restore"], nproc=4, timeout=180)
    assert launch.exit_codes == [0, 0, 0, 0], launch.output
    assert _resumed(launch.output) == {1}, launch.output
