"""How long does ``crashproof run`` take from the command to the first training step, and how much
CPU does the start cost, against ``torchrun`` on the same machine?

The trainer (written to a temporary directory) is the start of any DDP script: it stamps the time
at its first line, imports torch, joins a gloo process group, wraps a small model in
DistributedDataParallel and takes one optimizer step (the step imports torch._dynamo), stamps
the time again and exits. Three launchers start it with two ranks, ``--runs`` times each,
interleaved (the order rotates every round), so that a shared machine's drifts hit each alike:

* ``torchrun --standalone``;
* ``crashproof run``: trainers forked from a warm forkserver, itself forked from the agent;
* ``crashproof run --cold-start``: ``python -u script.py`` per trainer, as torchrun does.

For each run: the seconds from the launch to the later rank's first step, the seconds to the
launcher's exit, and the CPU the whole machine spent meanwhile (``/proc/stat``, every core: it
counts every process of the run, the forkserver and the resource tracker included, and anything
else running, so keep the machine quiet). Medians, and ratios to torchrun's medians.

    .venv/bin/python benchmarks/startup.py --runs 5 --markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _support import busy_cpu_s

LAUNCHERS = ("torchrun", "crashproof", "crashproof-cold")

TRAINER = """
import time
started = time.time()
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(8, 64)).sum().backward()
optimizer.step()
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}"), "w") as f:
    f.write(f"{started} {time.time()}")
"""


def command(launcher: str, script: Path, out: Path) -> list[str]:
    ranks = ["--nproc-per-node", "2"]
    if launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            *ranks,
            str(script),
            str(out),
        ]
    run = [sys.executable, "-m", "crashproof.cli", "run", *ranks, "--quiet", "--metrics-port", "-1"]
    run += ["--run-dir", str(out / "run")]
    if launcher == "crashproof-cold":
        run.append("--cold-start")
    return [*run, str(script), str(out)]


def one_run(launcher: str, script: Path, scratch: Path) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(dir=scratch))
    cpu = busy_cpu_s()
    launched = time.time()
    done = subprocess.run(
        command(launcher, script, out), capture_output=True, text=True, timeout=300, check=False
    )
    ended = time.time()
    cpu = busy_cpu_s() - cpu
    if done.returncode != 0:
        raise SystemExit(
            f"{launcher} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    stamps = [tuple(map(float, (out / f"rank{r}").read_text().split())) for r in (0, 1)]
    return {
        "to_script_s": max(s[0] for s in stamps) - launched,
        "to_first_step_s": max(s[1] for s in stamps) - launched,
        "to_exit_s": ended - launched,
        "cpu_s": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each launcher (default 5)")
    parser.add_argument("--markdown", action="store_true", help="a markdown table on stdout")
    parser.add_argument("--json", action="store_true", help="every run, as JSON, on stdout")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        scratch = Path(tmp)
        script = scratch / "trainer.py"
        script.write_text(TRAINER)
        one_run("crashproof", script, scratch)  # a first run warms the page cache for all
        for round_ in range(args.runs):
            order = LAUNCHERS[round_ % 3 :] + LAUNCHERS[: round_ % 3]
            for launcher in order:
                found = one_run(launcher, script, scratch)
                results[launcher].append(found)
                print(
                    f"round {round_ + 1} {launcher}: {json.dumps({k: round(v, 2) for k, v in found.items()})}",
                    file=sys.stderr,
                    flush=True,
                )
    medians = {
        name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    if args.json:
        print(json.dumps({"runs": results, "medians": medians}, indent=1))
    if args.markdown:
        base = medians["torchrun"]
        print(
            f"| launcher (medians of {args.runs}) | launch to script | launch to first step | vs torchrun | CPU of the start | vs torchrun |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for name in LAUNCHERS:
            m = medians[name]
            print(
                f"| {name} | {m['to_script_s']:.2f} s | {m['to_first_step_s']:.2f} s | "
                f"{m['to_first_step_s'] / base['to_first_step_s']:.2f}x | {m['cpu_s']:.2f} s | "
                f"{m['cpu_s'] / base['cpu_s']:.2f}x |"
            )


if __name__ == "__main__":
    main()
