"""The goodput report as one self-contained HTML page: inline CSS and SVG drawn here, no script,
no fonts or images fetched, so it opens anywhere (a laptop, a CI artifact, a mail attachment).

It draws what :mod:`crashproof.telemetry._ledger` computed and computes nothing itself: the
figures at the top, the timeline (:mod:`crashproof.telemetry._report_timeline`), the breakdown of
the wall time and the table of failures.
"""

from __future__ import annotations

import datetime as dt
import html

from crashproof._rundir import RunDir
from crashproof._units import format_duration as duration
from crashproof._version import __version__
from crashproof.telemetry._records import Ledger
from crashproof.telemetry._report_timeline import timeline_svg

__all__ = ["GENERATOR_MARK", "PART_LABELS", "render_html"]

GENERATOR_MARK = '<meta name="generator" content="crashproof report">'
"""In every page's head: ``crashproof report`` overwrites only files that carry it."""

PART_LABELS: dict[str, tuple[str, str, str]] = {
    "productive_s": ("productive", "#2e8b57", "computing steps the run kept"),
    "checkpoint_s": ("checkpoint pauses", "#17a2b8", "training paused to take checkpoints"),
    "lost_s": ("lost work", "#d62728", "steps computed after a checkpoint, then computed again"),
    "detect_s": ("detection", "#ff7f0e", "from the last step of a failed group to its stop"),
    "restart_s": ("restart", "#e6b800", "stopping, backing off, starting the group, start-up"),
    "restore_s": ("restore", "#1f77b4", "verifying and loading checkpoints"),
    "other_s": ("other", "#9e9e9e", "first start-up, shutdown, what the log cannot place"),
}
"""Part of the breakdown: (name, colour, what it is), in the order the report shows them."""

_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
 color:#222;background:#fff;margin:0;padding:24px 32px;max-width:1120px}
h1{font-size:24px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px}
.sub{color:#555;margin:0 0 16px} .note{color:#555;font-size:13px}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{border:1px solid #ddd;border-radius:8px;padding:10px 16px;min-width:120px}
.card .v{font-size:26px;font-weight:600} .card .k{color:#555;font-size:13px}
.card.main .v{font-size:40px;color:#2e8b57}
table{border-collapse:collapse;font-size:14px}
td,th{padding:4px 10px;text-align:left;vertical-align:top}
th{border-bottom:2px solid #ccc} tr+tr td{border-top:1px solid #eee}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums} td.n{white-space:nowrap}
#failures{width:100%}
td.why{min-width:180px}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-1px}
svg text{font-family:inherit}
"""


def render_html(ledger: Ledger) -> str:
    """The whole page."""
    title = f"crashproof report: {ledger.run_dir or ledger.run_id or 'run'}"
    body = [
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">{_e(_subtitle(ledger))}</p>',
        _cards(ledger),
        '<p class="note">ETTR, the effective training time ratio, is the share of the wall-clock '
        "time spent computing steps the run kept: not paused for checkpoints, not computing "
        "steps that a failure made it compute again, not detecting, restarting or restoring.</p>",
        "<h2>Steps over time</h2>",
        timeline_svg(ledger),
        '<p class="note">Each line is one attempt (a start of the trainer group). A line that '
        "falls back is a restore: the steps above where it restarts were computed twice. "
        "Shaded red: work lost to a failure, computed again after it; grey: no training, from a "
        "failure's last step until training went on. Hover a mark for its details.</p>",
        "<h2>Where the time went</h2>",
        _breakdown_svg(ledger),
        _breakdown_table(ledger),
        "<h2>Failures</h2>",
        _failures_table(ledger),
        f'<p class="note">Computed from {_e(_events_path(ledger))} by crashproof '
        f"{_e(__version__)}; how each part is computed: docs/goodput.md. "
        "Times are seconds from the run's start.</p>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        + GENERATOR_MARK
        + f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _utc(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _events_path(ledger: Ledger) -> str:
    return RunDir(ledger.run_dir).events if ledger.run_dir else "the event log"


def _subtitle(ledger: Ledger) -> str:
    if ledger.wall_s <= 0:
        return "No events yet."
    outcome = ledger.outcome or "still running (or its supervisor was killed): no run_end yet"
    run_id = f"run {ledger.run_id}, " if ledger.run_id else ""
    return f"{run_id}{_utc(ledger.start_ts)} to {_utc(ledger.end_ts)}; outcome: {outcome}"


def _cards(ledger: Ledger) -> str:
    cards = [
        ("main", f"{ledger.ettr:.1%}", "ETTR"),
        ("", duration(ledger.wall_s), "wall time"),
        ("", duration(ledger.productive_s), "productive"),
        ("", str(len(ledger.failures)), "failures"),
        ("", str(ledger.restarts), "restarts"),
        ("", f"{ledger.final_step:,}", "final step"),
    ]
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card {cls}"><div class="v">{_e(v)}</div>'
            f'<div class="k">{_e(k)}</div></div>'
            for cls, v, k in cards
        )
        + "</div>"
    )


# -- the breakdown -----------------------------------------------------------------------------


def _parts(ledger: Ledger) -> list[tuple[str, float]]:
    parts = ledger.parts()
    return [(key, parts[key]) for key in PART_LABELS]


def _breakdown_svg(ledger: Ledger) -> str:
    width, height = 1060, 64
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" id="breakdown" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="where the wall-clock time went">'
    ]
    at = 0.0
    for key, seconds in _parts(ledger):
        if ledger.wall_s <= 0 or seconds <= 0:
            continue
        name, colour, _ = PART_LABELS[key]
        share = seconds / ledger.wall_s
        w = width * share
        out.append(
            f'<rect class="part" x="{at:.2f}" y="8" width="{w:.2f}" height="40" fill="{colour}">'
            f"<title>{_e(name)}: {_e(duration(seconds))} ({share:.1%})</title></rect>"
        )
        label = f"{name} {share:.0%}"
        if w > 7.5 * len(label) + 10:
            out.append(
                f'<text x="{at + w / 2:.1f}" y="33" text-anchor="middle" font-size="13" '
                f'fill="#fff" font-weight="600">{_e(label)}</text>'
            )
        at += w
    out.append("</svg>")
    return "\n".join(out)


def _breakdown_table(ledger: Ledger) -> str:
    rows = []
    for key, seconds in _parts(ledger):
        name, colour, what = PART_LABELS[key]
        share = seconds / ledger.wall_s if ledger.wall_s > 0 else 0.0
        rows.append(
            f'<tr><td><span class="sw" style="background:{colour}"></span> {_e(name)}</td>'
            f'<td class="n">{_e(duration(seconds))}</td><td class="n">{share:.1%}</td>'
            f'<td class="note">{_e(what)}</td></tr>'
        )
    rows.append(
        f'<tr><td><b>wall time</b></td><td class="n"><b>{_e(duration(ledger.wall_s))}</b></td>'
        '<td class="n"><b>100%</b></td><td></td></tr>'
    )
    return (
        '<table id="parts"><tr><th>part</th><th class="n">time</th><th class="n">share</th>'
        "<th>what it is</th></tr>" + "".join(rows) + "</table>"
    )


def _failures_table(ledger: Ledger) -> str:
    if not ledger.failures:
        return '<p id="failures">No failures: every attempt ran to its end.</p>'
    head = (
        "#",
        "at",
        "attempt",
        "rank",
        "kind",
        "step reached",
        "restored",
        "lost steps",
        "lost",
        "detect",
        "restart",
        "restore",
        "what happened",
    )
    numeric = {0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11}
    rows = []
    for i, f in enumerate(ledger.failures, start=1):
        cells = [
            i,
            duration(f.ts - ledger.start_ts),
            f.attempt,
            "-" if f.rank is None else f.rank,
            f.kind,
            f.step_reached if f.step_reached >= 0 else "-",
            "-" if f.step_restored is None else f.step_restored,
            f.lost_steps,
            duration(f.lost_s),
            duration(f.detect_s),
            duration(f.restart_s),
            duration(f.restore_s),
            f.reason,
        ]
        rows.append(
            "<tr>"
            + "".join(
                f'<td class="n">{_e(c)}</td>'
                if n in numeric
                else f'<td class="{"why" if n == len(cells) - 1 else ""}">{_e(c)}</td>'
                for n, c in enumerate(cells)
            )
            + "</tr>"
        )
    header = "".join(
        f'<th class="n">{_e(h)}</th>' if n in numeric else f"<th>{_e(h)}</th>"
        for n, h in enumerate(head)
    )
    return f'<table id="failures"><tr>{header}</tr>{"".join(rows)}</table>'
