"""Re-saving a step never leaves a moment with no restorable copy of it.

A real process saves step 2, then saves step 2 again with other values, and SIGKILLs itself at
one point of the publish sequence (the ``CRASHPROOF_CHAOS_PUBLISH_KILL`` seam of
:mod:`crashproof.storage._local`): every point, both with the atomic name swap
(``renameat2(RENAME_EXCHANGE)``) and with the two-rename fallback of filesystems without it.
After the kill, a new writer must restore step 2, exactly the old or exactly the new values. The
review's case: the kill between moving the old copy aside and renaming the new one into place.

The object-store publish (copy, marker last) is cut at every storage call in-process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import crashproof as cp
from crashproof.checkpoint import describe_checkpoint
from crashproof.checkpoint.format._names import MANIFEST_NAME, checkpoint_dir_name
from crashproof.checkpoint.root._catalog import recover_interrupted
from crashproof.storage import FsspecStorage, LocalStorage, MemoryStorage
from crashproof.storage._local import PUBLISH_POINTS

STEP2 = checkpoint_dir_name(2)

# One process imports torch once and forks a child per scenario (torch's import dominates).
_DRIVER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import crashproof as cp
    from crashproof.storage import _local

    def state(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(8, 4)
        return cp.TrainState(model=model)

    def scenario(root, point, fallback, resave):
        if fallback:  # a filesystem that cannot swap two names in one step
            _local._exchange = lambda a, b: False
        mgr = cp.CheckpointManager(root, async_save=False, handle_signals=False)
        mgr.save(1, state(1))
        if resave:
            mgr.save(2, state(2))
        os.environ[_local.ENV_PUBLISH_KILL] = point
        mgr.save(2, state(3))  # killed inside, if the sequence has this point
        os._exit(0)

    for line in sys.stdin:
        root, point, fallback, resave = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                scenario(root, point, fallback, resave)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        print(json.dumps([root, os.waitstatus_to_exitcode(status)]), flush=True)
    """
)

# Which points each sequence passes (a point it does not pass lets the save finish: exit 0).
_EXCHANGE = {"publish:start", "publish:synced", "publish:exchanged", "publish:durable"}
_FALLBACK = {"publish:start", "publish:synced", "publish:set-aside", "publish:renamed"}
_FALLBACK |= {"publish:durable"}
_FIRST = {"publish:start", "publish:synced", "publish:renamed", "publish:durable"}


def _weights(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _restored(root: Path) -> tuple[int, torch.Tensor]:
    torch.manual_seed(99)
    model = torch.nn.Linear(8, 4)
    with cp.CheckpointManager(str(root), handle_signals=False) as mgr:
        step = mgr.restore(cp.TrainState(model=model))
    return step, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, bool], Any]:
    base = tmp_path_factory.mktemp("publish")
    scenarios = [
        (point, fallback, resave)
        for point in PUBLISH_POINTS
        for fallback in (False, True)
        for resave in (True, False)
    ]
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    results: dict[tuple[str, bool, bool], Any] = {}
    try:
        for i, (point, fallback, resave) in enumerate(scenarios):
            root = base / f"s{i}"
            proc.stdin.write(json.dumps([str(root), point, fallback, resave]) + "\n")
            proc.stdin.flush()
            _, code = json.loads(proc.stdout.readline())
            # Before anything recovers: what a reader finds where restore looks.
            info = describe_checkpoint(LocalStorage(), 2, str(root / STEP2))
            results[(point, fallback, resave)] = (root, code, info.valid)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return results


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("point", PUBLISH_POINTS)
def test_a_kill_at_any_point_of_a_resave_leaves_step_2_restorable(
    outcomes: dict[tuple[str, bool, bool], Any], point: str, fallback: bool
) -> None:
    root, code, valid_in_place = outcomes[(point, fallback, True)]
    passes = (_FALLBACK if fallback else _EXCHANGE) | {"remove:renamed"}
    assert code == (-signal.SIGKILL if point in passes else 0), "the kill point was not reached"
    if not fallback or point != "publish:set-aside":
        # With the swap there is no moment without step 2 in place; nor after the fallback's
        # second rename.
        assert valid_in_place, f"no complete step 2 where restore looks after a kill at {point}"
    step, weights = _restored(root)  # a new writer: start-up recovery runs first
    assert step == 2
    assert torch.equal(weights, _weights(2)) or torch.equal(weights, _weights(3))
    if code == 0 or point in (
        "publish:exchanged",
        "publish:renamed",
        "publish:durable",
        "remove:renamed",
    ):
        assert torch.equal(weights, _weights(3)), "the new copy was in place"
    leftovers = [n for n in os.listdir(root) if n.startswith(".")]
    assert leftovers == [], f"recovery left {leftovers}"


@pytest.mark.parametrize("point", sorted(_FIRST))
def test_a_kill_while_publishing_a_new_step_leaves_the_older_one_or_the_new_one(
    outcomes: dict[tuple[str, bool, bool], Any], point: str
) -> None:
    root, code, _ = outcomes[(point, False, False)]
    assert code == -signal.SIGKILL
    step, weights = _restored(root)
    assert (step, True) in ((1, torch.equal(weights, _weights(1))), (2, True))
    if step == 2:
        assert torch.equal(weights, _weights(3))


class _CutFs:
    """An fsspec memory filesystem whose ``n``-th mutating call (and every later one) fails, as
    a process killed there would leave it."""

    def __init__(self, n: int) -> None:
        import fsspec

        self._fs = fsspec.filesystem("memory", skip_instance_cache=True)
        self._fs.store.clear()
        self._fs.pseudo_dirs.clear()
        self.calls, self.n = 0, n

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if name not in ("rm", "copy", "pipe_file", "cp_file", "rm_file", "put_file", "mv"):
            return attr

        def cut(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls >= self.n:
                raise KeyboardInterrupt("killed")
            return attr(*args, **kwargs)

        return cut


def _write_ckpt(storage: Any, directory: str, step: int, payload: bytes) -> None:
    """A real checkpoint of ``step`` under ``directory``, saved by a manager elsewhere."""
    src = MemoryStorage()
    torch.manual_seed(int.from_bytes(payload[:1], "little"))
    with cp.CheckpointManager("/src", storage=src, async_save=False, handle_signals=False) as m:
        m.save(step, cp.TrainState(model=torch.nn.Linear(8, 4)))
    ckpt = f"/src/{checkpoint_dir_name(step)}"
    storage.make_dirs(directory)
    for name in src.list(ckpt):
        stream = storage.create(storage.join(directory, name))
        stream.write(src.get_bytes(f"{ckpt}/{name}"))
        stream.commit()


@pytest.mark.parametrize("cut_at", range(1, 12))
def test_an_object_store_publish_cut_anywhere_is_recovered(cut_at: int) -> None:
    fs = _CutFs(10**9)
    storage = FsspecStorage(fs, "memory")
    root = "memory://root"
    _write_ckpt(storage, f"{root}/{STEP2}", 2, b"\x01")
    tmp = f"{root}/.tmp-{STEP2}-abc"
    _write_ckpt(storage, tmp, 2, b"\x02")
    fs.calls, fs.n = 0, cut_at
    with contextlib.suppress(KeyboardInterrupt):
        storage.publish(tmp, f"{root}/{STEP2}", commit_marker=MANIFEST_NAME)
    fs.n = 10**9  # the next process: nothing fails
    recover_interrupted(storage, root)
    assert describe_checkpoint(storage, 2, f"{root}/{STEP2}").valid


@pytest.mark.parametrize("step", [-1, 2**62 + 1, 2**63 - 1, 2**63, 10**30])
def test_a_step_no_reader_could_read_back_is_refused_before_anything_is_written(
    tmp_path: Path, step: int
) -> None:
    """A manifest records steps up to 2**62: a larger one would commit a checkpoint that every
    reader refuses, after retention removed the good one before it."""
    model = torch.nn.Linear(4, 4)
    state = cp.TrainState(model=model)
    with cp.CheckpointManager(
        tmp_path, keep=cp.KeepLast(1), async_save=False, handle_signals=False
    ) as ckpt:
        ckpt.save(100, state)
        with pytest.raises(cp.ConfigError, match="step"):
            ckpt.save(step, state)
        with pytest.raises(cp.ConfigError, match="step"):
            ckpt.maybe_save(step, state)
        ckpt.save(2**62, state)  # the largest that round-trips
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        checkpoint_dir_name(2**62)
    ]
    with cp.CheckpointManager(tmp_path, read_only=True, handle_signals=False) as reader:
        assert reader.restore(cp.TrainState(model=torch.nn.Linear(4, 4))) == 2**62


def test_a_script_that_ends_without_close_is_told_its_last_save_may_be_lost(
    tmp_path: Path,
) -> None:
    """A loop ported from a tutorial often ends without ``close()``: the save in flight is then
    lost, and the process must say so rather than end in silence."""
    script = textwrap.dedent(
        """
        import sys, torch, crashproof as cp
        model = torch.nn.Linear(4, 4)
        ckpt = cp.CheckpointManager(sys.argv[1], every=cp.EverySteps(1), handle_signals=False)
        for step in range(1, 4):
            ckpt.maybe_save(step, cp.TrainState(model=model))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "root")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "was not closed" in done.stderr and "ckpt.close()" in done.stderr, done.stderr


def _linear_with(value: float) -> torch.nn.Linear:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


@pytest.mark.parametrize("when", ["after the manifest", "after the index"])
def test_a_reader_caught_mid_read_by_a_resave_reads_the_step_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Step 2 saved again (the copies swap names) between a reader's read of the manifest and
    of the files: the reader sees one copy's manifest with the other's files. That is no
    corruption: it reads step 2 again and gets the new copy, never falling back to step 1."""
    root, other = tmp_path / "root", tmp_path / "other"
    with cp.CheckpointManager(root, handle_signals=False, keep=cp.KeepAll()) as ckpt:
        for step, value in ((1, 1.0), (2, 2.0)):
            ckpt.save(step, cp.TrainState(model=_linear_with(value)))
    with cp.CheckpointManager(other, handle_signals=False) as ckpt:
        ckpt.save(2, cp.TrainState(model=_linear_with(5.0)))  # the new copy of step 2
    step2 = root / checkpoint_dir_name(2)

    from crashproof.checkpoint.restore import _fan_out, _rank_read

    swapped: list[bool] = []

    def swap_once() -> None:
        if not swapped:  # what the writer's exchange of names does, between two reads
            swapped.append(True)
            os.rename(step2, tmp_path / "old-copy")
            os.rename(other / checkpoint_dir_name(2), step2)

    if when == "after the manifest":
        real = _fan_out.read_manifest  # (where a restore reads it: rank 0's plan)

        def read_then_swap(storage: Any, path: str) -> Any:
            manifest = real(storage, path)
            if path.endswith(checkpoint_dir_name(2)):
                swap_once()
            return manifest

        monkeypatch.setattr(_fan_out, "read_manifest", read_then_swap)
    else:
        real_index = _rank_read.read_rank_index

        def index_then_swap(storage: Any, path: str, *args: Any) -> Any:
            index = real_index(storage, path, *args)
            if path.endswith(checkpoint_dir_name(2)):
                swap_once()
            return index

        monkeypatch.setattr(_rank_read, "read_rank_index", index_then_swap)

    model = _linear_with(0.0)
    with cp.CheckpointManager(root, handle_signals=False, read_only=True) as reader:
        assert reader.restore(cp.TrainState(model=model)) == 2
    assert swapped
    assert all(bool((p == 5.0).all()) for p in model.parameters())


def test_a_forked_child_that_exits_is_not_told_its_parents_manager_was_not_closed(
    tmp_path: Path,
) -> None:
    """A child forked from a process with an open manager (a DataLoader worker, a helper) runs
    the parent's exit handlers when it exits normally; the manager is not the child's to close,
    so only the process that created it may say it was never closed."""
    script = textwrap.dedent(
        """
        import os, sys, crashproof as cp
        ckpt = cp.CheckpointManager(sys.argv[1], handle_signals=False)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: the inherited exit handlers run
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        print("child done", flush=True)
        if sys.argv[2] == "close":
            ckpt.close()
        """
    )
    done = subprocess.run(  # a fresh interpreter: its exit handlers are the real ones
        [sys.executable, "-c", script, str(tmp_path / "root"), "close"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "child done" in done.stdout, done.stderr
    assert "was not closed" not in done.stderr, done.stderr
