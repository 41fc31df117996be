"""The ``crashproof`` command line: run training under supervision; look at, check, prune and
export checkpoints; report, plan and test a run's resilience.

One module per command group, each registering its parser and the function it dispatches to:
``_run`` (``crashproof run``: torchrun's parser, launched by :mod:`crashproof.supervisor.launch`,
whose docstring lists its exit codes), ``_checkpoints`` (``ls``, ``verify``, ``inspect``),
``_prune``, ``_export``, ``_import``, ``_report``, ``_plan``, ``_chaos``; ``_conventions`` and
``_roots`` hold what they share. This is the top layer: it may import every part, and nothing imports it.

Exit codes of the rest (README "Command line" has the table):

- 0 success (and, for ``verify``, everything checked is valid);
- 1 a checkpoint is invalid (``verify``, ``inspect``, ``export``), a campaign failed (``chaos``);
- 2 a usage error, or nothing to act on (no such root or step, a root that is a file or a run
  directory, an output path an export must not write);
- 74 the storage could not be read or written (no credentials, no such bucket, permission, an
  I/O error; a checkpoint file the storage refuses is this, never "invalid"), an output
  (``export -o``, ``report --html``) could not be written, or ``prune`` on a root whose writer
  holds its lock;
- 70 an internal error (a bug: ``-v`` shows the traceback); 130 interrupted (Ctrl-C).

Every failure is one line on stderr, ``crashproof: <what>: <why>; <what to do>``, naming the
argument or path it is about (control characters in it escaped: :mod:`crashproof._console`);
never a traceback.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from collections.abc import Sequence

from crashproof._version import __version__
from crashproof.cli._chaos import add_chaos_parser
from crashproof.cli._checkpoints import add_checkpoint_parsers
from crashproof.cli._conventions import OneLineParser, fail
from crashproof.cli._export import add_export_parser
from crashproof.cli._import import add_import_parser
from crashproof.cli._plan import add_plan_parser
from crashproof.cli._prune import add_prune_parser
from crashproof.cli._report import add_report_parser
from crashproof.errors import CrashproofError
from crashproof.exitcodes import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
)

__all__ = ["main"]


log = logging.getLogger("crashproof.cli")

_STORAGE_MODULES = ("botocore", "aiobotocore", "boto3", "s3fs", "gcsfs", "adlfs", "fsspec",
                    "google", "azure", "aiohttp", "urllib3", "requests")  # fmt: skip
"""Packages whose exceptions, reaching the command line, mean the storage is out of reach."""


def build_parser() -> argparse.ArgumentParser:
    """``crashproof``'s parser, every subcommand on it but ``run`` (:func:`main` hands that to
    torchrun's parser)."""
    parser = OneLineParser(
        prog="crashproof", description="Fault-tolerant PyTorch training: checkpoint tools."
    )
    parser.add_argument("--version", action="version", version=f"crashproof {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what crashproof does")
    # Of OneLineParser too (one-line errors); typed as the plain class the add_*_parser hooks take.
    sub: argparse._SubParsersAction[argparse.ArgumentParser] = parser.add_subparsers(
        dest="command", required=True, parser_class=OneLineParser
    )
    # Listed for --help only: main() hands `run` to torchrun's parser before this one runs.
    sub.add_parser(
        "run", help="run a training script like torchrun, restarting it on failures", add_help=False
    )
    add_checkpoint_parsers(sub)
    add_prune_parser(sub)
    add_export_parser(sub)
    add_import_parser(sub)
    add_plan_parser(sub)
    add_report_parser(sub)
    add_chaos_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # torchrun's own option parser (and torch): only for `run`
        from crashproof.cli._run import run_main

        try:  # a supervisor must outlive a closed pipe: SIGPIPE stays ignored
            return run_main(argv[1:])
        except SystemExit as exc:  # its usage errors: said already, in one line
            return _exit_code(exc.code)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except Exception as exc:  # what the checks could not foresee (a disk failing): one line
            return _unexpected("run", "run", exc, traceback_by="run --log-level debug")
    # Die quietly when piped into `head`, like other Unix tools.
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # a usage error (one line, said already), --help, --version
        return _exit_code(exc.code)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    hook, sys.unraisablehook = sys.unraisablehook, _log_unraisable
    succeeded = False
    try:
        code: int = args.func(args)
        succeeded = True
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (CrashproofError, ValueError) as exc:
        return fail(str(exc), EXIT_USAGE)
    except Exception as exc:
        return _unexpected(args.command, _subject(args), exc)
    finally:
        if not succeeded:  # what a failed storage client left half-made is finalized quietly
            gc.collect(1)  # here; young objects only (a full collection with torch loaded
            # takes a tenth of a second, and in-process callers pay it at every call)
        sys.unraisablehook = hook
    return code


def _log_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """An error in a finalizer (a storage client half-made by a bad URI cleaning up): for
    ``-v``, not a traceback among the command's one line."""
    log.info("ignored in %r", unraisable.object, exc_info=unraisable.exc_value)


def _exit_code(code: object) -> int:
    if code is None:
        return EXIT_OK
    if isinstance(code, int):
        return code
    return fail(str(code), EXIT_USAGE)


def _raised_in_storage_code(exc: BaseException) -> bool:
    """``exc`` was raised by a storage client's own code (fsspec, an SDK), not crashproof's."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", "")) if tb is not None else ""
    return module.split(".")[0] in _STORAGE_MODULES


def _subject(args: argparse.Namespace) -> str:
    """What a command's failure is about: its root, run directory or output, or the command."""
    return next(
        (str(v) for k in ("root", "run_dir", "output", "dir") if (v := getattr(args, k, None))),
        str(args.command),
    )


def _unexpected(command: str, subject: str, exc: Exception, traceback_by: str = "-v") -> int:
    """An exception no command turned into a message: the storage's, or a bug. Its traceback
    is logged for the option ``traceback_by`` (``-v``; ``run``'s ``--log-level debug``)."""
    what = f"{type(exc).__name__}: {exc}".strip().rstrip(":").replace("\n", " ")
    level = logging.INFO if traceback_by == "-v" else logging.DEBUG
    log.log(level, "%s failed", command, exc_info=exc)
    storage_error = type(exc).__module__.split(".")[0] in _STORAGE_MODULES
    if not isinstance(exc, OSError) and not storage_error and _raised_in_storage_code(exc):
        # A built-in error from a storage client's code: it refused what it was given, the URI.
        return fail(
            f"{subject}: crashproof cannot use this storage URI ({what}); give a local path or an "
            "object-store URI such as s3://BUCKET/PATH",
            EXIT_USAGE,
        )
    if isinstance(exc, OSError) or storage_error:
        remote = "://" in subject and not subject.lower().startswith(("file:", "local:"))
        return fail(
            f"{subject}: cannot read or write the storage ({what}); check that it exists, "
            + ("the credentials (for S3: AWS_* variables, ~/.aws) and " if remote else "")
            + "the permissions",
            EXIT_STORAGE,
        )
    return fail(
        f"{command} {subject}: internal error ({what}); please report it, with the "
        f"traceback `crashproof {traceback_by}` prints",
        EXIT_INTERNAL,
    )
