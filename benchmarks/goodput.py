"""Goodput under repeated failures: ETTR of ``crashproof run`` vs ``torchrun`` + ``torch.save``.

Target of the chaos/goodput issue: on the demo-sized model with 2 ranks, SIGKILLs at an
exponential MTBF of 30 s for at least 10 minutes, ``crashproof run`` keeps an effective training
time ratio (ETTR) of at least 0.95; plain torchrun with a hand-written ``torch.save`` resume is
the baseline.

The trainer is ``recovery_trainer.py`` (gloo DDP on 2 ranks, 50 ms steps, a checkpoint every
``--every`` steps, resume on every start): under ``crashproof run`` with crashproof's
asynchronous ``CheckpointManager``; under ``torchrun --max-restarts`` with rank 0
``torch.save``-ing model, optimizer and step to one file (a temporary file, then renamed) that
every rank ``torch.load``s on start. The kill times (exponential inter-arrival, mean ``--mtbf``)
and ranks are drawn once from ``--seed``; every launcher gets the same schedule. The campaign is
split into ``--rounds`` rounds of ``--duration`` seconds, each running every launcher in turn
(order rotated), so the machine's load drifts hit both alike.

ETTR, the same definition for both launchers: the work the run kept, at the step time it is
padded to, over the wall time from launch to the end of the round::

    ETTR = (newest step reached at the end) x step_s / wall time

so everything else (start-up, detection, restarts, restores, recomputed steps, checkpoint stalls,
a restart that never gets going) is lost time. For crashproof, ``crashproof report``'s ledger of
the same run (computed from its event log) is printed beside it as a cross-check when available.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import draw_kills
from recovery import Run, loadavg, log

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".bench-tmp" / "goodput"
LAUNCHERS = {"crashproof": "crashproof", "torchrun": "torch"}  # launcher -> trainer's --saver


def kill_schedule(
    seed: int, mtbf_s: float, duration_s: float, count: int
) -> list[list[tuple[float, int]]]:
    """Per round: (seconds after launch, rank) of each SIGKILL."""
    rng = random.Random(seed)
    return [draw_kills(rng, mtbf_s, duration_s) for _ in range(count)]


def newest_step(run: Run) -> int:
    """The step of the newest progress mark (the net progress, after any rollback)."""
    marks = [m for m in run.timelines.refresh() if m["event"] in ("progress", "restored")]
    return int(max(marks, key=lambda m: m["ts"])["step"]) if marks else 0


def ledger_ettr(run: Run) -> float | None:
    """crashproof's own ledger of the run, if the goodput module is there."""
    try:
        from crashproof.telemetry import read_ledger
    except ImportError:
        return None
    path = run.directory / "crashproof"
    try:
        return float(read_ledger(path).ettr)
    except Exception as exc:
        log(f"  ledger of {path}: {exc}")
        return None


def one_run(
    launcher: str, directory: Path, kills: list[tuple[float, int]], args: argparse.Namespace
) -> dict[str, Any]:
    run_args = argparse.Namespace(
        max_restarts=10_000,
        every=args.every,
        step_s=args.step_s,
        trainer_args=["--saver", LAUNCHERS[launcher], "--progress-every", "5"],
    )
    run = Run(launcher, directory, run_args)
    killed, stalls = 0, 0
    try:
        for at, rank in kills:
            while time.time() < run.started + at:
                time.sleep(0.05)
            pid = run.timelines.newest_pid(rank)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
        while time.time() < run.started + args.duration:
            time.sleep(0.1)
        wall = time.time() - run.started
        step = newest_step(run)
        progress = sorted(m["ts"] for m in run.timelines.marks if m["event"] == "progress")
        edges = [run.started, *progress, run.started + wall]
        gaps = [b - a for a, b in itertools.pairwise(edges)]
        stalls = sum(1 for gap in gaps if gap > 30)
    finally:
        run.stop()
    result = {
        "launcher": launcher,
        "kills": killed,
        "wall_s": round(wall, 2),
        "steps": step,
        "ettr": round(step * args.step_s / wall, 4),
        "stalls_over_30s": stalls,
    }
    if launcher == "crashproof":
        result["ledger_ettr"] = ledger_ettr(run)
    log(f"  {launcher}: {json.dumps(result)}")
    return result


def markdown(out: dict[str, Any]) -> str:
    a = out["args"]
    lines = [
        f"**ETTR under SIGKILLs** (2 ranks, gloo DDP, {a['step_s'] * 1000:.0f} ms steps, "
        f"checkpoint every {a['every']} steps; exponential kills, MTBF {a['mtbf']:.0f} s, seed "
        f"{a['seed']}; {a['rounds']} rounds of {a['duration']:.0f} s per launcher; load "
        f"{out['load_before']} before, {out['load_after']} after)",
        "",
        "| launcher | round | kills | wall s | steps kept | ETTR | crashproof ledger ETTR | stalls > 30 s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["runs"]:
        ledger = r.get("ledger_ettr")
        lines.append(
            f"| {r['launcher']} | {r['round']} | {r['kills']} | {r['wall_s']:.0f} | {r['steps']} | "
            f"{r['ettr']:.3f} | {'-' if ledger is None else f'{ledger:.3f}'} | {r['stalls_over_30s']} |"
        )
    lines += ["", "| launcher | median ETTR | total kills | total wall s |", "|---|---:|---:|---:|"]
    for name, s in out["summary"].items():
        lines.append(f"| {name} | {s['median_ettr']:.3f} | {s['kills']} | {s['wall_s']:.0f} |")
    ratio = out["ratio"]
    lines += ["", f"crashproof / torchrun median ETTR: **{ratio:.2f}x**"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between kills")
    p.add_argument("--duration", type=float, default=300.0, help="seconds per round and launcher")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--launchers", default="crashproof,torchrun")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    launchers = args.launchers.split(",")
    schedule = kill_schedule(args.seed, args.mtbf, args.duration, args.rounds)
    plain_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out: dict[str, Any] = {"args": plain_args, "load_before": loadavg()}
    runs = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for round_no, kills in enumerate(schedule):
        order = launchers[round_no % len(launchers) :] + launchers[: round_no % len(launchers)]
        for launcher in order:
            log(f"round {round_no + 1}: {launcher}, {len(kills)} kills in {args.duration:.0f} s")
            result = one_run(launcher, args.dir / stamp / f"{launcher}-{round_no}", kills, args)
            runs.append(result | {"round": round_no + 1})
    out["load_after"] = loadavg()
    out["runs"] = runs
    out["summary"] = {
        name: {
            "median_ettr": statistics.median(r["ettr"] for r in runs if r["launcher"] == name),
            "kills": sum(r["kills"] for r in runs if r["launcher"] == name),
            "wall_s": sum(r["wall_s"] for r in runs if r["launcher"] == name),
        }
        for name in launchers
    }
    if {"crashproof", "torchrun"} <= set(launchers):
        out["ratio"] = out["summary"]["crashproof"]["median_ettr"] / max(
            out["summary"]["torchrun"]["median_ettr"], 1e-9
        )
    else:
        out["ratio"] = float("nan")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(markdown(out) if args.markdown else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
