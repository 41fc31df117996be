"""No link, pipe or name under a root leads anywhere unexpected.

The attacker plants, in a root the run trusts: a symbolic link in place of a step directory, of
a delta's base, of a file, of a leftover; a FIFO in place of a shard or a manifest (opening one
blocks until a writer comes: forever); step names that only look like ``step_<digits>`` (Unicode
digits, a trailing newline) and a second spelling of a step (``step_2`` beside
``step_0000000002``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import crashproof as cp
from crashproof.checkpoint import committed_steps, describe_checkpoint, verify_checkpoint
from crashproof.checkpoint.format._names import checkpoint_dir_name, parse_step_dir
from crashproof.storage import LocalStorage, storage_for
from tests.warm_ranks import crashproof_cli


def _state(seed: int = 0) -> cp.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return cp.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _weights(state: cp.TrainState) -> torch.Tensor:
    assert state.model is not None
    return torch.cat([p.detach().flatten().clone() for p in state.model.parameters()])


def _save(root: Path, steps: dict[int, int], **kw: Any) -> None:
    with cp.CheckpointManager(str(root), async_save=False, handle_signals=False, **kw) as mgr:
        for step, seed in steps.items():
            mgr.save(step, _state(seed))


def _restore(root: Path, **kw: Any) -> tuple[int, torch.Tensor]:
    state = _state(99)
    with cp.CheckpointManager(str(root), read_only=True, handle_signals=False, **kw) as mgr:
        step = mgr.restore(state)
    return step, _weights(state)


def _bounded(fn: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """``fn()``, failing the test (not hanging it) if it blocks."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            err.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"blocked for {timeout_s} s"
    if err:
        raise err[0]
    return out[0]


def _step_dir(root: Path, step: int) -> Path:
    return root / checkpoint_dir_name(step)


def test_a_symlinked_step_directory_pointing_outside_the_root_is_never_restored(
    tmp_path: Path,
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _save(root, {1: 1})
    _save(elsewhere, {5: 5})
    os.symlink(_step_dir(elsewhere, 5), _step_dir(root, 5))
    step, weights = _restore(root)
    assert step == 1
    assert torch.equal(weights, _weights(_state(1)))
    assert [s for s, _ in committed_steps(LocalStorage(), str(root))] == [1]


def test_a_symlinked_step_directory_is_not_listed_by_the_cli_nor_deleted_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from crashproof.cli import main

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _save(root, {1: 1, 2: 2})
    _save(elsewhere, {3: 3})
    os.symlink(_step_dir(elsewhere, 3), _step_dir(root, 3))
    main(["ls", str(root)])
    assert checkpoint_dir_name(3) not in capsys.readouterr().out
    # A writer with a retention that keeps one: removes step 1 only, never anything through
    # the link, and never the link's target.
    _save(root, {4: 4}, keep=cp.KeepLast(1))
    assert sorted(p.name for p in (elsewhere / checkpoint_dir_name(3)).iterdir())
    assert _step_dir(root, 3).is_symlink()


@pytest.mark.parametrize(
    "spelling", ["file://{}", "file://localhost{}", "file:{}", "local://{}", "local:{}"]
)
def test_no_spelling_of_a_local_root_follows_a_link_out_of_it(
    tmp_path: Path, spelling: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``local:///ROOT`` used to reach the root through fsspec, which follows links: a linked
    step directory outside the root was restored and listed as the newest checkpoint."""
    from crashproof.cli import main

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _save(root, {1: 1})
    _save(elsewhere, {7: 7})
    os.symlink(_step_dir(elsewhere, 7), _step_dir(root, 7))
    uri = spelling.format(root)
    state = _state(99)
    with cp.CheckpointManager(uri, read_only=True, handle_signals=False) as mgr:
        assert mgr.restore(state) == 1
    assert torch.equal(_weights(state), _weights(_state(1)))
    for command in ("ls", "verify"):
        main([command, uri])
        assert checkpoint_dir_name(7) not in capsys.readouterr().out
    with cp.CheckpointManager(
        uri, async_save=False, handle_signals=False, keep=cp.KeepLast(1)
    ) as writer:  # a writer on that spelling removes nothing through the link
        writer.save(8, _state(8))
    assert sorted(p.name for p in (elsewhere / checkpoint_dir_name(7)).iterdir())
    assert _step_dir(root, 7).is_symlink()


def test_a_symlinked_delta_base_is_refused(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _save(root, {1: 1, 2: 2}, delta=cp.Delta(full_every=4))
    elsewhere.mkdir()
    # The base, byte for byte, moved out and linked back: only the link is wrong.
    shutil.move(str(_step_dir(root, 1)), str(elsewhere / checkpoint_dir_name(1)))
    os.symlink(elsewhere / checkpoint_dir_name(1), _step_dir(root, 1))
    assert _restore(root)[0] == 0
    with pytest.raises((cp.CorruptCheckpointError, FileNotFoundError)):
        verify_checkpoint(LocalStorage(), str(_step_dir(root, 2)))


@pytest.mark.parametrize("name", ["manifest.json", "rank_00000.safetensors", "rank_00000.json"])
def test_a_symlinked_file_inside_a_checkpoint_is_refused(tmp_path: Path, name: str) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _save(root, {1: 1, 2: 2})
    elsewhere.mkdir()
    shutil.move(str(_step_dir(root, 2) / name), str(elsewhere / name))  # same bytes
    os.symlink(elsewhere / name, _step_dir(root, 2) / name)
    assert _restore(root)[0] == 1
    assert not describe_checkpoint(LocalStorage(), 2, str(_step_dir(root, 2))).valid


@pytest.mark.parametrize(
    "name", ["manifest.json", "rank_00000.safetensors", "rank_00000.json", "rollbacks.json"]
)
@pytest.mark.parametrize("kind", ["char", "block", "socket"])
def test_a_device_in_place_of_a_file_is_never_opened(
    tmp_path: Path, name: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a device can act (a watchdog arms, a tape rewinds): readers looked at what they
    had opened, not before opening it. Every open of the planted name is recorded."""
    import socket
    import stat as stat_module

    from crashproof.checkpoint.root import read_marks
    from crashproof.cli import main

    root = tmp_path / "root"
    _save(root, {1: 1, 2: 2})
    where = root / name if name == "rollbacks.json" else _step_dir(root, 2) / name
    where.unlink(missing_ok=True)
    if kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        monkeypatch.chdir(where.parent)  # (a socket's path is short)
        sock.bind(where.name)
        sock.close()
    else:
        mode = stat_module.S_IFCHR if kind == "char" else stat_module.S_IFBLK
        try:
            os.mknod(where, 0o600 | mode, os.makedev(1, 3) if kind == "char" else os.makedev(7, 0))
        except PermissionError as exc:
            pytest.skip(f"cannot make a device node here (needs CAP_MKNOD): {exc}")
    planted = os.lstat(where).st_ino
    opened: list[str] = []
    real_open = os.open

    def recording_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        try:
            st = os.stat(path, dir_fd=kw.get("dir_fd"), follow_symlinks=False)
        except OSError:
            st = None
        if st is not None and st.st_ino == planted:
            opened.append(os.fsdecode(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", recording_open)
    assert _restore(root)[0] == (2 if name == "rollbacks.json" else 1)
    if name != "rollbacks.json":
        assert not describe_checkpoint(LocalStorage(), 2, str(_step_dir(root, 2))).valid
    for command in ("ls", "verify"):
        main([command, str(root)])  # (whatever they conclude: the device is not opened)
    assert read_marks(LocalStorage(), str(root)) == []  # what a writer with tiers reads
    assert opened == [], f"opened: {opened}"


@pytest.mark.parametrize("name", ["manifest.json", "rank_00000.safetensors", "rank_00000.json"])
def test_a_fifo_in_place_of_a_file_blocks_nothing(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    _save(root, {1: 1, 2: 2})
    (_step_dir(root, 2) / name).unlink()
    os.mkfifo(_step_dir(root, 2) / name)
    assert _bounded(lambda: _restore(root))[0] == 1
    info = _bounded(lambda: describe_checkpoint(LocalStorage(), 2, str(_step_dir(root, 2))))
    assert not info.valid
    with pytest.raises((FileNotFoundError, cp.CorruptCheckpointError)):
        _bounded(lambda: verify_checkpoint(LocalStorage(), str(_step_dir(root, 2))))
    for command in ("ls", "verify"):  # a process each: the CLI installs signal handlers
        done = crashproof_cli(command, root, timeout=60)
        assert done.returncode in (0, 1), done.stderr


def test_a_symlinked_leftover_is_unlinked_not_followed(tmp_path: Path) -> None:
    root, precious = tmp_path / "root", tmp_path / "precious"
    _save(root, {1: 1})
    precious.mkdir()
    (precious / "data").write_bytes(b"keep me")
    os.symlink(precious, root / ".tmp-step_0000000002-evil")
    os.symlink(precious, root / ".trash-step_0000000001-evil")
    _save(root, {2: 2})  # a writer starting up removes leftovers
    assert (precious / "data").read_bytes() == b"keep me"


@pytest.mark.parametrize(
    "name",
    [
        "step_\u0663",  # ARABIC-INDIC DIGIT THREE
        "step_\uff13",  # FULLWIDTH DIGIT THREE
        "step_000000000\u0663",
        "step_0000000003\n",
        "step_0000000003 ",
        " step_0000000003",
        "step_+000000003",
        "step_3",
        "step_00000000003",
        "Step_0000000003",
        "step_0x00000003",
    ],
)
def test_only_the_canonical_ascii_name_is_a_checkpoint(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    _save(root, {1: 1, 3: 3})
    os.rename(_step_dir(root, 3), root / name)
    assert parse_step_dir(name) is None
    assert [s for s, _ in committed_steps(LocalStorage(), str(root))] == [1]
    assert _restore(root)[0] == 1


def test_one_step_one_directory_and_one_warning_for_the_other_spelling(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    _save(root, {1: 1, 2: 2})
    shutil.copytree(_step_dir(root, 1), root / "step_2")  # step 1's bytes under step 2's name
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            found = committed_steps(LocalStorage(), str(root))
    assert [s for s, _ in found] == [2, 1]
    assert dict(found)[2].endswith(checkpoint_dir_name(2))
    warnings = [r for r in caplog.records if "'step_2'" in r.getMessage()]
    assert len(warnings) == 1 and checkpoint_dir_name(2) in warnings[0].getMessage()
    step, weights = _restore(root)
    assert step == 2 and torch.equal(weights, _weights(_state(2)))


def test_canonical_names_round_trip() -> None:
    for step in (0, 1, 9_999_999_999, 10_000_000_000, (1 << 63) - 1):
        assert parse_step_dir(checkpoint_dir_name(step)) == step
    assert parse_step_dir("step_" + "9" * 19) is None  # beyond a 64-bit step


def test_a_symlinked_root_itself_is_followed_once(tmp_path: Path) -> None:
    real, link = tmp_path / "real", tmp_path / "link"
    _save(real, {1: 1})
    os.symlink(real, link)
    path, _ = storage_for(str(link))
    assert path == str(real)
    _save(link, {2: 2})
    assert _restore(link)[0] == 2


# -- nothing is removed across a mount point --------------------------------------------------


@pytest.fixture
def bind_mount(tmp_path: Path) -> Any:
    """``bind(source, target)`` bind-mounts a directory (root only: skipped else); every mount
    is undone after the test."""
    mounted: list[Path] = []

    def bind(source: Path, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "--bind", str(source), str(target)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot bind-mount here (needs root): {done.stderr.strip()}")
        mounted.append(target)

    yield bind
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.mark.parametrize(
    "where", ["step-dir", "leftover", "inside-a-step-dir", "inside-a-leftover"]
)
def test_nothing_is_removed_across_a_mount_point_under_the_root(
    tmp_path: Path, where: str, bind_mount: Any
) -> None:
    """A directory outside the root bind-mounted at a step directory or a leftover: renaming a
    mount point fails (EBUSY) and the removal then deleted in place, through the mount."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    _save(root, {1: 1})
    outside.mkdir()
    (outside / "precious.txt").write_text("user data")
    if where == "step-dir":
        shutil.copytree(_step_dir(root, 1), outside, dirs_exist_ok=True)  # a valid copy there
        shutil.rmtree(_step_dir(root, 1))
        bind_mount(outside, _step_dir(root, 1))
    elif where == "leftover":
        bind_mount(outside, root / ".tmp-step_0000000009-abc")
    elif where == "inside-a-step-dir":
        bind_mount(outside, _step_dir(root, 1) / "sub")
    else:
        (root / ".trash-step_0000000008-abc").mkdir()
        bind_mount(outside, root / ".trash-step_0000000008-abc" / "sub")
    before = sorted(p.name for p in outside.iterdir())
    _save(root, {2: 2, 3: 3}, keep=cp.KeepLast(1))  # start-up clean-up, then retention
    assert sorted(p.name for p in outside.iterdir()) == before
    assert (outside / "precious.txt").read_text() == "user data"
    LocalStorage().remove(str(root))  # not even the whole root, asked directly
    assert (outside / "precious.txt").read_text() == "user data"


@pytest.mark.parametrize("kind", ["fifo", "symlink", "missing"])
@pytest.mark.parametrize("name", ["rank_00000.safetensors", "rank_00000.json"])
def test_a_tier_gives_up_a_local_checkpoint_with_a_fifo_or_link_in_place_of_a_file(
    tmp_path: Path, name: str, kind: str
) -> None:
    """No retry mends such a checkpoint: its copy to the tier is given up (logged, and a
    ``replication_dropped`` event), and close() does not wait its whole timeout for it."""
    root, remote = tmp_path / "root", tmp_path / "remote"
    _save(root, {1: 1, 2: 2})
    target = _step_dir(root, 2) / name
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_bytes(b"x" * 64)
        target.symlink_to(tmp_path / "elsewhere")
    manager = cp.CheckpointManager(
        str(root), handle_signals=False, remote=cp.Tier(str(remote)), remote_timeout_s=120
    )
    started = time.monotonic()
    _bounded(manager.close, timeout_s=60)
    assert time.monotonic() - started < 30
    assert not (remote / checkpoint_dir_name(2) / "manifest.json").exists()  # never committed
