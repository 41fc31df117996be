"""Promise: no command deletes what it did not create.

``crashproof export -o`` once ran a recursive delete on whatever was at its target: the checkpoint
root, a folder of user files, the current directory. Now every command that writes refuses an
existing non-empty target unless it is its own earlier output (a marker) and ``--force`` is
given; never the root, an ancestor of it, the current directory or an ancestor of that; it writes
beside the target and renames into place. Each test snapshots the files an attacker points the
command at and asserts they are byte for byte intact afterwards. In-process (``cli.main``): the
promise is about paths, not processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import crashproof
from crashproof.checkpoint.export._target import MARKER
from crashproof.cli import main
from tests.supervisor._runs import Run, output, start_run


@pytest.fixture(autouse=True)
def _keep_sigpipe() -> Iterator[None]:
    saved = signal.getsignal(signal.SIGPIPE)
    yield
    signal.signal(signal.SIGPIPE, saved)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint root, three levels below tmp_path (so that an ancestor of it is in reach
    without being anything outside the test's own directory), with steps 1 and 2."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    path = tmp_path / "a" / "b" / "ckpts"
    with crashproof.CheckpointManager(str(path), handle_signals=False) as manager:
        for step in (1, 2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            manager.save(step, crashproof.TrainState(model=model, optimizer=opt))
    (tmp_path / "a" / "notes.txt").write_text("an ancestor's own file")
    return path


def snapshot(top: Path) -> dict[str, str]:
    """Every entry under ``top`` (itself too), with a digest of each file's bytes."""
    found: dict[str, str] = {}
    for parent, dirs, files in os.walk(top):
        for name in dirs:
            found[os.path.relpath(os.path.join(parent, name), top)] = "dir"
        for name in files:
            path = os.path.join(parent, name)
            found[os.path.relpath(path, top)] = (
                hashlib.sha256(Path(path).read_bytes()).hexdigest() if os.path.isfile(path) else "?"
            )
    return found


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    (path / "sub").mkdir()
    (path / "sub" / "data.csv").write_text("1,2,3")
    return path


def export(root: Path, out: str | Path, *extra: str, fmt: str = "dcp") -> int:
    return main(["export", str(root), "--format", fmt, "-o", str(out), *extra])


def refused(code: int, err: str, names: str | Path) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert str(names) in err, err


# -- the reported cases ---------------------------------------------------------------------------


def test_export_dcp_onto_the_checkpoint_root_is_refused_and_every_checkpoint_survives(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(tmp_path)
    refused(export(root, root), capsys.readouterr().err, root)
    assert snapshot(tmp_path) == before
    assert main(["verify", str(root)]) == 0


def test_export_dcp_onto_a_folder_of_user_files_is_refused_and_they_survive(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = user_folder(tmp_path / "mine")
    before = snapshot(tmp_path)
    for extra in ((), ("--force",)):  # --force replaces only an earlier export, never this
        refused(export(root, folder, *extra), capsys.readouterr().err, folder)
    assert snapshot(tmp_path) == before


def test_export_dcp_onto_the_current_directory_is_refused(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = user_folder(tmp_path / "work")
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)
    for out in (".", str(work), "./", "sub/..", "..", str(tmp_path)):
        for extra in ((), ("--force",)):
            code = export(root, out, *extra)
            err = capsys.readouterr().err
            assert code == 2, (out, err)
            assert "current directory" in err, (out, err)
    assert snapshot(tmp_path) == before
    assert Path.cwd() == work


# -- more of the same class -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["dcp", "safetensors"])
def test_an_ancestor_of_the_root_or_a_path_inside_it_is_refused(
    root: Path, tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(tmp_path)
    for out in (root.parent, tmp_path / "a", root / "step_0000000009", root / "export"):
        for extra in ((), ("--force",)):
            code = export(root, out, *extra, fmt=fmt)
            err = capsys.readouterr().err
            assert code == 2, (out, err)
            assert str(out) in err
            assert "checkpoint root" in err, err
    assert snapshot(tmp_path) == before


def test_a_symbolic_link_to_the_root_or_to_user_files_is_refused(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = user_folder(tmp_path / "mine")
    (tmp_path / "to-root").symlink_to(root)
    (tmp_path / "to-mine").symlink_to(folder)
    (tmp_path / "to-nothing").symlink_to(tmp_path / "nothing")
    before = snapshot(tmp_path)
    for link in ("to-root", "to-mine", "to-nothing"):
        for fmt in ("dcp", "safetensors"):
            code = export(root, tmp_path / link, "--force", fmt=fmt)
            refused(code, capsys.readouterr().err, tmp_path / link)
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "nothing").exists()


def test_safetensors_export_onto_a_user_file_is_refused_even_a_safetensors_one(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": torch.ones(3)}, str(theirs))  # a valid safetensors file, not an export's
    text = tmp_path / "notes.txt"
    text.write_text("keep me")
    folder = user_folder(tmp_path / "folder")
    before = snapshot(tmp_path)
    for out in (theirs, text, folder):
        for extra in ((), ("--force",)):
            refused(export(root, out, *extra, fmt="safetensors"), capsys.readouterr().err, out)
    assert snapshot(tmp_path) == before


def test_a_fifo_or_a_path_under_a_file_is_refused_without_blocking(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "file").write_text("x")
    before = snapshot(tmp_path)
    for fmt in ("dcp", "safetensors"):
        for out in (tmp_path / "pipe", tmp_path / "file" / "out", tmp_path / "file" / "a" / "b"):
            refused(export(root, out, "--force", fmt=fmt), capsys.readouterr().err, out)
    assert snapshot(tmp_path) == before


def test_an_earlier_dcp_export_is_replaced_only_with_force_and_only_if_it_holds_nothing_else(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dcp"
    assert export(root, out, "--step", "1") == 0
    assert (out / MARKER).is_file() and (out / ".metadata").is_file()
    first = snapshot(out)
    code = export(root, out)  # no --force
    err = capsys.readouterr().err
    refused(code, err, out)
    assert "--force" in err
    assert snapshot(out) == first

    assert export(root, out, "--force") == 0  # replaced: now step 2
    assert json.loads((out / MARKER).read_text())["step"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dcp.")], "leftovers beside"

    (out / "my-notes.txt").write_text("added by the user after the export")
    capsys.readouterr()
    code = export(root, out, "--force")
    refused(code, capsys.readouterr().err, out / "my-notes.txt")
    assert (out / "my-notes.txt").read_text() == "added by the user after the export"


@pytest.mark.parametrize(
    "listed",
    [
        ["thesis.tex", "sub", "sub/data.csv"],  # a forged marker naming the user's files
        [".metadata", "__0_0.distcp", "thesis.tex", "sub", "sub/data.csv"],  # among DCP's own
        [".metadata", "__0_0.distcp", "sub", "sub/data.csv", "thesis.tex", 7, None],  # junk too
    ],
)
def test_a_forged_export_marker_does_not_make_user_files_an_export(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], listed: list[object]
) -> None:
    """A marker is a plain file: one that lists the user's files (hand-written, or an earlier
    export's edited) does not let --force replace them; only DCP's own output names count."""
    out = user_folder(tmp_path / "victim")
    (out / MARKER).write_text(json.dumps({"command": "export", "step": 1, "files": listed}))
    before = snapshot(out)
    code = export(root, out, "--force")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and str(out) in err, err
    assert snapshot(out) == before


def test_an_empty_directory_is_written_into(root: Path, tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert export(root, out) == 0
    assert (out / ".metadata").is_file()


def test_an_earlier_safetensors_export_is_replaced_only_with_force(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "w.safetensors"
    assert export(root, out, "--step", "1", fmt="safetensors") == 0
    step1 = out.read_bytes()
    refused(export(root, out, fmt="safetensors"), capsys.readouterr().err, out)
    assert out.read_bytes() == step1
    assert export(root, out, "--force", fmt="safetensors") == 0
    assert out.read_bytes() != step1
    assert set(load_file(str(out))) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_a_forced_sharded_export_removes_only_the_earlier_exports_stale_shards(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.safetensors"
    assert export(root, out, "--max-shard-size", "100", fmt="safetensors") == 0
    many = sorted(p.name for p in tmp_path.glob("m-*.safetensors"))
    assert len(many) == 4
    bystander = tmp_path / "m-00009-of-00009.safetensors"  # named like a shard, not an export's
    bystander.write_text("not mine")
    code = export(root, out, "--max-shard-size", "600", fmt="safetensors")  # no --force
    refused(code, capsys.readouterr().err, tmp_path / "m.safetensors.index.json")
    assert sorted(p.name for p in tmp_path.glob("m-0000?-of-00004.safetensors")) == many
    assert export(root, out, "--max-shard-size", "600", "--force", fmt="safetensors") == 0
    index = json.loads((tmp_path / "m.safetensors.index.json").read_text())
    now = sorted(set(index["weight_map"].values()))
    assert now and all(name.endswith(f"-of-{len(now):05d}.safetensors") for name in now)
    left = sorted(p.name for p in tmp_path.glob("m-*.safetensors"))
    assert left == sorted([*now, bystander.name]), "stale shards kept, or a bystander removed"
    assert bystander.read_text() == "not mine"


def test_a_failed_export_leaves_the_earlier_one_and_nothing_beside_it(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "dcp"
    assert export(root, out, "--step", "1") == 0
    before = snapshot(tmp_path)

    def broken_save(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("torch.distributed.checkpoint.state_dict_saver.save", broken_save)
    code = export(root, out, "--force")
    assert code == 74  # the storage could not be written (exit-code table)
    assert snapshot(tmp_path) == before


def test_a_user_directory_named_like_the_old_temporary_is_left_alone(
    root: Path, tmp_path: Path
) -> None:
    """The old export first deleted ``<out>.tmp-<pid>``, whoever had made it."""
    out = tmp_path / "dcp"
    stray = user_folder(tmp_path / f"dcp.tmp-{os.getpid()}")
    stray_file = tmp_path / f"w.safetensors.tmp-{os.getpid()}"
    stray_file.write_text("mine")
    before = snapshot(stray)
    assert export(root, out) == 0
    assert export(root, tmp_path / "w.safetensors", fmt="safetensors") == 0
    assert snapshot(stray) == before
    assert stray_file.read_text() == "mine"


def test_chaos_never_writes_over_a_user_file_or_into_a_full_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before anything launches (the script does not even exist)."""
    report = tmp_path / "results.json"
    report.write_text('{"mine": true}')
    full = user_folder(tmp_path / "full")
    (tmp_path / "file").write_text("x")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")  # were it launched, it would do nothing
    before = snapshot(tmp_path)
    run_args = ["--", "--nproc-per-node", "1", str(script)]
    fault = ["--fault", "at=1s,rank=0,kind=kill"]
    cases = [
        (["--dir", str(tmp_path / "c1"), "--report", str(report), "--force"], report),
        (["--dir", str(full)], full),
        (["--dir", str(tmp_path / "file")], tmp_path / "file"),
        (["--dir", str(tmp_path / "c2"), "--report", str(tmp_path / "file" / "r.json")],
         tmp_path / "file"),
    ]  # fmt: skip
    for options, named in cases:
        code = main(["chaos", *fault, *options, *run_args])
        refused(code, capsys.readouterr().err, named)
    assert snapshot(tmp_path) == before


def test_report_html_never_overwrites_a_file_it_did_not_write(tmp_path: Path) -> None:
    from crashproof.cli import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(
        '{"event": "run_start", "t": 1.0, "run_id": "r"}\n{"event": "run_end", "t": 2.0, '
        '"outcome": "succeeded", "exit_code": 0}\n'
    )
    notes = tmp_path / "notes.html"
    notes.write_text("<p>my notes</p>")
    assert main(["report", str(run_dir), "--html", str(notes)]) == 2
    assert notes.read_text() == "<p>my notes</p>"
    page = tmp_path / "page.html"
    assert main(["report", str(run_dir), "--html", str(page)]) == 0
    assert main(["report", str(run_dir), "--html", str(page)]) == 0  # its own page: replaced
    assert "crashproof report" in page.read_text()


def test_a_forced_single_file_export_removes_the_earlier_sharded_one_and_only_it(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported case: a single file beside stale shards and an index naming another step."""
    out = tmp_path / "m.safetensors"
    assert export(root, out, "--step", "1", "--max-shard-size", "100", fmt="safetensors") == 0
    shards = sorted(tmp_path.glob("m-*.safetensors"))
    assert len(shards) > 1
    bystander = tmp_path / "m-00009-of-00009.safetensors"  # named like a shard, not an export's
    bystander.write_text("not mine")
    refused(export(root, out, fmt="safetensors"), capsys.readouterr().err, "index.json")
    assert all(s.exists() for s in shards) and not out.exists()  # without --force: nothing
    assert export(root, out, "--step", "2", "--force", fmt="safetensors") == 0
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("m"))
    assert left == sorted([out.name, bystander.name]), left
    assert bystander.read_text() == "not mine"
    assert set(load_file(str(out))) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_a_forced_sharded_export_removes_the_earlier_single_file(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.safetensors"
    assert export(root, out, "--step", "1", fmt="safetensors") == 0
    code = export(root, out, "--max-shard-size", "100", fmt="safetensors")
    refused(code, capsys.readouterr().err, out)
    assert export(root, out, "--max-shard-size", "100", "--force", fmt="safetensors") == 0
    index = json.loads((tmp_path / "m.safetensors.index.json").read_text())
    assert not out.exists(), "the earlier single file sits beside the new index"
    assert sorted(p.name for p in tmp_path.glob("m-*.safetensors")) == sorted(
        set(index["weight_map"].values())
    )


def test_an_unmarked_index_beside_a_single_file_export_is_left_alone(
    root: Path, tmp_path: Path
) -> None:
    index = tmp_path / "m.safetensors.index.json"
    index.write_text('{"weight_map": {"w": "m-00001-of-00001.safetensors"}}')
    shard = tmp_path / "m-00001-of-00001.safetensors"
    save_file({"w": torch.zeros(2)}, str(shard))  # a user's file, not an export's
    before = snapshot(tmp_path)
    assert export(root, tmp_path / "m.safetensors", fmt="safetensors") == 0
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k != "m.safetensors"} == before


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank0.log").write_text("a trainer's log")
    (run_dir / "events.jsonl").write_text(
        '{"event": "run_start", "t": 1.0, "run_id": "r"}\n{"event": "run_end", "t": 2.0, '
        '"outcome": "succeeded", "exit_code": 0}\n'
    )
    return run_dir


def test_report_html_at_a_directory_is_refused_naming_html_and_it_survives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reported case: ``--html DIR`` was exit 74 blaming the run's storage."""
    run_dir = _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    for html in (str(tmp_path), ".", str(run_dir / "logs"), "/", str(run_dir)):
        code = main(["report", str(run_dir), "--html", html])
        err = capsys.readouterr().err
        assert code == 2, (html, err)
        assert f"--html {html}" in err and err.count("\n") == 1, err
        assert "storage" not in err and "credentials" not in err
    assert snapshot(tmp_path) == before


def test_report_html_never_writes_through_a_link_at_the_old_temporary_name(
    tmp_path: Path,
) -> None:
    """The page was written to ``<page>.tmp<pid>`` with ``open(..., "w")``: a link there had its
    target truncated."""
    run_dir = _run_dir(tmp_path)
    victim = tmp_path / "thesis.tex"
    victim.write_text("years of work")
    page = tmp_path / "page.html"
    (tmp_path / f"page.html.tmp{os.getpid()}").symlink_to(victim)
    assert main(["report", str(run_dir), "--html", str(page)]) == 0
    assert victim.read_text() == "years of work"
    assert "crashproof report" in page.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run", "thesis.tex", "page.html", f"page.html.tmp{os.getpid()}"]
    )


@pytest.mark.parametrize("dry_run", [False, True])
def test_prune_removes_only_checkpoints_and_counts_only_checkpoints(
    root: Path, capsys: pytest.CaptureFixture[str], dry_run: bool
) -> None:
    """A folder named like a newer step but holding no manifest (a user's), and a file named
    like one, are neither removed nor counted among the kept: --keep-last 1 keeps step 2 (the
    newest checkpoint) and removes step 1, the only checkpoint beyond it."""
    folder = root / "step_0000000004"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (root / "step_0000000005").write_text("a file")
    outside = {folder: snapshot(folder), root / "step_0000000005": "a file"}
    code = main(["prune", str(root), "--keep-last", "1", *(["--dry-run"] if dry_run else [])])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "step 1" in out and "step 2 " not in out and "step 4" not in out, out
    assert "1 checkpoint(s) " in out and "removed, 1 kept" in out, out
    assert snapshot(folder) == outside[folder]
    assert (root / "step_0000000005").read_text() == "a file"
    assert (root / "step_0000000002" / "manifest.json").is_file()
    assert (root / "step_0000000001").exists() is dry_run


# -- crashproof run's and chaos's files in a run directory ---------------------------------------
# Reported: `crashproof run` truncated a link's target at stacks/attempt_0/rank_0.txt, wrote its
# metrics URL through a link, deleted a user's notice.json, appended events through a link, and a
# requeue into the same run directory wiped the stack dumps of the hang that caused it; chaos
# wrote a run into a --run-dir outside its --dir. Every file is now opened without following a
# link, created new or appended to (crashproof's own only), replaced or removed only if its own.


def test_run_files_are_never_written_through_a_link_nor_over_a_user_file(tmp_path: Path) -> None:
    from crashproof._runfiles import RunFileRefused, open_run_file, remove_own, replace_own
    from crashproof.telemetry import is_event_log

    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (run / "link").symlink_to(victim)
    (run / "hard").hardlink_to(victim)
    (run / "dirlink").symlink_to(tmp_path)
    os.mkfifo(run / "fifo")
    (run / "mine.jsonl").write_text("my notes\n")
    before = snapshot(tmp_path)
    for rel, how in [("link", "append"), ("link", "rewrite"), ("hard", "append"),
                     ("hard", "rewrite"), ("fifo", "append"), ("dirlink/x", "new"),
                     ("mine.jsonl", "append"), ("mine.jsonl", "new"), ("../escape", "new")]:  # fmt: skip
        with pytest.raises(RunFileRefused):
            open_run_file(str(run), rel, how, own=is_event_log)
    for rel in ("link", "hard", "mine.jsonl", "dirlink/x"):
        with pytest.raises(RunFileRefused):
            replace_own(str(run), rel, b"{}", own=lambda head: head == b"ours")
        assert not remove_own(str(run / rel), own=lambda head: head == b"ours")
    assert snapshot(tmp_path) == before
    # crashproof's own: appended to, never truncated
    (run / "events.jsonl").write_text('{"ts": 1, "event": "run_start"}\n')
    os.close(open_run_file(str(run), "events.jsonl", "append", own=is_event_log))
    assert (run / "events.jsonl").read_text() == '{"ts": 1, "event": "run_start"}\n'


def _run_main(run_dir: Path, script: Path, *extra: str) -> int:
    return main(["run", "--run-dir", str(run_dir), "--metrics-port", "-1", *extra, str(script)])


@pytest.mark.parametrize("where", ["events.jsonl", "heartbeats", "stacks", "logs"])
@pytest.mark.parametrize("what", ["link", "fifo", "user file"])
def test_run_refuses_a_run_directory_whose_names_are_not_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, what: str
) -> None:
    """Refused before anything launches (one line, exit 2), the user's things untouched."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    mine = user_folder(tmp_path / "mine")
    run = tmp_path / "run"
    run.mkdir()
    target = run / where
    if what == "link":
        target.symlink_to(mine / "thesis.tex" if where == "events.jsonl" else mine)
    elif what == "fifo":
        os.mkfifo(target)
    elif where == "events.jsonl":
        target.write_text("my own log, not crashproof's\n")
    else:
        target.write_text("a file where a folder belongs")
    before = snapshot(tmp_path)
    code = _run_main(run, script)
    refused(code, capsys.readouterr().err, target)
    after = snapshot(tmp_path)  # (new files of its own in the run directory are no harm)
    assert {k: v for k, v in after.items() if k in before} == before
    assert snapshot(mine) == {k[5:]: v for k, v in before.items() if k.startswith("mine/")}


def test_a_reused_run_directory_keeps_the_earlier_sessions_stack_dumps(
    tmp_path: Path, runs: list[Run]
) -> None:
    """The reported case: a requeued job (examples/slurm_requeue.sbatch reuses its run
    directory) wiped the stack dumps of the hang that made it requeue. And what a user put in
    the run directory (a notice.json, a link at metrics_url and at the old stack file's name)
    is left as it was."""
    run_dir = tmp_path / "run"
    (run_dir / "stacks" / "attempt_0").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (run_dir / "stacks" / "attempt_0" / "rank_0.txt").symlink_to(victim)
    (run_dir / "metrics_url").symlink_to(victim)
    (run_dir / "notice.json").write_text('{"mine": true}')
    user = snapshot(tmp_path)
    first = start_run(
        run_dir,
        ["--hang-timeout", "2", "--metrics-port", "0"],
        ["--steps", "8", "--every", "2", "--stop-at", "3"],
    )
    runs.append(first)
    assert first.wait(timeout=120) == 0, output(first)
    dumps = {e["stacks"] for e in first.events("hang") if e["stacks"]}
    assert dumps, output(first)
    dumped = {path: Path(path).read_text() for path in dumps}
    assert all("trainer.py" in text for text in dumped.values())
    second = start_run(run_dir, ["--metrics-port", "0"], ["--steps", "8", "--every", "2"])
    runs.append(second)
    assert second.wait(timeout=120) == 0, output(second)
    assert {path: Path(path).read_text() for path in dumps} == dumped
    assert victim.read_text() == "precious"
    assert (run_dir / "notice.json").read_text() == '{"mine": true}'
    assert {k: v for k, v in snapshot(tmp_path).items() if k in user} == user
    assert len(second.events("run_start")) == 2  # one log, appended to


def test_chaos_never_writes_a_run_outside_its_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported case: --run-dir outside --dir put the run, and replaced chaos/nan.json, in a
    user's directory."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    outside = user_folder(tmp_path / "X")
    (outside / "chaos").mkdir()
    (outside / "chaos" / "nan.json").write_text('{"faults": ["mine"]}')
    before = snapshot(tmp_path)
    fault = ["--fault", "at=step:2,rank=0,kind=nan"]
    for run_dir in (str(outside), "{run}/../../X", str(tmp_path / "elsewhere")):
        code = main(["chaos", *fault, "--dir", str(tmp_path / "c"), "--",
                     "--nproc-per-node", "1", "--run-dir", run_dir, str(script)])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and "outside the campaign's --dir" in err, err
    assert snapshot(tmp_path) == before
