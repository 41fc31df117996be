"""``crashproof run`` refuses nonsense before it launches anything or makes any directory: one
line naming the flag and the value, exit 2.

Every option of run's parser (torchrun's and crashproof's) has hostile values here, and a test
fails when the parser gains an option this module does not attack. The checks run in-process:
the launch is replaced, so a value that gets past them fails the test instead of training.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crashproof._console import one_line
from crashproof.cli import main
from crashproof.cli._run import build_run_parser

SCRIPT_OK = "script.py"

BAD: dict[str, list[str]] = {
    "--nnodes": ["1:x", "0", "2:1", "-1", "1:2:3", "", "65537", "x"],
    "--nproc-per-node": ["abc", "", "0", "-1", "99999999999999999999", "1025", "100000"],
    "--rdzv-backend": ["nosuch", ""],
    "--rdzv-endpoint": ["::::junk", "localhost:99999", "host:-1", "a b:1", "[::1]:x"],
    "--rdzv-id": ["", " "],
    "--rdzv-conf": [
        "garbage",
        "=1",
        "a=",
        "keep_alive_interval=abc",
        "last_call_timeout=-1",
        "join_timeout=nan",
        "keep_alive_max_attempt=0",
        "is_host=maybe",
        "store_type=x",
        "read_timeout=99999999999999999999",
    ],
    "--max-restarts": ["-3", "abc", "1.5"],
    "--monitor-interval": ["nan", "inf", "0", "-1", "1e300", "abc"],
    "--start-method": ["x", ""],
    "--event-log-handler": ["nosuch", ""],
    "--role": ["", " "],
    "--log-dir": ["{file}", "{file}/sub", "{fifo}", ""],
    "--redirects": ["9", "x", "0:9", "-1"],
    "--tee": ["x", "4", "a:1"],
    "--local-ranks-filter": ["abc", "1,x", ",", "-1"],
    "--node-rank": ["-1", "1", "abc"],
    "--master-addr": ["", " ", "x" * 64],
    "--master-port": ["99999", "-5", "0", "abc", "65536"],
    "--local-addr": ["", " ", "b" * 70],
    "--logs-specs": ["nosuch"],
    "--numa-binding": ["x"],
    "--signals-to-handle": ["SIGNOPE", "", "TERM", "SIGTERM,"],
    "--shutdown-timeout": ["-1", "abc", "nan", "99999999999999999999"],
    "--run-dir": ["{file}", "{file}/sub", "{fifo}", ""],
    "--hang-timeout": ["abc", "nan", "inf", "0", "99999999999w"],
    "--startup-timeout": ["0", "-1", "1e400"],
    "--restore-timeout": ["nan", ""],
    "--save-timeout": ["", "inf"],
    "--done-timeout": ["-1", "0"],
    "--restart-window": ["-1h", "nan", "forever", "inf"],
    "--crash-loop-attempts": ["-2", "abc"],
    "--preload": ["nosuchmodule_xyz", "", "../../etc", "a b"],
    "--preemption": ["x", ""],
    "--preemption-grace": ["0", "-1"],
    "--replication-timeout": ["nan", "0"],
    "--memory-limit": ["0", "-1G", "lots", "nan", "", "1e999", "1", "4095", "0.5"],
    "--peer-replicas": ["-1", "9", "one", "1.5", ""],
    "--peer-parity": ["0", "-1", "17", "two", "2.0", ""],
    "--standby": ["-1", "65", "one", "1.5", ""],
    "--peer-bandwidth": ["0", "-1G", "fast", "nan", "", "1e999"],
    "--straggler-factor": ["1", "nan", "inf", "0.5"],
    "--straggler-steps": ["0", "-1"],
    "--metrics-port": ["99999", "-7", "0x50"],
    "--log-level": ["loud", "DEBUG"],
    "--metrics-host": ["", " ", "é" * 70, "a" * 64 + ".example"],
}
"""Hostile values of every option that takes one; ``{file}``, ``{fifo}``: such a path."""

ANY_VALUE = {"--duplicate-stdout-filters", "--duplicate-stderr-filters"}
"""Options every value of which means something: substrings of output lines to copy."""

GOOD = [["--nproc-per-node", "2"], ["--max-restarts", "0"], ["--nnodes", "1"],
        ["--monitor-interval", "0.5"], ["--metrics-port", "-1"], ["--preemption", "none"],
        ["--tee", "3"], ["--cold-start"], ["--rdzv-conf", "join_timeout=30"]]  # fmt: skip


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that gets past the checks reaches this instead of starting training."""

    def launched(*args: object, **kwargs: object) -> int:
        raise AssertionError("bad input was not refused: the job would have launched")

    monkeypatch.setattr("crashproof.cli._run.launch", launched)


@pytest.fixture
def paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / SCRIPT_OK).write_text("raise SystemExit('must never run')\n")
    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "fifo")
    yield {"file": str(tmp_path / "file"), "fifo": str(tmp_path / "fifo")}


def _refused(
    flag: str,
    value: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    others: tuple[list[str], list[str]] = ([], []),
) -> None:
    """``--flag=value`` (a value such as -1h is the option's, not an option of its own) between
    ``others``, good options, is refused and nothing is made."""
    before = sorted(os.listdir(tmp_path))
    options = [*others[0], f"{flag}={value}", *others[1]]
    code = main(["run", "--run-dir", str(tmp_path / "run"), *options, SCRIPT_OK])
    err = capsys.readouterr().err
    assert code == 2, (options, err)
    assert "Traceback" not in err and err.count("\n") == 1, (options, err)
    assert flag in err or flag.replace("-", "_") in err, (options, err)
    assert len(value.strip()) < 2 or one_line(value) in err or _as_float(value) in err, err
    assert sorted(os.listdir(tmp_path)) == before, options  # no run directory, no logs


def _as_float(value: str) -> str:
    """How a value torchrun's parser read as a float is named (``1e300``: ``1e+300``)."""
    try:
        return repr(float(value))
    except ValueError:
        return value


def test_every_option_of_run_is_attacked() -> None:
    """The parser is torchrun's: an option torch adds must get hostile values here too."""
    options = {
        action.option_strings[-1 if action.option_strings[0] in ("-r", "-t") else 0]
        for action in build_run_parser()._actions
        if action.option_strings and action.nargs != 0
    }
    assert options - ANY_VALUE == set(BAD), options ^ set(BAD)


@pytest.mark.usefixtures("no_launch")
def test_a_hostile_value_of_any_option_is_one_line_naming_it_and_nothing_is_made(
    paths: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = [(flag, value.format(**paths)) for flag, values in BAD.items() for value in values]

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
    @given(bad=st.sampled_from(pairs), good=st.lists(st.sampled_from(GOOD), max_size=3),
           first=st.booleans())  # fmt: skip
    def check(bad: tuple[str, str], good: list[list[str]], first: bool) -> None:
        flag, value = bad
        ok = [arg for option in good for arg in option if option[0] != flag]
        _refused(flag, value, tmp_path, capsys, ([], ok) if first else (ok, []))

    check()


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize("flag", sorted(BAD))
def test_each_hostile_value_is_refused(
    flag: str, paths: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for value in BAD[flag]:
        value = value.format(**paths)
        _refused(flag, value, tmp_path, capsys)


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (["--standalone", "--nnodes", "2"], "--nnodes"),
        (["--rdzv-backend", "static", "--nnodes", "1:2"], "--nnodes"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
        (["-m", "--no-python"], "-m"),
        (["--run-dir", "/proc/self/nosuch/x"], "--run-dir"),
        (["--peer-replicas", "1", "--peer-parity", "2"], "--peer-parity"),
        (["--standby", "1"], "--standby"),
        (["--standalone", "--standby", "1"], "--standby"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--standby", "2"], "--standby"),
        (["--no-memory", "--memory-limit", "8GiB"], "--memory-limit"),
        (["--no-memory", "--peer-replicas", "1"], "--peer-replicas"),
        (["--no-memory", "--peer-parity", "2"], "--peer-parity"),
        (["--no-memory", "--peer-bandwidth", "10MiB"], "--peer-bandwidth"),
        (["--nnodes", "2", "--peer-replicas", "2"], "--peer-replicas"),
        (["--nnodes", "1:3", "--peer-replicas", "3"], "--peer-replicas"),
        (["--nnodes", "3", "--peer-parity", "4"], "--peer-parity"),
        (["--peer-replicas", "0", "--peer-bandwidth", "500MiB"], "--peer-bandwidth"),
    ],
)
def test_contradictory_options_are_refused(
    options: list[str],
    flag: str,
    paths: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["run", *options, SCRIPT_OK])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and flag in err, (options, err)


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("script", "flag"),
    [
        (["nosuch.py"], "nosuch.py"),
        (["."], "."),
        (["fifo"], "fifo"),
        (["-m", "nosuch_xyz"], "-m"),
        (["-m", ".rel"], "-m"),
        (["--no-python", "nosuch_prog_xyz"], "--no-python"),
    ],
)
def test_a_missing_script_is_a_usage_error_before_anything_launches(
    script: list[str],
    flag: str,
    paths: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["run", "--run-dir", str(tmp_path / "run"), *script])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert flag in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_good_options_pass_the_checks(
    paths: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checks refuse nonsense only: every GOOD option together reaches the launch."""
    reached: list[object] = []
    monkeypatch.setattr("crashproof.cli._run.launch", lambda args: reached.append(args) or 0)
    argv = [arg for option in GOOD for arg in option]
    assert main(["run", *argv, "--nnodes", "1:1", "--rdzv-endpoint", "[::1]:29400", SCRIPT_OK]) == 0
    assert len(reached) == 1, capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "noted"),
    [
        (["--peer-replicas", "2"], "--peer-replicas 2 on one node"),
        (
            ["--peer-parity", "3", "--peer-bandwidth", "8MiB"],
            "--peer-parity 3, --peer-bandwidth 8 MiB",
        ),
        (["--peer-replicas", "0"], None),
        (["--nnodes", "1:2", "--peer-replicas", "1"], None),
        ([], None),
    ],
)
def test_peer_options_on_one_node_are_taken_with_a_note(
    options: list[str], noted: str | None, paths: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A command shared by one-node and multi-node jobs is not refused for its peer options on
    one node, where no copies can be made: the run is told once, on stderr."""
    from crashproof.cli._run import parse_run_args

    parse_run_args([*options, SCRIPT_OK])
    err = capsys.readouterr().err
    if noted is None:
        assert "on one node" not in err, err
    else:
        assert noted in err and "no other node to hold copies" in err and err.count("\n") == 1
