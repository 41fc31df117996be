"""The block ``crashproof run`` prints when it ends: how the run ended, what it cost, where to
look. Its figures are the goodput ledger's (:func:`crashproof.telemetry.compute_ledger`) over
the whole event log, so they are those ``crashproof report`` shows.
"""

from __future__ import annotations

import glob
import os
import shlex
from collections import Counter

from crashproof._rundir import RunDir
from crashproof._units import format_duration
from crashproof.telemetry import Ledger, compute_ledger, read_events

__all__ = ["summary"]


def summary(run_dir: str, *, outcome: str, code: int, log_dir: str | None, quiet: bool) -> str:
    """The closing block (one line with ``quiet``), for stderr."""
    layout = RunDir(run_dir)
    report = f"crashproof report {shlex.quote(run_dir)}"
    ledger = _ledger(layout.events)
    ettr = f"ETTR {ledger.ettr:.1%}" if ledger is not None else "ETTR unknown"
    if quiet:
        return f"crashproof run: {outcome} (exit {code}); {ettr}; the report: {report}"
    rows = [("outcome", f"{outcome} (exit {code})")]
    if ledger is not None:
        failures = [f for f in ledger.failures if f.kind not in ("stopped", "lost")]
        kinds = Counter(f.kind for f in failures)
        by_kind = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
        restarts = "restart" if ledger.restarts == 1 else "restarts"
        rows += [
            ("wall time", format_duration(ledger.wall_s)),
            ("attempts", f"{ledger.restarts + 1} ({ledger.restarts} {restarts})"),
            ("failures", f"{len(failures)}: {by_kind}" if failures else "none"),
            ("steps lost", str(sum(f.lost_steps for f in ledger.failures))),
            *_restored_from(ledger),
            ("ETTR", f"{ledger.ettr:.1%} of the wall time was productive training"),
            ("final step", str(ledger.final_step)),
        ]
    # each trainer opens its file at start; only a hang or a stuck exit writes one
    dumps = [p for p in glob.glob(layout.stack_dump("*", "*", "*")) if os.path.getsize(p) > 0]
    rows += [
        ("events", layout.events),
        ("logs", log_dir or layout.logs),
        (
            "stack dumps",
            f"{os.path.dirname(os.path.dirname(dumps[0]))} ({len(dumps)} files)"
            if dumps
            else "none",
        ),
        ("report", f"{report}  (writes {layout.report_page})"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = ["crashproof run: summary", *(f"  {name:<{width}}  {value}" for name, value in rows)]
    return "\n".join(lines)


def _restored_from(ledger: Ledger) -> list[tuple[str, str]]:
    """Where the restores after failures read the state: ``3 from memory, 1 local``."""
    kinds = Counter(f.restored_from for f in ledger.failures if f.restored_from is not None)
    if not kinds:
        return []
    said = {"memory": "from memory", "peer": "from a peer", "local": "local", "tier": "from a tier"}
    parts = [f"{n} {said.get(kind, kind)}" for kind, n in kinds.most_common()]
    return [("restores", ", ".join(parts))]


def _ledger(events_path: str) -> Ledger | None:
    """The run's ledger; None when its log cannot be read (the summary still says where to look)."""
    try:
        return compute_ledger(read_events(events_path))
    except (OSError, ValueError):
        return None
