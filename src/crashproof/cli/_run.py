"""``crashproof run``'s command line: torchrun's own parser (so every torchrun option keeps its
name and meaning) with crashproof's options added, and the checks made before anything launches.
The launch itself is :func:`crashproof.supervisor.launch.launch`'s.

Defaults that differ from torchrun's, each for recovery speed or diagnosis (docs/supervisor.md):
rendezvous ``c10d`` (on ``localhost``, port chosen free, when one node and no endpoint) and
``--shutdown-timeout 5`` (SIGKILL a trainer 5 s after SIGTERM, not 30 s); the launch adds the
rest (warm forked trainers, every rank's output kept and prefixed).

Imports torch: loaded only for ``crashproof run`` and ``crashproof chaos``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from torch.distributed.run import get_args_parser

from crashproof._console import say
from crashproof._units import DURATION_FORMS
from crashproof.cli._conventions import (
    OneLineParser,
    duration,
    number_above,
    or_auto,
    size,
    whole_number,
)
from crashproof.cli._run_checks import RunOptionError, check_run_args, options_without_effect
from crashproof.supervisor.launch import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_METRICS_PORT,
    DEFAULT_RESTART_WINDOW_S,
    PREEMPTION_PROVIDERS,
    launch,
)

__all__ = ["build_run_parser", "parse_run_args", "run_main"]

_DURATION = f"a duration: {DURATION_FORMS}"


def build_run_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser, with crashproof's options added and a few defaults changed."""
    parser = get_args_parser()
    parser.__class__ = OneLineParser  # the same parser, its errors on one line
    parser.prog = "crashproof run"
    parser.description = (
        "Run a training script like torchrun, and keep it running: detect crashed and hung "
        "ranks, dump their stacks, restart from the newest valid checkpoint, stop crash loops."
    )
    group = parser.add_argument_group("crashproof")
    group.add_argument(
        "--run-dir",
        default=None,
        help="events.jsonl, per-rank logs, heartbeats and stack dumps (default: ./crashproof-runs/<time>)",
    )
    group.add_argument(
        "--hang-timeout",
        type=or_auto(duration()),
        default=None,
        metavar="auto|SECONDS",
        help="how long without a finished step before a rank is hung; 'auto' (default) "
        f"calibrates from the observed step times: 10x the longest step, at least 60 s; or "
        f"{_DURATION}",
    )
    for option, default, allowance in (
        ("--startup-timeout", 600.0, "allowance from start to first step"),
        ("--restore-timeout", 600.0, "allowance for a restore"),
        ("--save-timeout", 600.0, "allowance for a save's blocking part"),
        (
            "--done-timeout",
            120.0,
            "allowance from closing the checkpoint manager to the trainer's exit; a trainer "
            "still there after it is ended (its work is committed) and the run goes on",
        ),
    ):
        group.add_argument(
            option, type=duration(), default=default, help=f"{allowance}; {_DURATION}"
        )
    group.add_argument(
        "--restart-window",
        type=duration(zero_ok=True),
        default=DEFAULT_RESTART_WINDOW_S,
        metavar="SECONDS",
        help=f"--max-restarts counts the restarts of this last span (default 1h): independent "
        f"failures spread over a long run never spend the budget, a burst does; 0: the whole "
        f"run, as torchrun counts; {_DURATION}",
    )
    group.add_argument(
        "--crash-loop-attempts",
        type=whole_number(0),
        default=3,
        help="failed attempts in a row that get no further than the furthest step reached "
        "that stop the run as a crash loop (0: never)",
    )
    group.add_argument(
        "--cold-start",
        action="store_true",
        help="exec a fresh 'python script.py' per trainer (torchrun's way) instead of forking "
        "it from a warm process that already imported torch",
    )
    group.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="also import MODULE in the warm process (repeatable), e.g. a heavy model library",
    )
    group.add_argument(
        "--preemption",
        choices=("auto", *PREEMPTION_PROVIDERS, "none"),
        default="auto",
        help="poll this cloud's metadata service for spot/preemption notices (auto: the cloud "
        "this machine runs on, if any; the base URL can be set with CRASHPROOF_METADATA_URL)",
    )
    group.add_argument(
        "--preemption-grace",
        type=duration(),
        default=30.0,
        metavar="SECONDS",
        help="on a preemption (SIGTERM to this command, or a notice), how long trainers get for "
        f"their emergency checkpoint before SIGKILL; {_DURATION}",
    )
    group.add_argument(
        "--replication-timeout",
        type=duration(),
        default=600.0,
        metavar="SECONDS",
        help="when the run ends, how long to wait for checkpoints still being copied to durable "
        "tiers (CheckpointManager(remote=...)); on a preemption at most --preemption-grace; "
        f"{_DURATION}",
    )
    group.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="keep no snapshots in this agent's memory: trainers restore from storage only (by "
        "default an asynchronous save's staging buffers live in the agent, so a trainer that "
        "crashes resumes from RAM; see docs/recovery.md)",
    )
    copies = group.add_mutually_exclusive_group()
    copies.add_argument(
        "--peer-replicas",
        type=whole_number(0, 8),
        default=None,
        metavar="K",
        help="on several nodes, copy each node's snapshots whole to the next K nodes' agents, so "
        "that losing K nodes loses no snapshot (0: none; by default one copy on two nodes, "
        "parity from three on)",
    )
    copies.add_argument(
        "--peer-parity",
        type=whole_number(1, 16),
        default=None,
        metavar="K",
        help="on several nodes, keep XOR parity of the snapshots in groups of K+1 nodes or more "
        "instead of whole copies: 1/K of a node's snapshots in memory per node or less, and any one "
        "node of a group may be lost (the default from three nodes on, with K up to 4)",
    )
    group.add_argument(
        "--peer-bandwidth",
        type=size(),
        default=None,
        metavar="SIZE",
        help="the most bytes a second this agent sends to its peers in the background (copies "
        "or parity), e.g. 500MiB, so the training's own traffic keeps the network (default: no "
        "limit); snapshots due while theirs is still being sent are skipped, never waited for",
    )
    group.add_argument(
        "--standby",
        type=whole_number(0, 64),
        default=0,
        metavar="N",
        help="the hot spares this run keeps: nodes started with the same command beyond --nnodes' "
        "maximum wait warm in the rendezvous and take a lost node's place at once; the agents "
        "report when fewer than N wait (0: no such check; spares are taken in either way)",
    )
    group.add_argument(
        "--memory-limit",
        type=size(),
        default=None,
        metavar="SIZE",
        help="the most shared memory this agent holds for its trainers' snapshots, e.g. 8GiB "
        "(default: what the host has available, less 256 MiB); a snapshot beyond it fails "
        "with InsufficientMemoryError",
    )
    group.add_argument(
        "--straggler-factor",
        type=number_above(1, "1.3"),
        default=1.3,
        help="report a rank whose work per step exceeds this many times its peers' median",
    )
    group.add_argument(
        "--straggler-steps",
        type=whole_number(1),
        default=20,
        help="over how many recent steps a rank's work per step is averaged for that",
    )
    group.add_argument(
        "--metrics-port",
        type=whole_number(
            -1,
            65535,
            accepted="give a port from 1 to 65535, 0 for any free port, or -1 for no metrics",
        ),
        default=None,
        help=f"serve Prometheus metrics on this port (default {DEFAULT_METRICS_PORT}, or any free "
        "port when another run holds it; 0: any free port; -1: no metrics); the URL is written "
        "to RUN_DIR/metrics_url and the run_start event",
    )
    group.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="the least severe of crashproof's own console lines to show (default info: every "
        "failure, restart and restore, and the summary)",
    )
    group.add_argument(
        "--quiet",
        action="store_true",
        help="only warnings and errors, and a one-line outcome instead of the summary block "
        "(the trainers' own output is shown as ever)",
    )
    group.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the address the metrics are served on (default: loopback only)",
    )
    parser.set_defaults(rdzv_backend="c10d", shutdown_timeout=5, max_restarts=DEFAULT_MAX_RESTARTS)
    _describe_default(
        parser,
        "max_restarts",
        f"restarts after failures per --restart-window "
        f"(default {DEFAULT_MAX_RESTARTS}; torchrun's is 0)",
    )
    return parser


def _describe_default(parser: argparse.ArgumentParser, dest: str, text: str) -> None:
    """Reword the help of a torchrun option whose default crashproof changes."""
    for action in parser._actions:
        if action.dest == dest:
            action.help = text


def run_main(argv: Sequence[str]) -> int:
    """``crashproof run ARGV``: parse, check, launch; a usage error exits 2 (SystemExit)."""
    return launch(parse_run_args(argv))


def parse_run_args(argv: Sequence[str]) -> argparse.Namespace:
    """``crashproof run``'s options, each checked (:mod:`._run_checks`) before anything is
    launched or created; a usage error is one line naming the option and exits 2 (SystemExit)."""
    parser = build_run_parser()
    args = parser.parse_args(argv)
    try:
        check_run_args(args)
    except RunOptionError as exc:
        parser.error(str(exc))
    for note in options_without_effect(args):
        say("crashproof run", note)
    return args
