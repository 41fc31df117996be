"""`make demo`: a training job attacked by every kind of fault, and the proof that it lost nothing.

1. ``crashproof chaos`` launches ``train_tiny.py`` on 2 ranks (DDP over gloo) under
   ``crashproof run`` and injects a seeded campaign of mixed faults: a rank killed, a rank hung,
   a NaN loss, the newest checkpoint corrupted (a flipped bit), a failing disk (EIO), a full disk
   (ENOSPC), a stalled write, a straggler. A live bar shows the training's step (it steps back
   where a failure cost work). Each fault is reported with what detected it, whether the run
   recovered and the steps it had to compute again.
2. The same job without faults (the NaN at the same step: the guard's decision to skip that batch
   is part of the result), and the two final checkpoints compared tensor by tensor, bit for bit.
3. ``crashproof report``: the goodput ledger (ETTR and where the rest of the time went) and the
   path of the self-contained HTML report.
4. ``crashproof ls`` and ``crashproof verify`` of what is on disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from crashproof.state import set_reproducible_defaults

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_tiny.py"

# Step-triggered, so the campaign is the same on any machine's speed; ranks and the bit flipped
# are drawn from --seed. One fault at a time: each waits until the previous one is resolved.
FAULTS = [
    "at=step:40,kind=kill",
    "at=step:90,kind=hang",
    "at=step:140,kind=nan",
    "at=step:190,kind=corrupt,mode=flip",
    "at=step:240,kind=storage,error=eio",
    "at=step:290,kind=storage,error=enospc",
    "at=step:340,kind=storage,error=hang,hang_s=2",
    "at=step:390,kind=straggler,stop=0.8,period_s=0.02,for_s=4",  # a period of ~2 steps
]


def banner(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def crashproof(*args: str, env: dict[str, str]) -> int:
    print(f"$ crashproof {' '.join(args)}", flush=True)
    return subprocess.run([sys.executable, "-m", "crashproof.cli", *args], env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="demo-runs", help="where the demo writes (recreated)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=7, help="draws the ranks and the bit flipped")
    args = parser.parse_args()
    root = Path(args.run_dir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CRASHPROOF_PROGRESS_INTERVAL_S": "0.5"}
    set_reproducible_defaults(env)  # bit-reproducible CPU math (docs/exactness.md)

    banner(f"1. crashproof chaos: {len(FAULTS)} faults against 2 ranks of train_tiny.py")
    campaign = root / "chaos"
    code = crashproof(
        "chaos", "--seed", str(args.seed), "--dir", str(campaign), "--compare-baseline",
        "--resolve-timeout", "120", "--timeout", "300",
        *[item for spec in FAULTS for item in ("--fault", spec)],
        "--",
        "--nproc-per-node", "2", "--hang-timeout", "3", "--max-restarts", "20",
        str(TRAIN), "--run-dir", "{run}", "--steps", str(args.steps), "--every", "10",
        "--hidden", "256", "--samples", "400", "--workers", "1",
        env=env,
    )  # fmt: skip

    run_dir = campaign / "run"
    banner("2. crashproof report: where the faulted run's time went")
    crashproof("report", str(run_dir), env=env)

    banner("3. what is on disk")
    crashproof("ls", str(run_dir / "checkpoints"), env=env)
    crashproof("verify", str(run_dir / "checkpoints"), "--latest", env=env)

    if code != 0:
        print(f"\n\033[1mthe campaign FAILED (exit {code}): see {run_dir / 'chaos_report.json'}")
        return 1
    print(
        "\n\033[1mevery fault was detected and recovered from, and the final state is bit for bit"
        " the one of the run that never failed\033[0m"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
