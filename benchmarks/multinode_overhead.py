"""What do memory snapshots plus their copies on another node cost a multi-node training run?
Measured in rounds of back-to-back runs, so noise cancels.

Two ``crashproof run`` agents on this machine play two nodes (c10d rendezvous on loopback, one
trainer each: ``examples/train_tiny.py``, gloo DDP, ``--hidden`` sized for ``--mb`` MB of state,
each node with a checkpoint root of its own). Five variants, one run of each per round, in an
order rotated from round to round:

* **off**: ``--no-memory``, no checkpoint: training alone;
* **local**: memory snapshots every ``--memory-every`` steps into the node's own agent, not copied
  (``--peer-replicas 0``): what the snapshots cost the trainers themselves;
* **copied**: the same snapshots, each also copied to the other node's agent (whole copies, the
  default for two nodes): the whole cost;
* **paced**: as copied, the copies capped at ``--paced`` bytes a second (``--peer-bandwidth``): a
  copy still being sent when the next snapshot is due is not sent again meanwhile, so fewer go;
* **paced3**: as paced, with three staging buffers instead of two: one holds the snapshot the
  other node covers, one is being sent, and the third takes the trainer's local snapshots
  meanwhile (with two, those are skipped while a paced copy is on its way).

``--variants`` runs some of them (``off`` always: the others are measured against it).

Each run's throughput is its trainers' steps per second between step 20 and its last step, from
the agents' progress events (start-up and the first steps left out); each round gives one
relative slowdown per variant, (off / variant) - 1, and the result is their median with a
bootstrap 95% interval, beside the spread of the runs without snapshots. Each run's CPU (every
busy time of the whole machine, ``/proc/stat``, start-up included) is reported per step: far less
noisy than the throughput, it shows what the snapshots and their copies cost in work.

    .venv/bin/python benchmarks/multinode_overhead.py --rounds 6 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _support import busy_cpu_s, free_port, wait_until
from node_loss import REPO, _events
from training_overhead import bootstrap_ci

WARMUP_STEPS = 20
"""Steps left out of the throughput: start-up, the first snapshots' allocations."""
VARIANTS = ("off", "local", "copied", "paced", "paced3")


def _node(run_dir: Path, port: int, variant: str, args: argparse.Namespace) -> Any:
    hidden = max(64, int((args.mb * 1e6 / 16) ** 0.5))  # (about 4 float32 copies of one layer)
    snapshots = variant != "off"
    buffers = "3" if variant == "paced3" else "2"
    mode = (
        ["--memory-every", str(args.memory_every), "--staging-buffers", buffers]
        if snapshots
        else []
    )
    paced = ["--peer-bandwidth", args.paced]
    agent = {"off": ["--no-memory"], "local": ["--peer-replicas", "0"], "copied": [],
             "paced": paced, "paced3": paced}[variant]  # fmt: skip
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "overhead",
        "--run-dir", str(run_dir), "--metrics-port", "-1", *agent,
        str(REPO / "examples" / "train_tiny.py"), "--run-dir", str(run_dir / "disk"),
        "--steps", str(args.steps), "--every", "1000000", "--workers", "0", "--batch-size", "8",
        "--hidden", str(hidden), "--root-scope", "node", *mode,
    ]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - the process keeps it
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CRASHPROOF_PROGRESS_INTERVAL_S": "0.05"},
    )  # fmt: skip


def one_run(work: Path, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One two-node run: its steps per second after the warm-up, and its CPU per step."""
    port = free_port()
    a, b = work / "a", work / "b"
    cpu_before = busy_cpu_s()
    nodes = [_node(a, port, variant, args)]
    try:
        wait_until(lambda: bool(_events(a)), 60, "node A")
        nodes.append(_node(b, port, variant, args))
        for node, where in zip(nodes, (a, b), strict=True):
            if node.wait(600) != 0:
                raise RuntimeError(
                    f"{where} failed: {where.with_suffix('.log').read_text()[-2000:]}"
                )
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(30)
    progress = [(e["ts"], e["step"]) for e in _events(a) if e["event"] == "progress"]
    after = [(ts, step) for ts, step in progress if step >= WARMUP_STEPS]
    (t0, s0), (t1, s1) = after[0], after[-1]
    if s1 <= s0:
        raise RuntimeError(f"too few steps after the warm-up to time: {progress[-3:]}")
    # (the machine's CPU over the whole run, start-up included, per step of both nodes)
    cpu_ms = 1000 * (busy_cpu_s() - cpu_before) / (2 * args.steps)
    found = {"variant": variant, "steps_per_s": (s1 - s0) / (t1 - t0), "cpu_ms_per_step": cpu_ms}
    if variant != "off":  # how many snapshots node A's trainer took, and how many its agent sent
        said = "".join(p.read_text() for p in sorted((a / "logs").rglob("stdout.log")))
        taken = re.findall(r"memory snapshots: (\d+) taken, (\d+) skipped", said)
        found["snapshots"], found["skipped"] = (int(n) for n in taken[-1])
        sent = [e for e in _events(a) if e["event"] == "memory_copies"]
        found["copies"] = sent[-1]["copies"] if sent else 0
    return found


def measure(args: argparse.Namespace) -> dict[str, Any]:
    variants = tuple(v for v in VARIANTS if v == "off" or v in args.variants)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        runs: dict[str, dict[str, Any]] = {}
        for variant in order:
            with tempfile.TemporaryDirectory(
                prefix="multinode-", dir=REPO, ignore_cleanup_errors=True
            ) as work:
                runs[variant] = one_run(Path(work), variant, args)
        off = runs["off"]["steps_per_s"]
        found = {v: runs[v] for v in variants}
        found["slowdown"] = {v: off / runs[v]["steps_per_s"] - 1 for v in variants[1:]}
        print(json.dumps(found), file=sys.stderr)
        rounds.append(found)
    offs = [r["off"]["steps_per_s"] for r in rounds]
    summary: dict[str, Any] = {}
    for variant in variants[1:]:
        slowdowns = [r["slowdown"][variant] for r in rounds]
        summary[variant] = {
            "median_slowdown": statistics.median(slowdowns),
            "ci95": list(bootstrap_ci(slowdowns)),
        }
    for variant in variants:
        summary.setdefault(variant, {})["cpu_ms_per_step"] = statistics.median(
            r[variant]["cpu_ms_per_step"] for r in rounds
        )
        for count in ("snapshots", "skipped", "copies"):
            if variant != "off":
                summary[variant][count] = statistics.median(r[variant][count] for r in rounds)
    return {
        "variants": list(variants),
        "rounds": rounds,
        "mb": args.mb,
        "steps": args.steps,
        "memory_every": args.memory_every,
        "paced": args.paced,
        "summary": summary,
        "off_spread": (max(offs) - min(offs)) / statistics.median(offs),
    }


def markdown(result: dict[str, Any]) -> str:
    summary, names = result["summary"], result["variants"][1:]
    rows = [
        f"Two nodes on loopback, one trainer each, about {result['mb']:.0f} MB of state, "
        f"{result['steps']} steps per run, a snapshot due every {result['memory_every']} steps; "
        f"medians of {len(result['rounds'])} rounds (paced: copies at most "
        f"{result['paced']} a second).",
        "",
        "| variant | slowdown (95% interval) | CPU per step | snapshots taken / skipped "
        "| copies sent |",
        "|---|---:|---:|---:|---:|",
        f"| off | | {summary['off']['cpu_ms_per_step']:.1f} ms | | |",
    ]
    for v in names:
        s = summary[v]
        low, high = s["ci95"]
        rows.append(
            f"| {v} | **{s['median_slowdown']:+.1%}** ({low:+.1%} to {high:+.1%}) "
            f"| {s['cpu_ms_per_step']:.1f} ms | {s['snapshots']:.0f} / {s['skipped']:.0f} "
            f"| {s['copies']:.0f} |"
        )
    rows += [
        "",
        "| round | off, steps/s | " + " | ".join(f"{v}, steps/s" for v in names) + " |",
        "|---:|---:|" + "---:|" * len(names),
    ]
    for i, r in enumerate(result["rounds"], 1):
        cells = " | ".join(f"{r[v]['steps_per_s']:.1f} ({r['slowdown'][v]:+.1%})" for v in names)
        rows.append(f"| {i} | {r['off']['steps_per_s']:.1f} | {cells} |")
    rows += [
        "",
        "CPU per step: the machine's busy time over the whole run (start-up included) per step of "
        f"both nodes. The runs without snapshots spread by {result['off_spread']:.1%}.",
    ]
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="one run of each variant per round")
    p.add_argument("--mb", type=float, default=40.0, help="approximate state size, MB")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--memory-every", type=int, default=10)
    p.add_argument("--paced", default="20MiB", help="the paced variants' --peer-bandwidth")
    p.add_argument("--variants", nargs="+", choices=VARIANTS[1:], default=list(VARIANTS[1:]),
                   help="the variants to run beside off (default: all)")  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    if args.markdown or not args.json:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
