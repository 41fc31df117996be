"""What does asynchronous checkpointing cost a training run? Measured in pairs, so noise cancels.

The target: training with ``CheckpointManager(async_save=True)`` saving every few seconds takes
<= 3% more wall time than the same training without checkpoints. On a shared 2-vCPU machine runs
of the *same* training spread by 5-10%, more than the effect, so two unpaired medians say little.
Here the two variants run as pairs, back to back, the order alternating from pair to pair (ABBA:
a drift of the machine's speed over the run affects both alike); each pair gives one relative
difference, (with - without) / without, and the result is the median of those differences with
a bootstrap 95% confidence interval (10,000 resamples of the pairs), beside the spread of the
runs without checkpoints for scale.

The training is ``async_save.py``'s (a TinyLM trained with AdamW on random tokens on the CPU, a
fresh model per run; its state after a few real steps, so the moments are not zero); the wall
time is the training loop plus ``close()`` (the last checkpoint committed), with retention on
(``KeepLast(1)``: each commit removes the checkpoint before it) as a run has it. About 10 minutes at the defaults::

    .venv/bin/python benchmarks/training_overhead.py --pairs 10 --markdown

With ``--memory-every N`` the variant with checkpoints takes memory snapshots instead, every N
steps, into the memory of an agent's memory host run in this process (what ``crashproof run``
does; ``CheckpointManager(memory_every=EverySteps(N))``), and nothing to disk::

    .venv/bin/python benchmarks/training_overhead.py --pairs 10 --memory-every 10 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from async_save import (
    ASYNC_CKPT,
    MEMORY_CKPT,
    NO_CKPT,
    TrainConfig,
    calibrate,
    checkpoint_every,
    run_steps,
    state_bytes,
    train_run,
)
from save_speed import DEFAULT_DIR, MB, Shape, log


def bootstrap_ci(
    values: list[float], *, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """The 95% percentile interval of the median of ``values``, resampled with replacement."""
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = TrainConfig(Shape(args.vocab, args.d_model, args.layers), args.batch, args.seq)
    step_s = calibrate(config)
    every = args.memory_every or checkpoint_every(step_s, args.ckpt_seconds)
    variant = MEMORY_CKPT if args.memory_every else ASYNC_CKPT
    steps = run_steps(step_s, every, args.train_seconds)
    saves = steps // every
    nbytes = state_bytes(config)
    log(
        f"{config}: {step_s * 1000:.0f} ms/step, {steps} steps per run, {variant} every "
        f"{every} steps ({saves} per run), {nbytes / MB:.1f} MB of state"
    )
    root = Path(tempfile.mkdtemp(prefix="overhead-", dir=args.dir))
    pairs: list[dict[str, Any]] = []
    for i in range(args.pairs + args.warmup):
        order = [NO_CKPT, variant] if i % 2 == 0 else [variant, NO_CKPT]
        runs = {v: train_run(config, v, steps, every, root / "ckpt") for v in order}
        without, with_ = runs[NO_CKPT]["wall_s"], runs[variant]["wall_s"]
        counted = i >= args.warmup
        log(
            f"  pair {i + 1 - args.warmup if counted else 'warm-up'}: without {without:.2f} s, "
            f"with {with_:.2f} s ({(with_ / without - 1) * 100:+.1f}%), order {order}"
        )
        if counted:
            pairs.append({"without_s": without, "with_s": with_, "order": order,
                          "blocking_s": runs[variant]["blocking_s"],
                          "waited_busy": runs[variant].get("waited_busy")})  # fmt: skip
    differences = [p["with_s"] / p["without_s"] - 1 for p in pairs]
    low, high = bootstrap_ci(differences)
    withouts = [p["without_s"] for p in pairs]
    return {
        "variant": variant,
        "config": str(config),
        "step_s": step_s,
        "steps": steps,
        "every": every,
        "saves_per_run": saves,
        "state_bytes": nbytes,
        "pairs": pairs,
        "median_overhead": statistics.median(differences),
        "mean_overhead": statistics.fmean(differences),
        "ci95": [low, high],
        "without_spread": (max(withouts) - min(withouts)) / statistics.median(withouts),
    }


def markdown(result: dict[str, Any]) -> str:
    low, high = result["ci95"]
    lines = [
        f"{result['config']}: {result['steps']} steps per run, {result['variant']} every "
        f"{result['every']} steps ({result['saves_per_run']} per run), "
        f"{result['state_bytes'] / MB:.1f} MB of state; {len(result['pairs'])} pairs.",
        "",
        "| pair | without s | with s | difference |",
        "|---:|---:|---:|---:|",
    ]
    for i, p in enumerate(result["pairs"], 1):
        lines.append(
            f"| {i} | {p['without_s']:.2f} | {p['with_s']:.2f} | "
            f"{(p['with_s'] / p['without_s'] - 1) * 100:+.1f}% |"
        )
    lines += [
        "",
        f"**Median paired overhead {result['median_overhead'] * 100:+.1f}%** (95% bootstrap "
        f"interval {low * 100:+.1f}% to {high * 100:+.1f}%; mean {result['mean_overhead'] * 100:+.1f}%); "
        f"the runs without checkpoints spread by {result['without_spread'] * 100:.1f}%.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=10, help="counted pairs (>= 10 for a result)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted pairs first")
    p.add_argument("--train-seconds", type=float, default=25, help="target seconds per run")
    p.add_argument("--ckpt-seconds", type=float, default=6, help="target seconds between saves")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="scratch dir on the disk to test")
    p.add_argument(
        "--memory-every",
        type=int,
        default=0,
        help="measure memory snapshots every N steps (an agent's memory host in this process)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    if args.pairs < 2 or args.warmup < 0:
        p.error("--pairs must be >= 2 and --warmup >= 0")
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.memory_every:
        from crashproof.link import ENV_MEMORY_SOCKET
        from crashproof.supervisor._memory_host import MemoryHost
        from crashproof.telemetry import EventLog

        host = MemoryHost(EventLog(args.dir / "memory-events.jsonl"))
        os.environ[ENV_MEMORY_SOCKET] = host.address
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    if args.markdown or not args.json:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
