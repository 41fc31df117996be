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

The same zygote also runs single programs, as ``python ARGS`` would (a script, ``-m module`` or
``-c code``, the ``crashproof`` command being ``-m crashproof.cli``): :func:`python` is
``subprocess.run`` for the tests that start many short programs (each CLI command a test runs
would otherwise import torch again, 1.5 s of CPU). The child is a real process with the
environment, working directory, stdin, stdout, stderr and exit code the test gives and reads;
only the interpreter's start-up is shared. Tests that are about start-up itself (the console
script, ``torchrun``, ``crashproof run --cold-start``, another user's process) start fresh
interpreters.

Run as a program, this module is the zygote: it reads one launch per line on stdin (JSON) and
answers on stdout with each rank's exit code.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
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
        out = self._next_file("launch", ".log")
        # (The test's environment now, as torchrun would pass it on: not the zygote's, which is
        # the environment of whichever test started it.)
        request = {"script": str(script), "args": args, "nproc": nproc, "port": free_port(),
                   "out": str(out), "cwd": os.getcwd(), "env": dict(os.environ)}  # fmt: skip
        try:
            codes = self._ask(request, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{script} did not finish within {timeout} s:\n{_tail(out)}"
            ) from None
        except ChildProcessError:
            raise AssertionError(
                f"the warm zygote died launching {script}:\n{_tail(out)}"
            ) from None
        return Launch(out.read_text(errors="replace"), codes)

    def python(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        input: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``, in a
        process forked from the zygote; raises ``subprocess.TimeoutExpired`` as that would."""
        out, err = self._next_file("out", ".txt"), self._next_file("err", ".txt")
        stdin = self._next_file("in", ".txt")
        stdin.write_text(input or "")
        request = {"python": argv, "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or os.getcwd()), "out": str(out), "err": str(err),
                   "stdin": str(stdin)}  # fmt: skip
        try:
            (code,) = self._ask(request, timeout)
        except ChildProcessError:
            raise AssertionError(
                f"the warm zygote died running python {argv}:\n{_tail(err)}"
            ) from None
        finally:
            stdin.unlink()
        said = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        return subprocess.CompletedProcess([sys.executable, *argv], code, *said)

    def _next_file(self, name: str, suffix: str) -> Path:
        self._launches += 1
        return self._scratch / f"{name}{self._launches}{suffix}"

    def _ask(self, request: dict[str, Any], timeout: float) -> list[int]:
        """Send one request; the exit codes it answers. On a timeout the zygote and everything
        it forked are ended (the next request starts a new one)."""
        zygote = self._start()
        assert zygote.stdin is not None and zygote.stdout is not None
        zygote.stdin.write(json.dumps(request) + "\n")
        zygote.stdin.flush()
        ready, _, _ = select.select([zygote.stdout], [], [], timeout)
        if not ready:
            self.close()  # ends the zygote and every process it forked (one process group)
            raise subprocess.TimeoutExpired(request.get("python") or request["script"], timeout)
        answer = zygote.stdout.readline()
        if not answer:
            self.close()
            raise ChildProcessError("the zygote died")
        return [int(code) for code in json.loads(answer)["exit_codes"]]

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

    import crashproof.cli
    import crashproof.supervisor._entry  # noqa: F401
    from crashproof.link import die_with_parent

    for optional in ("fsspec", "s3fs", "tqdm"):  # what the CLI's storage and bars import
        with contextlib.suppress(ImportError):
            __import__(optional)

    die_with_parent()  # the test worker that started it
    for line in iter(sys.stdin.readline, ""):
        request = json.loads(line)
        codes = [_run_python(request)] if "python" in request else _launch(request)
        sys.stdout.write(json.dumps({"exit_codes": codes}) + "\n")
        sys.stdout.flush()


def _launch(request: dict[str, Any]) -> list[int]:
    nproc = int(request["nproc"])
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
    return _fork(request["cwd"], lambda: _rank(request, rank, nproc))


def _rank(request: dict[str, Any], rank: int, nproc: int) -> int:
    """In the forked child: become rank ``rank`` of ``nproc`` and run the script."""
    fd = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stdin.close()
    os.environ.clear()
    os.environ.update(request["env"])
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
    return 0


def _run_python(request: dict[str, Any]) -> int:
    pid = _fork(request["cwd"], lambda: _python(request))
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _python(request: dict[str, Any]) -> int:
    """In the forked child: the streams and environment the test gave, then ``python ARGV``."""
    for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "out", os.O_WRONLY),
                            (2, "err", os.O_WRONLY)):  # fmt: skip
        opened = os.open(request[name], flags | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    # unbuffered, as under PYTHONUNBUFFERED: a program ending in os._exit loses nothing
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), errors="backslashreplace", write_through=True
    )
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    os.environ.clear()
    os.environ.update(request["env"])
    return _as_python(request["python"])


def _fork(cwd: str, run: Callable[[], int]) -> int:
    """Fork a child of the zygote that dies with it, works in ``cwd`` and exits with what
    ``run`` returns (or ``sys.exit``'s status, or 1 with the traceback of an exception);
    returns its pid."""
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        from crashproof.link import die_with_parent

        die_with_parent()  # the zygote
        os.chdir(cwd)
        code = run()
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _as_python(argv: list[str]) -> int:
    """Run ``python ARGV``: a script, ``-m module ARGS`` or ``-c code ARGS``."""
    from crashproof.supervisor._entry import run_script

    if argv[0] == "-m":
        run_script("module", argv[1], *argv[2:])
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        try:
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        finally:
            atexit._run_exitfuncs()
    else:
        run_script("script", argv[0], *argv[1:])
    return 0


def _exit_status(code: object) -> int:
    """The exit status of ``sys.exit(code)``, as the interpreter sets it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


_shared: WarmRanks | None = None


def python(
    argv: list[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    input: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """:meth:`WarmRanks.python` on this test worker's shared zygote (ended when it exits)."""
    global _shared
    if _shared is None:
        scratch = Path(tempfile.mkdtemp(prefix="warm-python-"))
        _shared = WarmRanks(scratch)
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        atexit.register(_shared.close)
    return _shared.python(argv, env=env, cwd=cwd, input=input, timeout=timeout)


def crashproof_cli(
    *args: str | Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """The ``crashproof`` command with ``args``, as a process (:func:`python`)."""
    return python(["-m", "crashproof.cli", *map(str, args)], env=env, cwd=cwd, timeout=timeout)


if __name__ == "__main__":
    _serve()
