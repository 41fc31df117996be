"""Promise: ``crashproof ls`` does not call a corrupt checkpoint valid.

``valid`` keeps its key (scripts read it) and means what ``ls`` checked cheaply: the manifest
parses and every file it lists is present with its listed size. ``verified`` says whether the
checksums were checked: true / false, or null when they were not (``ls`` without ``--verify``).
The text table's header names the checks behind each column. Corruptions an attacker can make
without changing a file's size (a flipped bit anywhere: tensor data, the safetensors header, the
rank index) must never come out ``verified: true``, and ``ls --verify`` must agree with
``crashproof verify`` on every checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import crashproof
from crashproof.cli import main

SHARD = "rank_00000.safetensors"
INDEX = "rank_00000.json"


@pytest.fixture(autouse=True)
def _keep_sigpipe() -> Iterator[None]:
    saved = signal.getsignal(signal.SIGPIPE)
    yield
    signal.signal(signal.SIGPIPE, saved)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    path = tmp_path / "ckpts"
    with crashproof.CheckpointManager(str(path), handle_signals=False) as manager:
        for step in (1, 2, 3):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            manager.save(step, crashproof.TrainState(model=model, optimizer=opt))
    return path


def ckpt(root: Path, step: int) -> Path:
    return root / f"step_{step:010d}"


def flip(path: Path, at: int) -> None:
    """Flip one bit of byte ``at`` (negative: from the end): same size, different content."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x04
    path.write_bytes(bytes(data))


def ls_json(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[int, Any]:
    assert main(["ls", str(root), "--json", *extra]) == 0
    return {row["step"]: row for row in json.loads(capsys.readouterr().out)}


def verify_says(root: Path, step: int, capsys: pytest.CaptureFixture[str]) -> bool:
    code = main(["verify", str(root), "--step", str(step)])
    capsys.readouterr()
    return code == 0


def test_a_flipped_bit_is_never_verified_and_verify_agrees(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported case: after a bit flip, ``ls`` said ``valid: yes``, ``verify`` INVALID."""
    flip(ckpt(root, 2) / SHARD, -5)
    rows = ls_json(root, capsys)
    assert rows[2]["valid"] is True  # the cheap checks cannot see it, and say only that
    assert rows[2]["verified"] is None  # ... and that the checksums were not read
    rows = ls_json(root, capsys, "--verify")
    assert rows[2]["verified"] is False
    assert SHARD in rows[2]["problem"]
    assert rows[3]["verified"] is True and rows[1]["verified"] is True
    for step in (1, 2, 3):
        assert rows[step]["verified"] is verify_says(root, step, capsys), step


@pytest.mark.parametrize(
    ("name", "at"),
    [
        (SHARD, -1),  # the last byte of the last tensor
        (SHARD, 20),  # inside the safetensors header
        (INDEX, -3),  # the rank index (tensor checksums, state tree)
        ("manifest.json", 40),  # the manifest itself
    ],
)
def test_no_same_size_corruption_comes_out_verified(
    root: Path, name: str, at: int, capsys: pytest.CaptureFixture[str]
) -> None:
    flip(ckpt(root, 3) / name, at)
    rows = ls_json(root, capsys, "--verify")
    assert rows[3]["verified"] is not True
    assert rows[3]["verified"] is verify_says(root, 3, capsys)
    if rows[3]["valid"] is False:  # the manifest broke: nothing claims more
        assert rows[3]["verified"] is False
    assert rows[2]["verified"] is True


def test_a_truncated_or_missing_file_is_not_valid_and_not_verified(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = ckpt(root, 3) / SHARD
    shard.write_bytes(shard.read_bytes()[:-8])
    (ckpt(root, 2) / INDEX).unlink()
    plain, checked = ls_json(root, capsys), ls_json(root, capsys, "--verify")
    for step in (2, 3):
        assert plain[step]["valid"] is False and plain[step]["verified"] is None
        assert checked[step]["valid"] is False and checked[step]["verified"] is False
        assert checked[step]["problem"]
    assert checked[1]["valid"] is True and checked[1]["verified"] is True


@pytest.mark.parametrize("how", ["renamed", "copied", "renamed as an older step"])
def test_a_checkpoint_under_another_steps_name_is_that_step_nowhere(
    root: Path, how: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Step 3's directory renamed or copied as step 7 (or moved to step 0) is step 3's data:
    ls, ls --verify, verify, export and restore all refuse it, and restore falls back."""
    target = 0 if how == "renamed as an older step" else 7
    if how == "copied":
        shutil.copytree(ckpt(root, 3), ckpt(root, target))
    else:
        ckpt(root, 3).rename(ckpt(root, target))
    expect = "the manifest is for step 3, not " + str(target)
    for extra in ((), ("--verify",)):
        row = ls_json(root, capsys, *extra)[target]
        assert row["valid"] is False and expect in row["problem"], row
    assert not verify_says(root, target, capsys)
    out = tmp_path / "out.safetensors"
    assert main(["export", str(root), "--step", str(target), "-o", str(out)]) == 1
    assert expect in capsys.readouterr().err and not out.exists()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with crashproof.CheckpointManager(str(root), handle_signals=False, read_only=True) as reader:
        restored = reader.restore(crashproof.TrainState(model=model, optimizer=opt))
    assert restored == (3 if how == "copied" else 2)


def test_json_keeps_its_keys_and_types(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for extra in ((), ("--verify",)):
        for row in ls_json(root, capsys, *extra).values():
            assert {"step", "path", "created", "size_bytes", "kind", "valid", "verified"} <= set(
                row
            )
            assert type(row["valid"]) is bool
            assert row["verified"] is (True if extra else None)


def test_the_table_names_the_checks_behind_each_column(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip(ckpt(root, 2) / SHARD, -5)
    assert main(["ls", str(root)]) == 0
    header, *rows = capsys.readouterr().out.strip().splitlines()
    assert "valid" in header and "sizes" in header and "checksums" in header
    assert "verified" not in header  # no column claims checksums that were not read
    assert all(row.split()[-1] == "yes" for row in rows)

    assert main(["ls", str(root), "--verify"]) == 0
    header, *rows = capsys.readouterr().out.strip().splitlines()
    assert "verified (checksums)" in header
    by_step = {int(row.split()[0]): row for row in rows}
    assert by_step[3].split()[-1] == "yes"
    assert "NO" in by_step[2].split() and SHARD in by_step[2]


def test_the_exit_code_of_ls_is_the_listing_not_the_verdict(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ls`` lists (exit 0 with invalid rows, as before); ``verify`` is the command that fails."""
    flip(ckpt(root, 1) / SHARD, -5)
    assert main(["ls", str(root), "--verify"]) == 0
    capsys.readouterr()
    assert main(["verify", str(root)]) == 1
    capsys.readouterr()


# -- a file the storage refuses is not a corrupt checkpoint ---------------------------------------
#
# An operator who reads INVALID may delete the checkpoint; a permission or an I/O error says
# nothing about it. `verify`, `ls --verify`, `inspect` and `export` exit 74 naming the file;
# plain `ls` still describes the checkpoint from its readable manifest.


def refuse_reads(monkeypatch: pytest.MonkeyPatch, name: str, errno_: int) -> None:
    """The local storage refuses to open ``name`` as the kernel would (relative name, errno)."""
    from crashproof.storage import LocalStorage

    real = LocalStorage.open

    def refusing(self: LocalStorage, path: str) -> Any:
        if Path(path).name == name and Path(path).parent.name == "step_0000000003":
            raise OSError(errno_, os.strerror(errno_), name)
        return real(self, path)

    monkeypatch.setattr(LocalStorage, "open", refusing)


@pytest.mark.parametrize("errno_", [errno.EACCES, errno.EIO])
@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "{root}", "--latest"],
        ["verify", "{root}"],
        ["ls", "{root}", "--verify"],
        ["export", "{root}", "--step", "3", "-o", "{out}"],
        ["export", "{root}", "-o", "{out}"],
    ],
)
def test_a_file_the_storage_refuses_is_exit_74_naming_it_never_invalid(
    root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    errno_: int,
) -> None:
    refuse_reads(monkeypatch, SHARD, errno_)
    argv = [a.format(root=root, out=tmp_path / "w.safetensors") for a in argv]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 74, (argv, out, err)
    assert "INVALID" not in out + err and "Traceback" not in err
    assert err.count("\n") == 1, err
    assert str(ckpt(root, 3) / SHARD) in err, err  # the file, in full
    assert "credentials" not in err
    assert not (tmp_path / "w.safetensors").exists()


def test_ls_describes_a_checkpoint_with_an_unreadable_file_from_its_manifest(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = ls_json(root, capsys)[3]
    refuse_reads(monkeypatch, SHARD, errno.EACCES)
    row = ls_json(root, capsys)[3]
    for key in ("created", "size_bytes", "kind", "world_size", "base_step"):
        assert row[key] == before[key], key
    assert row["valid"] is False and row["verified"] is None
    assert str(ckpt(root, 3) / SHARD) in row["problem"]
    assert "cannot be read" in row["problem"] and "not a sign of corruption" in row["problem"]
    capsys.readouterr()
    assert main(["verify", str(root), "--step", "2"]) == 0  # the others still verify


def _without_dac_override() -> list[str] | None:
    """A command prefix that runs a program without the power to ignore file permissions (none
    needed when not root); None when this machine offers none."""
    if os.geteuid() != 0:
        return []
    caps = "cap_dac_override,cap_dac_read_search"
    if shutil.which("capsh"):
        return ["capsh", f"--drop={caps}", "--", "-c", 'exec "$0" "$@"']
    if shutil.which("setpriv"):
        return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    return None


def test_a_real_permission_error_is_exit_74_and_ls_keeps_the_manifests_fields(
    root: Path, tmp_path: Path
) -> None:
    """The reported case, as a real process that cannot read one rank's data file."""
    prefix = _without_dac_override()
    if prefix is None:
        pytest.skip("running as root, and neither capsh nor setpriv can drop CAP_DAC_OVERRIDE")
    shard = ckpt(root, 3) / SHARD
    shard.chmod(0)
    try:
        probe = subprocess.run([*prefix, "cat", str(shard)], capture_output=True, check=False)
        if probe.returncode == 0:
            pytest.skip("this machine lets the unprivileged process read a mode-000 file")
        cli = [*prefix, sys.executable, "-m", "crashproof.cli"]
        done = subprocess.run(
            [*cli, "verify", str(root), "--latest"], capture_output=True, text=True, check=False
        )
        assert done.returncode == 74, done.stdout + done.stderr
        assert "INVALID" not in done.stdout + done.stderr
        assert done.stderr.count("\n") == 1 and str(shard) in done.stderr, done.stderr
        done = subprocess.run(
            [*cli, "ls", str(root), "--json"], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        row = {r["step"]: r for r in json.loads(done.stdout)}[3]
        assert row["kind"] == "full" and row["created"] is not None and row["size_bytes"] > 0
        assert str(shard) in row["problem"]
    finally:
        shard.chmod(0o644)
