"""Ranks of a gloo job forked from one warm process, for the tests that start many small jobs.

``torchrun --standalone --nproc-per-node N script.py`` starts N + 1 fresh interpreters; each
imports torch, torch.distributed and crashproof and, at its first optimizer, torch._dynamo:
3 to 4 s of CPU per rank on a small machine before the script does anything. The sharded and
resharding tests start some 30 such ranks. Here a "zygote" process imports all of it once per
test worker; each launch forks the ranks from it. Each rank is still a real process of a real
gloo job: it gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, one OpenMP thread), runs the script as ``python script.py ARGS``
would (:func:`crashproof.supervisor._entry.run_script`, as ``crashproof run`` starts its
trainers), and, as under torchrun, the others are killed once one fails. Launching itself is
tested with torchrun and ``crashproof run`` elsewhere.

Run as a program, this module is the zygote: it reads one launch per line on stdin (JSON) and
answers on stdout with each rank's exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import free_port


@dataclass(frozen=True)
class Launch:
    """What one launch printed (every rank's stdout and stderr, interleaved by line) and how each
    rank ended (exit code, or minus the signal that ended it)."""

    output: str
    exit_codes: list[int]

    @property
    def returncode(self) -> int:
        """0 when every rank succeeded, else the first failure's code (as torchrun reports)."""
        return next((code for code in self.exit_codes if code != 0), 0)


class WarmRanks:
    """Launches ``nproc`` ranks of a script as forks of one warm zygote (started on first use)."""

    def __init__(self, scratch: Path) -> None:
        self._scratch = scratch
        self._zygote: subprocess.Popen[str] | None = None
        self._launches = 0

    def run(self, script: Path, args: list[str], *, nproc: int, timeout: float = 240) -> Launch:
        zygote = self._start()
        assert zygote.stdin is not None and zygote.stdout is not None
        self._launches += 1
        out = self._scratch / f"launch{self._launches}.log"
        request = {"script": str(script), "args": args, "nproc": nproc, "port": free_port(),
                   "out": str(out), "cwd": os.getcwd()}  # fmt: skip
        zygote.stdin.write(json.dumps(request) + "\n")
        zygote.stdin.flush()
        ready, _, _ = select.select([zygote.stdout], [], [], timeout)
        if not ready:
            self.close()  # ends the zygote and every rank it forked (one process group)
            raise AssertionError(f"{script} did not finish within {timeout} s:\n{_tail(out)}")
        answer = zygote.stdout.readline()
        if not answer:
            self.close()
            raise AssertionError(f"the warm zygote died launching {script}:\n{_tail(out)}")
        codes = json.loads(answer)["exit_codes"]
        return Launch(out.read_text(errors="replace"), [int(code) for code in codes])

    def close(self) -> None:
        if self._zygote is None:
            return
        if self._zygote.poll() is None:
            os.killpg(self._zygote.pid, signal.SIGKILL)
        self._zygote.wait()
        for stream in (self._zygote.stdin, self._zygote.stdout):
            if stream is not None:
                stream.close()
        self._zygote = None

    def _start(self) -> subprocess.Popen[str]:
        if self._zygote is None or self._zygote.poll() is not None:
            self._zygote = subprocess.Popen(
                [sys.executable, "-m", "tests.warm_ranks"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=Path(__file__).resolve().parent.parent,
                start_new_session=True,  # its own process group: close() ends every rank
            )
        return self._zygote


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no output)"


# --- the zygote -----------------------------------------------------------------------------


def _serve() -> None:
    # Everything the ranks import, once; torch._dynamo is what an optimizer's first
    # add_param_group imports. No computation here: forking stays safe (no thread pool yet).
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch
    import torch._dynamo
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp
    import torch.nn.parallel  # noqa: F401

    import crashproof.supervisor._entry  # noqa: F401
    from crashproof.link import die_with_parent

    die_with_parent()  # the test worker that started it
    for line in iter(sys.stdin.readline, ""):
        request = json.loads(line)
        codes = _launch(request)
        sys.stdout.write(json.dumps({"exit_codes": codes}) + "\n")
        sys.stdout.flush()


def _launch(request: dict[str, Any]) -> list[int]:
    nproc = int(request["nproc"])
    sys.stdout.flush()
    pids = [_fork_rank(request, rank, nproc) for rank in range(nproc)]
    codes: dict[int, int] = {}
    while len(codes) < nproc:
        pid, status = os.wait()
        if pid not in pids:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:  # as torchrun does: one rank failed, the others cannot go on
            time.sleep(0.2)  # a moment for the others' own error lines
            for other in pids:
                if other not in codes:
                    _kill(other)
    return [codes[pid] for pid in pids]


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _fork_rank(request: dict[str, Any], rank: int, nproc: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        from crashproof.link import die_with_parent

        die_with_parent()  # the zygote
        os.chdir(request["cwd"])
        fd = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stdin.close()
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
            WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]),
            TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID="warm-ranks", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        )  # fmt: skip
        import torch

        if nproc > 1:
            torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1, read before any op here
        from crashproof.supervisor._entry import run_script

        run_script("script", request["script"], *request["args"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve()
