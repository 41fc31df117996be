"""The report page's timeline: the training step over the run's time, one line per attempt,
with the work each failure lost and its downtime behind it, and a mark for every checkpoint,
restore, failure, restart, hang, rollback and preemption notice. An inline SVG drawn from the
ledger's ``timeline`` and ``markers``; it computes nothing itself.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence

from crashproof._units import format_duration as duration
from crashproof.telemetry._records import Ledger, Marker, TimelinePoint

__all__ = ["timeline_svg"]

_MARKS = {  # kind: (colour, what the legend says)
    "checkpoint": ("#17a2b8", "checkpoint committed"),
    "restore": ("#1f77b4", "restore"),
    "failure": ("#d62728", "failure"),
    "restart": ("#e6b800", "restart"),
    "hang": ("#8e44ad", "hang"),
    "rollback": ("#8c564b", "numerics rollback"),
    "preemption": ("#555555", "preemption notice"),
}
_ATTEMPT_COLOURS = ("#2e8b57", "#ff7f0e", "#e377c2", "#6b8e23")
"""The attempts' step lines: hues no mark uses (marks are cyan, blue, red, yellow, purple, brown
and grey), so no attempt's line reads as a row of checkpoints or restores."""
_CHAR_W = 7.2
"""The width of a character of the 12 px labels, generously (for the margins they need)."""
_Scale = Callable[[float], float]
_LOST, _DOWN = "#d62728", "#7f7f7f"
_FEW_CHECKPOINTS = 60
"""Up to this many, checkpoints are marks on the step line; beyond, ticks along the bottom."""
_MAX_POINTS = 4000
_MAX_CHECKPOINT_MARKS = 400


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _ticks(high: float, count: int = 6) -> list[float]:
    """Round numbers from 0 to at least ``high``."""
    if high <= 0:
        return [0.0, 1.0]
    raw = high / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [i * step for i in range(math.ceil(high / step - 1e-9) + 1)]


def _time_unit(seconds: float) -> tuple[float, str]:
    """The unit the time axis counts in: seconds, minutes, hours or days."""
    for unit, name in ((86400.0, "d"), (3600.0, "h"), (60.0, "min")):
        if seconds >= 2 * unit:
            return unit, name
    return 1.0, "s"


def _thin(points: Sequence[TimelinePoint]) -> list[TimelinePoint]:
    """At most about ``_MAX_POINTS`` progress points; every other point kept."""
    progress = [p for p in points if p.source == "progress"]
    if len(progress) <= _MAX_POINTS:
        return list(points)
    keep_every = math.ceil(len(progress) / _MAX_POINTS)
    kept = {id(p) for p in progress[::keep_every]}
    return [p for p in points if p.source != "progress" or id(p) in kept]


def timeline_svg(ledger: Ledger) -> str:
    """The figure: one step line per attempt over the run's time, its marks and its legend."""
    if ledger.wall_s <= 0:
        return '<p class="note">Nothing to draw: the log has no events.</p>'
    unit, unit_name = _time_unit(ledger.wall_s)
    x_ticks = [t * unit for t in _ticks(ledger.wall_s / unit) if t * unit <= ledger.wall_s * 1.02]
    max_step = max([1, *(p.step for p in ledger.timeline), *(m.step or 0 for m in ledger.markers)])
    y_ticks = _ticks(max_step, 5)
    # Margins from the labels they hold: the widest step label right of the axis title, and
    # half the last time label past the plot's right edge.
    widest = max(len(f"{s:,.0f}") for s in y_ticks) * _CHAR_W
    last = len(f"{x_ticks[-1] / unit:g} {unit_name}") * _CHAR_W if x_ticks else 0.0
    width, height, top, bottom = 1060, 420, 16, 48
    left, right = round(max(72.0, 36 + widest)), round(max(20.0, last / 2 + 6))
    plot_w, plot_h = width - left - right, height - top - bottom
    x_max, y_max = ledger.wall_s, y_ticks[-1]

    def x(ts: float) -> float:
        return left + plot_w * (ts - ledger.start_ts) / x_max

    def y(step: float) -> float:
        return top + plot_h * (1 - step / y_max)

    out = _downtime_bands(ledger, x, top, plot_h)
    for t in x_ticks:
        out.append(
            f'<line x1="{x(ledger.start_ts + t):.1f}" y1="{top}" x2="{x(ledger.start_ts + t):.1f}" '
            f'y2="{top + plot_h}" stroke="#eee"/>'
        )
        out.append(
            f'<text x="{x(ledger.start_ts + t):.1f}" y="{top + plot_h + 18}" '
            f'text-anchor="middle" font-size="12" fill="#444">{t / unit:g} {unit_name}</text>'
        )
    for s in y_ticks:
        out.append(
            f'<line x1="{left}" y1="{y(s):.1f}" x2="{left + plot_w}" y2="{y(s):.1f}" '
            'stroke="#eee"/>'
        )
        out.append(
            f'<text x="{left - 8}" y="{y(s) + 4:.1f}" text-anchor="end" font-size="12" '
            f'fill="#444">{s:,.0f}</text>'
        )
    out.append(
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>'
    )
    out.append(
        f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle" font-size="13" '
        'fill="#222">time since the run started</text>'
    )
    out.append(
        f'<text x="16" y="{top + plot_h / 2}" font-size="13" fill="#222" text-anchor="middle" '
        f'transform="rotate(-90 16 {top + plot_h / 2})">step</text>'
    )
    attempts = sorted({p.attempt for p in ledger.timeline})
    for attempt in attempts:
        line = _monotone([p for p in _thin(ledger.timeline) if p.attempt == attempt])
        colour = _attempt_colour(attempt)
        path = " ".join(f"{x(p.ts):.1f},{y(p.step):.1f}" for p in line)
        out.append(
            f'<polyline class="steps" points="{path}" fill="none" stroke="{colour}" '
            f'stroke-width="2.2"><title>attempt {attempt}</title></polyline>'
        )
    out += _marks(ledger.markers, x, y, top, plot_h)
    kinds = {m.kind for m in ledger.markers}
    lane = sum(m.kind == "checkpoint" for m in ledger.markers) > _FEW_CHECKPOINTS
    legend, rows = _legend(attempts, kinds, height, left, width - right, lane)
    full = height + 12 + 24 * rows
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{full}" '
        f'viewBox="0 0 {width} {full}" role="img" id="timeline" '
        'aria-label="training step over time, with failures, restarts, checkpoints and restores">'
    )
    return "\n".join([head, *out, *legend, "</svg>"])


def _attempt_colour(attempt: int) -> str:
    return _ATTEMPT_COLOURS[attempt % len(_ATTEMPT_COLOURS)]


def _monotone(points: list[TimelinePoint]) -> list[TimelinePoint]:
    """An attempt's points as a line: a step lower than the last is a restore (a rollback) or
    an out-of-order event (a checkpoint logged after its persist), which is dropped."""
    line: list[TimelinePoint] = []
    for p in points:
        if line and p.step < line[-1].step and p.source not in ("restore", "estimate"):
            continue
        line.append(p)
    return line


def _downtime_bands(ledger: Ledger, x: _Scale, top: float, plot_h: float) -> list[str]:
    """Behind each failure: its lost work (red: from the step it went back to, first time
    round, to its last step) and its downtime (grey: from its last step to training again)."""
    bands = []
    for f in ledger.failures:
        until = f.resumed_ts if f.resumed_ts is not None else ledger.end_ts
        for start, end, colour, what in (
            (f.lost_from_ts, f.last_step_ts, _LOST, f"{f.lost_steps} steps computed again"),
            (f.last_step_ts, until, _DOWN, "without training"),
        ):
            if end - start <= 0:
                continue
            bands.append(
                f'<rect class="band" x="{x(start):.1f}" y="{top}" '
                f'width="{max(1.5, x(end) - x(start)):.1f}" height="{plot_h}" fill="{colour}" '
                f'fill-opacity="0.16"><title>{_e(f.kind)}: {duration(end - start)} '
                f"{_e(what)}</title></rect>"
            )
    return bands


def _marks(markers: Iterable[Marker], x: _Scale, y: _Scale, top: float, plot_h: float) -> list[str]:
    out = []
    checkpoints = [m for m in markers if m.kind == "checkpoint"]
    every = max(1, math.ceil(len(checkpoints) / _MAX_CHECKPOINT_MARKS))
    shown = {id(m) for m in checkpoints[::every]}
    lane = len(checkpoints) > _FEW_CHECKPOINTS  # too many to mark on the line: a tick each
    for m in markers:
        colour, _ = _MARKS.get(m.kind, ("#000", m.kind))
        tip = f"<title>{_e(m.label)}</title>"
        cx, cy = x(m.ts), y(m.step if m.step is not None else 0)
        if m.kind == "checkpoint" and id(m) in shown and lane:
            out.append(
                f'<line class="mark-checkpoint" x1="{cx:.1f}" y1="{top + plot_h - 12}" '
                f'x2="{cx:.1f}" y2="{top + plot_h}" stroke="{colour}" stroke-width="1.5">'
                f"{tip}</line>"
            )
        elif m.kind == "checkpoint" and id(m) in shown:
            out.append(
                f'<path class="mark-checkpoint" d="M{cx:.1f},{cy - 5:.1f} l4,5 l-4,5 l-4,-5 z" '
                f'fill="{colour}">{tip}</path>'
            )
        elif m.kind == "restore":
            out.append(
                f'<circle class="mark-restore" cx="{cx:.1f}" cy="{cy:.1f}" r="5" '
                f'fill="#fff" stroke="{colour}" stroke-width="2.5">{tip}</circle>'
            )
        elif m.kind in ("failure", "hang", "rollback"):
            out.append(
                f'<line x1="{cx:.1f}" y1="{top}" x2="{cx:.1f}" y2="{top + plot_h}" '
                f'stroke="{colour}" stroke-dasharray="5,3" stroke-width="1.5"/>'
            )
            out.append(
                f'<path class="mark-{m.kind}" d="M{cx - 6:.1f},{cy - 6:.1f} l12,12 '
                f'M{cx + 6:.1f},{cy - 6:.1f} l-12,12" stroke="{colour}" stroke-width="3">'
                f"{tip}</path>"
            )
        elif m.kind in ("restart", "preemption"):
            out.append(
                f'<line class="mark-{m.kind}" x1="{cx:.1f}" y1="{top}" x2="{cx:.1f}" '
                f'y2="{top + plot_h}" stroke="{colour}" stroke-width="1.8">{tip}</line>'
            )
            out.append(f'<path d="M{cx - 6:.1f},{top} l12,0 l-6,9 z" fill="{colour}">{tip}</path>')
    return out


def _legend(
    attempts: list[int], kinds: set[str], top: float, left: float, width: float, lane: bool
) -> tuple[list[str], int]:
    """The legend under the plot and its number of rows; the four main marks always shown."""
    items: list[tuple[str, str]] = [
        (
            f'<line x1="0" y1="0" x2="22" y2="0" stroke="{_attempt_colour(a)}" '
            'stroke-width="2.5"/>',
            f"attempt {a}",
        )
        for a in attempts[: len(_ATTEMPT_COLOURS)]
    ]
    if len(attempts) > len(_ATTEMPT_COLOURS):
        items.append(("", f"(colours repeat: {len(attempts)} attempts)"))
    c = {k: v[0] for k, v in _MARKS.items()}
    cross = 'd="M5,-6 l12,12 M17,-6 l-12,12" stroke-width="3"'
    marks = [
        (
            "checkpoint",
            f'<line x1="11" y1="-7" x2="11" y2="7" stroke="{c["checkpoint"]}" stroke-width="2"/>'
            if lane
            else f'<path d="M11,-5 l4,5 l-4,5 l-4,-5 z" fill="{c["checkpoint"]}"/>',
        ),
        (
            "restore",
            f'<circle cx="11" cy="0" r="5" fill="#fff" stroke="{c["restore"]}" '
            'stroke-width="2.5"/>',
        ),
        ("failure", f'<path {cross} stroke="{c["failure"]}"/>'),
        (
            "restart",
            f'<line x1="11" y1="-8" x2="11" y2="8" stroke="{c["restart"]}" stroke-width="2.5"/>',
        ),
        ("hang", f'<path {cross} stroke="{c["hang"]}"/>'),
        ("rollback", f'<path {cross} stroke="{c["rollback"]}"/>'),
        (
            "preemption",
            f'<line x1="11" y1="-8" x2="11" y2="8" stroke="{c["preemption"]}" stroke-width="2.5"/>',
        ),
    ]
    main = {"checkpoint", "restore", "failure", "restart"}
    items += [(symbol, _MARKS[kind][1]) for kind, symbol in marks if kind in main | kinds]
    items += [
        (
            f'<rect x="0" y="-7" width="22" height="14" fill="{_LOST}" fill-opacity="0.2"/>',
            "lost work (computed again)",
        ),
        (
            f'<rect x="0" y="-7" width="22" height="14" fill="{_DOWN}" fill-opacity="0.2"/>',
            "no training (detect, restart, restore)",
        ),
    ]
    out, at, row = ['<g class="legend" font-size="13">'], left, 0
    for symbol, label in items:
        size = 40 + 7.5 * len(label)
        if at + size > width and at > left:
            at, row = left, row + 1
        out.append(
            f'<g class="legend-item" transform="translate({at:.0f},{top + 14 + 24 * row:.0f})">'
            f'{symbol}<text x="28" y="4.5" fill="#222">{_e(label)}</text></g>'
        )
        at += size
    out.append("</g>")
    return out, row + 1
