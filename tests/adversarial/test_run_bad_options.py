"""``crashproof run`` refuses nonsense before it launches anything: one line naming the flag, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from crashproof.cli import main

SCRIPT_OK = "script.py"


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (["--max-restarts", "-3"], "--max-restarts"),
        (["--metrics-port", "99999"], "--metrics-port"),
        (["--metrics-port", "-7"], "--metrics-port"),
        (["--hang-timeout", "abc"], "--hang-timeout"),
        (["--hang-timeout", "nan"], "--hang-timeout"),
        (["--hang-timeout", "inf"], "--hang-timeout"),
        (["--hang-timeout", "0"], "--hang-timeout"),
        (["--done-timeout", "-1"], "--done-timeout"),
        (["--crash-loop-attempts", "-2"], "--crash-loop-attempts"),
        (["--straggler-factor", "1"], "--straggler-factor"),
        (["--straggler-steps", "0"], "--straggler-steps"),
        (["--monitor-interval", "0"], "--monitor-interval"),
        (["--restart-window", "-1h"], "--restart-window"),
        (["--restart-window", "nan"], "--restart-window"),
        (["--restart-window", "forever"], "--restart-window"),
        (["--log-level", "loud"], "--log-level"),
    ],
)
def test_a_bad_option_is_one_line_naming_it_and_nothing_launches(
    options: list[str],
    flag: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / SCRIPT_OK).write_text("raise SystemExit('must never run')\n")
    code = main(["run", "--run-dir", str(tmp_path / "run"), *options, SCRIPT_OK])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert flag in err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_missing_script_is_a_usage_error_before_anything_launches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--run-dir", str(tmp_path / "run"), "nosuch.py"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "nosuch.py" in err and "Traceback" not in err
