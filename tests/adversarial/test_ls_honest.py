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

import json
import signal
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
