"""Promise: every command answers bad input with one line and a documented exit code, never a
traceback.

Two hypothesis properties run every subcommand in-process (``crashproof.cli.main``): one over
argv (hostile values for every option and positional: empty, NUL, negative, huge, ``nan``,
``inf``, paths of every hostile kind), one over small hostile directory trees (a file instead of
a directory, symbolic links, FIFOs, empty and garbage manifests, a manifest that is a directory, a
run directory instead of a root, a checkpoint directory instead of a root, a root inside a root).
Each run must end with an exit code of the README's table (0, 1, 2, 74), no traceback, and, when
it fails, exactly one line on stderr naming an argument or path it was given. A few cases run as
real processes: a bucket without credentials, a run directory, an option parsing error.

``chaos`` and ``run`` get only values that must be refused before anything launches; a launch
seam is replaced so that a regression fails the test instead of starting training.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import crashproof
from crashproof._console import one_line
from crashproof.cli import main
from tests.warm_ranks import crashproof_cli

TABLE = {0, 1, 2, 74}
"""The exit codes of README "Command line" for everything but `run` (70: internal error, a bug,
is in the table too, but no input may reach it)."""

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(autouse=True)
def _keep_sigpipe() -> Iterator[None]:
    saved = signal.getsignal(signal.SIGPIPE)
    yield
    signal.signal(signal.SIGPIPE, saved)


def _save_checkpoints(root: Path, steps: tuple[int, ...] = (1, 2)) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with crashproof.CheckpointManager(str(root), handle_signals=False) as manager:
        for step in steps:
            manager.save(step, crashproof.TrainState(model=model, optimizer=opt))


@pytest.fixture(scope="module")
def good_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("good") / "ckpts"
    _save_checkpoints(root)
    return root


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory, good_root: Path) -> dict[str, str]:
    """Paths of every hostile kind, by name (the argv property draws from them)."""
    top = tmp_path_factory.mktemp("zoo")
    (top / "file").write_text("not a directory")
    os.mkfifo(top / "fifo")
    (top / "dangling").symlink_to(top / "nothing")
    (top / "to-root").symlink_to(good_root)
    (top / "empty").mkdir()
    run_dir = top / "run"
    run_dir.mkdir()
    step = good_root / "step_0000000002"
    (run_dir / "events.jsonl").write_text(
        json.dumps({"ts": 1.0, "event": "checkpoint", "step": 2, "path": str(step)}) + "\n"
    )
    (top / "garbage").mkdir()
    (top / "garbage" / "step_0000000001").mkdir()
    (top / "garbage" / "step_0000000001" / "manifest.json").write_text("{not json")
    return {
        "root": str(good_root),
        "step-dir": str(step),
        "parent-of-root": str(good_root.parent),
        "file": str(top / "file"),
        "under-file": str(top / "file" / "x"),
        "fifo": str(top / "fifo"),
        "dangling": str(top / "dangling"),
        "to-root": str(top / "to-root"),
        "empty": str(top / "empty"),
        "missing": str(top / "missing"),
        "run-dir": str(run_dir),
        "garbage": str(top / "garbage"),
        "out-dir": str(top / "out" / "dcp"),
        "out-file": str(top / "out" / "w.safetensors"),
    }


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # main returns its code; a SystemExit escaping is a finding too
        pytest.fail(f"main raised SystemExit({exc.code}) for {argv}")
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_naming(
    code: int, err: str, argv: list[str], names: list[str], out: str = ""
) -> None:
    assert code in TABLE, (code, argv, err)
    assert "Traceback" not in err + out, (argv, err)
    if code == 0:
        return
    if code == 1 and argv[0] == "verify" and not err:  # the verdict, one line per checkpoint
        assert out and all(": valid" in li or ": INVALID: " in li for li in out.splitlines()), out
        return
    lines = [line for line in err.splitlines() if line.strip()]
    # `export` without --step may first say which steps it skipped: one line each, then the verdict.
    verdict = [line for line in lines if not line.startswith("crashproof: skipping step")]
    assert len(verdict) == 1, (argv, err)
    assert verdict[0].startswith("crashproof"), (argv, err)
    named = any(name and name in verdict[0] for name in names)
    assert named or re.search(r"--[a-z][a-z-]+", verdict[0]), (argv, err)  # or an option


def names_in(argv: list[str]) -> list[str]:
    """What a message may name: the arguments given (not too short to mean anything), option
    names, the positional's name, a path's resolved form."""
    names = ["ROOT", "root", "RUN_DIR", "run_dir"]
    for token in argv[1:]:
        if len(token.strip()) >= 2:
            names.append(token)
            names.append(token.split("=")[0])
            names.append(one_line(token))  # a control character is named escaped
        if token.strip() and "\x00" not in token:
            names.append(os.path.realpath(token))
            names.append(os.path.abspath(token))
    return names


# -- the argv property ----------------------------------------------------------------------------

HOSTILE = ["", " ", "-", "--", "\x00", "0", "-1", "-3", "1e400", "nan", "inf", "-inf", "abc",
           "99999999999999999999999", "1.5", "é", "5GB", "infGB", "nanMB", "-5GB", "0B"]  # fmt: skip
PATHS = ["root", "step-dir", "parent-of-root", "file", "under-file", "fifo", "dangling", "to-root",
         "empty", "missing", "run-dir", "garbage"]  # fmt: skip
URIS = ["s3://", "memory://", "://x", "ftp://127.0.0.1:1/x", "reference://x", "github://a:b@/",
        "data://x", "dir://x", "S3://b/x", "nosuch://x", "simplecache::s3://b"]  # fmt: skip
"""Unsupported or malformed storage URIs: a usage error naming the URI (exit 2), never 70."""


@st.composite
def argv_for(draw: st.DrawFn, zoo: dict[str, str]) -> list[str]:
    value = st.sampled_from(HOSTILE)
    path = st.sampled_from(PATHS).map(lambda k: zoo[k])
    where = st.one_of(path, value, st.sampled_from(URIS))
    command = draw(
        st.sampled_from(["ls", "verify", "inspect", "prune", "export", "plan", "report"])
    )
    argv = [command]
    if command in ("ls", "verify", "inspect", "prune", "export"):
        argv.append(draw(where))
    if command == "report":
        argv.append(draw(where))
    options: dict[str, list[st.SearchStrategy[Any]]] = {
        "ls": [st.just(["--json"]), st.just(["--verify"])],
        "verify": [st.tuples(st.just("--step"), value), st.just(["--latest"]), st.just(["--json"])],
        "inspect": [st.tuples(st.just("--step"), value), st.just(["--json"])],
        "prune": [
            st.tuples(
                st.sampled_from(
                    [
                        "--keep-last",
                        "--keep-every",
                        "--keep-hourly",
                        "--keep-daily",
                        "--keep-weekly",
                    ]
                ),
                value,
            ),
            st.tuples(st.just("--keep-within"), value),
            st.tuples(st.just("--keep-best"), st.sampled_from([":max", "loss:up", "", "m:min"])),
        ],
        "export": [
            st.tuples(st.just("--step"), value),
            st.tuples(st.just("--format"), st.sampled_from(["dcp", "safetensors", "pickle", ""])),
            st.tuples(st.just("--max-shard-size"), value),
            st.tuples(
                st.just("-o"), st.one_of(where, st.sampled_from([zoo["out-dir"], zoo["out-file"]]))
            ),
            st.just(["--force"]),
        ],
        "plan": [
            st.tuples(
                st.sampled_from(
                    [
                        "--devices",
                        "--days",
                        "--ckpt-minutes",
                        "--restart-minutes",
                        "--cost-per-device-hour",
                        "--mtbf-hours",
                        "--daily-failure-prob",
                        "--cluster-mtbf-hours",
                    ]
                ),
                st.one_of(value, st.sampled_from(["1e-308", "1e308", "5e-324", "1e-300"])),
            ),
            st.just(["--json"]),
        ],
        "report": [st.tuples(st.just("--html"), where), st.just(["--json"])],
    }
    for option in draw(st.lists(st.sampled_from(options[command]), max_size=4)):
        argv.extend(draw(option))
    if command == "prune":
        argv.append("--dry-run")  # the property is about answers, not about removing checkpoints
    return argv


def test_every_subcommand_answers_hostile_argv_with_one_line_and_a_documented_code(
    zoo: dict[str, str],
    good_root: Path,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Hostile values are relative paths too (``--html 0``): whatever is written lands here.
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    before = sorted(p.name for p in good_root.rglob("*"))

    @SETTINGS
    @given(argv=argv_for(zoo))
    def check(argv: list[str]) -> None:
        code, out, err = run_cli(argv, capsys)
        assert_one_line_naming(code, err, argv, names_in(argv), out)
        assert sorted(p.name for p in good_root.rglob("*")) == before, argv
        for out in (zoo["out-dir"], zoo["out-file"]):  # room for the next export
            if os.path.isdir(out):
                shutil.rmtree(out)
            elif os.path.lexists(out):
                os.remove(out)

    check()


# -- the reported cases, each named -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["ls", "{file}"], "{file}"),
        (["ls", "{fifo}"], "{fifo}"),
        (["ls", "{dangling}"], "{dangling}"),
        (["ls", "{step-dir}"], "{step-dir}"),
        (["ls", ""], "ROOT"),
        (["verify", "{run-dir}"], "{run-dir}"),
        (["prune", "{run-dir}", "--keep-last", "1"], "{run-dir}"),
        (["export", "{root}", "-o", "{under-file}"], "{file}"),
        (["export", "{root}", "--format", "dcp", "-o", "{empty}/.."], "{empty}/.."),
        (["export", "{root}", "-o", "{out-file}", "--max-shard-size", "infGB"], "--max-shard-size"),
        (["export", "{root}", "-o", "{out-file}", "--max-shard-size", "1e400"], "--max-shard-size"),
        (["export", "{root}", "-o", ""], "-o"),
        (["prune", "{root}", "--keep-best", ":max", "--dry-run"], "--keep-best"),
        (["prune", "{root}", "--keep-within", "nan", "--dry-run"], "--keep-within"),
        (["ls", "{root}", "--no-such-option"], "--no-such-option"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_a_reported_bad_input_gets_one_line_and_exit_2(
    zoo: dict[str, str], argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(**zoo) for a in argv]
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (argv, err)
    assert_one_line_naming(code, err, argv, [named.format(**zoo)])
    assert out == ""


@pytest.mark.parametrize("uri", URIS)
@pytest.mark.parametrize("command", ["ls", "verify", "inspect", "prune", "export", "report"])
def test_an_unsupported_or_malformed_storage_uri_is_one_line_and_exit_2(
    uri: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported cases: ``ls ftp://127.0.0.1:1/x`` (and reference://, github://, data://) was
    an internal error with a finalizer's traceback; ``s3://`` was read as the local path s3:."""
    argv = [command, uri, *{"prune": ["--keep-last", "1"],
                            "export": ["-o", str(tmp_path / "w.st")]}.get(command, [])]  # fmt: skip
    code, _, err = run_cli(argv, capsys)
    assert code == 2, (argv, err)
    assert err.count("\n") == 1 and "Traceback" not in err and "Exception ignored" not in err, err
    assert uri in err, err
    assert "s3:: " not in err and "/s3:" not in err, err  # never the local path s3:
    assert not os.listdir(tmp_path)


def test_ls_of_a_run_directory_says_so_and_where_its_checkpoints_are(
    zoo: dict[str, str], good_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["ls", zoo["run-dir"]], capsys)
    assert code == 2 and out == ""
    assert "run directory" in err
    assert str(good_root) in err


# -- the tree property ----------------------------------------------------------------------------

MANIFESTS = ["", "{", "[]", "null", '{"step": 1}', '{"format": 1, "step": "x", "files": 7}', "\xff"]


@st.composite
def hostile_tree(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """(name, kind, content) entries of a checkpoint root; kind: file, dir, fifo, link, ckpt."""
    names = st.sampled_from(["step_0000000001", "step_0000000002", "step_0000000003", "step_2",
                             "events.jsonl", "manifest.json", "notes.txt", ".tmp-x", "sub"])  # fmt: skip
    kinds = st.sampled_from(["file", "dir", "fifo", "link", "ckpt", "ckpt-flipped", "manifest"])
    entries = draw(st.lists(st.tuples(names, kinds, st.sampled_from(MANIFESTS)), max_size=5,
                            unique_by=lambda e: e[0]))  # fmt: skip
    return entries


def build(top: Path, entries: list[tuple[str, str, str]], real: Path) -> Path:
    root = top / "root"
    root.mkdir()
    for name, kind, content in entries:
        path = root / name
        if kind == "file":
            path.write_text(
                json.dumps({"ts": 1, "event": "checkpoint", "path": str(real / "step_0000000001")})
                if name == "events.jsonl"
                else content
            )
        elif kind == "dir":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "link":
            path.symlink_to([real, top, top / "nowhere", real / "step_0000000001"][len(name) % 4])
        elif kind in ("ckpt", "ckpt-flipped"):
            shutil.copytree(real / "step_0000000001", path)
            if kind == "ckpt-flipped":
                shard = path / "rank_00000.safetensors"
                data = bytearray(shard.read_bytes())
                data[-2] ^= 0x01
                shard.write_bytes(bytes(data))
        else:  # a checkpoint directory whose manifest is hostile (or a directory, or a FIFO)
            path.mkdir()
            manifest = path / "manifest.json"
            if content == "null":
                manifest.mkdir()
            elif content == "{":
                os.mkfifo(manifest)
            else:
                manifest.write_text(content)
    return root


def test_every_subcommand_answers_a_hostile_tree_with_a_documented_code(
    good_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    @SETTINGS
    @given(entries=hostile_tree(), as_root=st.sampled_from(["root", "entry"]))
    def check(entries: list[tuple[str, str, str]], as_root: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            root = build(Path(tmp), entries, good_root)
            target = str(root / entries[0][0]) if as_root == "entry" and entries else str(root)
            for argv in (
                ["ls", target],
                ["ls", target, "--verify", "--json"],
                ["verify", target],
                ["inspect", target],
                ["prune", target, "--keep-last", "1", "--dry-run"],
                ["export", target, "-o", str(Path(tmp) / "out.safetensors")],
                ["export", target, "--format", "dcp", "-o", str(Path(tmp) / "dcp")],
                ["report", target],
            ):
                code, out, err = run_cli(argv, capsys)
                assert_one_line_naming(code, err, argv, [*names_in(argv), tmp], out)
            assert good_root.joinpath("step_0000000001", "manifest.json").is_file()

    check()


# -- chaos and run: refused before anything launches ------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A regression that gets past the checks reaches these instead of starting training."""

    def launched(*args: object, **kwargs: object) -> int:
        raise AssertionError("bad input was not refused: the job would have launched")

    monkeypatch.setattr("crashproof.chaos._orchestrate._campaign", launched)
    import crashproof.supervisor.launch as launch

    for seam in ("_launch", "_run_agent"):
        if hasattr(launch, seam):
            monkeypatch.setattr(launch, seam, launched)


@pytest.mark.usefixtures("no_launch")
def test_chaos_refuses_bad_options_with_one_line_naming_them(
    tmp_path: Path, zoo: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    run = ["--", "--nproc-per-node", "1", str(script)]
    fault = ["--fault", "at=1s,rank=0,kind=kill"]
    cases = [
        (["--seed", "x", *fault, *run], "--seed"),
        (["--mtbf", "-1", "--duration", "5", *run], "--mtbf"),
        (["--mtbf", "nan", "--duration", "5", *run], "--mtbf"),
        (["--mtbf", "5", *run], "--duration"),
        (["--fault", "garbage", *run], "garbage"),
        (["--fault", "at=xs,rank=0,kind=kill", *run], "at=xs"),
        (["--fault", "at=1s,rank=7,kind=kill", *run], "rank"),
        ([*fault, "--resolve-timeout", "0", *run], "--resolve-timeout"),
        ([*fault, "--dir", zoo["file"], *run], zoo["file"]),
        ([*fault, "--dir", zoo["garbage"], *run], zoo["garbage"]),
        ([*fault, "--report", zoo["file"], "--dir", str(tmp_path / "c"), *run], zoo["file"]),
        ([*fault], "--"),
        # the wrapped run's argv, checked by run's own checks before anything is made
        ([*fault, "--", "nosuch.py"], "nosuch.py"),
        ([*fault, "--", "--max-restarts", "-3", str(script)], "--max-restarts"),
        ([*fault, "--", "--nproc-per-node", "0", str(script)], "--nproc-per-node"),
        ([*fault, "--", "--nnodes", "1:x", str(script)], "--nnodes"),
        ([*fault, "--", "--run-dir", zoo["file"], str(script)], "--run-dir"),
        ([*fault, "--", "--monitor-interval", "nan", str(script)], "--monitor-interval"),
        ([*fault, "--", "--bogus", str(script)], "--bogus"),
        # a schedule too large to draw: refused at once, not drawn for ever
        (["--mtbf", "0.000001", "--duration", "1w", *run], "--mtbf"),
        (["--mtbf", "1e-300", "--duration", "1", *run], "--mtbf"),
    ]
    for options, named in cases:
        argv = ["chaos", *options]
        code, _, err = run_cli(argv, capsys)
        assert code == 2, (argv, err)
        assert_one_line_naming(code, err, argv, [named])
    assert sorted(os.listdir(tmp_path)) == ["train.py"]  # nothing made


@pytest.mark.usefixtures("no_launch")
def test_chaos_takes_a_report_path_without_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported case: ``--report report.json`` was refused as "report.json:  is a file"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit(0)\n")
    argv = ["chaos", "--fault", "at=1s,rank=0,kind=kill", "--report", "report.json", "--",
            "--nproc-per-node", "1", "train.py"]  # fmt: skip
    _, _, err = run_cli(argv, capsys)
    assert "would have launched" in err and "is a file" not in err, err


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (["--max-restarts", "-3"], "--max-restarts"),
        (["--metrics-port", "99999"], "--metrics-port"),
        (["--hang-timeout", "abc"], "--hang-timeout"),
        ([], "nosuch.py"),
    ],
)
def test_run_refuses_bad_options_before_launching(
    tmp_path: Path, options: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Parsed by crashproof.supervisor.launch (the supervisor's module)."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    target = str(tmp_path / "nosuch.py") if flag == "nosuch.py" else str(script)
    argv = ["run", "--run-dir", str(tmp_path / "r"), *options, target]
    code, _, err = run_cli(argv, capsys)
    assert code == 2, (argv, err)
    assert "Traceback" not in err
    assert flag in err, err


# -- real processes -------------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return crashproof_cli(*args, env=env)


def test_a_bucket_without_credentials_is_one_line_and_exit_74(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}  # fmt: skip
    done = _cli("ls", "s3://crashproof-no-such-bucket/x", env=env)
    assert done.returncode == 74, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "s3://crashproof-no-such-bucket/x" in done.stderr


def test_the_console_answers_a_run_directory_and_a_bad_option_in_one_line(
    zoo: dict[str, str],
) -> None:
    for args, named in (
        (["ls", zoo["run-dir"]], zoo["run-dir"]),
        (["verify", zoo["root"], "--step", "abc"], "--step"),
    ):
        done = _cli(*args)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert named in done.stderr and "Traceback" not in done.stderr


# -- control characters in what a message names ----------------------------------------------------

CONTROL = ["\n", "\r", "\x1b[2J", "\u2028", "\t", "\x85"]


@pytest.mark.parametrize("bad", CONTROL)
@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{p}"],
        ["verify", "{p}"],
        ["inspect", "{p}"],
        ["prune", "{p}", "--keep-last", "1"],
        ["export", "{root}", "-o", "{file}/{p}"],
        ["export", "{root}", "--format", "dcp", "-o", "{file}/{p}"],
        ["report", "{p}"],
        ["report", "{run-dir}", "--html", "{file}/{p}"],
        ["prune", "{root}", "--keep-within", "{p}", "--dry-run"],
        ["ls", "{root}", "--{p}"],
        ["chaos", "--fault", "at=1s,rank=0,kind=kill", "--dir", "{file}/{p}", "--", "x.py"],
    ],
)
@pytest.mark.usefixtures("no_launch")
def test_a_control_character_in_a_path_or_value_is_named_escaped_on_one_line(
    zoo: dict[str, str], argv: list[str], bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported case: ``crashproof ls $'root2\\n'`` printed two lines."""
    argv = [a.format(p=f"root2{bad}x", **zoo) for a in argv]
    code, _, err = run_cli(argv, capsys)
    assert code == 2, (argv, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert not any(c in err[:-1] for c in CONTROL), err
    assert f"root2{one_line(bad)}x" in err, err


# -- an output that cannot be written: exit 74 naming the option, for export and report alike -------


def _run_dir(top: Path) -> Path:
    run_dir = top / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(
        '{"event": "run_start", "t": 1.0, "run_id": "r"}\n{"event": "run_end", "t": 2.0, '
        '"outcome": "succeeded", "exit_code": 0}\n'
    )
    return run_dir


def _assert_output_unwritable(code: int, err: str, option: str, path: str) -> None:
    assert code == 74, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{option} {path}: cannot be written" in err, err
    assert "credentials" not in err and "S3" not in err, err


@pytest.mark.parametrize("err_no", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_an_export_whose_output_cannot_be_written_is_74_naming_o(
    good_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    err_no: int,
) -> None:
    from traceback import StackSummary

    from torch.distributed.checkpoint.api import CheckpointException

    def failing_shard(_storage: object, path: str, *args: object, **kwargs: object) -> None:
        raise OSError(err_no, os.strerror(err_no), path)

    def failing_save(*args: object, **kwargs: object) -> None:  # as torch wraps a rank's error
        raise CheckpointException(
            "save", {0: (OSError(err_no, os.strerror(err_no)), StackSummary())}
        )

    monkeypatch.setattr("crashproof.checkpoint.export._export.write_shard", failing_shard)
    monkeypatch.setattr("torch.distributed.checkpoint.state_dict_saver.save", failing_save)
    for fmt, out in (("safetensors", tmp_path / "w.safetensors"), ("dcp", tmp_path / "dcp")):
        argv = ["export", str(good_root), "--format", fmt, "-o", str(out)]
        code, _, err = run_cli(argv, capsys)
        _assert_output_unwritable(code, err, "-o", str(out))
        assert os.strerror(err_no) in err
    assert sorted(os.listdir(tmp_path)) == []  # nothing left beside the targets


def test_a_report_page_that_cannot_be_written_is_74_naming_html(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _run_dir(tmp_path)

    def failing(path: str, data: bytes) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path + ".tmp-x")

    monkeypatch.setattr("crashproof.telemetry._report.write_atomically", failing)
    page = str(tmp_path / "page.html")
    code, _, err = run_cli(["report", str(run_dir), "--html", page], capsys)
    _assert_output_unwritable(code, err, "--html", page)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A real read-only mount (root only; skipped elsewhere)."""
    where = tmp_path / "ro"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_outputs_on_a_read_only_mount_are_74_naming_the_option_as_processes(
    good_root: Path, tmp_path: Path, read_only_dir: Path
) -> None:
    """The reported case: ``export -o ro/new.st`` blamed the checkpoint root and suggested S3
    credentials; ``report --html`` on the same failure exited 2."""
    run_dir = _run_dir(tmp_path)
    cases = [
        (["export", str(good_root), "-o", str(read_only_dir / "new.st")], "-o"),
        (["export", str(good_root), "--format", "dcp", "-o", str(read_only_dir / "d")], "-o"),
        (["export", str(good_root), "-o", str(read_only_dir / "sub" / "new.st")], "-o"),
        (["report", str(run_dir), "--html", str(read_only_dir / "r.html")], "--html"),
    ]
    for args, option in cases:
        done = _cli(*args)
        _assert_output_unwritable(done.returncode, done.stderr, option, args[-1])
        assert "Read-only file system" in done.stderr


def test_report_html_naming_a_directory_is_exit_2_naming_html(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _run_dir(tmp_path)
    for html in ("/", str(tmp_path), str(run_dir), "."):
        code, out, err = run_cli(["report", str(run_dir), "--html", html], capsys)
        assert code == 2 and out == "", err
        assert_one_line_naming(code, err, ["report", html], [f"--html {html}"])


# -- a file the storage refuses to read: exit 74 naming it, never "invalid" -----------------------

REFUSALS = [errno.EACCES, errno.EPERM, errno.EIO]


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``refuse(name, err_no)``: every open of a path named ``name`` fails with ``err_no``."""
    real_open = os.open

    def refuse(name: str, err_no: int) -> None:
        def opener(path: Any, *args: Any, **kwargs: Any) -> int:
            if os.path.basename(os.fsdecode(path)) == name:
                raise OSError(err_no, os.strerror(err_no), os.fsdecode(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", opener)

    return refuse


@pytest.mark.parametrize("err_no", REFUSALS)
@pytest.mark.parametrize(
    "name", ["manifest.json", "rank_00000.json", "rank_00000.safetensors", "step_0000000002"]
)
@pytest.mark.parametrize(
    "argv",
    [["ls"], ["ls", "--verify"], ["verify"], ["verify", "--step", "2"], ["inspect"], ["export"]],
)
def test_a_file_the_storage_refuses_is_74_naming_it_in_every_command(
    good_root: Path,
    tmp_path: Path,
    refusing: Any,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    name: str,
    err_no: int,
) -> None:
    """The reported case: an unreadable manifest, step directory or index was `verify` INVALID
    (exit 1), `inspect` and `export` exit 1 (or an older step exported), `ls --verify` a row
    not verified."""
    if argv == ["inspect"] and name == "rank_00000.safetensors":
        pytest.skip("inspect reads no tensor data")
    out = ["-o", str(tmp_path / "w.st")] if argv[0] == "export" else []
    refusing(name, err_no)
    full = [argv[0], str(good_root), *argv[1:], *out]
    code, stdout, err = run_cli(full, capsys)
    if argv == ["ls"]:  # a listing, no verdict: the row names the file (test_ls_honest.py)
        assert code == 0 and err == "" and name in stdout and os.strerror(err_no) in stdout
        return
    assert code == 74, (full, stdout, err)
    assert err.count("\n") == 1 and "INVALID" not in stdout + err, err
    assert os.strerror(err_no) in err and name in err and str(good_root) in err, err
    assert not os.path.exists(tmp_path / "w.st")


@pytest.mark.parametrize("err_no", REFUSALS)
def test_an_event_log_the_storage_refuses_is_74_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], err_no: int
) -> None:
    run_dir = _run_dir(tmp_path)

    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(err_no, os.strerror(err_no), str(run_dir / "events.jsonl"))

    monkeypatch.setattr("crashproof.telemetry._ledger.read_events", refused)
    code, _, err = run_cli(["report", str(run_dir), "--json"], capsys)
    assert code == 74 and err.count("\n") == 1, err
    assert str(run_dir / "events.jsonl") in err and os.strerror(err_no) in err, err


def test_unreadable_files_are_74_as_processes_without_capabilities(
    good_root: Path, tmp_path: Path
) -> None:
    """As the tester ran it: chmod 000, DAC capabilities dropped (root) or a plain user."""
    setpriv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
               "--inh-caps=-dac_override,-dac_read_search", "--"]  # fmt: skip
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: permissions cannot be taken away")
    prefix = setpriv if os.geteuid() == 0 else []
    root = tmp_path / "root"
    shutil.copytree(good_root, root, ignore=shutil.ignore_patterns(".crashproof.lock"))
    manifest = root / "step_0000000002" / "manifest.json"
    run_dir = _run_dir(tmp_path)
    manifest.chmod(0)
    (run_dir / "events.jsonl").chmod(0)
    try:
        for args, named in (
            (["verify", str(root)], manifest),
            (["report", str(run_dir), "--json"], run_dir / "events.jsonl"),
        ):
            done = subprocess.run(
                [*prefix, sys.executable, "-m", "crashproof.cli", *args],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            if "setpriv" in done.stderr and done.returncode != 74:
                pytest.skip(f"setpriv cannot drop capabilities here: {done.stderr.strip()}")
            assert done.returncode == 74, done.stderr
            assert done.stderr.count("\n") == 1 and str(named) in done.stderr, done.stderr
    finally:
        manifest.chmod(0o644)
        (run_dir / "events.jsonl").chmod(0o644)


# -- report: malformed events; plan: JSON that parses ---------------------------------------------


@pytest.mark.parametrize("ts", ["1e300", "1e12", "-1e12", "-5", "NaN", "Infinity", '"x"', "true"])
def test_report_skips_an_event_whose_time_is_not_a_time_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ts: str
) -> None:
    """The reported cases: ``"ts": 1e300`` was exit 70 (OverflowError), ``1e12`` exit 2 with
    "year 33658 is out of range" naming no path."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    events = run_dir / "events.jsonl"
    events.write_text(
        '{"event":"run_start","ts":1000,"run_id":"r"}\n'
        f'{{"event":"replicated","ts":{ts}}}\n'
        '{"event":"run_end","ts":1010,"outcome":"succeeded","exitcode":0}\n'
    )
    for extra in ([], ["--json"]):
        code, out, err = run_cli(["report", str(run_dir), *extra], capsys)
        assert code == 0, err
        assert err.count("\n") == 1 and f"{events}: skipped malformed line 2" in err, err
        if extra:
            json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))


@pytest.mark.parametrize(
    "rate",
    [
        ["--mtbf-hours", "1e-308"],
        ["--cluster-mtbf-hours", "5e-324"],
        ["--mtbf-hours", "nan"],
        ["--daily-failure-prob", "inf"],
        ["--mtbf-hours", "1e308"],
    ],
)
def test_plan_json_is_json_or_a_one_line_refusal(
    rate: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported case: ``plan --json --mtbf-hours 1e-308`` printed ``Infinity``."""
    argv = ["plan", "--json", "--devices", "8", "--days", "30", "--ckpt-minutes", "1",
            "--restart-minutes", "5", "--cost-per-device-hour", "2", *rate]  # fmt: skip
    code, out, err = run_cli(argv, capsys)
    if code == 0:
        json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    else:
        assert code == 2 and out == "" and err.count("\n") == 1 and rate[0] in err, err
