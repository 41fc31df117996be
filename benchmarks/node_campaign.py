"""ETTR of a two-node run under a kill campaign that loses whole nodes as well as trainers.

Two ``crashproof run`` agents on this machine play two nodes (c10d on loopback, one trainer each,
``examples/train_tiny.py``, gloo DDP, memory snapshots every ``--memory-every`` steps copied to
the other node, a checkpoint on the shared disk every ``--every`` steps) and a third waits as a
hot spare (``--standby 1``). The same job runs once without faults and once under SIGKILLs at
exponential intervals of mean ``--mtbf`` seconds (seeded). Each kill is, with probability
``--node-share``, of a whole node (its agent and its trainer at once: a lost machine), else of
one trainer. After a node is lost, the spare takes its place and this script starts a new spare,
as a scheduler would. (Node 0's agent hosts the c10d rendezvous store, which must outlive the
run: its node is never the one lost; its trainer may be killed.)

Reported per kill, from the agents' events: the time from the kill to the first step after the
restore, the steps computed again (reached before the kill, restored below it), and where the
restore read from; then

- **ETTR from the kills' cost**: 1 - (each kill's time to resume + its steps computed again at
  the clean run's median step time) / the faulted run's wall time, which the machine's drift
  between two runs does not blur;
- ETTR by the wall clock: the clean run's wall time over the faulted run's;
- whether the final weights and every step's samples and loss equal the clean run's.

    .venv/bin/python benchmarks/node_campaign.py --markdown
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

from _support import free_port, wait_until

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from crashproof.telemetry import read_events  # noqa: E402

DEFAULT_DIR = REPO / ".bench-tmp" / "node_campaign"


class Cluster:
    """The agents of one run: node 0 (the store's host), node 1, and the spares after them."""

    def __init__(self, directory: Path, args: argparse.Namespace) -> None:
        self.directory, self.args = directory, args
        self.port = free_port()
        self.agents: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, spare: bool) -> None:
        run_dir = self.directory / f"agent{len(self.agents)}"
        run_dir.mkdir(parents=True)
        a = self.args
        command = [
            sys.executable, "-m", "crashproof.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
            "--max-restarts", "1000", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "node-campaign",
            "--run-dir", str(run_dir), "--metrics-port", "-1",
            *(["--standby", "1"] if spare else []),
            str(REPO / "examples" / "train_tiny.py"), "--run-dir", str(self.directory / "ckpt"),
            "--steps", str(a.steps), "--every", str(a.every), "--memory-every", str(a.memory_every),
            "--staging-buffers", "2", "--workers", "0", "--batch-size", "8",
            "--hidden", str(a.hidden), "--step-s", str(a.step_s),
            "--step-log", str(self.directory / "steps.jsonl"),
            "--dump", str(self.directory / "final.safetensors"),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_CBWR": "AUTO,STRICT",
               "MKL_DYNAMIC": "FALSE", "CRASHPROOF_PROGRESS_INTERVAL_S": "0.05"}  # fmt: skip
        with open(run_dir.with_suffix(".log"), "wb") as log:
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        self.agents.append((proc, run_dir))

    def events(self) -> list[dict[str, Any]]:
        found = []
        for _, run_dir in self.agents:
            path = run_dir / "events.jsonl"
            if path.exists():
                found += [{**e, "agent": run_dir.name} for e in read_events(path)]
        return sorted(found, key=lambda e: e["ts"])

    def _states(self) -> list[str | None]:
        """Each agent's last word on its place: ``rank_start`` or ``standby_promoted`` (in the
        round), ``standby`` (waiting as a spare), None (not yet, or its process ended)."""
        events = self.events()
        states: list[str | None] = []
        for proc, run_dir in self.agents:
            said = [e["event"] for e in events if e["agent"] == run_dir.name and e["event"] in
                    ("rank_start", "standby", "standby_promoted")]  # fmt: skip
            states.append(said[-1] if said and proc.poll() is None else None)
        return states

    def active(self) -> list[int]:
        """The agents in the round now (alive, and not waiting as a spare)."""
        return [i for i, s in enumerate(self._states()) if s in ("rank_start", "standby_promoted")]

    def spare_waiting(self) -> bool:
        return "standby" in self._states()

    def trainer_pid(self, agent: int) -> int | None:
        name = self.agents[agent][1].name
        starts = [e for e in self.events() if e["agent"] == name and e["event"] == "rank_start"]
        return int(starts[-1]["pid"]) if starts else None

    def stop(self) -> None:
        for proc, _ in self.agents:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def one_run(directory: Path, args: argparse.Namespace, faults: bool) -> dict[str, Any]:
    cluster = Cluster(directory, args)
    rng = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    started = time.time()
    try:
        cluster.start(spare=False)
        wait_until(lambda: bool(cluster.events()), 60, "node 0's agent")
        cluster.start(spare=False)
        if faults:
            wait_until(lambda: len(cluster.active()) == 2, 120, "both nodes training")
            cluster.start(spare=True)
        next_kill = time.time() + rng.expovariate(1.0 / args.mtbf)
        while cluster.agents[0][0].poll() is None:
            time.sleep(0.05)
            if not faults or time.time() < next_kill:
                continue
            next_kill = time.time() + rng.expovariate(1.0 / args.mtbf)
            node_kill = rng.random() < args.node_share
            active = cluster.active()
            if len(active) < 2:
                continue  # a recovery is under way: this fault is drawn again later
            if node_kill:
                if not cluster.spare_waiting():
                    continue
                victim = next(i for i in active if i != 0)
                os.killpg(cluster.agents[victim][0].pid, signal.SIGKILL)
                cluster.agents[victim][0].wait(30)
                kills.append({"t": time.time(), "kind": "node", "agent": victim})
                cluster.start(spare=True)  # the scheduler brings a new spare
            else:
                victim = rng.choice(active)
                pid = cluster.trainer_pid(victim)
                if pid is None:
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append({"t": time.time(), "kind": "trainer", "agent": victim})
        code = cluster.agents[0][0].wait()
        wall = time.time() - started
        events = cluster.events()
    finally:
        cluster.stop()
    return {"dir": str(directory), "exitcode": code, "wall_s": wall, "kills": kills,
            "events": events}  # fmt: skip


def step_s(run: dict[str, Any]) -> float:
    """The median time between two steps, from the agents' progress events."""
    progress = [e for e in run["events"] if e["event"] == "progress"]
    rates = [
        (b["ts"] - a["ts"]) / (b["step"] - a["step"])
        for a, b in itertools.pairwise(progress)
        if b["step"] > a["step"] and b["ts"] - a["ts"] < 1.0
    ]
    return statistics.median(rates) if rates else 0.0


def kill_costs(run: dict[str, Any], per_step_s: float) -> list[dict[str, Any]]:
    """Per kill: the first step after the restore that followed it, the steps computed again,
    and where the restore read from."""
    events = run["events"]
    costs = []
    for i, kill in enumerate(run["kills"]):
        until = run["kills"][i + 1]["t"] if i + 1 < len(run["kills"]) else float("inf")
        restores = [e for e in events if e["event"] == "restore" and kill["t"] < e["ts"] < until]
        if not restores:
            continue
        restore = restores[0]
        resumed = [e for e in events if e["event"] == "progress" and e["ts"] > restore["ts"]]
        reached = [e["step"] for e in events if e["event"] == "progress" and e["ts"] <= kill["t"]]
        if not resumed or not reached:
            continue
        redone = max(0, max(reached) - int(restore["step"]))
        to_step = resumed[0]["ts"] - kill["t"]
        costs.append({"kind": kill["kind"], "to_first_step_s": round(to_step, 3),
                      "redone_steps": redone, "source": restore.get("kind"),
                      "cost_s": round(to_step + redone * per_step_s, 3)})  # fmt: skip
    return costs


def same_run(clean: Path, faulted: Path) -> bool:
    first, second = load_file(clean / "final.safetensors"), load_file(faulted / "final.safetensors")
    if first.keys() != second.keys() or not all(first[k].equal(second[k]) for k in first):
        return False
    for rank in (0, 1):
        logs = [_records(d / f"steps.jsonl.rank{rank}") for d in (clean, faulted)]
        if logs[0] != logs[1]:
            return False
    return True


def _records(path: Path) -> dict[int, tuple[Any, Any]]:
    """Each step's samples and loss; a step done again after a restore must match itself."""
    records: dict[int, tuple[Any, Any]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        records[r["step"]] = (r["ids"], r["loss"])
    return records


def campaign(args: argparse.Namespace) -> dict[str, Any]:
    base = args.dir / f"{int(time.time())}"
    clean = one_run(base / "clean", args, faults=False)
    faulted = one_run(base / "faulted", args, faults=True)
    per_step = step_s(clean)
    costs = kill_costs(faulted, per_step)
    out = {
        "mtbf_s": args.mtbf, "node_share": args.node_share, "steps": args.steps,
        "exitcodes": [clean["exitcode"], faulted["exitcode"]],
        "clean_wall_s": round(clean["wall_s"], 1), "faulted_wall_s": round(faulted["wall_s"], 1),
        "step_s": round(per_step, 4), "kills": faulted["kills"], "costs": costs,
        "ettr_costs": 1 - sum(c["cost_s"] for c in costs) / faulted["wall_s"],
        "ettr_wall": clean["wall_s"] / faulted["wall_s"],
        "bit_identical": same_run(Path(clean["dir"]), Path(faulted["dir"])),
    }  # fmt: skip
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def markdown(out: dict[str, Any]) -> str:
    costs = out["costs"]
    rows = ["| kill | kills | kill -> first step (median) | steps computed again (median) | "
            "cost (median) | restored from |", "|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for kind in ("trainer", "node"):
        mine = [c for c in costs if c["kind"] == kind]
        if not mine:
            continue
        sources = sorted({str(c["source"]) for c in mine})
        rows.append(
            f"| {kind} | {len(mine)} | {statistics.median(c['to_first_step_s'] for c in mine):.2f} s"
            f" | {statistics.median(c['redone_steps'] for c in mine):.0f} | "
            f"{statistics.median(c['cost_s'] for c in mine):.2f} s | {', '.join(sources)} |"
        )
    rows += [
        "",
        f"MTBF {out['mtbf_s']:.0f} s, {out['node_share']:.0%} of kills a whole node; "
        f"{len(out['kills'])} kills in {out['faulted_wall_s']:.0f} s ({len(costs)} resumed from). "
        f"**ETTR from the kills' cost: {out['ettr_costs']:.3f}**; by the wall clock "
        f"{out['ettr_wall']:.3f} ({out['clean_wall_s']:.0f} s without faults). Final state and "
        f"every step's samples and loss equal to the run without faults: "
        f"**{out['bit_identical']}**.",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--step-s", type=float, default=0.05, help="the trainer's pause per step")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--every", type=int, default=100, help="checkpoint to disk every N steps")
    p.add_argument("--memory-every", type=int, default=5)
    p.add_argument("--mtbf", type=float, default=30.0)
    p.add_argument("--node-share", type=float, default=0.3, help="the share of node kills")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    out = campaign(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(markdown(out) if args.markdown else json.dumps(out, indent=1))
    good = out["bit_identical"] and out["exitcodes"] == [0, 0]
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
