"""What crashproof takes as available host memory honours the limits a job runs under: a memory
cgroup (v1 or v2, its own or an ancestor's) and the address-space limit, not only the machine's
``MemAvailable``. A restore's read buffer and async staging are sized from it."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from crashproof import _host_memory
from tests.warm_ranks import python

GIB = 1 << 30


def _write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("_", ".", 1)).write_text(text)


def _v1(root: Path, cgroup: str, limit: int, usage: int, inactive: int = 0) -> None:
    _write(
        root / "memory" / cgroup.lstrip("/"),
        memory_limit_in_bytes=f"{limit}\n",
        memory_usage_in_bytes=f"{usage}\n",
        memory_stat=f"cache 5\ntotal_inactive_file {inactive}\nrss 3\n",
    )


def _v2(root: Path, cgroup: str, limit: str, usage: int, inactive: int = 0) -> None:
    _write(
        root / cgroup.lstrip("/"),
        memory_max=f"{limit}\n",
        memory_current=f"{usage}\n",
        memory_stat=f"anon 3\ninactive_file {inactive}\nactive_file 9\n",
    )


def _proc(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cgroup"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_v1_limit_less_what_cannot_be_reclaimed(tmp_path: Path) -> None:
    mount = tmp_path / "sys"
    _v1(mount, "/", limit=2**63 - 4096, usage=0)  # the root: no limit
    _v1(mount, "/job/7", limit=8 * GIB, usage=5 * GIB, inactive=1 * GIB)
    proc = _proc(tmp_path, "9:pids:/\n4:memory:/job/7\n0::/\n")
    assert _host_memory.cgroup_room(proc, str(mount)) == 4 * GIB


def test_an_ancestors_tighter_limit_wins(tmp_path: Path) -> None:
    mount = tmp_path / "sys"
    _v2(mount, "/", limit="max", usage=0)
    _v2(mount, "/slurm", limit=str(3 * GIB), usage=2 * GIB)
    _v2(mount, "/slurm/job_1", limit=str(64 * GIB), usage=1 * GIB)
    proc = _proc(tmp_path, "0::/slurm/job_1\n")
    assert _host_memory.cgroup_room(proc, str(mount)) == 1 * GIB


def test_a_container_mounting_its_own_cgroup_at_the_root(tmp_path: Path) -> None:
    """/proc/self/cgroup names the host's path, which is not under the container's mount."""
    mount = tmp_path / "sys"
    _v1(mount, "/", limit=6 * GIB, usage=2 * GIB, inactive=GIB)
    proc = _proc(tmp_path, "4:memory:/docker/0123abcd\n")
    assert _host_memory.cgroup_room(proc, str(mount)) == 5 * GIB


@pytest.mark.parametrize(
    "proc_text",
    ["", "0::/\n", "garbage\n", "4:cpu,cpuacct:/x\n", "::\n"],
    ids=["empty", "v2-root-no-limit", "garbage", "no-memory-controller", "colons"],
)
def test_no_limit_or_nothing_readable_is_none(tmp_path: Path, proc_text: str) -> None:
    mount = tmp_path / "sys"
    _v2(mount, "/", limit="max", usage=GIB)
    assert _host_memory.cgroup_room(_proc(tmp_path, proc_text), str(mount)) is None


def test_unreadable_or_malformed_files_are_skipped(tmp_path: Path) -> None:
    mount = tmp_path / "sys"
    _v2(mount, "/a", limit="12x", usage=GIB)
    _v2(mount, "/a/b", limit=str(2 * GIB), usage=GIB)
    (mount / "a" / "b" / "memory.stat").write_text("inactive_file nope\n")
    proc = _proc(tmp_path, "0::/a/b\n")
    assert _host_memory.cgroup_room(proc, str(mount)) == GIB
    assert _host_memory.cgroup_room(str(tmp_path / "none"), str(mount)) is None


def test_over_the_limit_is_no_room_not_a_negative_figure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mount = tmp_path / "sys"
    _v2(mount, "/j", limit=str(GIB), usage=2 * GIB)
    proc = _proc(tmp_path, "0::/j\n")
    assert _host_memory.cgroup_room(proc, str(mount)) == -GIB
    monkeypatch.setattr(_host_memory, "cgroup_room", lambda: -GIB)
    assert _host_memory.available_memory_bytes() == 0


_RESTORE_UNDER_A_LIMIT = """
import ctypes, logging, resource, sys
import torch
from torch import nn
import crashproof as cp

logging.disable(logging.WARNING)
root, mode = sys.argv[1], sys.argv[2]

def model(seed):
    torch.manual_seed(seed)
    m = nn.Module()
    m.ps = nn.ParameterList([nn.Parameter(torch.randn(1024, 1024 * 10)) for _ in range(8)])
    return m  # 8 x 40 MiB

if mode == "save":
    with cp.CheckpointManager(root, handle_signals=False, async_save=False) as ck:
        ck.save(1, cp.TrainState(model=model(1)))
    sys.exit(0)
ctypes.CDLL("libc.so.6").mallopt(-8, 1)  # M_ARENA_MAX: as ulimit -v users run (see the test)
live = model(2)
ck = cp.CheckpointManager(root, handle_signals=False, read_only=True)
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
# Room for the read path, not for a second copy of the 320 MiB model (the one-pass buffer).
resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))
assert ck.restore(cp.TrainState(model=live)) == 1
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
assert all(torch.equal(a, b) for a, b in zip(live.parameters(), model(1).parameters()))
print("restored under the limit")
"""


def test_a_restore_under_an_address_space_limit_fits_within_it(tmp_path: Path) -> None:
    """The machine has gigabytes available; the process may allocate 256 MiB more. The default
    restore must size its one-pass buffer from the latter, or allocate a second copy of the
    model past the limit. (One malloc arena: each thread's own reserves 64 MiB of address
    space, which ``ulimit -v`` users set this for.)"""
    script = tmp_path / "restore.py"
    script.write_text(_RESTORE_UNDER_A_LIMIT)
    root = str(tmp_path / "ck")
    saved = python([str(script), root, "save"], timeout=120)
    assert saved.returncode == 0, saved.stderr
    done = python([str(script), root, "restore"], timeout=120)
    assert done.returncode == 0 and "restored under the limit" in done.stdout, (
        done.stdout + done.stderr[-3000:]
    )


def test_the_address_space_room_is_read_from_this_process() -> None:
    code = (
        "import resource; from crashproof import _host_memory as h\n"
        "assert h._address_space_room() is None\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 40, resource.RLIM_INFINITY))\n"
        "room = h._address_space_room(); assert room is not None and 0 < room < 1 << 40\n"
        "assert h.available_memory_bytes() <= room\n"
    )
    done = python(["-c", code], timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_cgroup_name_of_any_bytes_and_odd_limits(tmp_path: Path) -> None:
    """The kernel takes any byte but "/" in a cgroup's name; a limit of -1 is no limit."""
    mount = tmp_path / "sys"
    odd = os.fsdecode(b"/job-\xff\xe9")
    _v2(mount, odd, limit=str(2 * GIB), usage=GIB)
    proc = tmp_path / "cgroup"
    proc.write_bytes(b"0::/job-\xff\xe9\n")
    assert _host_memory.cgroup_room(str(proc), str(mount)) == GIB
    _v2(mount, odd, limit="-1", usage=GIB)
    assert _host_memory.cgroup_room(str(proc), str(mount)) is None
