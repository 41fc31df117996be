"""ETTR and exactness under a long SIGKILL campaign, measured by ``crashproof chaos`` itself.

The target of the chaos/goodput issue: the demo model (``examples/train_tiny.py``) on 2 ranks,
SIGKILLs at an exponential MTBF of 30 s for at least 10 minutes: ETTR >= 0.95, and the final
state bit-identical to the same job run without faults. This script runs exactly that campaign::

    crashproof chaos --seed S --mtbf 30 --duration 900 --faults kill --compare-baseline \\
        -- --nproc-per-node 2 examples/train_tiny.py --run-dir {run} --steps 66000 --every 50 ...

The kills keep coming for as long as the run lasts (66,000 steps take over 10 minutes here, and
kills are drawn for 15), so the ETTR is that of a run under fire from its start to its end, not
diluted by a quiet tail.

and turns its JSON report into a table: kills injected, detected and recovered, steps lost per
kill (median, max, against the checkpoint interval), detection time, the ETTR of the faulted run
(from the goodput ledger, ``crashproof report``'s arithmetic) and its breakdown, and whether the
final checkpoint equals the baseline's, tensor by tensor and state by state.

``benchmarks/goodput.py`` compares ETTR with ``torchrun`` + ``torch.save`` under the same kills.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".bench-tmp" / "chaos_ettr"


def run_campaign(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    report = directory / "report.json"
    command = [
        sys.executable, "-m", "crashproof.cli", "chaos", "--seed", str(args.seed),
        "--mtbf", str(args.mtbf), "--duration", str(args.duration), "--faults", "kill",
        "--dir", str(directory), "--report", str(report), "--no-progress",
        *(["--compare-baseline"] if not args.no_baseline else []),
        "--",
        "--nproc-per-node", "2", "--max-restarts", "10000",
        str(REPO / "examples" / "train_tiny.py"), "--run-dir", "{run}",
        "--steps", str(args.steps), "--every", str(args.every), "--hidden", "256",
        "--samples", "400", "--workers", "1",
        *(["--memory-every", str(args.memory_every)] if args.memory_every else []),
    ]  # fmt: skip
    env = {**os.environ, "MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE"}
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    print(done.stdout[-3000:], file=sys.stderr)
    if not report.exists():
        raise SystemExit(f"no report: exit {done.returncode}\n{done.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(report.read_text())
    out["exitcode"] = done.returncode
    out["campaign_wall_s"] = round(time.monotonic() - started, 1)
    return out


def ledger_parts(run_dir: str) -> dict[str, float]:
    """Productive seconds and each loss (they add up to the wall time)."""
    from crashproof.telemetry import read_ledger

    return read_ledger(run_dir).parts()


def _restores(run_dir: str) -> str:
    """How many restores came from the agent's memory and how many from disk."""
    kinds: list[str] = []
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "restore":
                kinds.append(str(event.get("kind")))
    return f"{kinds.count('memory')} / {len(kinds) - kinds.count('memory')}"


def markdown(report: dict[str, Any], args: argparse.Namespace, book: dict[str, float]) -> str:
    faults = report["faults"]
    lost = [f["lost_steps"] for f in faults]
    detect = [f["detect_s"] for f in faults if f["detect_s"] is not None]
    baseline = report["baseline"]
    memory = f", memory snapshot every {args.memory_every}" if args.memory_every else ""
    lines = [
        f"**ETTR and exactness under SIGKILLs** (`examples/train_tiny.py`, 2 ranks, gloo DDP, "
        f"{args.steps} steps, asynchronous checkpoint every {args.every} steps{memory}; "
        f"exponential kills at an MTBF of {args.mtbf:.0f} s for {args.duration:.0f} s, "
        f"seed {args.seed}; "
        f"the faulted run took {report['run']['wall_s']:.0f} s)",
        "",
        "| | |",
        "|---|---:|",
        f"| kills injected / detected / recovered | {report['injected']} / "
        f"{report['detected']} / {report['recovered']} |",
        f"| steps lost per kill: median / max (interval {args.every}) | "
        f"{statistics.median(lost) if lost else 0:.0f} / {max(lost, default=0)} |",
        f"| detection (kill to `rank_exit`): median s | "
        f"{statistics.median(detect) if detect else float('nan'):.3f} |",
        f"| restores: from the agent's memory / from disk | {_restores(report['run_dir'])} |",
        f"| **ETTR** (goodput ledger) | **{report['ettr']:.3f}** |",
    ]
    for part, seconds in book.items():
        lines.append(f"| {part.removesuffix('_s').replace('_', ' ')}: s | {seconds:.1f} |")
    if baseline is not None:
        same = (
            "**yes**"
            if baseline["identical"]
            else f"NO: {baseline['problem'] or baseline['differences'][:3]}"
        )
        lines.append(
            f"| final checkpoint bit-identical to the run without faults (step "
            f"{baseline['step']}, {baseline['tensors']} tensors + state) | {same} |"
        )
    lines.append(f"| campaign passed | {'yes' if report['passed'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtbf", type=float, default=30.0)
    p.add_argument("--duration", type=float, default=900.0, help="seconds of kills drawn")
    p.add_argument("--steps", type=int, default=66_000, help="over 10 minutes of training")
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--memory-every",
        type=int,
        default=0,
        help="also snapshot into the agent's memory every N steps (0: only the checkpoints' "
        "asynchronous snapshots are kept there)",
    )
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    directory = args.dir / time.strftime("%Y%m%d-%H%M%S")
    report = run_campaign(args, directory)
    book = ledger_parts(report["run_dir"])
    if args.json:
        args.json.write_text(json.dumps({"report": report, "ledger": book}, indent=2))
    print(markdown(report, args, book) if args.markdown else json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
