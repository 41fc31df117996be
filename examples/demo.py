"""`make demo`: train a small model, kill it mid-run, resume it, and prove nothing was lost.

1. An uninterrupted reference run of ``train_tiny.py``.
2. The same run, killed with SIGKILL partway through (a real kill, from outside).
3. What crashproof saved (``crashproof ls`` and ``crashproof verify``), then a flipped bit in the
   newest checkpoint, which ``verify`` catches.
4. A second launch that skips the corrupt checkpoint, restores the newest valid one and finishes.
5. The resumed run's final weights, optimizer state and EMA compared with the reference, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from crashproof.state._reproducible import set_reproducible_defaults

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_tiny.py"


def banner(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def train(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(TRAIN), "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_child_env(),
    )


def finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        print(out)
        raise SystemExit(f"training exited with {proc.returncode}")
    return out


def steps_logged(log: Path) -> int:
    if not log.exists():
        return 0
    lines = log.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def _child_env() -> dict[str, str]:
    """The runs' environment: bit-reproducible CPU math (MKL's settings, unless already chosen;
    ``crashproof run`` does the same for its trainers), unbuffered output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    set_reproducible_defaults(env)
    return env


def crashproof(*args: str) -> None:
    print(f"$ crashproof {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "crashproof.cli", *args], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="demo-runs", help="where the demo writes (recreated)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument(
        "--kill-at", type=int, default=77, help="SIGKILL the run once it has logged this step"
    )
    args = parser.parse_args()
    root = Path(args.run_dir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    common = [
        "--steps",
        str(args.steps),
        "--every",
        "10",
        "--keep",
        "3",
        "--samples",
        "400",
        "--hidden",
        "256",
    ]

    banner(f"1. reference run: {args.steps} steps, never interrupted")
    finish(
        train(
            root / "reference",
            *common,
            "--step-log",
            str(root / "reference.jsonl"),
            "--dump",
            str(root / "reference.safetensors"),
        )
    )
    print(f"done: {steps_logged(root / 'reference.jsonl')} steps")

    banner(f"2. the same run, killed with SIGKILL once it reaches step {args.kill_at}")
    log = root / "resumed.jsonl"
    proc = train(root / "run", *common, "--step-log", str(log))
    while steps_logged(log) < args.kill_at and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    print(f"killed at step {steps_logged(log)} (exit status {proc.returncode})")

    banner("3. what crashproof saved")
    crashproof("ls", str(root / "run" / "checkpoints"))
    crashproof("verify", str(root / "run" / "checkpoints"), "--latest")

    banner("3b. silent corruption: flip one bit in the newest checkpoint's tensor data")
    newest = sorted((root / "run" / "checkpoints").glob("step_*"))[-1]
    shard = newest / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    print(f"flipped bit 4 of byte {len(data) // 2} in {shard}")
    crashproof("verify", str(root / "run" / "checkpoints"), "--latest")

    banner("4. relaunch: restore the newest valid checkpoint and finish")
    out = finish(
        train(
            root / "run",
            *common,
            "--step-log",
            str(log),
            "--dump",
            str(root / "resumed.safetensors"),
        )
    )
    for line in out.splitlines():
        if "skipping checkpoint" in line or line.startswith("starting at step"):
            print(line)

    banner("5. compare with the reference run, bit for bit")
    reference, resumed = (
        load_file(root / "reference.safetensors"),
        load_file(root / "resumed.safetensors"),
    )
    different = [k for k in reference if not torch.equal(reference[k], resumed[k])]
    ref_steps = [json.loads(x) for x in (root / "reference.jsonl").read_text().splitlines()]
    run_steps = {r["step"]: r for r in map(json.loads, log.read_text().splitlines())}
    same_samples = all(run_steps[r["step"]] == r for r in ref_steps)
    print(
        f"{len(reference)} tensors (model, AdamW state, EMA): {len(reference) - len(different)} identical"
    )
    print(f"every step saw the same samples and computed the same loss: {same_samples}")
    if different or not same_samples:
        print(f"MISMATCH: {different[:5]}")
        return 1
    print("\033[1mthe resumed run is bit-for-bit identical to the run that never failed\033[0m")
    return 0


if __name__ == "__main__":
    sys.exit(main())
