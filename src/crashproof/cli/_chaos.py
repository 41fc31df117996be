"""``crashproof chaos [options] -- <crashproof run arguments>``: the campaign's options, and the
``crashproof run`` arguments parsed by ``run``'s own parser; the campaign itself is
:func:`crashproof.chaos.run_campaign`'s.
"""

from __future__ import annotations

import argparse
import os

from crashproof._console import say
from crashproof._units import DURATION_FORMS
from crashproof.chaos import KINDS, RUN_PLACEHOLDER, CampaignOptions, RunOptions, run_campaign
from crashproof.cli._conventions import duration
from crashproof.exitcodes import EXIT_USAGE

__all__ = ["add_chaos_parser", "run_chaos"]


def add_chaos_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``chaos`` on ``crashproof``'s subcommands; it dispatches through ``func``."""
    p = subparsers.add_parser(
        "chaos",
        help="inject seeded faults into a `crashproof run` job and check it recovers",
        description="Launch `crashproof run` with the arguments after `--`, inject faults (kill, "
        "hang, nan, corrupt, storage, straggler) on a seeded schedule, and report for each "
        "whether it was detected and recovered from, and the work it cost. `{run}` in the "
        "arguments stands for the run's directory. Exit 0: every fault detected and recovered "
        "(and the baseline matched), 1: not, 2: usage error. Durations (SECONDS, and at= and "
        f"*_s= in a fault) are {DURATION_FORMS}. See docs/chaos.md.",
    )
    p.add_argument("--seed", type=int, default=0, help="the same seed draws the same schedule")
    p.add_argument("--mtbf", type=duration(), metavar="SECONDS",
                   help="mean time between faults: exponential inter-arrival times")  # fmt: skip
    p.add_argument("--duration", type=duration(), metavar="SECONDS",
                   help="with --mtbf: no faults after this long; the run is then left to finish")  # fmt: skip
    p.add_argument("--faults", default=",".join(KINDS), metavar="KIND,...",
                   help=f"with --mtbf: the kinds drawn from, uniformly (default {','.join(KINDS)})")  # fmt: skip
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help='one fault, e.g. "at=30s,rank=1,kind=kill" or "at=step:120,rank=0,kind=nan" '
        "(repeatable, injected in the order given)",
    )
    p.add_argument("--dir", metavar="DIR",
                   help="the campaign's directory (default ./crashproof-chaos/<time>-<pid>); "
                        "{run} is DIR/run, the baseline's DIR/baseline")  # fmt: skip
    p.add_argument(
        "--report", metavar="PATH", help="the JSON report (default RUN_DIR/chaos_report.json)"
    )
    p.add_argument("--compare-baseline", action="store_true",
                   help="also run without faults and compare the final checkpoints bit for bit")  # fmt: skip
    p.add_argument("--resolve-timeout", type=duration(), default=300.0, metavar="SECONDS",
                   help="how long to wait for a fault's detection and recovery (default 300)")  # fmt: skip
    p.add_argument("--timeout", type=duration(), default=None, metavar="SECONDS",
                   help="stop each run after this long (default: no limit)")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="replace an earlier campaign's report at --report (nothing else)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress bar (it shows only on a terminal anyway)")  # fmt: skip
    p.add_argument("run_args", nargs=argparse.REMAINDER, metavar="-- RUN_ARGS")
    p.set_defaults(func=run_chaos)
    return p


def run_chaos(args: argparse.Namespace) -> int:
    """``crashproof chaos``: parse the ``crashproof run`` arguments, then run the campaign."""
    run_args = list(args.run_args)
    if run_args[:1] == ["--"]:
        run_args = run_args[1:]
    if not run_args:
        return _usage(
            "give the `crashproof run` arguments after --, e.g. -- --nproc-per-node 2 train.py "
            f"--run-dir {RUN_PLACEHOLDER}"
        )
    from crashproof.cli._run import build_run_parser, parse_run_args  # torch: only when needed

    # Every option of the run checked as `crashproof run` checks it, before anything is made:
    # {run} stands for a directory under --dir, whose own checks follow in the campaign.
    where = os.path.join(os.path.abspath(args.dir or "crashproof-chaos"), "run")
    try:
        # The campaign's default --run-dir first: one given in run_args comes later and wins.
        parse_run_args([a.replace(RUN_PLACEHOLDER, where) for a in ["--run-dir", where, *run_args]])
    except SystemExit as exc:  # its one line is said already
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    run = build_run_parser().parse_args(run_args)  # as given: {run} is the campaign's to place
    options = CampaignOptions(
        seed=args.seed,
        faults=list(args.fault),
        mtbf_s=args.mtbf,
        duration_s=args.duration,
        kinds=args.faults,
        directory=args.dir,
        report=args.report,
        compare_baseline=args.compare_baseline,
        resolve_timeout_s=args.resolve_timeout,
        timeout_s=args.timeout,
        force=args.force,
        json=args.json,
        progress=not args.no_progress,
    )
    return run_campaign(
        options,
        RunOptions(
            args=run_args,
            run_dir=run.run_dir,
            script_args=list(run.training_script_args),
            nproc_per_node=run.nproc_per_node,
            nnodes=run.nnodes,
        ),
    )


def _usage(message: str) -> int:
    say("crashproof chaos", message)
    return EXIT_USAGE
