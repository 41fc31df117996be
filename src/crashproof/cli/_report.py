"""``crashproof report RUN_DIR``: a run's goodput ledger printed as a summary (or JSON), and
written as an HTML page (``RUN_DIR/report.html`` unless told otherwise), never over a file that
is not such a page. The ledger and the page are :mod:`crashproof.telemetry`'s.

Exit codes, as for the other commands: 0 written; 2 no event log in RUN_DIR, or ``--html`` names
what the command must not write (a directory, a link, a file it did not write, a path under a
file); 74 the page could not be written (a read-only or full disk, no permission).
"""

from __future__ import annotations

import argparse
import os

from crashproof._console import output_unwritable, say
from crashproof._files import check_parent
from crashproof._rundir import RunDir
from crashproof.cli._conventions import print_json
from crashproof.errors import ConfigError
from crashproof.exitcodes import EXIT_OK, EXIT_STORAGE, EXIT_USAGE
from crashproof.telemetry import (
    format_summary,
    is_report_page,
    read_ledger,
    write_html_report,
)

__all__ = ["add_report_parser", "run_report"]


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
        help=f"where to write the page (default {RunDir('RUN_DIR').report_page}; with --json, only if given)",
    )
    p.add_argument("--json", action="store_true", help="print the ledger as a JSON object")
    p.set_defaults(func=run_report)
    return p


def run_report(args: argparse.Namespace) -> int:
    """``crashproof report``: print the summary and the page's path (or the JSON)."""
    if "://" in args.run_dir:
        say("crashproof", f"report: {args.run_dir}: give the local run directory, not a URI")
        return EXIT_USAGE
    events = RunDir(args.run_dir).events
    malformed: list[tuple[int, str]] = []
    try:
        ledger = read_ledger(args.run_dir, on_malformed=lambda n, why: malformed.append((n, why)))
    except FileNotFoundError as exc:
        say("crashproof", f"report: {exc}")
        return EXIT_USAGE
    except OSError as exc:  # it is a file (read_ledger checked): the storage refused to read it
        say("crashproof", f"report: {events}: cannot be read ({exc.strerror or exc}); check the "
            "permissions and the device")  # fmt: skip
        return EXIT_STORAGE
    except UnicodeDecodeError as exc:
        say("crashproof", f"report: {events}: not an event log (not UTF-8 text: {exc.reason})")
        return EXIT_USAGE
    if malformed:  # as a torn line: skipped, but said (one line, whatever their number)
        line, why = malformed[0]
        more = f" and {len(malformed) - 1} more" if len(malformed) > 1 else ""
        say("crashproof", f"report: {events}: skipped malformed line {line} ({why}){more}")
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
        print_json(ledger.to_json())
    else:
        print(format_summary(ledger))
        print(f"\nreport: {html_path}")
    return EXIT_OK


def _refuse_html(path: str) -> str:
    """Why the page must not be written at ``path`` ("" when it may): only a new path, or a page
    this command wrote, in a directory."""
    if not path:
        return "--html '': give the path of the page to write"
    if os.path.isdir(path) and not os.path.islink(path):
        return f"--html {path}: is a directory; give a file path such as {RunDir(path).report_page}"
    if os.path.lexists(path) and not is_report_page(path):
        return f"--html {path}: exists and is not a page this command wrote; choose a new path"
    try:
        check_parent(path, "--html")
    except ConfigError as exc:
        return str(exc)
    return ""
