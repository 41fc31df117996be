"""How long does a run take to recover from a lost node, with its peers' copies of the node's
snapshots, against the same recovery from checkpoints on disk?

Two ``crashproof run`` agents on this machine play two nodes (c10d rendezvous on loopback, one
trainer each: ``examples/train_tiny.py`` with ``--hidden`` sized for ``--mb`` MB of state, gloo
DDP, steps paced to ``--step-s``). Once both train, node B (its agent and trainer) is SIGKILLed
and a new agent is started in its place, as a scheduler would. The variants, in turns, ``--runs``
times each:

* **peers**: memory snapshots every 5 steps and ``--peer-replicas 1``; no checkpoint on disk;
* **spare**: as *peers*, the node in B's place started before the loss with ``--standby 1``,
  waiting warm in the rendezvous (a hot spare);
* **disk**: the same with ``--no-memory`` and a checkpoint every 5 steps on the local disk (the
  recovery every other launcher offers);
* **trainer**: as *peers*, but only node B's trainer is SIGKILLed (its agent lives on): the
  failure a run meets most, for comparison; both nodes meet in the rendezvous again all the same.

From the event logs: kill -> the new agent's start (the scheduler's part: here at once) -> the
first step after the restore; the restore's own time, the bytes it read, and what was fetched
from the peer. Medians.

    .venv/bin/python benchmarks/node_loss.py --markdown
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from _support import free_port, wait_until  # noqa: E402
from crashproof.telemetry import read_events  # noqa: E402

SPARE_WARM_S = 5.0
VARIANTS = ("peers", "spare", "disk", "trainer")
TIMELINE = {
    "survivor_restart_s": "survivor restarts",
    "fenced_s": "lost node fenced",
    "trainers_started_s": "survivor's trainers started",
    "restored_s": "restored",
}
"""The recovery's steps, as the survivor's and the new node's events time them."""


def _node(run_dir: Path, port: int, ckpt: Path, variant: str, hidden: int, step_s: float) -> Any:
    memory = ["--memory-every", "5", "--every", "100000", "--staging-buffers", "2"]
    disk = ["--every", "5", "--keep", "2"]
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
        "--max-restarts", "5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "node-loss", "--run-dir", str(run_dir), "--metrics-port", "-1",
        *(["--no-memory"] if variant == "disk" else []),
        *(["--standby", "1"] if variant == "spare" else []),
        str(REPO / "examples" / "train_tiny.py"), "--run-dir", str(ckpt), "--steps", "100000",
        "--workers", "0", "--batch-size", "8", "--hidden", str(hidden), "--step-s", str(step_s),
        *(disk if variant == "disk" else memory),
    ]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - the process keeps it
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # (progress events every 50 ms: the first step after the recovery, to the 50 ms)
        env={**os.environ, "OMP_NUM_THREADS": "1", "CRASHPROOF_PROGRESS_INTERVAL_S": "0.05"},
    )  # fmt: skip


def _events(*run_dirs: Path) -> list[dict[str, Any]]:
    found = []
    for d in run_dirs:
        if (d / "events.jsonl").exists():
            found += list(read_events(d / "events.jsonl"))
    return sorted(found, key=lambda e: e["ts"])


def one_loss(work: Path, variant: str, hidden: int, step_s: float) -> dict[str, Any]:
    port = free_port()
    ckpt, a, b, b2 = work / "ckpt", work / "a", work / "b", work / "b2"
    nodes = [_node(a, port, ckpt, variant, hidden, step_s)]
    try:
        wait_until(lambda: bool(_events(a)), 60, "node A")
        nodes.append(_node(b, port, ckpt, variant, hidden, step_s))
        steps = lambda: [e["step"] for e in _events(a, b) if e["event"] == "progress"]  # noqa: E731
        wait_until(lambda: max(steps(), default=0) >= 22, 120, "training")
        if variant == "spare":  # started ahead, waiting warm
            nodes.append(_node(b2, port, ckpt, variant, hidden, step_s))
            waiting = lambda: any(e["event"] == "standby" for e in _events(b2))  # noqa: E731
            wait_until(waiting, 120, "the spare")
            # A spare waits minutes in practice: its trainers' forkserver has finished importing
            # torch (on this loaded machine that takes seconds after the spare says it waits).
            time.sleep(SPARE_WARM_S)
        trainer = [e["pid"] for e in _events(b) if e["event"] == "rank_start"][-1]
        killed = time.time()
        if variant == "trainer":
            os.kill(trainer, signal.SIGKILL)
            b2 = b  # (the same node trains on)
        else:
            os.killpg(nodes[1].pid, signal.SIGKILL)
            nodes[1].wait(30)
        if variant in ("peers", "disk"):
            nodes.append(_node(b2, port, ckpt, variant, hidden, step_s))

        def restored() -> list[dict[str, Any]]:
            return [e for e in _events(a, b2) if e["event"] == "restore" and e["ts"] > killed]

        def resumed() -> bool:  # (A's trainer may report a step or two before it fails)
            done = restored()
            return bool(done) and any(
                e["event"] == "progress" and e["ts"] > done[0]["ts"] for e in _events(a, b2)
            )

        wait_until(resumed, 180, "the first step after the recovery")
        events = [e for e in _events(a, b2) if e["ts"] > killed]
        restore = restored()[0]
        first_step = min(
            e["ts"] for e in events if e["event"] == "progress" and e["ts"] > restore["ts"]
        )
        fetched = [e for e in events if e["event"] == "memory_fetched"]
        # (A spare's agent started long before: it counts from when it was taken in.)
        begun = {"spare": "standby_promoted", "trainer": "rank_start"}.get(variant, "run_start")
        started = min(e["ts"] for e in events if e["event"] == begun)

        def after_kill(event: str, where: Path) -> float | None:
            times = [e["ts"] for e in _events(where) if e["event"] == event and e["ts"] > killed]
            return round(min(times) - killed, 3) if times else None

        return {
            "variant": variant,
            # The timeline, from the kill: the survivor's restart (it saw its trainer fail), its
            # agent's taking the lost node out of the rendezvous, the new round's trainers
            # started, the restore done.
            "survivor_restart_s": after_kill("restart", a),
            "fenced_s": after_kill("node_fenced", a),
            "trainers_started_s": after_kill("rank_start", a),
            "restored_s": round(restore["ts"] - killed, 3),
            "kill_to_first_step_s": first_step - killed,
            "replacement_start_to_first_step_s": first_step - started,
            "restore_s": restore["seconds"],
            "restore_kind": restore.get("kind"),
            "restore_bytes": restore.get("bytes"),
            "fetch_s": fetched[0]["seconds"] if fetched else None,
        }
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(30)


def measure(runs: int, mb: float, step_s: float) -> dict[str, Any]:
    # train_tiny's model has one hidden x hidden layer; the state is about 4 copies of it
    # (weights, two Adam moments, the EMA) in float32.
    hidden = max(64, int((mb * 1e6 / 16) ** 0.5))
    results: list[dict[str, Any]] = []
    for i in range(runs):
        order = VARIANTS
        for variant in order if i % 2 == 0 else order[::-1]:
            # (a killed agent's trainers, in sessions of their own, die a moment after it)
            with tempfile.TemporaryDirectory(
                prefix="node-loss-", dir=REPO, ignore_cleanup_errors=True
            ) as work:
                result = one_loss(Path(work), variant, hidden, step_s)
            print(json.dumps(result), file=sys.stderr)
            results.append(result)
    summary: dict[str, Any] = {"runs": runs, "hidden": hidden, "step_s": step_s, "results": results}
    for variant in VARIANTS:
        mine = [r for r in results if r["variant"] == variant]
        summary[variant] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("kill_to_first_step_s", "replacement_start_to_first_step_s", "restore_s")
        }
        for key in TIMELINE:  # (None: not seen, e.g. no node fenced)
            seen = [r[key] for r in mine if r[key] is not None]
            summary[variant][key] = statistics.median(seen) if seen else None
    return summary


def markdown(result: dict[str, Any]) -> str:
    rows = ["| recovery of a lost node | kill -> first step | new agent's start (spare: taken in; trainer: restarted) -> first step | restore |",
            "|---|---|---|---|"]  # fmt: skip
    variants = (
        ("spare", "**a hot spare, from the peers' copies**"),
        ("peers", "a new node, from the peers' copies"),
        ("disk", "a new node, from the local disk"),
        ("trainer", "(a trainer lost, its node kept: from its agent's memory)"),
    )
    for variant, name in variants:
        r = result[variant]
        rows.append(
            f"| {name} | {r['kill_to_first_step_s']:.2f} s | "
            f"{r['replacement_start_to_first_step_s']:.2f} s | {r['restore_s']:.3f} s |"
        )
    rows += ["", "| from the kill, medians | " + " | ".join(TIMELINE.values()) + " |",
             "|---|" + "---:|" * len(TIMELINE)]  # fmt: skip
    for variant, name in variants:
        cells = [result[variant][key] for key in TIMELINE]
        rows.append(
            f"| {name} | " + " | ".join("-" if c is None else f"{c:.2f} s" for c in cells) + " |"
        )
    kinds = sorted({str(r["restore_kind"]) for r in result["results"]})
    rows += ["", f"Medians of {result['runs']} losses each (restores seen: {', '.join(kinds)})."]
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mb", type=float, default=20.0, help="approximate state size, MB")
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    result = measure(args.runs, args.mb, args.step_s)
    if args.json:
        print(json.dumps(result, indent=2))
    if args.markdown or not args.json:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
