"""One writer per root: a second writer is refused at once, readers change nothing.

The review found an evaluator (``CheckpointManager(root)`` + ``restore()`` in a loop) deleting the
trainer's saves in progress, and a second trainer's ``KeepLast(2)`` deleting every checkpoint of
the first. Here the attacker is that second process, that evaluator, a crashed writer's lock
left behind, a lock from another host, and a second writer on an object store (no lock there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import crashproof as cp
from crashproof.checkpoint.root import _lock, _lock_holder
from crashproof.checkpoint.root._lock_file import LOCK_NAME
from crashproof.errors import CheckpointWriteError, ConfigError, RootLockedError
from crashproof.storage import MemoryStorage
from tests.warm_ranks import crashproof_cli, python


def _state(seed: int = 0) -> cp.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return cp.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root`` (not following links): inode, size, mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
            )
    return out


def _manager(root: Path, **kw: Any) -> cp.CheckpointManager:
    return cp.CheckpointManager(str(root), async_save=False, handle_signals=False, **kw)


def test_a_second_writer_in_the_same_process_fails_naming_the_holder(tmp_path: Path) -> None:
    first = _manager(tmp_path)
    with pytest.raises(CheckpointWriteError) as info:
        _manager(tmp_path, keep=cp.KeepLast(2))
    message = str(info.value)
    assert f"pid {os.getpid()}" in message and socket.gethostname() in message
    assert "read_only=True" in message and LOCK_NAME in message
    first.close()
    assert not (tmp_path / LOCK_NAME).exists(), "close() must let go of the root"
    _manager(tmp_path).close()  # and the next writer opens it


def test_the_lock_file_names_host_pid_and_start_time(tmp_path: Path) -> None:
    with _manager(tmp_path):
        data = json.loads((tmp_path / LOCK_NAME).read_text())
    assert data["host"] == socket.gethostname()
    assert data["pid"] == os.getpid()
    assert data["process_start"] == _lock_holder.process_start(os.getpid()) != ""
    assert abs(data["since_unix"] - time.time()) < 60


_HOLDER = textwrap.dedent(
    """
    import sys, time
    import crashproof as cp
    mgr = cp.CheckpointManager(sys.argv[1], keep=cp.KeepLast(1), handle_signals=False)
    print("LOCKED", flush=True)
    if sys.argv[2] == "die":
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    """
)


def _holder(root: Path, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root), mode], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    if mode == "hold":
        assert proc.stdout.readline().strip() == "LOCKED"
    return proc


def test_a_second_trainer_process_fails_and_the_first_ones_checkpoints_survive(
    tmp_path: Path,
) -> None:
    with _manager(tmp_path) as first:
        for step in (1, 2, 3):
            first.save(step, _state(step))
    before = sorted(p.name for p in tmp_path.iterdir())
    holder = _holder(tmp_path, "hold")
    try:
        with pytest.raises(CheckpointWriteError, match=f"pid {holder.pid} on host"):
            _manager(tmp_path, keep=cp.KeepLast(1))
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME) == before
    finally:
        holder.kill()
        holder.wait()


def test_an_evaluator_looping_over_restore_never_touches_the_trainers_save_in_progress(
    tmp_path: Path,
) -> None:
    with _manager(tmp_path) as trainer:
        trainer.save(1, _state())
    trainer = _manager(tmp_path)  # the writer, alive
    # A save in progress, as the trainer's writer thread leaves it between two files.
    inflight = tmp_path / ".tmp-step_0000000002-abcd1234-1"
    inflight.mkdir()
    (inflight / "rank_00000.safetensors").write_bytes(b"half a shard")
    (tmp_path / ".trash-step_0000000000-deadbeef").mkdir()
    before = _tree(tmp_path)
    # The review's evaluator, verbatim: now refused at once instead of deleting the save.
    with pytest.raises(CheckpointWriteError, match="read_only=True"):
        cp.CheckpointManager(str(tmp_path)).restore(_state(1))
    for _ in range(20):
        with cp.CheckpointManager(str(tmp_path), read_only=True) as reader:
            assert reader.restore(_state(1)) == 1
            assert [c.step for c in reader.list()] == [1]
    assert _tree(tmp_path) == before
    trainer.close()


def test_a_reader_changes_nothing_in_a_root_full_of_leftovers(tmp_path: Path) -> None:
    """No writer alive at all, so nothing protects the leftovers but read_only itself."""
    with _manager(tmp_path) as writer:
        writer.save(1, _state())
        writer.save(2, _state(2))
    (tmp_path / "step_0000000002" / "manifest.json").unlink()  # an incomplete checkpoint
    for name in (".tmp-step_0000000003-x", ".trash-step_0000000001-y", ".replaced-step_1-z"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"x")
    (tmp_path / LOCK_NAME).write_text('{"host": "h", "pid": 1, "since_unix": 0}')
    before = _tree(tmp_path)
    reader = cp.CheckpointManager(str(tmp_path), read_only=True, handle_signals=False)
    assert reader.restore(_state(3)) == 1
    reader.list()
    for call in (
        lambda: reader.save(3, _state()),
        lambda: reader.maybe_save(3, _state()),
        lambda: reader.prune(cp.KeepLast(1)),
        lambda: reader.rollback(_state(), before=2, anomaly_step=2),
    ):
        with pytest.raises(ConfigError, match="read_only=True"):
            call()
    reader.close()
    for argv in (["ls", str(tmp_path)], ["verify", str(tmp_path)], ["inspect", str(tmp_path)]):
        _cli(argv)
    assert _tree(tmp_path) == before


def _cli(argv: list[str]) -> None:
    from crashproof.cli import main

    main(argv)


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = _holder(tmp_path, "die")
    assert holder.wait(timeout=60) == -signal.SIGKILL
    left = json.loads((tmp_path / LOCK_NAME).read_text())
    assert left["pid"] == holder.pid  # the crash left its lock file behind
    with caplog.at_level(logging.WARNING, logger="crashproof.checkpoint"):
        mgr = _manager(tmp_path)
    assert any(
        "taking over the lock" in r.message and str(holder.pid) in r.message for r in caplog.records
    )
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    mgr.close()


def test_a_reused_pid_does_not_keep_a_dead_writers_lock(tmp_path: Path) -> None:
    """The lock file names a pid that is alive now, but as another process (start time)."""
    me = _lock._me()
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"host": me.host, "pid": 1, "process_start": "other-boot:1", "since_unix": 0})
    )
    _manager(tmp_path).close()


def test_a_live_process_named_in_an_unlocked_lock_file_is_not_taken_over(tmp_path: Path) -> None:
    """The flock is free (say, a filesystem whose locks do not reach here) but the holder lives."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        start = _lock_holder.process_start(sleeper.pid)
        (tmp_path / LOCK_NAME).write_text(
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": sleeper.pid,
                    "process_start": start,
                    "since_unix": 0,
                }
            )
        )
        with pytest.raises(CheckpointWriteError, match=f"pid {sleeper.pid}"):
            _manager(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
    _manager(tmp_path).close()  # once it is gone, the lock is stale


def test_another_hosts_lock_is_never_taken_over_and_the_message_says_how_to_clear_it(
    tmp_path: Path,
) -> None:
    lock = tmp_path / LOCK_NAME
    lock.write_text(
        json.dumps({"host": "gpu-node-17", "pid": 4242, "process_start": "", "since_unix": 0})
    )
    with pytest.raises(CheckpointWriteError) as info:
        _manager(tmp_path)
    assert "gpu-node-17" in str(info.value) and "delete the lock file" in str(info.value)
    assert json.loads(lock.read_text())["host"] == "gpu-node-17", "left as it was"
    lock.unlink()
    _manager(tmp_path).close()


class _Rank:
    """A group as one rank of a two-rank job sees it; rank 0's broadcast value is given."""

    def __init__(self, rank: int, rank0_error: str | None = None) -> None:
        self.rank, self.world_size = rank, 2
        self._says = {"error": rank0_error, "lock": None}  # (no lock to look for: an object store)

    def broadcast(self, obj: Any) -> Any:
        return obj if self.rank == 0 else self._says

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj, obj]


def test_only_rank_0_locks_and_every_rank_fails_when_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crashproof.checkpoint import manager as manager_module

    monkeypatch.setattr(manager_module, "default_group", lambda timeout_s=0: _Rank(1))
    rank1 = _manager(tmp_path)
    assert not (tmp_path / LOCK_NAME).exists(), "a rank that does not commit takes no lock"
    holder = _holder(tmp_path, "hold")  # a writer holds the root: rank 0 will fail ...
    try:
        monkeypatch.setattr(
            manager_module, "default_group", lambda timeout_s=0: _Rank(1, "locked by pid 1")
        )
        with pytest.raises(CheckpointWriteError, match="rank 0 cannot write"):
            _manager(tmp_path)  # ... and rank 1 hears it, instead of waiting in a collective
    finally:
        holder.kill()
        holder.wait()
    rank1._shared.closed = True  # never started anything


def test_a_second_writer_on_an_object_store_is_detected_and_deletes_nothing() -> None:
    storage = MemoryStorage()  # no lock there: the duty is the user's, detection is ours
    first = cp.CheckpointManager(
        "/run", storage=storage, keep=cp.KeepLast(1), async_save=False, handle_signals=False
    )
    first.save(1, _state())
    second = cp.CheckpointManager(
        "/run", storage=storage, keep=cp.KeepLast(1), async_save=False, handle_signals=False
    )
    second.save(2, _state(2))  # retention of the second: step 1 was there at its start
    first.save(3, _state(3))  # the first sees step 2, which it did not commit
    names = set(storage.list("/run"))
    assert "step_0000000002" in names, "the first writer's retention deleted the other's"
    with pytest.raises(CheckpointWriteError, match="another writer"):
        first.save(4, _state(4))
    first.close()
    second.close()


def test_the_agents_replication_never_removes_anything_from_the_local_root(
    tmp_path: Path,
) -> None:
    from crashproof.checkpoint.tiers._replicator import TierReplicator
    from crashproof.checkpoint.tiers._tier import Tier

    local = tmp_path / "local"
    with _manager(local) as writer:
        writer.save(1, _state())
    writer = _manager(local)
    inflight = local / ".tmp-step_0000000002-feedface-1"
    inflight.mkdir()
    (inflight / "rank_00000.safetensors").write_bytes(b"partial")
    before = _tree(local)
    from crashproof.storage import LocalStorage

    replicator = TierReplicator(
        LocalStorage(),
        str(local),
        Tier(str(tmp_path / "remote")),
        keep=cp.KeepLast(1),
        emit=lambda *a, **k: None,
    )
    try:
        assert replicator.wait_durable(30)
    finally:
        replicator.stop()
    assert _tree(local) == before
    writer.close()


_FORKING_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    import crashproof as cp
    mgr = cp.CheckpointManager(sys.argv[1], handle_signals=False)
    child = os.fork()  # a data loader worker, forked after the manager took the lock
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
    """
)


def test_a_forked_child_of_a_killed_writer_does_not_keep_the_root_locked(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKING_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(CheckpointWriteError, match=f"pid {proc.pid}"):
            _manager(tmp_path)  # the writer lives: refused
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # the orphaned worker still runs ...
        _manager(tmp_path).close()  # ... and the root is free all the same
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_a_killed_writer_not_yet_reaped_does_not_keep_the_root_locked(tmp_path: Path) -> None:
    holder = _holder(tmp_path, "hold")
    holder.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (fields := _lock_holder.proc_stat(holder.pid)) is not None and fields[0] != b"Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        _manager(tmp_path).close()  # a zombie: exited, its parent (this test) not yet waited
    finally:
        holder.wait()


# -- the lock must not depend on a file anyone can delete, link or replace -------------------

_SAVING_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import crashproof as cp
    root = sys.argv[1]
    mgr = cp.CheckpointManager(root, keep=cp.KeepLast(1), async_save=False, handle_signals=False)
    mgr.save(1, cp.TrainState(model=torch.nn.Linear(4, 3)))
    mgr.wait()  # retention (which checks the lock, re-creating a deleted file) has run
    # A save in progress, as the writer thread leaves it between two files.
    os.mkdir(os.path.join(root, ".tmp-step_0000000002-abcd1234-1"))
    print("SAVING", flush=True)
    time.sleep(120)
    """
)


def _saving_holder(root: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVING_HOLDER, str(root)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "SAVING"
    return proc


_REPLACEMENTS = {
    "deleted": None,
    "emptied-by-rm-and-touch": "",
    "a-dead-local-pid": json.dumps(
        {"host": socket.gethostname(), "pid": 2**22 + 1, "process_start": "", "since_unix": 0}
    ),
}


@pytest.mark.parametrize("replacement", list(_REPLACEMENTS), ids=list(_REPLACEMENTS))
def test_a_deleted_lock_file_does_not_admit_a_second_writer(
    tmp_path: Path, replacement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's r06: `rm ROOT/.crashproof.lock` while the writer runs; the second writer's
    start-up then removed the first one's save in progress. Also the file made again, empty or
    naming a dead process (what a second writer takes over)."""
    # A lock held by a process the file calls dead is waited for (it may be exiting) before the
    # refusal: 10 s in production, shortened here; the refusal is what is tested.
    monkeypatch.setattr("crashproof.checkpoint.root._lock._EXITING_WAIT_S", 0.5)
    holder = _saving_holder(tmp_path)
    try:
        (tmp_path / LOCK_NAME).unlink()
        if _REPLACEMENTS[replacement] is not None:
            (tmp_path / LOCK_NAME).write_text(_REPLACEMENTS[replacement] or "")
        before = _tree(tmp_path)
        with pytest.raises(RootLockedError, match="second writer would delete"):
            _manager(tmp_path, keep=cp.KeepLast(1))
        from crashproof.cli import EXIT_STORAGE, main

        assert main(["prune", str(tmp_path), "--keep-last", "1"]) == EXIT_STORAGE
        assert _tree(tmp_path) == before, "the save in progress and the checkpoint survive"
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
    _manager(tmp_path).close()  # once the writer is gone, the root is free


def test_the_lock_file_taken_away_from_a_second_writer_in_this_process_still_refuses(
    tmp_path: Path,
) -> None:
    first = _manager(tmp_path)
    (tmp_path / LOCK_NAME).unlink()
    with pytest.raises(RootLockedError, match="names no one"):
        _manager(tmp_path)
    assert not (tmp_path / LOCK_NAME).exists(), "the refused writer made no lock file"
    first.close()


def test_a_writer_re_creates_its_deleted_lock_file_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock = _lock.lock_root(str(tmp_path))
    (tmp_path / LOCK_NAME).unlink()
    with caplog.at_level(logging.ERROR, logger="crashproof.checkpoint"):
        lock.check()
    assert any("was deleted" in r.message for r in caplog.records)
    data = json.loads((tmp_path / LOCK_NAME).read_text())
    assert data["pid"] == os.getpid() and data["root"] == str(tmp_path)
    lock.check()  # quiet now
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_writers_next_save_re_creates_a_deleted_lock_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with _manager(tmp_path, keep=cp.KeepLast(1)) as writer:
        writer.save(1, _state())
        writer.wait()  # its retention, which checks the lock, is over
        (tmp_path / LOCK_NAME).unlink()
        with caplog.at_level(logging.ERROR, logger="crashproof.checkpoint"):
            writer.save(2, _state(2))
        assert any(LOCK_NAME in r.message and "deleted" in r.message for r in caplog.records)
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert [c.step for c in writer.list()] == [2]


@pytest.mark.parametrize(
    "replacement",
    [
        json.dumps({"host": "gpu-node-17", "pid": 4242, "process_start": "", "since_unix": 0}),
        "not json",
    ],
    ids=["another-hosts-writer", "garbage"],
)
def test_a_writer_whose_lock_file_was_replaced_fails_its_next_save_and_removes_nothing(
    tmp_path: Path, replacement: str
) -> None:
    """Another writer (another host, where NFS has no directory lock) made its own lock file
    after ours was deleted: saving on, and retention, would delete its checkpoints."""
    writer = _manager(tmp_path, keep=cp.KeepLast(1))
    writer.save(1, _state())
    writer.wait()  # its retention, which checks the lock, is over
    (tmp_path / LOCK_NAME).unlink()
    (tmp_path / LOCK_NAME).write_text(replacement)
    before = _tree(tmp_path)
    with pytest.raises(RootLockedError, match="was replaced") as info:
        writer.save(2, _state(2))
    assert ("gpu-node-17" in str(info.value)) == ("gpu-node-17" in replacement)
    with pytest.raises(RootLockedError, match="was replaced"):
        writer.prune(cp.KeepLast(1))
    assert _tree(tmp_path) == before
    writer.close()
    assert (tmp_path / LOCK_NAME).read_text() == replacement, "close() leaves the other's file"


def test_a_writer_whose_root_was_moved_fails_its_next_save_and_keeps_out_of_the_new_one(
    tmp_path: Path,
) -> None:
    root, moved = tmp_path / "run", tmp_path / "run.old"
    writer = _manager(root, keep=cp.KeepLast(1))
    writer.save(1, _state())
    writer.wait()  # its retention, which checks the lock, is over
    root.rename(moved)
    root.mkdir()
    with _manager(root) as newcomer:  # a new run, in the directory now at that path
        newcomer.save(5, _state(5))
        before = _tree(root)
        with pytest.raises(CheckpointWriteError, match="moved, replaced or deleted") as info:
            writer.save(2, _state(2))
        assert str(moved) in str(info.value), "names where the locked directory is now"
        writer.close()  # deletes its own lock file, in the moved directory
        assert not (moved / LOCK_NAME).exists()
        assert json.loads((root / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert _tree(root) == before
        assert [c.step for c in newcomer.list()] == [5]
    assert [p.name for p in moved.iterdir()] == ["step_0000000001"]


def test_a_writer_whose_root_was_deleted_fails_its_next_save_saying_so(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "run"
    writer = _manager(root)
    writer.save(1, _state())
    writer.wait()  # its retention, which checks the lock, is over
    shutil.rmtree(root)
    with pytest.raises(CheckpointWriteError, match="is gone"):
        writer.save(2, _state(2))
    assert not root.exists(), "no directory made again at the path"
    writer.close()


def test_the_lock_check_costs_no_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """check() runs before every save: stat calls only, never the file's contents."""
    lock = _lock.lock_root(str(tmp_path))
    monkeypatch.setattr(os, "pread", lambda *a: pytest.fail("check() read the lock file"))
    monkeypatch.setattr(os, "read", lambda *a: pytest.fail("check() read the lock file"))
    lock.check()
    monkeypatch.undo()
    lock.release()


def test_a_hard_linked_lock_file_is_replaced_not_written_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The review's r17: a hard link to a file outside the root got the lock's JSON."""
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "outside_the_root.txt"
    victim.write_text("precious data outside the checkpoint root\n" * 3)
    os.link(victim, root / LOCK_NAME)
    before = os.stat(victim)
    with caplog.at_level(logging.WARNING, logger="crashproof.checkpoint"):
        mgr = _manager(root)
    assert any("hard link" in r.message for r in caplog.records)
    assert victim.read_text() == "precious data outside the checkpoint root\n" * 3
    after = os.stat(victim)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert after.st_nlink == 1, "only the root's name was dropped"
    lock = os.stat(root / LOCK_NAME)
    assert lock.st_ino != after.st_ino and lock.st_nlink == 1
    assert json.loads((root / LOCK_NAME).read_text())["pid"] == os.getpid()
    mgr.close()
    assert victim.exists() and not (root / LOCK_NAME).exists()


def test_a_dead_writers_lock_hard_linked_into_a_snapshot_is_not_written_through(
    tmp_path: Path,
) -> None:
    """`cp -al run snapshot` of a crashed run: the snapshot's lock file is the run's too."""
    run, snapshot = tmp_path / "run", tmp_path / "snapshot"
    holder = _holder(run, "die")
    assert holder.wait(timeout=60) == -signal.SIGKILL
    snapshot.mkdir()
    os.link(run / LOCK_NAME, snapshot / LOCK_NAME)
    left = (run / LOCK_NAME).read_bytes()
    _manager(snapshot).close()
    assert (run / LOCK_NAME).read_bytes() == left
    _manager(run).close()  # and the run's own stale lock is still taken over


def test_a_hard_linked_lock_naming_a_live_writer_elsewhere_is_refused_untouched(
    tmp_path: Path,
) -> None:
    other = tmp_path / "other"
    holder = _holder(other, "hold")
    try:
        root = tmp_path / "root"
        root.mkdir()
        os.link(other / LOCK_NAME, root / LOCK_NAME)
        left = (other / LOCK_NAME).read_bytes()
        with pytest.raises(RootLockedError, match=f"pid {holder.pid}"):
            _manager(root)
        assert (other / LOCK_NAME).read_bytes() == left
    finally:
        holder.kill()
        holder.wait()


def _make_special(path: Path, kind: str, tmp_path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.bind(str(path))
        except OSError as exc:  # a path too long for a socket address
            pytest.skip(f"cannot bind a socket at {path}: {exc}")
        sock.close()
    elif kind == "directory":
        path.mkdir()
        (path / "keep").write_text("x")
    elif kind == "symlink-to-a-file":
        target = tmp_path / "target.txt"
        target.write_text("precious")
        path.symlink_to(target)
    elif kind == "dangling-symlink":
        path.symlink_to(tmp_path / "nowhere")
    elif kind == "character-device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("making a device needs privileges")


_SPECIAL = ["fifo", "socket", "directory", "symlink-to-a-file", "dangling-symlink"]
_SPECIAL += ["character-device"]
_KIND_WORD = {
    "fifo": "FIFO",
    "socket": "socket",
    "directory": "directory",
    "symlink-to-a-file": "symbolic link",
    "dangling-symlink": "symbolic link",
    "character-device": "character device",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", _SPECIAL)
def test_no_special_file_at_the_lock_name_is_opened_or_waited_on(tmp_path: Path, kind: str) -> None:
    """The review's r05: a FIFO there hung the writer's constructor and `crashproof prune`.
    Each is refused at once with a message that names it, and left as it was."""
    root = tmp_path / "root"
    with _manager(root, keep=cp.KeepLast(2)) as writer:
        writer.save(1, _state())
        writer.save(2, _state(2))
    lock = root / LOCK_NAME
    _make_special(lock, kind, tmp_path)
    checkpoints = _tree(root)
    before = os.lstat(lock)
    code = f"""
import crashproof as cp
try:
    cp.CheckpointManager({str(root)!r}, handle_signals=False).close()
    print("CONSTRUCTED")
except cp.CrashproofError as exc:
    print(type(exc).__name__, exc)
"""
    out = python(["-c", code], timeout=30).stdout
    assert out.startswith("CheckpointWriteError"), out
    assert f"is a {_KIND_WORD[kind]}" in out and f"rm {lock}" in out
    for argv, rc in ((["prune", str(root), "--keep-last", "1"], 74), (["ls", str(root)], 0)):
        done = crashproof_cli(*argv, timeout=30)
        assert done.returncode == rc, (argv, done.stderr)
    assert _tree(root) == checkpoints, "prune removed nothing"
    after = os.lstat(lock)
    assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (
        before.st_ino,
        before.st_mode,
        before.st_mtime_ns,
    )
    if kind == "symlink-to-a-file":
        assert (tmp_path / "target.txt").read_text() == "precious"


def test_a_fifo_lock_file_does_not_block_listing_a_root_with_checkpoints(tmp_path: Path) -> None:
    """The review's r05b: `ls` reads, `prune` must refuse; neither may wait on the FIFO."""
    with _manager(tmp_path) as writer:
        writer.save(1, _state())
        writer.save(2, _state(2))
    os.mkfifo(tmp_path / LOCK_NAME)
    ls = crashproof_cli("ls", tmp_path, timeout=30)
    assert ls.returncode == 0 and "2" in ls.stdout
    prune = crashproof_cli("prune", tmp_path, "--keep-last", "1", timeout=30)
    assert prune.returncode == 74 and "is a FIFO" in prune.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME) == [
        "step_0000000001",
        "step_0000000002",
    ]
    assert _lock.read_holder(str(tmp_path)) is None  # and the reader's look does not block


def test_a_fifo_swapped_in_for_a_held_lock_file_is_noticed_without_blocking(
    tmp_path: Path,
) -> None:
    lock = _lock.lock_root(str(tmp_path))
    (tmp_path / LOCK_NAME).unlink()
    os.mkfifo(tmp_path / LOCK_NAME)
    with pytest.raises(RootLockedError, match="is a FIFO"):
        lock.check()
    lock.release()
    assert stat.S_ISFIFO(os.lstat(tmp_path / LOCK_NAME).st_mode), "left as it was"


# -- a durable tier on a local path is a root like any other: its replicator is its writer ------


def _tier_manager(root: Path, tier: str, **kw: Any) -> cp.CheckpointManager:
    return _manager(root, remote=cp.Tier(tier, keep=kw.pop("tier_keep", None)), **kw)


@pytest.mark.parametrize("spelling", ["path", "trailing-slash", "dot-dot"])
def test_a_local_tier_that_is_another_runs_locked_root_is_refused_untouched(
    tmp_path: Path, spelling: str
) -> None:
    """The attack: run A's tier is run B's live root. A's replicator used to write there without
    the lock, remove B's manifest-less directories and apply A's tier retention to B's steps."""
    theirs, ours = tmp_path / "b", tmp_path / "a"
    other = _manager(theirs, keep=cp.KeepAll())
    for step in (100, 101, 102):
        other.save(step, _state(step))
    inflight = theirs / ".tmp-step_0000000103-cafe-1"  # B's save in progress
    inflight.mkdir()
    (inflight / "rank_00000.safetensors").write_bytes(b"half")
    before = _tree(theirs)
    uri = {
        "path": str(theirs),
        "trailing-slash": f"{theirs}/",
        "dot-dot": f"{theirs}/../b",
    }[spelling]
    try:
        with pytest.raises(RootLockedError, match=f"pid {os.getpid()}") as info:
            _tier_manager(ours, uri, keep=cp.KeepLast(1), tier_keep=cp.KeepLast(1))
        assert LOCK_NAME in str(info.value)
        assert _tree(theirs) == before
        with _manager(ours) as again:  # the refused manager let go of its own root
            again.save(1, _state(1))
    finally:
        other.close()


def test_a_tier_held_by_a_replicating_run_refuses_a_writer_and_prune(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    with _tier_manager(tmp_path / "a", str(tier)) as replicating:
        replicating.save(1, _state(1))
        replicating.wait()
        with pytest.raises(RootLockedError, match=f"pid {os.getpid()}"):
            _manager(tier)
        proc = crashproof_cli("prune", str(tier), "--keep-last", "1")
        assert proc.returncode == 74 and "locked by" in proc.stderr
        with pytest.raises(RootLockedError):  # nor a second run's tier
            _tier_manager(tmp_path / "c", str(tier))
    assert not (tier / LOCK_NAME).exists(), "close() lets go of the tier's root"
    with _manager(tier) as after:
        assert [c.step for c in after.list()] == [1]


def test_a_tier_replicator_that_lost_its_tiers_lock_removes_nothing_there(
    tmp_path: Path,
) -> None:
    """The tier's lock file replaced (another writer, another host) while replication runs:
    neither the tier's retention nor the clean-up of uploads that never committed acts."""
    tier = tmp_path / "tier"
    writer = _tier_manager(tmp_path / "a", str(tier), keep=cp.KeepAll(), tier_keep=cp.KeepLast(1))
    try:
        writer.save(1, _state(1))
        assert writer._tiers._replicas[0].wait_durable(30)
        (tier / LOCK_NAME).unlink()
        (tier / LOCK_NAME).write_text(json.dumps({"host": "gpu-node-17", "pid": 1}))
        (tier / "step_0000000050").mkdir()  # an upload of the other writer, in progress
        before = _tree(tier)
        writer.save(2, _state(2))
        writer.wait()
        deadline = time.monotonic() + 10
        while not writer.replication_status()[0].last_error and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "was replaced" in writer.replication_status()[0].last_error
        assert _tree(tier) == before
    finally:
        writer._tiers.stop()
        writer.close()


def test_tier_retention_across_two_runs_keeps_this_runs_newest(tmp_path: Path) -> None:
    """A tier that holds a finished run's later steps: KeepLast(1) there used to remove each of
    this run's uploads right after it (the other run's step being the newest), so the run was
    never durable while close() said it was."""
    tier = tmp_path / "tier"
    with _manager(tier, keep=cp.KeepAll()) as earlier:
        for step in (100, 101, 102):
            earlier.save(step, _state(step))
    with _tier_manager(
        tmp_path / "a", str(tier), keep=cp.KeepLast(2), tier_keep=cp.KeepLast(1)
    ) as run:
        for step in (1, 2, 3):
            run.save(step, _state(step))
    names = sorted(p.name for p in tier.iterdir())
    assert "step_0000000003" in names, names
    assert "step_0000000102" in names  # the newest of the tier stays too
    with cp.CheckpointManager(str(tier), read_only=True) as reader:
        assert reader.restore(_state(0), step=3) == 3


# -- every spelling of a local path is the same locked root ------------------------------------

_SPELLINGS = {
    "file-uri": "file://{root}",
    "file-localhost": "file://localhost{root}",
    "file-one-slash": "file:{root}",
    "local-uri": "local://{root}",
    "local-one-slash": "local:{root}",
    "upper-case": "FILE://{root}",
    "asynclocal": "asynclocal://{root}",
}


@pytest.mark.parametrize("spelling", sorted(_SPELLINGS))
def test_no_spelling_of_a_locked_root_admits_a_second_writer(tmp_path: Path, spelling: str) -> None:
    """``local:///ROOT`` (fsspec's local filesystem) used to be an object store: no lock, and a
    second writer removed the first one's save in progress at start."""
    root = tmp_path / "run"
    first = _manager(root)
    first.save(1, _state(1))
    inflight = root / ".tmp-step_0000000002-abcd1234-1"
    inflight.mkdir()
    (inflight / "rank_00000.safetensors").write_bytes(b"half a shard")
    before = _tree(root)
    uri = _SPELLINGS[spelling].format(root=root)
    try:
        with pytest.raises(RootLockedError, match=f"pid {os.getpid()}"):
            cp.CheckpointManager(uri, async_save=False, handle_signals=False)
        proc = crashproof_cli("prune", uri, "--keep-last", "1")
        assert proc.returncode == 74 and "locked by" in proc.stderr, proc.stderr
        assert _tree(root) == before
    finally:
        first.close()
    with cp.CheckpointManager(uri, read_only=True) as reader:  # and it is the same root
        assert reader.storage.describe(reader.root) == str(root)
        assert [c.step for c in reader.list()] == [1]


@pytest.mark.parametrize(
    "uri",
    [
        "file://gpu-node-17/ckpt",  # another host's file
        "local://relative/ckpt",  # a host, for RFC 8089
        "file:///ckpt?x=1",
        "file:///ckpt#frag",
        "generic:///ckpt",  # fsspec routers and wrappers that reach local files
        "dir:///ckpt",
        "simplecache::file:///ckpt",
        "zip:///ckpt",
        "nosuchprotocol://ckpt",
    ],
)
def test_a_uri_that_is_not_plainly_local_nor_an_object_store_is_refused(uri: str) -> None:
    with pytest.raises(ConfigError, match="ckpt"):
        cp.CheckpointManager(uri, handle_signals=False)
    proc = crashproof_cli("ls", uri)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_an_fsspec_storage_over_local_files_is_refused() -> None:
    fsspec = pytest.importorskip("fsspec")
    from crashproof.storage import FsspecStorage

    with pytest.raises(ConfigError, match="lock"):
        FsspecStorage(fsspec.filesystem("file"), "file")
    with pytest.raises(ConfigError, match="lock"):
        cp.CheckpointManager(
            "memory://fsspec-local-tier",
            handle_signals=False,
            remote=cp.Tier("simplecache://t", storage_options={"target_protocol": "file"}),
        )


def test_a_local_tier_spelled_as_a_uri_is_locked_too(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    with _manager(tier, keep=cp.KeepAll()) as other_run:
        other_run.save(100, _state(100))
        before = _tree(tier)
        for uri in (f"file://{tier}", f"local://{tier}", f"file:{tier}"):
            with pytest.raises(RootLockedError):
                _tier_manager(tmp_path / "a", uri, tier_keep=cp.KeepLast(1))
        assert _tree(tier) == before


# -- every change in a root checks the hold first, not only the start of a save ----------------


def _replace_lock(root: Path) -> None:
    (root / LOCK_NAME).unlink()
    (root / LOCK_NAME).write_text(json.dumps({"host": "gpu-node-17", "pid": 1, "since_unix": 1}))


@pytest.mark.parametrize("then", ["write-on", "disk-full"])
def test_a_lock_lost_during_a_background_save_stops_its_writes_publish_and_removals(
    tmp_path: Path, then: str
) -> None:
    """The lock file is replaced while the async save writes its shard; the save then goes on
    (or finds the disk full, and makes room by removing checkpoints): it used to publish, and
    remove for space, in a root another writer now holds."""
    from crashproof.storage import LocalStorage

    root = tmp_path / "run"

    class Storage(LocalStorage):
        armed = False

        def create(self, path: str) -> Any:
            if Storage.armed and path.endswith("rank_00000.safetensors"):
                Storage.armed = False
                _replace_lock(root)
                if then == "disk-full":
                    raise OSError(28, "No space left on device", path)
            return super().create(path)

    writer = cp.CheckpointManager(
        str(root), storage=Storage(), keep=cp.KeepLast(1), handle_signals=False
    )
    writer.save(1, _state(1))
    writer.wait()
    before = {k: v for k, v in _tree(root).items() if k != LOCK_NAME}
    Storage.armed = True
    writer.save(2, _state(2))  # async: the failure comes at the wait
    with pytest.raises(RootLockedError, match="was replaced"):
        writer.wait()
    after = _tree(root)
    assert {k: v for k, v in after.items() if k in before} == before, "something was removed"
    assert not any(k.startswith("step_0000000002") for k in after), "published without the lock"
    assert writer.stats.removed_for_space == 0
    writer.close()


def test_a_download_from_a_tier_is_not_published_into_a_root_whose_lock_was_lost(
    tmp_path: Path,
) -> None:
    root, tier = tmp_path / "run", tmp_path / "tier"
    with _manager(tier) as tier_writer:
        tier_writer.save(5, _state(5))
    writer = _manager(root, remote=str(tier), replicate=False)
    _replace_lock(root)
    assert writer.restore(_state(0)) == 0  # the tier's copy could not be brought in
    assert sorted(p.name for p in root.iterdir()) == [LOCK_NAME]
    writer.close()


# -- a lock file's fields are data from disk: out of range is garbage, never a traceback --------

_GARBAGE_FIELDS = {
    "pid-huge": {"pid": 10**30},
    "pid-2^63": {"pid": 2**63},
    "pid-0": {"pid": 0},  # kill(0, 0) is this process group: "alive"
    "pid-minus-1": {"pid": -1},  # kill(-1, 0): every process we may signal
    "pid-float-string": {"pid": "1e3"},
    "since-nan": {"since_unix": float("nan")},
    "since-inf": {"since_unix": float("inf")},
    "since-1e300": {"since_unix": 1e300},
    "since-negative": {"since_unix": -1e18},
    "host-empty": {"host": ""},
    "other-host-nan": {"host": "gpu-node-17", "since_unix": float("nan")},
    "other-host-pid-0": {"host": "gpu-node-17", "pid": 0},
}


def _garbage_lock(fields: dict[str, Any]) -> str:
    holder = {"host": socket.gethostname(), "pid": 999_999, "process_start": "x:1"}
    return json.dumps(holder | {"since_unix": 1.0} | fields)  # NaN and Infinity as Python writes


@pytest.mark.parametrize("case", sorted(_GARBAGE_FIELDS))
def test_a_lock_file_naming_no_possible_process_is_taken_over_by_writer_and_prune(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _manager(tmp_path) as first:
        first.save(1, _state(1))
        first.save(2, _state(2))
    garbage = _garbage_lock(_GARBAGE_FIELDS[case])
    (tmp_path / LOCK_NAME).write_text(garbage)
    with caplog.at_level(logging.WARNING, logger="crashproof.checkpoint"):
        _manager(tmp_path).close()
    assert any("taking over the lock" in r.getMessage() for r in caplog.records)
    (tmp_path / LOCK_NAME).write_text(garbage)
    proc = crashproof_cli("prune", str(tmp_path), "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["since-nan", "pid-0", "host-control-chars"])
def test_a_held_lock_with_garbage_in_its_file_refuses_with_one_clean_message(
    tmp_path: Path, case: str
) -> None:
    """The OS-level lock is held (a live writer) and its file was overwritten: refused, and
    the message renders whatever the file says."""
    with _manager(tmp_path) as first:
        first.save(1, _state(1))
    holder = _holder(tmp_path, "hold")
    try:
        fields = (
            {"host": "node\x1b[2J\n7"} if case == "host-control-chars" else _GARBAGE_FIELDS[case]
        )
        with open(tmp_path / LOCK_NAME, "r+") as f:  # the holder's own file, rewritten
            f.truncate(0)
            f.write(_garbage_lock(fields))
        with pytest.raises(RootLockedError) as info:
            _manager(tmp_path)
        message = str(info.value)
        assert "\x1b" not in message and "\n" not in message
        proc = crashproof_cli("prune", str(tmp_path), "--keep-last", "1")
        assert proc.returncode == 74 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_renders_any_field_safely() -> None:
    for since in (float("nan"), float("inf"), 1e300, -1e300):
        text = _lock_holder.Holder("h\x07st", 5, "", since).describe()
        assert "pid 5" in text and "\x07" not in text


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"
)
def test_another_users_stale_lock_file_is_one_clear_refusal_naming_it_and_what_to_do() -> None:
    """A shared root whose lock file (0644) another user's dead process left: a writer of
    another user cannot take it over itself. It gets a RootLockedError naming the file, its
    owner, the holder it names and what to do, and prune exits 74 saying the same; nothing is
    written."""
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="crashproof-shared-"))
    try:
        shared.chmod(0o777)  # a directory every user may write, as a group's shared root
        root = shared / "ckpt"
        with cp.CheckpointManager(root, async_save=False, handle_signals=False) as ckpt:
            ckpt.save(1, cp.TrainState(model=torch.nn.Linear(2, 2)))
        root.chmod(0o777)
        dead = subprocess.Popen(["true"])
        dead.wait()
        lock = root / LOCK_NAME
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                    "process_start": "x:1", "since_unix": 1.0}))  # fmt: skip
        lock.chmod(0o644)
        before = sorted(p.name for p in root.iterdir())
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        env = {**os.environ, "HOME": str(shared)}
        code = (
            "import crashproof as cp\n"
            "try:\n"
            f"    cp.CheckpointManager({str(root)!r}, handle_signals=False).close()\n"
            "except cp.errors.RootLockedError as exc:\n"
            "    print('REFUSED', exc)\n"
        )
        writer = subprocess.run([*as_nobody, sys.executable, "-c", code],
                                capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        said = writer.stdout + writer.stderr
        assert writer.returncode == 0 and "REFUSED" in said, said
        assert str(lock) in said and "user 0" in said and f"pid {dead.pid}" in said, said
        assert f"remove {lock}" in said, said
        prune = subprocess.run(
            [*as_nobody, sys.executable, "-m", "crashproof.cli", "prune", str(root), "--keep-last", "1"],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert prune.returncode == 74, prune.stderr
        assert prune.stderr.count("\n") == 1 and str(lock) in prune.stderr, prune.stderr
        assert sorted(p.name for p in root.iterdir()) == before
    finally:
        shutil.rmtree(shared, ignore_errors=True)
