"""``crashproof chaos`` against ``examples/train_tiny.py`` on 2 ranks (DDP over gloo): one fault
of every kind, each detected and recovered from, no NaN ever committed, each failure costing at
most one checkpoint interval (two for a corruption: the newest checkpoint is the one lost), the
NaN rolled back to the checkpoint before it and never committed, and the final checkpoint bit for
bit the one of a run without faults."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from crashproof.cli._chaos import add_chaos_parser
from crashproof.telemetry import read_events, read_ledger
from tests.conftest import EXAMPLES, REPO

EVERY = 10


def _chaos(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="crashproof")
    add_chaos_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["chaos", *argv])
    code: int = args.func(args)
    return code


def _trainer(steps: int) -> list[str]:
    return [
        "--nproc-per-node", "2", "--hang-timeout", "2", "--max-restarts", "20",
        str(EXAMPLES / "train_tiny.py"), "--run-dir", "{run}", "--steps", str(steps),
        "--every", str(EVERY), "--sync",
    ]  # fmt: skip


FAULTS = [
    "at=step:30,rank=1,kind=kill",
    "at=step:60,rank=0,kind=hang",
    "at=step:100,rank=1,kind=nan",
    "at=step:130,rank=0,kind=corrupt,mode=flip",
    "at=step:170,rank=1,kind=storage,error=eio",
    "at=step:200,rank=0,kind=storage,error=enospc",
    # A period of about two steps: every step of rank 1 is slowed (by 0.1 s periods, its steps
    # ran at full speed between stops of five steps' length, and whether a stop fell into the
    # forward pass its compute_section() times was left to chance: the CI missed it once).
    "at=step:240,rank=1,kind=straggler,stop=0.5,period_s=0.02,for_s=3",
    "at=step:290,rank=0,kind=storage,error=hang,hang_s=1.5",
    "at=step:330,rank=1,kind=corrupt,mode=truncate",
]


@pytest.mark.timeout(420)
@pytest.mark.serial  # its straggler fault is judged by step times
def test_a_campaign_of_every_kind_is_detected_recovered_and_ends_bit_identical_to_a_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRASHPROOF_PROGRESS_INTERVAL_S", "0.5")
    report_path = tmp_path / "report.json"
    argv = ["--dir", str(tmp_path / "c"), "--seed", "11", "--compare-baseline",
            "--resolve-timeout", "60", "--timeout", "150", "--report", str(report_path)]  # fmt: skip
    for spec in FAULTS:
        argv += ["--fault", spec]
    code = _chaos([*argv, "--", *_trainer(600)])
    report: dict[str, Any] = json.loads(report_path.read_text())
    faults = report["faults"]
    summary = [(f["id"], f["kind"], f["step"], f["detected_by"], f["recovered_by"],
                f["lost_steps"]) for f in faults]  # fmt: skip
    assert code == 0, json.dumps(report, indent=1)[-6000:]
    assert report["passed"] and report["run"]["exitcode"] == 0
    # Listed in the order injected: a fault due while its rank saves a checkpoint lets a later
    # one whose rank is training go first (the CI once saw f9 before f8), so compare by id.
    kinds = {f["id"]: f["kind"] for f in faults}
    assert kinds == {f"f{i}": s.split("kind=")[1].split(",")[0] for i, s in enumerate(FAULTS, 1)}
    assert report["injected"] == report["detected"] == report["recovered"] == len(FAULTS)
    assert not report["not_injected"]
    by_kind = {f["id"]: f for f in faults}
    assert by_kind["f1"]["detected_by"] == "rank_exit: rank 1 SIGKILL"
    assert by_kind["f2"]["detected_by"].startswith("hang: ")
    assert by_kind["f3"]["detected_by"].startswith("numerics: nonfinite loss")
    assert by_kind["f4"]["detected_by"].startswith(("restore: from step", "trainer log"))
    assert "crashproof chaos fault f5" in by_kind["f5"]["detected_by"]
    assert "crashproof chaos fault f6" in by_kind["f6"]["detected_by"]
    assert by_kind["f7"]["detected_by"].startswith("straggler: rank 1")
    assert by_kind["f8"]["detected_by"].startswith(("checkpoint: step", "hang: "))
    assert by_kind["f9"]["detected_by"].startswith(("restore: from step", "trainer log"))
    for f in faults:
        # Synchronous saves: a failure loses the steps since the newest checkpoint, at most one
        # interval. A corruption damages that newest checkpoint itself, so the restart falls back
        # to the one before it (checked below: exactly one checkpoint back): the interval the
        # corrupted checkpoint covered is lost on top of the steps since it, up to two intervals.
        bound = 2 * EVERY if f["kind"] == "corrupt" else EVERY
        assert 0 <= f["lost_steps"] <= bound, summary
    assert any(f["lost_steps"] > 0 for f in faults), summary  # restarts did recompute
    assert report["ettr"] is not None and 0 < report["ettr"] < 1

    baseline = report["baseline"]
    assert baseline["identical"] and baseline["exitcode"] == 0, baseline
    assert baseline["step"] == 600 and baseline["world_size"] == 2 and baseline["tensors"] > 40

    run_dir = tmp_path / "c" / "run"
    events = list(read_events(run_dir / "events.jsonl"))
    log = [json.loads(line) for line in (run_dir / "chaos.jsonl").read_text().splitlines()]
    injected_at = {e["id"]: float(e["ts"]) for e in log if e["event"] == "inject"}
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    restores = [e for e in events if e["event"] == "restore"]

    # The NaN: both ranks agreed to roll back (rank 0 with its own, finite loss) ...
    nan_step = by_kind["f3"]["step"]
    nan_losses = [e for e in events if e["event"] == "numerics" and e["loss"] == "nan"]
    assert [(e["rank"], e["step"]) for e in nan_losses] == [(1, nan_step)]
    verdicts = sorted(
        (e for e in events if e["event"] == "numerics" and e["step"] == nan_step),
        key=lambda e: e["rank"],
    )
    assert [(e["rank"], e["step"], e["kind"], e["action"]) for e in verdicts] == [
        (0, nan_step, "nonfinite", "rollback"), (1, nan_step, "nonfinite", "rollback"),
    ]  # fmt: skip
    assert verdicts[0]["loss"] != "nan"
    attempt, nan_at = verdicts[0]["restart"], float(verdicts[0]["ts"])
    # ... to the newest checkpoint committed before it, of a step before the NaN's ...
    newest = max((e for e in checkpoints if float(e["ts"]) < nan_at), key=lambda e: e["step"])
    rolled_back_to = newest["step"]
    assert rolled_back_to < nan_step
    rollbacks = sorted((e for e in events if e["event"] == "numerics_rollback"),
                       key=lambda e: e["rank"])  # fmt: skip
    assert [(e["rank"], e["step"], e["rolled_back_to"], e["first_step"]) for e in rollbacks] == [
        (0, nan_step, rolled_back_to, nan_step), (1, nan_step, rolled_back_to, nan_step),
    ]  # fmt: skip
    assert all(e["skipped"] for e in rollbacks)  # the batch was left out, not replayed
    restore = next(e for e in restores if float(e["ts"]) >= nan_at)
    assert (restore["restart"], restore["step"]) == (attempt, rolled_back_to)
    assert Path(restore["source"]).name == Path(newest["path"]).name
    assert by_kind["f3"]["lost_steps"] == nan_step - 1 - rolled_back_to
    # ... and nothing of the abandoned stretch was committed: the loop's save of the NaN step,
    # which comes after the rollback, is dropped (the state is the restored step's by then), so
    # the attempt commits each step once, going on from the checkpoint restored.
    steps = [e["step"] for e in checkpoints if e.get("restart") == attempt]
    assert steps == sorted(set(steps)), steps
    after = [e["step"] for e in checkpoints
             if e.get("restart") == attempt and float(e["ts"]) > float(restore["ts"])]  # fmt: skip
    assert after and after[0] == rolled_back_to + EVERY, after

    # A corruption falls back exactly one checkpoint, never behind the previous fault's step
    # (which would undo that fault's recovery: for f4, the NaN's skipped batch).
    for previous, f in itertools.pairwise(faults):
        if f["kind"] != "corrupt":
            continue
        corrupted, at = f["details"]["step"], injected_at[f["id"]]
        before = [e["step"] for e in checkpoints if float(e["ts"]) < at and e["step"] < corrupted]
        fallback = max(before)
        restored = next(e for e in restores if float(e["ts"]) > at)
        assert restored["step"] == fallback >= previous["step"], (f, restored)
        assert corrupted - fallback <= f["lost_steps"], summary  # the corrupted interval's steps

    # No checkpoint left holds a NaN or an infinity. (The seam makes only the guard's view of
    # the loss NaN, not the tensors: what shows that the NaN step was never applied is the
    # rollback above and the bit-identical baseline.)
    shards = list((run_dir / "checkpoints").glob("step_*/*.safetensors"))
    assert shards
    for shard in shards:
        for name, tensor in load_file(shard).items():
            if tensor.is_floating_point():
                assert torch.isfinite(tensor).all(), f"{shard}: {name}"
    assert [e["id"] for e in log if e["event"] == "inject"] == [f["id"] for f in faults]
    assert {e["id"] for e in log if e["event"] == "fired"} == {"f3", "f5", "f6", "f8"}


@pytest.mark.timeout(180)
def test_crashproof_chaos_on_the_command_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "crashproof.cli", "chaos", "--dir", str(tmp_path / "c"),
         # listed first, due later: the step-20 kill must not wait behind it
         "--fault", "at=step:45,rank=0,kind=kill",
         "--fault", "at=step:20,rank=1,kind=kill", "--resolve-timeout", "60", "--timeout", "120",
         "--", *_trainer(60)],
        capture_output=True, text=True, timeout=170, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 fault(s) injected, 2 detected, 2 recovered" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-2].endswith("PASSED")
    report = json.loads((tmp_path / "c" / "run" / "chaos_report.json").read_text())
    assert report["passed"] and [f["id"] for f in report["faults"]] == ["f2", "f1"]
    # one clock: the campaign's times count from the run's start, as the report's do
    ledger = read_ledger(tmp_path / "c" / "run")
    first_kill = next(f for f in ledger.failures if f.kind == "killed")
    assert abs(report["faults"][0]["at_s"] - (first_kill.ts - ledger.start_ts)) < 1.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fault", "at=1s,kind=kill"], "give the `crashproof run` arguments"),
        (["--fault", "at=1s,kind=kill", "--", "--nproc-per-node", "2", "t.py"], None),
        (["--compare-baseline", "--fault", "at=1s,kind=kill", "--", "t.py", "--x", "1"],
         "must put its checkpoints under {run}"),
        (["--fault", "at=1s,kind=boom", "--", "t.py"], "unknown kind"),
        (["--fault", "at=1s,kind=kill", "--mtbf", "5", "--", "t.py"], "either --mtbf"),
        (["--mtbf", "5", "--", "t.py"], "needs --duration"),
        (["--", "t.py"], "give --mtbf"),
        (["--fault", "at=1s,kind=kill", "--", "--nproc-per-node", "2", "--bogus", "t.py"],
         "unrecognized arguments: --bogus"),
        (["--fault", "at=1s,kind=kill", "--", "--nnodes", "2", "t.py"], "single-node jobs"),
        (["--fault", "at=1s,kind=kill", "--", "--nnodes", "1:4", "t.py"], "single-node jobs"),
    ],
)  # fmt: skip
def test_usage_errors_exit_2_before_anything_runs(
    argv: list[str], message: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if message is None:  # a rank the run does not have
        argv = [argv[0], "at=1s,kind=kill,rank=2", *argv[2:]]
        message = "the run has 2 rank(s)"
    script = tmp_path / "t.py"  # a script that exists: the run's own checks pass
    script.write_text("")
    argv = [str(script) if a == "t.py" else a for a in argv]
    assert _chaos(["--dir", str(tmp_path / "c"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_duration_that_is_not_a_finite_time_is_refused(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --duration inf would draw faults forever; --resolve-timeout nan would never give up.
    for option in ("--duration", "--resolve-timeout"):
        with pytest.raises(SystemExit) as exit_:
            _chaos(["--mtbf", "5", option, value, "--", "t.py"])
        assert exit_.value.code == 2
        assert "finite number of seconds" in capsys.readouterr().err


_FAILS_ONCE_IN_THE_BASELINE = """
import os, runpy, sys
run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
marker = os.path.join(os.path.dirname(run_dir), "baseline-failed-once")
if os.path.basename(run_dir) == "baseline" and os.environ.get("RANK") == "1" and not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(3)  # (a trainer of the baseline fails, once: not a fault of the campaign's)
sys.argv[0] = TRAIN_TINY
runpy.run_path(TRAIN_TINY, run_name="__main__")
"""


@pytest.mark.timeout(240)
def test_a_baseline_that_restarted_is_run_again_and_the_clean_one_is_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A baseline whose trainer failed and was restarted is no run without faults (a NaN armed
    once would not come again): it is run again from scratch, and the one that ran through is
    compared, bit for bit."""
    script = tmp_path / "fails_once.py"
    script.write_text(
        _FAILS_ONCE_IN_THE_BASELINE.replace("TRAIN_TINY", repr(str(EXAMPLES / "train_tiny.py")))
    )
    trainer = [str(script) if a == str(EXAMPLES / "train_tiny.py") else a for a in _trainer(30)]
    report_path = tmp_path / "report.json"
    argv = ["--dir", str(tmp_path / "c"), "--compare-baseline", "--fault",
            "at=step:10,rank=0,kind=kill", "--resolve-timeout", "60", "--timeout", "120",
            "--report", str(report_path)]  # fmt: skip
    code = _chaos([*argv, "--", *trainer])
    report: dict[str, Any] = json.loads(report_path.read_text())
    assert code == 0 and report["passed"], json.dumps(report, indent=1)[-3000:]
    assert report["baseline"]["identical"] and report["baseline"]["exitcode"] == 0
    assert (tmp_path / "c" / "baseline-failed-once").exists()  # (it did fail, the first time)
    said = capsys.readouterr().out
    assert "[chaos] the baseline restarted (exit code 3): it is no run without faults" in said
    baseline_events = list(read_events(tmp_path / "c" / "baseline" / "events.jsonl"))
    assert not [e for e in baseline_events if e["event"] == "restart"]  # the clean one, compared
