"""Two real ranks under torchrun (gloo, DDP): parallel per-rank saves, one commit, exact resume."""

from __future__ import annotations

import io
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import crashproof as cp
from tests.conftest import EXAMPLES, free_port, run_python, warm_context
from tests.warm_ranks import WarmRanks

STEPS = 30


def _torchrun(
    run_dir: Path, log: Path, *extra: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    args = [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(EXAMPLES / "train_tiny.py"), "--run-dir", str(run_dir), "--steps", str(STEPS),
        "--every", "5", "--workers", "1", "--step-log", str(log), *extra,
    ]  # fmt: skip
    return run_python(args, check=check, timeout=240)


def test_two_ranks_resume_bit_identical_after_a_crash(tmp_path: Path) -> None:
    _torchrun(tmp_path / "ref", tmp_path / "ref.log", "--dump", str(tmp_path / "ref.safetensors"))
    crashed = _torchrun(tmp_path / "run", tmp_path / "run.log", "--crash-at", "17", check=False)
    assert crashed.returncode != 0
    resumed = _torchrun(
        tmp_path / "run", tmp_path / "run.log", "--dump", str(tmp_path / "run.safetensors")
    )
    # Where it resumed: a restore that found nothing would replay from step 0 to the same end.
    # (Step 15's asynchronous save may not have committed before the crash after step 17.)
    starts = re.findall(r"starting at step (\d+)", resumed.stdout)
    assert len(starts) == 2 and len(set(starts)) == 1, resumed.stdout + resumed.stderr
    assert starts[0] in ("10", "15"), resumed.stdout

    expected, resumed = (
        load_file(tmp_path / "ref.safetensors"),
        load_file(tmp_path / "run.safetensors"),
    )
    assert expected.keys() == resumed.keys()
    assert [k for k in expected if not torch.equal(expected[k], resumed[k])] == []
    for rank in (0, 1):  # each rank saw the same samples at every step as in the reference run
        ref = {
            r["step"]: r
            for r in map(json.loads, (tmp_path / f"ref.log.rank{rank}").read_text().splitlines())
        }
        run = {
            r["step"]: r
            for r in map(json.loads, (tmp_path / f"run.log.rank{rank}").read_text().splitlines())
        }
        assert run == ref

    # One checkpoint per step, holding both ranks' files, committed by one manifest.
    checkpoints = cp.CheckpointManager(str(tmp_path / "run" / "checkpoints")).list()
    assert [c.step for c in checkpoints] == [30, 25, 20]
    assert all(c.valid and c.world_size == 2 for c in checkpoints)
    newest = tmp_path / "run" / "checkpoints" / "step_0000000030"
    assert sorted(p.name for p in newest.iterdir()) == [
        "manifest.json", "rank_00000.json", "rank_00000.safetensors", "rank_00001.json", "rank_00001.safetensors",
    ]  # fmt: skip
    cp.checkpoint.verify_checkpoint(cp.LocalStorage(), str(newest))


def test_replicated_state_is_written_once_spread_over_the_ranks(
    tmp_path: Path, warm_ranks: WarmRanks
) -> None:
    args = ["--run-dir", str(tmp_path / "run"), "--steps", str(STEPS), "--every", "5", "--sync"]
    launch = warm_ranks.run(EXAMPLES / "train_tiny.py", [*args, "--workers", "1"], nproc=2)
    assert launch.returncode == 0, launch.output[-3000:]
    newest = tmp_path / "run" / "checkpoints" / "step_0000000030"
    indexes = [json.loads((newest / f"rank_0000{r}.json").read_text()) for r in (0, 1)]
    by_name = [{t["name"]: t for t in index["tensors"]} for index in indexes]
    assert list(by_name[0]) == list(by_name[1])  # every rank's index lists every tensor
    owned = [0, 0]
    for name, mine in by_name[0].items():
        theirs = by_name[1][name]
        if name.startswith(("model/", "optimizer/")):  # DDP: the same on both, stored once
            files = (mine.get("file"), theirs.get("file"))
            assert files in ((None, "rank_00000.safetensors"), ("rank_00001.safetensors", None))
            assert (mine["offset"], mine["checksum"]) == (theirs["offset"], theirs["checksum"])
            owned[0 if files[0] is None else 1] += mine["nbytes"]
        else:  # per-rank state (RNG, data position, EMA) stays in each rank's own shard
            assert "file" not in mine and "file" not in theirs
    assert min(owned) > 0.3 * sum(owned), owned  # both ranks write a fair share
    per_rank = [
        sum(t["nbytes"] for n, t in names.items() if not n.startswith(("model/", "optimizer/")))
        for names in by_name
    ]
    shards = sum((newest / f"rank_0000{r}.safetensors").stat().st_size for r in (0, 1))
    assert shards < sum(owned) + sum(per_rank) + 64 * 1024  # once, not twice (headers aside)
    cp.checkpoint.verify_checkpoint(cp.LocalStorage(), str(newest))


def _two_ranks(target: Any, root: str) -> tuple[list[Any], list[int | None]]:
    """Run ``target(rank, root, port, queue)`` as ranks 0 and 1 of a gloo job in spawned
    processes; returns what each put on the queue (one item each, in the order they came) and
    their exit codes (None: still running after a minute, then killed)."""
    ctx = warm_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, root, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    outcomes = [queue.get(timeout=120) for _ in procs]
    codes: list[int | None] = []
    for p in procs:
        p.join(60)
        codes.append(p.exitcode)
        if p.is_alive():
            p.kill()
            p.join(30)
    return outcomes, codes


def _diverging_ranks(rank: int, root: str, port: int, out: Any) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    with torch.no_grad():
        if rank == 1:
            model.module.weight[0, 0] += 1.0  # out of sync: a bug DDP does not catch by itself
    ckpt = cp.CheckpointManager(root, async_save=False, handle_signals=False)
    try:
        ckpt.save(1, cp.TrainState(model=model))
        out.put((rank, "committed"))
    except cp.CheckpointWriteError as exc:
        out.put((rank, str(exc)))
    ckpt.close()
    torch.distributed.destroy_process_group()


def test_replicated_state_that_differs_between_ranks_fails_the_save(tmp_path: Path) -> None:
    outcomes = dict(_two_ranks(_diverging_ranks, str(tmp_path / "ckpt"))[0])
    assert all("have diverged" in outcomes[r] for r in (0, 1)), outcomes
    assert not list((tmp_path / "ckpt").glob("step_*"))


def _batchnorm_ranks(rank: int, root: str, port: int, out: Any) -> None:
    """DDP with BatchNorm: each rank's running statistics follow its own batches."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = cp.TrainState(model=model, optimizer=optimizer)
    with cp.CheckpointManager(root, async_save=False, handle_signals=False) as ckpt:
        if ckpt.restore(state) == 0:
            gen = torch.Generator().manual_seed(rank)
            for _ in range(3):
                model(torch.randn(8, 4, generator=gen) * (rank + 1)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            ckpt.save(3, state)
    # Plain bytes, not tensors: a tensor sent through a torch queue travels as a file descriptor
    # that the parent fetches from this process, which may have exited by then.
    buffer = io.BytesIO()
    torch.save(model.module.state_dict(), buffer)
    out.put((rank, buffer.getvalue()))
    torch.distributed.destroy_process_group()


def _spawn_batchnorm_ranks(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    outcomes, codes = _two_ranks(_batchnorm_ranks, str(root))
    assert codes == [0, 0]
    states = dict(outcomes)
    return {rank: torch.load(io.BytesIO(data), weights_only=True) for rank, data in states.items()}


def test_ddp_buffers_that_differ_between_ranks_are_saved_per_rank_and_restore_anywhere(
    tmp_path: Path,
) -> None:
    saved = _spawn_batchnorm_ranks(tmp_path / "ckpt")
    mean = "1.running_mean"
    assert not torch.equal(saved[0][mean], saved[1][mean])  # the ranks' statistics differ
    assert torch.equal(saved[0]["0.weight"], saved[1]["0.weight"])  # the parameters do not

    # Parameters written once (rank 1's index points into rank 0's file or the other way round),
    # each rank's buffers in its own file.
    newest = tmp_path / "ckpt" / "step_0000000003"
    indexes = [json.loads((newest / f"rank_0000{r}.json").read_text()) for r in (0, 1)]
    by_name = [{t["name"]: t.get("file") for t in index["tensors"]} for index in indexes]
    files = {name: [by_name[0][name], by_name[1][name]] for name in by_name[0]}
    assert all(None in files[f"model/{k}"] and files[f"model/{k}"] != [None, None]
               for k in ("0.weight", "0.bias", "1.weight", "1.bias")), files  # fmt: skip
    assert files[f"model/{mean}"] == [None, None], files

    # The same world size: every rank gets its own statistics back, bit for bit.
    restored = _spawn_batchnorm_ranks(tmp_path / "ckpt")
    for rank in (0, 1):
        for name, tensor in saved[rank].items():
            assert torch.equal(restored[rank][name], tensor), (rank, name)

    # One rank: rank 0's statistics, the common parameters.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with cp.CheckpointManager(tmp_path / "ckpt", handle_signals=False) as ckpt:
        assert ckpt.restore(cp.TrainState(model=model, optimizer=optimizer)) == 3
    for name, tensor in saved[0].items():
        assert torch.equal(model.state_dict()[name], tensor), name


def _rank0_saves_alone(rank: int, root: str, port: int, out: Any) -> None:
    """The tutorial's habit: ``if rank == 0: save()``; rank 1 goes on without saving."""
    import logging

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("crashproof.checkpoint").addHandler(Keep())
    model = torch.nn.Linear(4, 4)
    ckpt = cp.CheckpointManager(root, async_save=False, handle_signals=False, timeout_s=14)
    started = time.monotonic()
    if rank == 0:
        try:
            ckpt.save(1, cp.TrainState(model=model))
            out.put((rank, "committed", said, 0.0))
        except cp.CheckpointWriteError as exc:
            out.put((rank, str(exc), said, time.monotonic() - started))
    else:
        time.sleep(16)  # training on, never calling save
        out.put((rank, "trained", said, 0.0))


def test_a_save_called_on_one_rank_only_names_the_others_within_seconds(tmp_path: Path) -> None:
    outcomes = {
        r: (what, said, waited)
        for r, what, said, waited in _two_ranks(_rank0_saves_alone, str(tmp_path / "ckpt"))[0]
    }
    what, said, waited = outcomes[0]
    # named within seconds (the ERROR line), given up on at the manager's timeout (not 600 s)
    late = [line for line in said if "have not come after" in line]
    assert late and "ranks 1 have not come" in late[0] and "Saves are collective" in late[0], said
    assert "the save of step 1: ranks 1 did not come within 14 s" in what, what
    assert 14 <= waited < 30
    assert not list((tmp_path / "ckpt").glob("step_*"))
