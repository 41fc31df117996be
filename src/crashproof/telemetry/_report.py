"""``crashproof report RUN_DIR``: a run's goodput ledger as a terminal summary, as JSON, and as
one self-contained HTML page (``RUN_DIR/report.html`` unless told otherwise).

The numbers come from :mod:`crashproof.telemetry._ledger`, the page from
:mod:`crashproof.telemetry._report_html`; this module only formats and writes them.
Exit codes, as for the other commands: 0 written; 2 no event log in RUN_DIR, or ``--html`` names
what the command must not write (a directory, a link, a file it did not write, a path under a
file); 74 the page could not be written (a read-only or full disk, no permission).
"""

from __future__ import annotations

import argparse
import json
import os
import stat

from crashproof._console import output_unwritable, say
from crashproof._files import check_parent, write_atomically
from crashproof._rundir import RunDir
from crashproof.errors import ConfigError
from crashproof.exitcodes import EXIT_OK, EXIT_STORAGE, EXIT_USAGE
from crashproof.telemetry._durations import duration
from crashproof.telemetry._ledger import Ledger, read_ledger
from crashproof.telemetry._report_html import GENERATOR_MARK, PART_LABELS, render_html

__all__ = ["add_report_parser", "format_summary", "run_report", "write_html_report"]


def write_html_report(ledger: Ledger, path: str | os.PathLike[str]) -> str:
    """Write the report page to ``path`` (atomically: a reader never sees half a page; the
    directories above it made if missing); returns the path written."""
    target = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    write_atomically(target, render_html(ledger).encode("utf-8"))
    return target


def _replaceable(path: str) -> bool:
    """Whether ``path`` is a report page written earlier (never follows a link, never blocks
    on a FIFO): only those are overwritten."""
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


def _refuse_html(path: str) -> str:
    """Why the page must not be written at ``path`` ("" when it may): only a new path, or a page
    this command wrote, in a directory."""
    if not path:
        return "--html '': give the path of the page to write"
    if os.path.isdir(path) and not os.path.islink(path):
        return f"--html {path}: is a directory; give a file path such as {RunDir(path).report_page}"
    if os.path.lexists(path) and not _replaceable(path):
        return f"--html {path}: exists and is not a page this command wrote; choose a new path"
    try:
        check_parent(path, "--html")
    except ConfigError as exc:
        return str(exc)
    return ""


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
        lines.append(
            f"  {i:>2} {duration(f.ts - ledger.start_ts):>12} "
            f"{'-' if f.rank is None else f.rank:>5} {f.kind:<10} "
            f"{f.step_reached if f.step_reached >= 0 else '-':>8} "
            f"{'-' if f.step_restored is None else f.step_restored:>9} {f.lost_steps:>10} "
            f"{duration(f.lost_s):>10} {duration(down):>10}  {f.reason[:100]}"
        )
    return "\n".join(lines)


def add_report_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``report`` on ``crashproof``'s subcommands; it dispatches through ``func``."""
    p = subparsers.add_parser(
        "report",
        help="where a run's time went: ETTR, losses by cause, failures; writes an HTML page",
        description=f"Read {RunDir('RUN_DIR').events} (the --run-dir of `crashproof run`) and report "
        "the run's effective training time ratio and where the rest of its time went "
        "(docs/goodput.md).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of `crashproof run`")
    p.add_argument(
        "--html",
        metavar="PATH",
        help=f"where to write the page (default {RunDir('RUN_DIR').report_page}; with --json, "
        "only if given)",
    )
    p.add_argument("--json", action="store_true", help="print the ledger as a JSON object")
    p.set_defaults(func=run_report)
    return p


def run_report(args: argparse.Namespace) -> int:
    """``crashproof report``: print the summary and the page's path (or the JSON)."""
    try:
        ledger = read_ledger(args.run_dir)
    except FileNotFoundError as exc:
        say("crashproof", f"report: {exc}")
        return EXIT_USAGE
    except OSError as exc:  # a directory named events.jsonl, no permission...
        say("crashproof", f"report: cannot read the event log in {args.run_dir}: {exc}")
        return EXIT_USAGE
    html_path = args.html
    if html_path is None and not args.json:
        html_path = RunDir(args.run_dir).report_page
    if html_path is not None:
        refused = _refuse_html(html_path)
        if refused:
            say("crashproof", f"report: {refused}")
            return EXIT_USAGE
        try:
            write_html_report(ledger, html_path)
        except OSError as exc:  # as `export -o`: the storage of an output (docs: README)
            say("crashproof", f"report: {output_unwritable('--html', html_path, exc)}")
            return EXIT_STORAGE
    if args.json:
        print(json.dumps(ledger.to_json(), indent=2))
    else:
        print(format_summary(ledger))
        print(f"\nreport: {html_path}")
    return EXIT_OK
