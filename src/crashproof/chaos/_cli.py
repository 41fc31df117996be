"""``crashproof chaos [options] -- <crashproof run arguments>``: a seeded fault campaign.

Imports nothing heavy at module level: ``crashproof.chaos`` is imported by the guard and the
storage seams, and the campaign machinery (torch's launcher among it) loads only when a
campaign runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

from crashproof._console import say
from crashproof.chaos._schedule import KINDS, Fault, draw_schedule, parse_duration, parse_fault
from crashproof.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE

__all__ = ["RUN_PLACEHOLDER", "add_chaos_parser", "run_chaos"]


RUN_PLACEHOLDER = "{run}"
"""In the ``crashproof run`` arguments: the run's own directory (``DIR/run``, or ``DIR/baseline``
for the baseline), so the two runs never share a checkpoint directory."""


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
        "(and the baseline matched), 1: not, 2: usage error. See docs/chaos.md.",
    )
    p.add_argument("--seed", type=int, default=0, help="the same seed draws the same schedule")
    p.add_argument("--mtbf", type=_duration, metavar="SECONDS",
                   help="mean time between faults: exponential inter-arrival times")  # fmt: skip
    p.add_argument("--duration", type=_duration, metavar="SECONDS",
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
    p.add_argument("--resolve-timeout", type=_duration, default=300.0, metavar="SECONDS",
                   help="how long to wait for a fault's detection and recovery (default 300)")  # fmt: skip
    p.add_argument("--timeout", type=_duration, default=None, metavar="SECONDS",
                   help="stop each run after this long (default: no limit)")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="replace an earlier campaign's report at --report (nothing else)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress bar (it shows only on a terminal anyway)")  # fmt: skip
    p.add_argument("run_args", nargs=argparse.REMAINDER, metavar="-- RUN_ARGS")
    p.set_defaults(func=run_chaos)
    return p


def _usage(message: str) -> int:
    say("crashproof chaos", message)
    return EXIT_USAGE


def _parse_run_args(run_args: list[str]) -> argparse.Namespace:
    """``crashproof run``'s own parser on the arguments (SystemExit(2) on a bad one)."""
    from crashproof.supervisor.launch import build_parser

    return build_parser().parse_args(run_args)


def _duration(text: str) -> float:
    """``parse_duration`` for argparse, which shows an ArgumentTypeError's message (a ValueError's
    it replaces with "invalid value")."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _world_size(run: argparse.Namespace) -> int:
    try:
        nproc = int(run.nproc_per_node)
        nodes = max(int(n) for n in str(run.nnodes).split(":", 1))  # "1:4": up to 4
    except ValueError:
        raise ValueError(
            f"--nproc-per-node {run.nproc_per_node} --nnodes {run.nnodes}: give whole numbers, "
            "so the campaign knows which ranks there are"
        ) from None
    if nodes != 1:
        raise ValueError(
            f"--nnodes {run.nnodes}: crashproof chaos injects faults into the ranks of the "
            "machine it runs on, so it runs single-node jobs (--nnodes 1)"
        )
    return nproc * nodes


def _schedule(args: argparse.Namespace, world_size: int) -> list[Fault]:
    if args.fault and args.mtbf is not None:
        raise ValueError("give either --mtbf (a drawn schedule) or --fault (explicit faults)")
    if args.fault:
        return [_fault(spec, i, args.seed, world_size) for i, spec in enumerate(args.fault)]
    if args.mtbf is None:
        raise ValueError('give --mtbf SECONDS --duration SECONDS, or --fault "at=30s,kind=kill"')
    if args.duration is None:
        raise ValueError("--mtbf needs --duration SECONDS: how long faults keep coming")
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    return draw_schedule(
        seed=args.seed,
        mtbf_s=args.mtbf,
        duration_s=args.duration,
        kinds=kinds,
        world_size=world_size,
    )


def _fault(spec: str, index: int, seed: int, world_size: int) -> Fault:
    """``parse_fault``, its message naming the ``--fault`` it is about."""
    try:
        return parse_fault(spec, index=index, seed=seed, world_size=world_size)
    except ValueError as exc:
        if spec in str(exc):
            raise
        raise ValueError(f"--fault {spec!r}: {exc}") from None


def _fill(run_args: list[str], directory: str) -> list[str]:
    return [a.replace(RUN_PLACEHOLDER, directory) for a in run_args]


def run_chaos(args: argparse.Namespace) -> int:
    """``crashproof chaos``: run the campaign (and the baseline), print and write the report."""
    run_args = list(args.run_args)
    if run_args[:1] == ["--"]:
        run_args = run_args[1:]
    if not run_args:
        return _usage(
            "give the `crashproof run` arguments after --, e.g. -- --nproc-per-node 2 train.py --run-dir {run}"
        )
    try:
        run = _parse_run_args(run_args)
    except SystemExit:
        return _usage(f"the `crashproof run` arguments do not parse: {' '.join(run_args)}")
    if run.run_dir is None:
        run_args = ["--run-dir", RUN_PLACEHOLDER, *run_args]
    elif args.compare_baseline and RUN_PLACEHOLDER not in run.run_dir:
        return _usage(
            f"--run-dir {run.run_dir}: with --compare-baseline write it with {RUN_PLACEHOLDER}, or leave it out"
        )
    if args.compare_baseline and not any(RUN_PLACEHOLDER in a for a in run.training_script_args):
        return _usage(
            f"--compare-baseline: the script's arguments must put its checkpoints under "
            f"{RUN_PLACEHOLDER} (e.g. --run-dir {RUN_PLACEHOLDER}), or the baseline would resume "
            "from the faulted run's checkpoints"
        )
    try:
        schedule = _schedule(args, _world_size(run))
        if args.resolve_timeout <= 0:
            raise ValueError("--resolve-timeout must be positive")
    except ValueError as exc:
        return _usage(str(exc))
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    directory = os.path.abspath(
        args.dir or os.path.join("crashproof-chaos", f"{stamp}-{os.getpid()}")
    )
    faulted_args = _fill(run_args, os.path.join(directory, "run"))
    run_dir = os.path.abspath(_parse_run_args(faulted_args).run_dir)
    if os.path.exists(os.path.join(run_dir, "events.jsonl")):
        return _usage(f"{run_dir} already holds a run's events: give the campaign a new --dir")
    report_path = args.report or os.path.join(run_dir, "chaos_report.json")
    refused = _refuse_outputs(directory, report_path, force=args.force)
    if refused:
        return _usage(refused)
    os.makedirs(directory, exist_ok=True)
    with _signals_end_the_campaign():
        return _campaign(args, schedule, directory, run_args, faulted_args, run_dir, report_path)


_REPORT_KEYS = {"run_dir", "seed", "faults", "injected", "detected", "recovered", "passed"}
"""A JSON object with these keys is a campaign's report: the mark ``--force`` replaces."""


def _refuse_outputs(directory: str, report: str, *, force: bool) -> str | None:
    """Why the campaign must not write where it was told to (None: it may). It never writes into
    a directory that holds anything, nor over a file that is not an earlier campaign's report
    (and that only with ``--force``), nor under a file."""
    for path in (directory, report):
        parent = path
        while not os.path.lexists(parent) and parent != os.path.dirname(parent):
            parent = os.path.dirname(parent)
        if parent != path and not os.path.isdir(parent):
            return f"{path}: {parent} is a file, not a directory; choose a path in a directory"
    if os.path.lexists(directory):
        if not os.path.isdir(directory) or os.path.islink(directory):
            return f"--dir {directory}: exists and is not a directory; give a new directory"
        if os.listdir(directory):
            return (
                f"--dir {directory}: the directory holds files already; a campaign writes its "
                "runs and logs there and must not mix them with others: give a new or empty --dir"
            )
    if not os.path.lexists(report):
        return None
    if os.path.islink(report) or not os.path.isfile(report):
        return f"--report {report}: exists and is not a regular file; choose another path"
    if not _is_report(report):
        return (
            f"--report {report}: the file exists and is not a campaign report; a campaign never "
            "replaces what it did not write: choose a new path"
        )
    if not force:
        return f"--report {report}: holds an earlier campaign's report; give --force to replace it"
    return None


def _is_report(path: str) -> bool:
    import json

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(64 * 1024 * 1024))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and set(doc) >= _REPORT_KEYS


@contextlib.contextmanager
def _signals_end_the_campaign() -> Iterator[None]:
    """SIGTERM and SIGHUP (a CI job's time limit, a closed terminal) end the campaign as Ctrl-C
    does: by an exception, so the runs it started are stopped on the way out instead of going
    on training (they run in sessions of their own, out of reach of the signal)."""

    def stop(signum: int, _frame: object) -> None:
        for ignored in previous:  # a second signal must not cut the clean-up short
            signal.signal(ignored, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _campaign(
    args: argparse.Namespace,
    schedule: list[Fault],
    directory: str,
    run_args: list[str],
    faulted_args: list[str],
    run_dir: str,
    report_path: str,
) -> int:
    from crashproof._seams import ENV_CHAOS_NAN, write_control
    from crashproof.chaos._baseline import Comparison, compare_final_checkpoints
    from crashproof.chaos._campaign import Campaign, run_crashproof, stop_run
    from crashproof.chaos._report import build_report, format_table, summary_line, write_report
    from crashproof.chaos._watch import RunView

    echo = not args.json
    if echo:
        print(
            f"[chaos] {len(schedule)} fault(s) scheduled (seed {args.seed}); run directory {run_dir}"
        )
        for f in schedule:
            print(f"[chaos]   {f.id} {f.kind:<9} at {f.trigger:<10} rank {f.rank}  {_params(f)}")
    campaign = Campaign(
        run_args=faulted_args,
        run_dir=run_dir,
        schedule=schedule,
        seed=args.seed,
        console_path=os.path.join(directory, "run.log"),
        resolve_timeout_s=args.resolve_timeout,
        timeout_s=args.timeout,
        echo=echo,
        progress=echo and not args.no_progress,
    )
    result = campaign.run()
    comparison: Comparison | None = None
    baseline_code: int | None = None
    baseline_dir: str | None = None
    if args.compare_baseline:
        base_args = _fill(run_args, os.path.join(directory, "baseline"))
        baseline_dir = os.path.abspath(_parse_run_args(base_args).run_dir)
        env = dict(os.environ)
        # A NaN changes what the run trains on by design (the guard skips or replays the batch):
        # the baseline gets the same NaNs at the same steps, and nothing else.
        nans = [
            {"id": i.fault.id, "rank": i.fault.rank, "step": i.step}
            for i in result.injections
            if i.fault.kind == "nan" and i.fired_ts is not None
        ]
        if nans:
            control = os.path.join(baseline_dir, "chaos", "nan.json")
            os.makedirs(os.path.dirname(control), exist_ok=True)
            write_control(control, nans)
            env[ENV_CHAOS_NAN] = control
        if echo:
            print(
                f"[chaos] baseline run without faults{' (same NaN steps)' if nans else ''}: {baseline_dir}"
            )
        with open(os.path.join(directory, "baseline.log"), "a") as console:
            proc = run_crashproof(base_args, env, console)
            try:
                baseline_code = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                baseline_code = None  # reported as a failed baseline
            finally:
                stop_run(proc, grace_s=10)
        faulted_root = campaign.view.checkpoint_root()
        base_view = RunView(baseline_dir)
        base_view.refresh()
        baseline_root = base_view.checkpoint_root()
        if faulted_root is None or baseline_root is None:
            comparison = Comparison(
                identical=False,
                problem="no checkpoint event in "
                + (run_dir if faulted_root is None else baseline_dir),
            )
        else:
            comparison = compare_final_checkpoints(faulted_root, baseline_root)
    report = build_report(
        result=result,
        run_dir=run_dir,
        seed=args.seed,
        explicit=bool(args.fault),
        baseline=comparison,
        baseline_exitcode=baseline_code,
        baseline_run_dir=baseline_dir,
    )
    write_report(report, report_path)
    if args.json:
        import json

        print(json.dumps(report, indent=2))
    else:
        print()
        for line in format_table(result.injections):
            print(line)
        for f in result.not_injected:
            why = result.blocked.get(f.id, "the run ended first")
            print(f"{f.id:<5} {f.kind:<9} {f.trigger:>7} {f.rank:>4}  not injected: {why}")
        print()
        print(summary_line(report))
        print(f"report: {report_path}; the run's output: {os.path.join(directory, 'run.log')}")
    return EXIT_OK if report["passed"] else EXIT_FAILED


def _params(fault: Fault) -> str:
    items: dict[str, Any] = dict(fault.params)
    return " ".join(f"{k}={v}" for k, v in items.items())
