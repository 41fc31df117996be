"""What CPU does a checkpoint cost under ``crashproof run``, where each save to disk is also a
memory snapshot in the agent's memory, against the same save without an agent?

Under ``crashproof run`` a save's staging buffers are a segment of the agent's shared memory:
the one copy out of the live tensors is both the memory snapshot and the source of the disk
checkpoint. Each of the two is checksummed (xxh3) and checked for NaN and inf; the memory
snapshot's writer hashes the staged bytes once and hands the checksums to the disk writer, so a
save with an agent should cost no more CPU than one without (the background threads compete with
training for the cores: see ``training_overhead.py``).

One process plays both sides (the agent's memory host is the code ``crashproof run`` runs).
The state is ``--gib`` GiB of float32 weights in ``--tensors`` tensors. In turns, ``--runs``
times each, after one save of each that sizes the staging buffers:

* **no agent**: ``save`` + ``wait`` of an asynchronous checkpoint to the local disk;
* **with the agent**: the same save, which is a memory snapshot too;
* **memory only**: a memory snapshot (``memory_every``), nothing to disk;
* **one hash pass**: xxh3 over the state's bytes, alone (the floor of one checksum pass).

For each: the process's CPU time (every thread: training's, the writers', the memory host's) and
the wall time from ``save`` to the end of ``wait``. Medians, and the CPU with the agent over the
CPU without: the median of each round's ratio (paired: it cancels much of the machine's drift).
The kernel's share of a write to disk varies widely from one save to the next; ``--dir`` on a
tmpfs (``/dev/shm``) leaves the writers' own CPU, which is what the two cases differ in.

    .venv/bin/python benchmarks/save_cpu.py --dir /dev/shm --runs 25 --markdown
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import crashproof as cp
from _support import agent_memory, gib_of_weights, gib_of_weights_arguments, print_result
from crashproof.checkpoint.format import digest, tensor_bytes
from crashproof.link import ENV_MEMORY_SOCKET


def _timed(work: Callable[[], None]) -> tuple[float, float]:
    """(CPU seconds of the whole process, wall seconds) spent in ``work``."""
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return time.process_time() - cpu, time.perf_counter() - wall


def measure(gib: float, tensors: int, runs: int, directory: str) -> dict[str, Any]:
    state, nbytes = gib_of_weights(gib, tensors)
    step = iter(range(1, 10**6))
    with (
        agent_memory("crashproof-save-cpu-", directory) as (work, host),
        contextlib.ExitStack() as managers,
    ):
        os.environ.pop(ENV_MEMORY_SOCKET, None)
        alone = managers.enter_context(
            cp.CheckpointManager(
                work / "alone", async_save=True, keep=cp.KeepLast(1), handle_signals=False
            )
        )
        os.environ[ENV_MEMORY_SOCKET] = host.address
        supervised = managers.enter_context(
            cp.CheckpointManager(
                work / "supervised", async_save=True, keep=cp.KeepLast(1), handle_signals=False
            )
        )
        memory_only = managers.enter_context(
            cp.CheckpointManager(
                work / "memory",
                every=cp.EverySteps(10**9),
                memory_every=cp.EverySteps(1),
                handle_signals=False,
            )
        )
        assert supervised._pipeline._memory is not None, "the agent's memory is not in use"

        def save(manager: cp.CheckpointManager) -> None:
            manager.save(next(step), state)
            manager.wait()

        def snapshot() -> None:
            taken = memory_only.stats.memory_snapshots
            memory_only.maybe_save(next(step), state)
            memory_only.wait()
            assert memory_only.stats.memory_snapshots == taken + 1, "the snapshot was skipped"

        def hash_once() -> None:
            for p in state.model.parameters():  # type: ignore[union-attr]
                digest(tensor_bytes(p.detach()))

        variants: dict[str, Callable[[], None]] = {
            "alone": lambda: save(alone),
            "supervised": lambda: save(supervised),
            "memory": snapshot,
            "hash": hash_once,
        }
        for run in variants.values():  # (the staging buffers are made by the first save)
            run()
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        wall: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(runs):
            for name, run in variants.items():
                c, w = _timed(run)
                cpu[name].append(c)
                wall[name].append(w)
        assert supervised.stats.memory_snapshots == runs + 1, supervised.stats
        median_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        return {
            "gib": nbytes / 2**30,
            "tensors": tensors,
            "runs": runs,
            "cpu_s": median_cpu,
            "wall_s": {k: statistics.median(v) for k, v in wall.items()},
            "cpu_runs": cpu,
            "supervised_cpu_over_alone": statistics.median(
                with_agent / alone
                for with_agent, alone in zip(cpu["supervised"], cpu["alone"], strict=True)
            ),
        }


def markdown(result: dict[str, Any]) -> str:
    names = {
        "alone": "a checkpoint to disk, no agent",
        "supervised": "**a checkpoint to disk under the agent** (a memory snapshot too)",
        "memory": "a memory snapshot only",
        "hash": "one xxh3 pass over the state (alone)",
    }
    rows = ["| save | CPU (all threads) | save -> wait done |", "|---|---:|---:|"]
    for key, name in names.items():
        rows.append(f"| {name} | {result['cpu_s'][key]:.3f} s | {result['wall_s'][key]:.3f} s |")
    rows.append("")
    rows.append(
        f"{result['gib']:.2f} GiB in {result['tensors']} tensors, medians of {result['runs']} "
        f"runs. CPU of a checkpoint under the agent over one without (paired): "
        f"**{result['supervised_cpu_over_alone']:.2f}x**."
    )
    return "\n".join(rows)


def main() -> int:
    args = gib_of_weights_arguments(
        __doc__.split("\n")[0], gib=0.5, extra=[("--dir", os.getcwd(), "scratch directory")]
    )
    print_result(measure(args.gib, args.tensors, args.runs, args.dir), args, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
