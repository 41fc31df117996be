"""How fast does a trainer that crashed restore from its agent's memory, against the local disk
and against a plain memcpy of the same bytes?

Target (recovery from memory): a restore of a 1 GiB state from the agent's memory at >= 5x the
speed of the verified restore from the local disk, and >= 0.8x a plain memcpy of the same bytes.

One process plays both sides: the agent's memory host (the same code ``crashproof run`` runs)
and the trainer. The state is ``--gib`` GiB of float32 weights in ``--tensors`` tensors of a
model (the restore's live destinations, as in a restarted trainer that built its model). One
asynchronous save puts it on disk and, at no extra copy, in the agent's memory. Then, in turns,
``--runs`` times each:

* **memcpy**: one ``np.copyto`` per tensor from the segment into the live tensors, the lower bound
  of any restore from memory (it verifies nothing);
* **agent's check**: what ``crashproof run``'s agent does once a crashed trainer and what it
  left are gone: it checks every byte of the snapshots in its memory against their checksums,
  on a thread, while the next trainer starts (its interpreter, torch, its model: seconds);
* **memory**: ``CheckpointManager.restore`` from the agent's memory, end to end, of a snapshot
  the agent checked (mapped read-only since: the restore copies it without hashing it again);
* **memory, hashed by the restore**: the same restore where the agent has not checked it (a
  trainer restarted by the user's own code, or a check not finished): every byte hashed, then
  copied;
* **disk, cold**: ``restore`` with ``memory=False`` after dropping the checkpoint's files from
  the page cache (``posix_fadvise(DONTNEED)``: what a restarted trainer meets when the save is
  not recent, or on another node);
* **disk, warm**: the same with the files in the page cache (a crash right after the save).

Reports medians and ratios (memcpy and disk time over memory time, for both memory restores), and
the agent's check and the restore after it together: all the work, when nothing hides the check.

    .venv/bin/python benchmarks/memory_restore.py --markdown
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import crashproof as cp
from _support import agent_memory, gib_of_weights, gib_of_weights_arguments, print_result
from crashproof.supervisor._memory_host import MemoryHost


def _drop_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _restore(root: Path, state: cp.TrainState, *, memory: bool) -> tuple[float, str]:
    with cp.CheckpointManager(root, memory=memory, handle_signals=False) as ckpt:
        started = time.perf_counter()
        step = ckpt.restore(state)
        seconds = time.perf_counter() - started
        assert step == 1, step
        return seconds, ckpt._restorer.last_kind


def _agent_check(host: MemoryHost, *, checked: bool) -> float:
    """Forget the host's checks; with ``checked``, check again as the agent does after its
    trainers stopped, and return how long that took."""
    with host._lock:
        for segment in host._segments.values():
            segment.checked_gen = None
    if not checked:
        return 0.0
    began = time.perf_counter()
    host.trainers_stopped()
    assert host.checks_done(600)
    return time.perf_counter() - began


def measure(gib: float, tensors: int, runs: int) -> dict[str, Any]:
    with agent_memory("crashproof-memory-restore-", os.getcwd()) as (work, host):
        root = work / "ckpt"
        state, nbytes = gib_of_weights(gib, tensors)
        with cp.CheckpointManager(root, handle_signals=False) as ckpt:
            ckpt.save(1, state)
            ckpt.wait()
            memory = ckpt._pipeline._memory
            assert memory is not None
        live = [p.detach() for p in state.model.parameters()]  # type: ignore[union-attr]
        times: dict[str, list[float]] = {
            "memcpy": [],
            "agent_check": [],
            "memory": [],
            "memory_hashed": [],
            "disk_cold": [],
            "disk_warm": [],
        }
        with cp.CheckpointManager(root, handle_signals=False) as holder:  # maps the segment
            slots = holder._pipeline._memory
            assert slots is not None
            view = slots.slots[slots.steps()[1]].view()
            start = slots.slots[slots.steps()[1]].contents["shard"][0]
            header = int.from_bytes(view[start : start + 8], "little") + 8
            sources, pos = [], start + header
            for tensor in live:
                n = tensor.numel() * 4
                sources.append(np.frombuffer(view[pos : pos + n], dtype=np.uint8))
                pos += n
            for _ in range(runs):
                began = time.perf_counter()
                for tensor, source in zip(live, sources, strict=True):
                    np.copyto(tensor.view(torch.uint8).reshape(-1).numpy(), source)
                times["memcpy"].append(time.perf_counter() - began)
            del sources, view
        for _ in range(runs):
            _agent_check(host, checked=False)
            seconds, kind = _restore(root, state, memory=True)
            assert kind == "memory", kind
            times["memory_hashed"].append(seconds)
            times["agent_check"].append(_agent_check(host, checked=True))
            seconds, kind = _restore(root, state, memory=True)
            assert kind == "memory", kind
            times["memory"].append(seconds)
            _drop_cache(root)
            seconds, kind = _restore(root, state, memory=False)
            assert kind == "local", kind
            times["disk_cold"].append(seconds)
            seconds, _ = _restore(root, state, memory=False)
            times["disk_warm"].append(seconds)
        times["check_then_memory"] = [
            a + b for a, b in zip(times["agent_check"], times["memory"], strict=True)
        ]
        medians = {k: statistics.median(v) for k, v in times.items()}
        return {
            "gib": nbytes / 2**30,
            "tensors": tensors,
            "runs": runs,
            "median_s": medians,
            "gbps": {k: nbytes / v / 1e9 for k, v in medians.items()},
            "disk_cold_over_memory": medians["disk_cold"] / medians["memory"],
            "disk_warm_over_memory": medians["disk_warm"] / medians["memory"],
            "memory_speed_over_memcpy": medians["memcpy"] / medians["memory"],
            "disk_cold_over_memory_hashed": medians["disk_cold"] / medians["memory_hashed"],
            "memory_hashed_speed_over_memcpy": medians["memcpy"] / medians["memory_hashed"],
        }


def markdown(result: dict[str, Any]) -> str:
    rows = [
        "| restore of the state | median | GB/s |",
        "|---|---|---|",
    ]
    names = {
        "memcpy": "plain memcpy from the segment (verifies nothing)",
        "agent_check": "the agent's check, while the next trainer starts (hashes every byte)",
        "memory": "**from the agent's memory**, checked by the agent (copied)",
        "memory_hashed": "from the agent's memory, not checked by the agent (hashed, copied)",
        "check_then_memory": "the agent's check, then the restore (all the work, one after the other)",
        "disk_warm": "from the local disk, page cache warm (verified)",
        "disk_cold": "from the local disk, page cache dropped (verified)",
    }
    for key, name in names.items():
        rows.append(f"| {name} | {result['median_s'][key]:.3f} s | {result['gbps'][key]:.2f} |")
    rows.append("")
    rows.append(
        f"{result['gib']:.2f} GiB in {result['tensors']} tensors, medians of {result['runs']} "
        f"runs. From memory: **{result['disk_cold_over_memory']:.1f}x** the speed of the cold "
        f"disk restore ({result['disk_warm_over_memory']:.1f}x the warm one), "
        f"**{result['memory_speed_over_memcpy']:.2f}x** a plain memcpy. Hashed by the restore "
        f"itself: {result['disk_cold_over_memory_hashed']:.1f}x the cold disk restore, "
        f"{result['memory_hashed_speed_over_memcpy']:.2f}x a memcpy."
    )
    return "\n".join(rows)


def main() -> int:
    args = gib_of_weights_arguments(__doc__.split("\n")[0], gib=1.0)
    print_result(measure(args.gib, args.tensors, args.runs), args, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
