"""Each rank's output on the console a whole line at a time: a line written in pieces (an
unbuffered ``print`` writes its text and its newline apart) is shown once, whole, behind its
rank's prefix; a line left unfinished is shown after a moment; nothing is lost at the end."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from crashproof.supervisor._console_lines import HOLD_S, tail_whole_lines


class _Console(io.StringIO):
    """A console that notes when each write came."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[float, str]] = []

    def write(self, s: str) -> int:
        self.writes.append((time.monotonic(), s))
        return super().write(s)


def _tail(
    path: Path, console: _Console, finished: threading.Event, **kw: object
) -> threading.Thread:
    thread = threading.Thread(
        target=tail_whole_lines,
        kwargs={
            "header": "[rank 0] ",
            "file": str(path),
            "dst": console,
            "finished": finished,
            "interval_sec": 0.01,
            **kw,
        },
    )
    thread.start()
    return thread


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def test_a_line_written_in_pieces_is_shown_once_whole(tmp_path: Path) -> None:
    log, console, finished = tmp_path / "0.log", _Console(), threading.Event()
    thread = _tail(log, console, finished)
    _append(log, "FACTS {")
    time.sleep(0.1)  # the copier reads the piece before the rest is written
    _append(log, '"rank": 0}')
    time.sleep(0.1)
    _append(log, "\nsecond\n")
    time.sleep(0.1)
    finished.set()
    thread.join(5)
    assert not thread.is_alive()
    assert [s for _, s in console.writes] == ['[rank 0] FACTS {"rank": 0}\n', "[rank 0] second\n"]


def test_an_unfinished_line_is_shown_after_a_moment_and_ended(tmp_path: Path) -> None:
    log, console, finished = tmp_path / "0.log", _Console(), threading.Event()
    thread = _tail(log, console, finished)
    _append(log, "password: ")
    written = time.monotonic()
    deadline = written + 5
    while not console.writes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert console.writes and console.writes[0][1] == "[rank 0] password: \n"
    assert console.writes[0][0] - written >= HOLD_S - 0.05  # held back for the rest a while
    _append(log, "typed\n")
    finished.set()
    thread.join(5)
    assert [s for _, s in console.writes] == ["[rank 0] password: \n", "[rank 0] typed\n"]


def test_a_slow_progress_bar_shows_one_line_per_redraw_and_no_empty_ones(tmp_path: Path) -> None:
    """tqdm redraws with a carriage return and no newline: each redraw, seconds apart, is shown
    once it has waited its moment, and the next redraw's return (read as the line's ending)
    adds no empty line."""
    log, console, finished = tmp_path / "0.log", _Console(), threading.Event()
    thread = _tail(log, console, finished)
    for shown in (" 10%", " 20%"):
        _append(log, "\r" + shown)
        time.sleep(HOLD_S + 0.3)
    _append(log, "\r100%\n")
    time.sleep(0.1)
    finished.set()
    thread.join(5)
    assert [s for _, s in console.writes] == [
        "[rank 0] \n",  # (the first return, before anything was drawn: as torch shows it)
        "[rank 0]  10%\n", "[rank 0]  20%\n", "[rank 0] 100%\n",
    ]  # fmt: skip


def test_what_is_left_when_the_rank_ends_is_shown_whole_and_filtered(tmp_path: Path) -> None:
    log, console, finished = tmp_path / "0.log", _Console(), threading.Event()
    log.write_text("kept 1\ndropped\nkept 2\nkept, no newline")
    finished.set()  # the rank ended before the copier first looked
    thread = _tail(log, console, finished, log_line_filter=lambda line: line.startswith("kept"))
    thread.join(5)
    assert console.getvalue() == "[rank 0] kept 1\n[rank 0] kept 2\n[rank 0] kept, no newline\n"


def test_a_log_never_made_ends_the_copier_once_the_rank_is_done(tmp_path: Path) -> None:
    console, finished = _Console(), threading.Event()
    thread = _tail(tmp_path / "never.log", console, finished)
    time.sleep(0.05)
    finished.set()
    thread.join(5)
    assert not thread.is_alive() and console.getvalue() == ""


PIECES = """
import os, sys, time
rank = os.environ["RANK"]
for i in range(300):
    sys.stdout.write(f"line {i} of rank {rank}: " + "x" * 40)
    sys.stdout.flush()
    time.sleep(0.001)  # the newline comes apart, as an unbuffered print writes it
    sys.stdout.write("\\n")
    sys.stdout.flush()
"""


@pytest.mark.timeout(120)
def test_under_crashproof_run_two_ranks_writing_lines_in_pieces_show_only_whole_lines(
    tmp_path: Path,
) -> None:
    script = tmp_path / "pieces.py"
    script.write_text(PIECES)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crashproof.cli",
            "run",
            "--nproc-per-node",
            "2",
            "--quiet",
            "--run-dir",
            str(tmp_path / "run"),
            "--metrics-port",
            "-1",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shown = [line for line in proc.stdout.splitlines() if line.startswith("[rank")]
    whole = re.compile(r"\[rank (\d)\] line (\d+) of rank \1: x{40}")
    broken = [line for line in shown if not whole.fullmatch(line)]
    assert not broken, broken[:5]
    for rank in (0, 1):
        numbers = [
            int(m[2]) for line in shown if (m := whole.fullmatch(line)) and m[1] == str(rank)
        ]
        assert numbers == list(range(300)), (rank, numbers[:10])
