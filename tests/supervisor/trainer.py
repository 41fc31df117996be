"""A small DDP trainer for the supervisor's tests, with failures it can be told to stage.

Every step all-reduces gradients over gloo, so a rank that stops leaves its peers blocked in a
collective (a real hang), and a rank that dies leaves them with a broken connection.

    --fail-at STEP        exit 3 after STEP (once the save before it committed), on every attempt
    --fail-attempts K     ... only on the first K attempts
    --fail-every-attempt  fail STEP + 5 * attempt: progress each time (spends the budget)
    --peer-busy-s S       when a rank fails, the others work S seconds before their next collective
    --stop-at STEP        SIGSTOP rank --stop-rank after STEP on the first attempt (a hang)
    --fail-at-start-from K  exit 3 at start-up (before restoring) on attempt K and later
    --helpers N           fork N sleeping children from the main thread (as DataLoader workers)
    --spawn-helper        and spawn one (an exec'd child, as a "spawn" DataLoader worker)
    --ignore-sigterm      ignore SIGTERM (keeps the supervisor waiting out its grace)
    --hang-after-close R  after closing the manager, rank R (or "all") never exits
    --work-after-close S  after closing the manager, work S seconds, beating, then exit
    --after-close ACTION  after closing the manager, rank --after-close-rank (or "all"): segv,
                          abort (crash on the way out) or beat-step-hang (crashproof.heartbeat(step),
                          then never exit)
    --work-before-close S rank 0 works S seconds, beating, before it closes its manager
    --export-after-close S  rank 0 works S seconds after closing its manager without a beat (an
                          export or an upload), then says "rank 0 exported"
    --clean-env-children FILE  rank 0 of the first attempt starts programs with an environment
                          of their own (so no marker of the run's), not detached: a child, one
                          left behind by a shell (`cmd &`), one in a process group of its own;
                          their pids are appended to FILE, their command lines the digits its name ends in
    --raise-in-loop-at STEP  rank 1 raises after STEP on the first attempt; the manager is closed
                          in a `finally` on the way out
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import crashproof as cp


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.02, help="extra sleep per step")
    p.add_argument("--fail-at", type=int, default=None)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-attempts", type=int, default=None)
    p.add_argument("--fail-every-attempt", action="store_true")
    p.add_argument(
        "--peer-busy-s", type=float, default=0.0, help="the other ranks' work when one fails"
    )
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--stop-rank", type=int, default=1)
    p.add_argument("--exit-zero", action="store_true", help="finish with sys.exit(0)")
    p.add_argument("--fail-at-start-from", type=int, default=None)
    p.add_argument("--helpers", type=int, default=0)
    p.add_argument("--spawn-helper", action="store_true")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--hang-after-close", default=None)
    p.add_argument("--work-after-close", type=float, default=0.0)
    p.add_argument("--after-close", choices=["segv", "abort", "beat-step-hang"], default=None)
    p.add_argument("--after-close-rank", default="1")
    p.add_argument("--work-before-close", type=float, default=0.0)
    p.add_argument("--export-after-close", type=float, default=0.0)
    p.add_argument("--raise-in-loop-at", type=int, default=None)
    p.add_argument("--clean-env-children", default=None)
    p.add_argument("--remote", default=None, help="a durable tier (replicated by the agent)")
    p.add_argument(
        "--ckpt-per-world",
        action="store_true",
        help="a checkpoint root per world size (restoring across world sizes is resharding)",
    )
    args = p.parse_args()

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if args.fail_at_start_from is not None and attempt >= args.fail_at_start_from:
        print(f"attempt {attempt} fails at start-up", file=sys.stderr, flush=True)
        return 3
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = cp.TrainState(model=model, optimizer=optimizer)
    root = f"{args.ckpt}/world_{dist.get_world_size()}" if args.ckpt_per_world else args.ckpt
    ckpt = cp.CheckpointManager(
        root, every=cp.EverySteps(args.every), keep=cp.KeepLast(2), remote=args.remote
    )
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    helpers = [
        multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,), daemon=True)
        for _ in range(args.helpers)
    ]
    if args.spawn_helper:
        helpers.append(
            multiprocessing.get_context("spawn").Process(
                target=time.sleep, args=(3600,), daemon=True
            )
        )
    for helper in helpers:
        helper.start()
        print(f"rank {rank} helper pid {helper.pid}", flush=True)
    if args.clean_env_children and rank == 0 and attempt == 0:
        clean_env_children(args.clean_env_children)
    start = ckpt.restore(state)
    print(
        f"attempt {attempt} starts at step {start} with world size {dist.get_world_size()}",
        flush=True,
    )
    try:
        train(args, ckpt, state, model, optimizer, start, attempt, rank)
    finally:
        if rank == 0:
            beat_for(args.work_before_close)
        ckpt.close()
    if args.after_close is not None and args.after_close_rank in ("all", str(rank)):
        after_close(args.after_close, args.steps, rank)
    if args.hang_after_close in ("all", str(rank)):
        print(f"rank {rank} hangs after close", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:  # as a deadlock in a destructor at exit: never beats, never exits
            time.sleep(1)
    if args.export_after_close and rank == 0:
        time.sleep(args.export_after_close)
        print("rank 0 exported", flush=True)
    beat_for(args.work_after_close)  # work after close that tells it is alive
    for helper in helpers:
        helper.terminate()
    dist.destroy_process_group()
    print(f"rank {rank} finished at step {args.steps}", flush=True)
    if args.exit_zero:
        sys.exit(0)
    return 0


def clean_env_children(record: str) -> None:
    """Programs that carry nothing of the run's environment and stay in the trainer's session."""
    import subprocess

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    # FILE's name ends in digits: in their command lines, so a test can tell them apart
    tag = "0." + os.path.basename(record).rsplit("-", 1)[1]
    sleep = ["sleep", "3600", tag]
    pids = [
        subprocess.Popen(sleep, env=env).pid,
        subprocess.Popen(sleep, env=env, process_group=0).pid,
    ]
    # a shell that starts one in the background and exits at once: its parent is gone at once
    shell = subprocess.run(
        ["sh", "-c", f"sleep 3600 {tag} >/dev/null 2>&1 & echo $!"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    pids.append(int(shell.stdout))
    with open(record, "a") as f:
        f.write("".join(f"{pid}\n" for pid in pids))


def beat_for(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        cp.heartbeat()
        time.sleep(0.05)


def after_close(action: str, steps: int, rank: int) -> None:
    """What a trainer does on its way out after its work is committed."""
    print(f"rank {rank} after close: {action}", flush=True)
    if action == "segv":  # as a native destructor crashing at interpreter exit
        os.kill(os.getpid(), signal.SIGSEGV)
    elif action == "abort":
        os.abort()
    elif action == "beat-step-hang":  # an evaluation loop reporting a step, then a deadlock
        cp.heartbeat(steps + 1)
        while True:
            time.sleep(1)


def train(
    args: argparse.Namespace,
    ckpt: cp.CheckpointManager,
    state: cp.TrainState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    start: int,
    attempt: int,
    rank: int,
) -> None:
    for step in range(start, args.steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_s)
        done = step + 1
        ckpt.maybe_save(done, state)
        fail_at = args.fail_at
        if fail_at is not None and args.fail_every_attempt:
            fail_at += 5 * attempt
        failing = (
            fail_at is not None
            and done == fail_at
            and (args.fail_attempts is None or attempt < args.fail_attempts)
        )
        if failing:
            # The failure comes after the last save committed, as the tests that restart from it
            # assume (under load an asynchronous save two steps old may still be in flight).
            ckpt.wait()
        if failing and rank == args.fail_rank:
            print(f"rank {rank} fails after step {done}", file=sys.stderr, flush=True)
            os._exit(3)
        if failing:
            time.sleep(args.peer_busy_s)  # the others' own work, before their next collective
        if args.stop_at == done and rank == args.stop_rank and attempt == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        if args.raise_in_loop_at == done and rank == 1 and attempt == 0:
            raise RuntimeError(f"rank {rank} fails in its loop after step {done}")


if __name__ == "__main__":
    sys.exit(main())
