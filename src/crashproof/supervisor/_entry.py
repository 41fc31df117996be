"""How a trainer starts from a warm process: run the user's script as ``python script.py`` would.

``crashproof run`` forks each trainer from a forkserver that imported torch and crashproof once,
so a restart pays for neither import (about a second each on a small machine). The forked child
calls :func:`run_script`, which makes the process look like a fresh ``python script.py args``
(``sys.argv``, ``sys.path[0]``, ``__main__``) and runs the script. ``--cold-start`` skips all this
and execs ``python -u script.py`` per trainer, the way torchrun does.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import signal
import sys
import traceback

# Imported here so the forkserver, which preloads this module, holds them warm for every trainer.
import torch
import torch.distributed
import torch.nn.parallel

import crashproof  # noqa: F401

# The first DistributedDataParallel of a process imports torch._dynamo (and sympy, some 800
# modules): 1-1.5 s of every restart on a small machine, the largest part left after torch.
with contextlib.suppress(ImportError):  # a torch built without it
    import torch._dynamo
from crashproof.link import attach_to_supervisor, script_returned
from crashproof.supervisor._seed import python_default

__all__ = ["FORKSERVER_IGNORES", "run_script"]

FORKSERVER_IGNORES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
"""Ignored by the warm forkserver (:mod:`crashproof.supervisor._forkserver`), restored here."""


_SCRIPT_LEFT: list[object] = []
"""What the script leaves: its globals (or the traceback of how it ended, whose frames hold them),
kept until the process ends. python tears ``__main__``'s globals down only after the exit handlers,
as it finalizes, when no other thread can take the GIL any more. Torn down earlier, while the
interpreter runs, a DDP model's gloo process group is destroyed by a thread holding the GIL and
joins gloo's own threads, one of which may be waiting for the GIL to drop a Python object: the
trainer hung after its script had finished."""


def run_script(kind: str, target: str, *argv: str) -> None:
    """Run ``target`` (``kind`` "script": a path; "module": a module name) as ``__main__``.

    ``sys.exit(0)`` counts as success (the elastic agent would otherwise wait for a return value
    that never comes); any other exit code is the trainer's failure, as for ``python script.py``.
    ``atexit`` handlers run as at a normal interpreter exit.
    """
    is_module = kind == "module"
    # A forkserver child inherits "forkserver" as its default start method; a fresh interpreter
    # has the platform's default. Without this, a DataLoader's workers would come from a new
    # forkserver of the trainer's, and outlive the trainer when it is killed.
    multiprocessing.set_start_method(None, force=True)
    _drop_forkserver_pipe()
    _signals_as_an_exec_gives_them()
    _fresh_randomness()
    attach_to_supervisor()
    sys.argv = [target, *argv]
    sys.path[0] = "" if is_module else os.path.dirname(os.path.abspath(target))
    trainer = os.getpid()
    try:
        try:
            if is_module:
                _SCRIPT_LEFT.append(runpy.run_module(target, run_name="__main__", alter_sys=True))
            else:
                _SCRIPT_LEFT.append(runpy.run_path(target, run_name="__main__"))
        except SystemExit as exc:
            _SCRIPT_LEFT.append(exc.__traceback__)  # (its frames hold the script's globals)
            if os.getpid() != trainer:
                _end_forked_child(exc.code)
            if exc.code not in (None, 0):
                raise
        except KeyboardInterrupt:
            # torch's wrapper would take it for its own stop and exit 0 without a result (the
            # run then waited for ever); python dies of SIGINT, and so does this trainer.
            traceback.print_exc()
            _exit_as_python(signal.SIGINT)
        except BaseException as exc:
            _SCRIPT_LEFT.append(exc.__traceback__)
            if os.getpid() != trainer:  # a forked child's error: python prints it, exits 1
                traceback.print_exc()
                _exit_as_python(None, 1)
            raise
        if os.getpid() != trainer:  # a child the script forked ran off the end of the script
            _end_forked_child(None)
    finally:
        atexit._run_exitfuncs()
        _flush()
    # Reached only when the script ended normally: from here the process waits for torch.
    script_returned()


def _end_forked_child(code: object) -> None:
    """End a process the script forked that left the script (``sys.exit`` in the child, or the
    end of the script): as under ``python script.py``, its exit handlers run and it exits with
    its code. Returning further would hand torch a result in the trainer's name, and the
    agent would take the trainer for finished."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    _exit_as_python(None, code or 0)


def _signals_as_an_exec_gives_them() -> None:
    """The dispositions a trainer torch's agent exec'd would start with: the signals the warm
    forkserver ignores (:data:`FORKSERVER_IGNORES`) at their default, and so the signals torch's
    agent handles (``TORCHELASTIC_SIGNALS_TO_HANDLE``: SIGTERM, SIGINT, SIGHUP, SIGQUIT), from
    just before it starts its trainers: an exec resets them, with python's own SIGINT handler,
    even when the launcher was started with SIGINT ignored (a shell's background job). The warm
    forkserver started earlier, ignoring what the launcher ignored then."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    handled = {getattr(signal, name.strip(), None) for name in names.split(",")}
    for sig in {*FORKSERVER_IGNORES, *(s for s in handled if isinstance(s, signal.Signals))}:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, python_default(sig))


def _exit_as_python(sig: signal.Signals | None, code: int = 0) -> None:
    """Run the exit handlers, flush, and end the process now: by ``sig`` (with its default
    action, as python does for an uncaught KeyboardInterrupt) or with ``code``."""
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    _flush()
    if sig is not None:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(code & 0xFF)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _drop_forkserver_pipe() -> None:
    """Close this trainer's copy of the write end of the forkserver's "alive" pipe.

    multiprocessing hands it to every child of the forkserver; the forkserver exits when the last
    copy closes. Held by the trainers, it kept the forkserver (and so the trainers, which die
    with it) alive after the agent was SIGKILLed.
    """
    import multiprocessing.forkserver

    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        setattr(server, "_forkserver_alive_fd", None)  # noqa: B010  (not in the stubs)


def _fresh_randomness() -> None:
    """Seed torch and NumPy from the OS, as a fresh interpreter does.

    Forked children share the forkserver's generator states: without this every rank (and every
    restart) would start from the same unseeded torch and NumPy state, e.g. the same dropout
    masks on every rank of a script that never seeds. Python's ``random`` reseeds itself at fork.
    """
    torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
