"""What does keeping a node's snapshots safe on its peers cost in memory, and how long does it take
to cover a snapshot and to rebuild a lost node's: XOR parity against whole copies.

Each simulated node is a process of its own on this machine: a memory host with its peer
replication, as ``crashproof run``'s agent runs it, and one rank that commits ``--mb`` MB of
random bytes as a snapshot (over the same socket a trainer uses). The nodes meet in a TCP store
as in a c10d rendezvous. Once every node's snapshot is covered (copied, or in parity), each node
measures what it holds: the shared memory of its segments and copies (memfd sizes) plus the growth
of its private memory (RssAnon: the parity buffers), divided by its own snapshot's size. Then node
1 is lost: a new node process takes its place, its rank asks for its snapshot, and the time to
copy or rebuild it is measured, and its bytes compared with the lost node's.

    .venv/bin/python benchmarks/peer_memory.py --nodes 3 5 --mb 256 --runs 3 --markdown
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import mmap
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

KEY = "benchmarkbench01"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _memfd_bytes() -> int:
    """The sizes of the memfd segments this process holds open."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:crashproof"):
                total += os.fstat(int(fd)).st_size
        except OSError:
            continue
    return total


_BLOCK = 64 << 20


def _payload(rank: int, nbytes: int) -> Any:
    """Rank ``rank``'s snapshot bytes, block by block (no second copy of them in memory)."""
    rng = np.random.default_rng(rank)
    for start in range(0, nbytes, _BLOCK):
        yield rng.bytes(min(_BLOCK, nbytes - start))


def _fill(view: Any, rank: int, nbytes: int) -> None:
    pos = 0
    for block in _payload(rank, nbytes):
        view[pos : pos + len(block)] = block
        pos += len(block)


def _same(view: Any, rank: int, nbytes: int) -> bool:
    pos = 0
    for block in _payload(rank, nbytes):
        if view[pos : pos + len(block)] != block:
            return False
        pos += len(block)
    return True


def _node(
    index: int,
    nodes: int,
    port: int,
    scheme: dict[str, Any],
    nbytes: int,
    round_number: int,
    commit: bool,
    out: Any,
    events: tuple[Any, Any],
) -> None:
    """One node: its memory host joins round ``round_number``; with ``commit``, its rank
    commits a snapshot and the node reports what it holds once covered, then joins the next
    round when told (a survivor); else it asks for the snapshot it lacks (the replacement)."""
    import logging

    import torch.distributed as dist

    from crashproof.link import MemoryClient
    from crashproof.supervisor._memory_host import MemoryHost
    from crashproof.telemetry import EventLog

    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (kill -USR1: where it waits)
    directory = tempfile.mkdtemp()
    host = MemoryHost(EventLog(Path(directory) / "events.jsonl"))
    host.replicate_to_peers(scheme.get("replicas"), "127.0.0.1", parity=scheme.get("parity"))
    assert host.peers is not None
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    host.peers.join_round(dist.PrefixStore(f"round{round_number}", store), index, nodes, [index])
    client = MemoryClient(host.address)
    ids = {"key": KEY, "rank": index, "world_size": nodes, "slot": 0}
    result: dict[str, Any] = {"node": index}
    if commit:
        reply, fds = client.request({"op": "allocate", **ids, "nbytes": nbytes})
        with mmap.mmap(fds[0], nbytes) as mm:
            os.close(fds[0])
            client.request({"op": "invalidate", **ids})
            _fill(mm, index, nbytes)
        files = {"files": {}, "shard": [0, nbytes], "path": "step_10"}
        anon_before = _status_kib("RssAnon")
        started = time.perf_counter()
        client.request({"op": "commit", **ids, "step": 10, "files": files})
        while host._pinned.get(KEY) != 10:
            if time.perf_counter() - started > 300:
                raise RuntimeError("the snapshot was not covered in 300 s (see the log)")
            time.sleep(0.005)
        result["cover_s"] = time.perf_counter() - started
        time.sleep(0.5)  # (the other nodes finish covering too)
        held = _memfd_bytes() + max(0, _status_kib("RssAnon") - anon_before) * 1024
        result["ratio"] = held / nbytes
        result["parity_bytes"] = host.peers.holder.nbytes
    else:  # a replacement: its rank asks for the snapshot it does not have
        started = time.perf_counter()
        reply, fds = client.request({"op": "hello", "key": KEY, "rank": index,
                                     "world_size": nodes})  # fmt: skip
        result["restore_s"] = time.perf_counter() - started
        slots = [s for s in reply["slots"] if s["step"] is not None]
        result["origin"] = slots[0]["origin"] if slots else None
        result["exact"] = False
        for info, fd in zip(reply["slots"], fds, strict=False):
            if info["step"] == 10:
                with mmap.mmap(fd, info["nbytes"], mmap.MAP_SHARED, mmap.PROT_READ) as mm:
                    result["exact"] = _same(mm, index, nbytes)
            os.close(fd)
    out.put(result)
    rejoin, stop = events
    if commit:
        rejoin.wait()
        host.peers.join_round(
            dist.PrefixStore(f"round{round_number + 1}", store), index, nodes, [index]
        )
    stop.wait()
    client.close()
    host.close()


def _run(nodes: int, scheme: dict[str, Any], nbytes: int) -> dict[str, Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))  # fmt: skip
    ctx = mp.get_context("spawn")
    # (An event per node: a process killed while it waits on a shared one would leave the
    # others' wake-up hanging.)
    out, stop = ctx.Queue(), ctx.Event()
    rejoin = [ctx.Event() for _ in range(nodes)]
    procs = [
        ctx.Process(
            target=_node,
            args=(i, nodes, store.port, scheme, nbytes, 0, True, out, (rejoin[i], stop)),
        )
        for i in range(nodes)
    ]
    for p in procs:
        p.start()
    first = [out.get(timeout=600) for _ in procs]
    procs[1].kill()  # node 1 is lost, all at once
    procs[1].join()
    # The survivors join a new round with the replacement, as their agents would. (A queue of
    # its own: the node killed may have died holding the first one's lock.)
    out = ctx.Queue()
    replacement = ctx.Process(
        target=_node, args=(1, nodes, store.port, scheme, nbytes, 1, False, out, (None, stop))
    )
    replacement.start()
    for i, event in enumerate(rejoin):
        if i != 1:
            event.set()
    second = out.get(timeout=600)
    stop.set()
    for p in [*procs, replacement]:
        p.join(30)
        if p.is_alive():
            p.kill()
    return {
        "ratio": statistics.median(r["ratio"] for r in first),
        "cover_s": max(r["cover_s"] for r in first),
        "restore_s": second["restore_s"],
        "origin": second["origin"],
        "exact": second["exact"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--mb", type=int, default=256, help="each node's snapshot")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = []
    for nodes in args.nodes:
        for name, scheme in [("parity", {}), ("copies", {"replicas": 1})]:
            runs = [_run(nodes, scheme, args.mb << 20) for _ in range(args.runs)]
            row = {
                "nodes": nodes,
                "scheme": name,
                "memory_ratio": statistics.median(r["ratio"] for r in runs),
                "cover_s": statistics.median(r["cover_s"] for r in runs),
                "rebuild_s": statistics.median(r["restore_s"] for r in runs),
                "exact": all(r["exact"] for r in runs),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.markdown:
        print("\n| nodes | scheme | memory per node / its state | commit -> covered | lost node's "
              "snapshot back | byte-identical |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['nodes']} | {r['scheme']} | {r['memory_ratio']:.3f}x | "
                  f"{r['cover_s']:.2f} s | {r['rebuild_s']:.2f} s | {r['exact']} |")  # fmt: skip


if __name__ == "__main__":
    main()
