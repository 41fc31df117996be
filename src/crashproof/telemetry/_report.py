"""A run's goodput ledger as a terminal summary and as one self-contained HTML page (written
atomically), and how to tell a page written here from any other file. The numbers come from
:mod:`crashproof.telemetry._ledger`, the page from :mod:`crashproof.telemetry._report_html`; this
module only formats and writes them. ``crashproof report`` (:mod:`crashproof.cli`) prints them.
"""

from __future__ import annotations

import os
import stat
import statistics

from crashproof._console import wrapped_cell
from crashproof._files import write_atomically
from crashproof._units import format_duration as duration
from crashproof.telemetry._ledger import Ledger
from crashproof.telemetry._report_html import GENERATOR_MARK, PART_LABELS, render_html

__all__ = ["format_summary", "is_report_page", "write_html_report"]


def write_html_report(ledger: Ledger, path: str | os.PathLike[str]) -> str:
    """Write the report page to ``path`` (atomically: a reader never sees half a page; the
    directories above it made if missing); returns the path written."""
    target = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    write_atomically(target, render_html(ledger).encode("utf-8"))
    return target


def is_report_page(path: str) -> bool:
    """Whether ``path`` is a report page written earlier (never follows a link, never blocks
    on a FIFO): the only file ``crashproof report`` overwrites."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen: it refuses a directory
            return False
        head = os.read(fd, 4096)
    except OSError:
        return False
    finally:
        os.close(fd)
    # Pages from before the mark was added are recognised by their title.
    return GENERATOR_MARK.encode() in head or b"<title>crashproof report: " in head


def format_summary(ledger: Ledger) -> str:
    """The ledger as a plain-text table for a terminal."""
    if ledger.wall_s <= 0:
        return f"run {ledger.run_dir}: no events yet" if ledger.run_dir else "no events yet"
    outcome = ledger.outcome or "not ended"
    restarts = f"{ledger.restarts} restart{'s' if ledger.restarts != 1 else ''}"
    lines = [
        f"run {ledger.run_dir or ledger.run_id or ''} ({outcome}, {restarts}, "
        f"final step {ledger.final_step:,})",
        f"ETTR {ledger.ettr:.1%}: {duration(ledger.productive_s)} productive of "
        f"{duration(ledger.wall_s)} wall time",
        "",
        f"  {'where the time went':<22}{'time':>14}{'share':>9}",
    ]
    parts = ledger.parts()
    for key, (name, _, _) in PART_LABELS.items():
        seconds = parts[key]
        lines.append(f"  {name:<22}{duration(seconds):>14}{seconds / ledger.wall_s:>9.1%}")
    if not ledger.failures:
        lines += ["", "no failures"]
        return "\n".join(lines)
    lines += [
        "",
        f"  {'#':>2} {'at':>12} {'rank':>5} {'kind':<10} {'reached':>8} {'restored':>9} "
        f"{'lost steps':>10} {'lost':>10} {'down':>10}  what happened",
    ]
    for i, f in enumerate(ledger.failures, start=1):
        down = f.detect_s + f.restart_s + f.restore_s
        lead = (
            f"  {i:>2} {duration(f.ts - ledger.start_ts):>12} "
            f"{'-' if f.rank is None else f.rank:>5} {f.kind:<10} "
            f"{f.step_reached if f.step_reached >= 0 else '-':>8} "
            f"{'-' if f.step_restored is None else f.step_restored:>9} {f.lost_steps:>10} "
            f"{duration(f.lost_s):>10} {duration(down):>10}  "
        )
        first, *more = wrapped_cell(f.reason, 70)
        lines += [lead + first, *(" " * len(lead) + line for line in more)]
    lines += _recoveries(ledger)
    return "\n".join(lines)


_SOURCES = {
    "memory": "the agent's memory",
    "local": "the checkpoint root",
    "tier": "a durable tier",
}


def _recoveries(ledger: Ledger) -> list[str]:
    """Where the restores read the state, with their median time: what memory recovery saved."""
    by_source: dict[str, list[float]] = {}
    for f in ledger.failures:
        if f.restored_from is not None:
            by_source.setdefault(f.restored_from, []).append(f.restore_s)
    if not by_source:
        return []
    lines = ["", "  restored from"]
    for source, times in sorted(by_source.items(), key=lambda item: -len(item[1])):
        name = _SOURCES.get(source, source)
        lines.append(
            f"  {name:<22}{len(times):>6} x, restore {duration(statistics.median(times))} median"
        )
    return lines
