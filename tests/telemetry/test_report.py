"""``crashproof report``: the terminal summary, the JSON, and the HTML page as a person sees it,
rendered by a real headless Chromium (skipped, saying why, where none is installed: the Makefile
installs Debian's ``chromium`` package for CI)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from crashproof.cli._report import add_report_parser, run_report
from crashproof.telemetry import (
    Ledger,
    compute_ledger,
    format_summary,
    write_html_report,
)
from crashproof.telemetry._report_html import PART_LABELS
from tests.telemetry.test_ledger import HANG, ONE_KILL, ROLLBACK

CHROMIUM = next(
    (p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))),
    None,
)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: `apt-get install -y chromium` (Debian)"
)


def write_run(tmp_path: Path, events: list[dict[str, object]]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", *args],
        capture_output=True, text=True, timeout=90, check=True,
    )  # fmt: skip


class _Dom(HTMLParser):
    """The text a reader sees, and the class names of the elements."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.classes: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.classes += (dict(attrs).get("class") or "").split()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_the_page_is_one_self_contained_file(tmp_path: Path) -> None:
    page = Path(write_html_report(compute_ledger(ONE_KILL), tmp_path / "r.html")).read_text()
    assert "<script" not in page and "<link" not in page and "<img" not in page
    assert " src=" not in page and "url(" not in page and "@import" not in page
    # the one URL: the SVG namespace, a name that is never fetched
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}


@needs_chromium
def test_chromium_shows_the_ettr_the_legend_the_marks_and_the_failures(tmp_path: Path) -> None:
    ledger = compute_ledger(ONE_KILL, run_dir="runs/one-kill")
    page = write_html_report(ledger, tmp_path / "report.html")
    dom = _Dom()
    dom.feed(chromium(tmp_path, "--dump-dom", Path(page).as_uri()).stdout)
    text = " ".join(" ".join(dom.text).split())
    assert f"{ledger.ettr:.1%}" in text and "ETTR" in text  # 59.7%
    assert "33.5 s" in text  # the wall time
    for legend in ("attempt 0", "attempt 1", "checkpoint committed", "restore", "failure",
                   "restart", "lost work (computed again)", "no training"):  # fmt: skip
        assert legend in text, legend
    assert "svg" in dom.tags and "polyline" in dom.tags
    assert dom.classes.count("steps") == 2  # one line per attempt
    assert dom.classes.count("mark-checkpoint") == 4
    assert dom.classes.count("mark-restore") == 1 and dom.classes.count("mark-failure") == 1
    assert dom.classes.count("mark-restart") == 1
    assert dom.classes.count("part") == 7  # every part with time in it: all seven here
    for name, _, _ in PART_LABELS.values():
        assert name in text
    assert "killed by SIGKILL" in text and "25" in text and "20" in text  # reached, restored


def read_png(path: Path) -> np.ndarray:
    """An 8-bit RGB(A), non-interlaced PNG (what Chromium writes) as an (h, w, 3) array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, chunks, header = 8, [], (0, 0, 0, 0, 0, 0, 0)
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), np.uint8).reshape(height, stride + 1)
    rows = np.zeros((height, stride), np.uint8)
    prev = np.zeros(stride, np.uint8)
    for y in range(height):
        kind, line = int(raw[y, 0]), raw[y, 1:]
        if kind == 0:
            row = line.copy()
        elif kind == 1:  # Sub: a running sum along each channel
            row = np.cumsum(line.reshape(width, bpp), axis=0, dtype=np.int64) % 256
            row = row.astype(np.uint8).reshape(-1)
        elif kind == 2:  # Up
            row = line + prev
        else:  # Average, Paeth: byte by byte
            out, src, up = bytearray(stride), line.tobytes(), prev.tobytes()
            for i in range(stride):
                a = out[i - bpp] if i >= bpp else 0
                b = up[i]
                if kind == 3:
                    out[i] = (src[i] + ((a + b) >> 1)) & 255
                    continue
                c = up[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                out[i] = (src[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            row = np.frombuffer(bytes(out), np.uint8)
        rows[y], prev = row, row
    return rows.reshape(height, width, bpp)[:, :, :3]


def _is(pixels: np.ndarray, colour: str) -> np.ndarray:
    """Which pixels show ``colour`` (give or take a colour profile's rounding)."""
    rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
    return np.all(np.abs(pixels.astype(np.int16) - rgb) <= 3, axis=-1)


def _breakdown_row(image: np.ndarray) -> int:
    """The top rows of the breakdown bar: the rows with the longest run of 'productive'."""
    green = _is(image, PART_LABELS["productive_s"][1])
    counts = green.sum(axis=1)
    bar_rows = np.flatnonzero(counts > 0.9 * counts.max())
    return int(bar_rows[0]) + 2  # above the labels written inside the bar


@needs_chromium
def test_the_screenshot_shows_the_report_with_the_bar_in_proportion(tmp_path: Path) -> None:
    ledger = compute_ledger(ONE_KILL, run_dir="runs/one-kill")
    page = write_html_report(ledger, tmp_path / "report.html")
    shot = tmp_path / "report.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,1600", Path(page).as_uri())
    image = read_png(shot)
    print(f"screenshot: {shot}")
    assert image.shape == (1600, 1200, 3)
    white = _is(image, "#ffffff")
    assert 0.05 < 1 - white.mean() < 0.6, "the page is blank, or nothing but ink"
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 200  # text, lines, colours

    row = image[_breakdown_row(image)]
    shares = {key: int(_is(row, colour).sum()) for key, (_, colour, _) in PART_LABELS.items()}
    bar_px = sum(shares.values())
    assert bar_px > 900, shares  # the bar spans the page
    expected = ledger.parts()
    for key, px in shares.items():
        assert px / bar_px == pytest.approx(expected[key] / ledger.wall_s, abs=0.012), (key, shares)

    # the timeline: both attempts' colours and the failure's red cross are drawn
    plot = image[250:800]
    for colour in ("#2e8b57", "#ff7f0e", "#d62728", "#1f77b4"):
        assert _is(plot, colour).sum() > 20, colour


def report(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="crashproof")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["report", *args])
    code: int = parsed.func(parsed)
    assert parsed.func is run_report
    return code


def test_report_prints_the_summary_and_writes_the_page_into_the_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path, ONE_KILL)
    assert report([str(run)]) == 0
    out = capsys.readouterr().out
    assert "ETTR 59.7%" in out and "killed by SIGKILL" in out
    assert f"report: {run / 'report.html'}" in out
    assert "<svg" in (run / "report.html").read_text()


def test_report_json_is_the_ledger_and_writes_no_page_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path, HANG)
    assert report([str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ettr"] == pytest.approx(10.0 / 19.5) and data["failures"][0]["kind"] == "hang"
    assert not (run / "report.html").exists()
    assert report([str(run), "--json", "--html", str(tmp_path / "elsewhere.html")]) == 0
    assert (tmp_path / "elsewhere.html").exists()


def test_report_on_a_directory_without_an_event_log_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "events.jsonl") in err and "--run-dir" in err


def test_the_summary_lists_every_part_and_each_failure() -> None:
    ledger: Ledger = compute_ledger(ROLLBACK, run_dir="runs/r")
    summary = format_summary(ledger)
    assert summary.splitlines()[1] == "ETTR 66.7%: 10.0 s productive of 15.0 s wall time"
    for name, _, _ in PART_LABELS.values():
        assert re.search(rf"^  {re.escape(name)} +[\d.]+ s +[\d.]+%$", summary, re.M), name
    assert re.search(r"numerics +15 +10 +5 +2\.50 s", summary)
    assert format_summary(compute_ledger([], run_dir="r")) == "run r: no events yet"


def test_no_label_leaves_the_figure_and_no_attempt_line_has_a_mark_s_colour() -> None:
    from crashproof.telemetry import _report_timeline as timeline

    # millions of steps over hours: the widest labels a run gives
    events = [
        {"ts": 0.0, "event": "run_start"},
        {"ts": 1.0, "event": "rank_start", "rank": 0, "pid": 1, "restart": 0},
        {"ts": 9000.0, "event": "progress", "rank": 0, "pid": 1, "step": 2_400_000,
         "since_step": 1, "step_time_s": 0.00375},
        {"ts": 9001.0, "event": "run_end", "outcome": "succeeded"},
    ]  # fmt: skip
    svg = timeline.timeline_svg(compute_ledger(events))
    labels = re.findall(
        r'<text x="([\d.]+)"[^>]*text-anchor="(end|middle)"[^>]*>([^<]+)</text>', svg
    )
    assert any(text == "2,500,000" for _, _, text in labels), labels
    for x, anchor, text in labels:
        extent = len(text) * timeline._CHAR_W
        if anchor == "end":  # a step label: right of the rotated "step" title (x 16, 13 px)
            assert float(x) - extent >= 24, (x, text)
        else:
            assert float(x) + extent / 2 <= 1060 and float(x) - extent / 2 >= 0, (x, text)

    def rgb(colour: str) -> np.ndarray:
        return np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=float)

    for line in timeline._ATTEMPT_COLOURS:
        for mark, _ in timeline._MARKS.values():
            assert np.linalg.norm(rgb(line) - rgb(mark)) > 60, (line, mark)
