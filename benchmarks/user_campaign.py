"""ETTR of a user-style training under SIGKILLs, by the wall clock, and where each kill's time goes.

The campaign an outside user would run: ``benchmarks/user_trainer.py`` (a README-style loop: a
small transformer, AdamW, a ``DataLoader`` with worker processes, DDP on 2 ranks, an asynchronous
checkpoint every ``--every`` steps, real compute in every step) under ``crashproof run``, once
without faults and once with SIGKILLs of a random rank's trainer at exponential intervals (mean
``--mtbf``; times and ranks drawn from ``--seed``), back to back. Each round:

- **ETTR by the wall clock**: the uninterrupted run's wall time over the faulted run's, both
  from launch to exit (the same work: both train every step to ``--steps``);
- each kill's cost from the trainers' own step logs: kill to the next finished step, plus the
  steps computed again (finished before the kill, after the checkpoint it resumed from) at the
  faulted run's median step time; and the **ETTR those costs give**, 1 - (their sum) / (the
  faulted run's wall time), which the machine's drift in speed from one run to the next (several
  percent here, more than the kills cost) does not blur;
- each attempt's median step time against the uninterrupted run's (a restarted trainer that
  steps slower costs time no failure record shows);
- the goodput ledger's ETTR and breakdown of the same faulted run (``crashproof report``'s
  arithmetic), to see whether the ledger accounts for what the wall clock lost;
- the final weights of the two runs compared bit for bit.

    .venv/bin/python benchmarks/user_campaign.py --markdown
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from _support import draw_kills

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".bench-tmp" / "user_campaign"
TRAINER = REPO / "benchmarks" / "user_trainer.py"


def _records(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def one_run(
    directory: Path, args: argparse.Namespace, kills: list[tuple[float, int]]
) -> dict[str, Any]:
    """Launch the job under ``crashproof run``, kill as scheduled, wait for its end."""
    directory.mkdir(parents=True)
    log = directory / "steps.log"
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2",
        "--max-restarts", "1000", "--run-dir", str(directory / "run"), str(TRAINER),
        "--run-dir", str(directory), "--steps", str(args.steps), "--every", str(args.every),
        "--width", str(args.width), "--workers", str(args.workers), "--step-log", str(log),
        "--dump", str(directory / "final.safetensors"),
    ]  # fmt: skip
    env = {**os.environ, "MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE"}
    started = time.time()
    with open(directory / "output.txt", "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        landed: list[dict[str, Any]] = []
        for at, rank in kills:
            while time.time() - started < at and proc.poll() is None:
                time.sleep(0.02)
            if proc.poll() is not None:
                break
            records = _records(Path(f"{log}.rank{rank}"))
            if not records:
                continue  # not started yet: nothing of the user's to kill
            pid = records[-1]["pid"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # already gone (a restart in progress)
            landed.append({"t": time.time(), "rank": rank, "pid": pid})
        code = proc.wait()
    wall = time.time() - started
    return {"dir": str(directory), "exitcode": code, "wall_s": wall, "started": started,
            "kills": landed, "steps": [_records(Path(f"{log}.rank{r}")) for r in (0, 1)]}  # fmt: skip


def kill_costs(run: dict[str, Any]) -> list[dict[str, float]]:
    """Per kill: seconds to the next finished step, and the steps computed again."""
    records = sorted(run["steps"][0], key=lambda r: r["t"])
    costs = []
    for kill in run["kills"]:
        before = [r for r in records if r["t"] <= kill["t"]]
        after = [r for r in records if r["t"] > kill["t"]]
        if not before or not after:
            continue
        costs.append({
            "to_next_step_s": after[0]["t"] - kill["t"],
            "redone_steps": before[-1]["step"] - after[0]["step"] + 1,
        })  # fmt: skip
    return costs


def attempt_step_times(run: dict[str, Any]) -> list[float]:
    """Rank 0's median step time in each attempt (each trainer process), in order."""
    by_pid: dict[int, list[float]] = {}
    for r in run["steps"][0]:
        by_pid.setdefault(r["pid"], []).append(r["t"])
    medians = []
    for times in by_pid.values():
        gaps = [b - a for a, b in itertools.pairwise(times)]
        if len(gaps) >= 5:
            medians.append(statistics.median(gaps))
    return medians


def ledger(run_dir: str) -> dict[str, Any] | None:
    done = subprocess.run(
        [sys.executable, "-m", "crashproof.cli", "report", run_dir, "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    try:
        return dict(json.loads(done.stdout))
    except ValueError:
        return None


def same_weights(a: str, b: str) -> bool:
    first, second = load_file(a), load_file(b)
    return first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)


def campaign(args: argparse.Namespace) -> list[dict[str, Any]]:
    rounds = []
    for i in range(args.rounds):
        base = args.dir / f"round{i}-{int(time.time())}"
        clean = one_run(base / "clean", args, [])
        kills = draw_kills(random.Random(args.seed + i), args.mtbf, clean["wall_s"] * 1.5)
        faulted = one_run(base / "faulted", args, kills)
        book = ledger(str(Path(faulted["dir"]) / "run"))
        costs = kill_costs(faulted)
        step_s = statistics.median(attempt_step_times(faulted) or [0.0])
        # Each kill's cost from the step logs: to the next step, and the steps computed again;
        # free of the run-to-run drift of the machine's speed, which the wall clock is not.
        kill_s = [c["to_next_step_s"] + c["redone_steps"] * step_s for c in costs]
        rounds.append({
            "clean_wall_s": clean["wall_s"], "faulted_wall_s": faulted["wall_s"],
            "exitcodes": [clean["exitcode"], faulted["exitcode"]],
            "ettr_wall": clean["wall_s"] / faulted["wall_s"], "kills": len(faulted["kills"]),
            "kill_costs": costs, "kill_s": kill_s,
            "ettr_steps": 1 - sum(kill_s) / faulted["wall_s"],
            "clean_step_s": statistics.median(attempt_step_times(clean) or [0.0]),
            "attempt_step_s": attempt_step_times(faulted),
            "ledger_ettr": book["ettr"] if book else None,
            "ledger_breakdown": book["breakdown"] if book else None,
            "bit_identical": same_weights(
                str(Path(clean["dir"]) / "final.safetensors"),
                str(Path(faulted["dir"]) / "final.safetensors"),
            ),
        })  # fmt: skip
        print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    return rounds


def markdown(rounds: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"`user_trainer.py`, 2 ranks, {args.steps} steps, a checkpoint every {args.every} steps, "
        f"{args.workers} DataLoader workers per rank; SIGKILLs at MTBF {args.mtbf:g} s.",
        "",
        "| round | uninterrupted s | with kills s | kills | ETTR (wall) | **ETTR (kills' cost)** | ledger ETTR | a kill's cost s (median, max) | kill to next step s (median) | steps redone (median) | step s: uninterrupted, attempts (median, max) | bit-identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|",
    ]  # fmt: skip
    for i, r in enumerate(rounds, 1):
        costs = r["kill_costs"]
        to_next = [c["to_next_step_s"] for c in costs] or [0.0]
        redone = [c["redone_steps"] for c in costs] or [0]
        attempts = r["attempt_step_s"] or [0.0]
        kill_s = r["kill_s"] or [0.0]
        lines.append(
            f"| {i} | {r['clean_wall_s']:.1f} | {r['faulted_wall_s']:.1f} | {r['kills']} "
            f"| {r['ettr_wall']:.3f} | **{r['ettr_steps']:.3f}** | {r['ledger_ettr'] or 0:.3f} "
            f"| {statistics.median(kill_s):.2f}, {max(kill_s):.2f} "
            f"| {statistics.median(to_next):.2f} | {statistics.median(redone):g} "
            f"| {r['clean_step_s']:.3f}; {statistics.median(attempts):.3f}, {max(attempts):.3f} "
            f"| {'yes' if r['bit_identical'] else '**no**'} |"
        )
    lines.append("")
    for i, r in enumerate(rounds, 1):
        parts = ", ".join(
            f"{k.removesuffix('_s')} {v:.1f} s" for k, v in (r["ledger_breakdown"] or {}).items()
        )
        lost = r["faulted_wall_s"] - r["clean_wall_s"]
        lines.append(f"- Round {i}: the wall clock lost {lost:.1f} s to {r['kills']} kills; the ledger's breakdown of the faulted run: {parts}.")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--width", type=int, default=160)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mtbf", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    rounds = campaign(args)
    if args.json:
        print(json.dumps(rounds, indent=2))
    if args.markdown or not args.json:
        print(markdown(rounds, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
