"""What do memory snapshots plus their copies on another node cost a multi-node training run?
Measured in pairs, so noise cancels.

Two ``crashproof run`` agents on this machine play two nodes (c10d rendezvous on loopback, one
trainer each: ``examples/train_tiny.py``, gloo DDP, ``--hidden`` sized for ``--mb`` MB of state,
each node with a checkpoint root of its own). Two variants, back to back, in ABBA order:

* **off**: ``--no-memory``, no checkpoint: training alone;
* **on**: memory snapshots every ``--memory-every`` steps, each copied to the other node's agent
  (whole copies, the default for two nodes), no checkpoint to disk.

Each run's throughput is its trainers' steps per second between step 20 and its last step, from
the agents' progress events (start-up and the first steps left out); each pair gives one relative
slowdown, (off / on) - 1, and the result is their median with a bootstrap 95% interval, beside
the spread of the runs without snapshots.

    .venv/bin/python benchmarks/multinode_overhead.py --pairs 6 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _support import free_port, wait_until
from node_loss import REPO, _events
from training_overhead import bootstrap_ci

WARMUP_STEPS = 20
"""Steps left out of the throughput: start-up, the first snapshots' allocations."""


def _node(run_dir: Path, port: int, snapshots: bool, args: argparse.Namespace) -> Any:
    hidden = max(64, int((args.mb * 1e6 / 16) ** 0.5))  # (about 4 float32 copies of one layer)
    mode = ["--memory-every", str(args.memory_every), "--staging-buffers", "2"] if snapshots else []
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "overhead",
        "--run-dir", str(run_dir), "--metrics-port", "-1",
        *([] if snapshots else ["--no-memory"]),
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


def one_run(work: Path, snapshots: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One two-node run; its steps per second after the warm-up and what was copied."""
    port = free_port()
    a, b = work / "a", work / "b"
    nodes = [_node(a, port, snapshots, args)]
    try:
        wait_until(lambda: bool(_events(a)), 60, "node A")
        nodes.append(_node(b, port, snapshots, args))
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
    return {"snapshots": snapshots, "steps_per_s": (s1 - s0) / (t1 - t0)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    pairs: list[dict[str, Any]] = []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        runs: dict[bool, dict[str, Any]] = {}
        for snapshots in order:
            with tempfile.TemporaryDirectory(prefix="multinode-", dir=REPO) as work:
                runs[snapshots] = one_run(Path(work), snapshots, args)
        off, on = runs[False]["steps_per_s"], runs[True]["steps_per_s"]
        pair = {"off": off, "on": on, "slowdown": off / on - 1}
        print(json.dumps(pair), file=sys.stderr)
        pairs.append(pair)
    slowdowns = [p["slowdown"] for p in pairs]
    offs = [p["off"] for p in pairs]
    low, high = bootstrap_ci(slowdowns)
    return {
        "pairs": pairs,
        "mb": args.mb,
        "steps": args.steps,
        "memory_every": args.memory_every,
        "median_slowdown": statistics.median(slowdowns),
        "ci95": [low, high],
        "off_spread": (max(offs) - min(offs)) / statistics.median(offs),
    }


def markdown(result: dict[str, Any]) -> str:
    rows = [
        f"Two nodes on loopback, one trainer each, about {result['mb']:.0f} MB of state, "
        f"{result['steps']} steps per run; snapshots every {result['memory_every']} steps, each "
        "copied to the other node's agent.",
        "",
        "| pair | off, steps/s | on, steps/s | slowdown |",
        "|---:|---:|---:|---:|",
    ]
    for i, p in enumerate(result["pairs"], 1):
        rows.append(f"| {i} | {p['off']:.1f} | {p['on']:.1f} | {p['slowdown']:+.1%} |")
    low, high = result["ci95"]
    rows += [
        "",
        f"**Median paired slowdown {result['median_slowdown']:+.1%}** (95% bootstrap interval "
        f"{low:+.1%} to {high:+.1%}); the runs without snapshots spread by "
        f"{result['off_spread']:.1%}.",
    ]
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--mb", type=float, default=40.0, help="approximate state size, MB")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--memory-every", type=int, default=10)
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
