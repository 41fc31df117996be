"""A campaign from start to verdict: which faults, where the runs and the report go (never over
what a campaign did not write), the faulted run and the optional baseline, the table and the
report. The command line (:mod:`crashproof.cli`) parses the options, ``crashproof run``'s among
them, and hands them here as :class:`CampaignOptions` and :class:`RunOptions`.

Imports nothing heavy at module level: the campaign machinery (torch's launcher among it) loads
only when a campaign runs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from crashproof._console import say
from crashproof._files import check_parent
from crashproof._rundir import RunDir
from crashproof.chaos._schedule import Fault, draw_schedule, parse_fault
from crashproof.errors import ConfigError
from crashproof.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE

__all__ = ["RUN_PLACEHOLDER", "CampaignOptions", "RunOptions", "run_campaign"]

_BASELINE_TRIES = 3
"""How often the baseline is run when it restarts (a trainer of it failed): it must run through
without a failure to stand for the job without faults."""


RUN_PLACEHOLDER = "{run}"
"""In the ``crashproof run`` arguments: the run's own directory (``DIR/run``, or ``DIR/baseline``
for the baseline), so the two runs never share a checkpoint directory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CampaignOptions:
    """What ``crashproof chaos`` was asked for (its options, by the same names)."""

    seed: int = 0
    faults: Sequence[str] = ()
    """Explicit faults (``--fault``), in injection order; or, with ``mtbf_s``, none."""
    mtbf_s: float | None = None
    duration_s: float | None = None
    kinds: str = ""
    """``--faults``: the kinds a drawn schedule draws from, comma-separated."""
    directory: str | None = None
    report: str | None = None
    compare_baseline: bool = False
    resolve_timeout_s: float = 300.0
    timeout_s: float | None = None
    force: bool = False
    json: bool = False
    progress: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """The ``crashproof run`` arguments of the job, and what the campaign needs of them parsed."""

    args: Sequence[str]
    """As given (``{run}`` unfilled)."""
    run_dir: str | None
    """Their ``--run-dir`` (None: not given)."""
    script_args: Sequence[str]
    """The training script's own arguments."""
    nproc_per_node: str
    nnodes: str


def _usage(message: str) -> int:
    say("crashproof chaos", message)
    return EXIT_USAGE


def run_campaign(options: CampaignOptions, run: RunOptions) -> int:
    """``crashproof chaos``: run the campaign (and the baseline), print and write the report.
    Exit 0 passed, 1 failed, 2 a usage error (said in one line, before anything runs)."""
    run_args = list(run.args)
    run_dir_template = run.run_dir
    if run_dir_template is None:
        run_args = ["--run-dir", RUN_PLACEHOLDER, *run_args]
        run_dir_template = RUN_PLACEHOLDER
    elif options.compare_baseline and RUN_PLACEHOLDER not in run_dir_template:
        return _usage(
            f"--run-dir {run_dir_template}: with --compare-baseline write it with {RUN_PLACEHOLDER}, or leave it out"
        )
    if options.compare_baseline and not any(RUN_PLACEHOLDER in a for a in run.script_args):
        return _usage(
            f"--compare-baseline: the script's arguments must put its checkpoints under "
            f"{RUN_PLACEHOLDER} (e.g. --run-dir {RUN_PLACEHOLDER}), or the baseline would resume "
            "from the faulted run's checkpoints"
        )
    try:
        schedule = _schedule(options, _world_size(run))
    except ValueError as exc:
        return _usage(str(exc))
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    directory = os.path.abspath(
        options.directory or os.path.join("crashproof-chaos", f"{stamp}-{os.getpid()}")
    )
    faulted = _placed(run_args, run_dir_template, os.path.join(directory, "run"))
    baseline = _placed(run_args, run_dir_template, os.path.join(directory, "baseline"))
    for placed in (faulted, baseline) if options.compare_baseline else (faulted,):
        if not _inside(placed.run_dir, directory):
            return _usage(
                f"--run-dir {placed.run_dir}: outside the campaign's --dir {directory}; a "
                f"campaign writes only into its own directory: write --run-dir with "
                f"{RUN_PLACEHOLDER}, or leave it out"
            )
    if os.path.exists(RunDir(faulted.run_dir).events):
        return _usage(
            f"{faulted.run_dir} already holds a run's events: give the campaign a new --dir"
        )
    report_path = options.report or RunDir(faulted.run_dir).chaos_report
    refused = _refuse_outputs(directory, report_path, force=options.force)
    if refused:
        return _usage(refused)
    os.makedirs(directory, exist_ok=True)
    with _signals_end_the_campaign():
        return _campaign(options, schedule, directory, faulted, baseline, report_path)


class _Placed(NamedTuple):
    """One run of the campaign: its ``crashproof run`` arguments and its run directory."""

    args: list[str]
    run_dir: str


def _placed(run_args: list[str], run_dir_template: str, directory: str) -> _Placed:
    """The run whose ``{run}`` is ``directory``."""
    return _Placed(
        [a.replace(RUN_PLACEHOLDER, directory) for a in run_args],
        os.path.abspath(run_dir_template.replace(RUN_PLACEHOLDER, directory)),
    )


def _inside(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or under it, links resolved (as far as they exist)."""
    real, top = os.path.realpath(path), os.path.realpath(directory)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def _world_size(run: RunOptions) -> int:
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


def _schedule(options: CampaignOptions, world_size: int) -> list[Fault]:
    if options.faults and options.mtbf_s is not None:
        raise ValueError("give either --mtbf (a drawn schedule) or --fault (explicit faults)")
    if options.faults:
        return [_fault(spec, i, options.seed, world_size) for i, spec in enumerate(options.faults)]
    if options.mtbf_s is None:
        raise ValueError('give --mtbf SECONDS --duration SECONDS, or --fault "at=30s,kind=kill"')
    if options.duration_s is None:
        raise ValueError("--mtbf needs --duration SECONDS: how long faults keep coming")
    kinds = [k.strip() for k in options.kinds.split(",") if k.strip()]
    return draw_schedule(
        seed=options.seed,
        mtbf_s=options.mtbf_s,
        duration_s=options.duration_s,
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


_REPORT_KEYS = {"run_dir", "seed", "faults", "injected", "detected", "recovered", "passed"}
"""A JSON object with these keys is a campaign's report: the mark ``--force`` replaces."""


def _refuse_outputs(directory: str, report: str, *, force: bool) -> str | None:
    """Why the campaign must not write where it was told to (None: it may). It never writes into
    a directory that holds anything, nor over a file that is not an earlier campaign's report
    (and that only with ``--force``), nor under a file."""
    for option, path in (("--dir", directory), ("--report", report)):
        try:
            check_parent(path, option)
        except ConfigError as exc:
            return str(exc)
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
    options: CampaignOptions,
    schedule: list[Fault],
    directory: str,
    faulted: _Placed,
    baseline: _Placed,
    report_path: str,
) -> int:
    from crashproof._seams import ENV_CHAOS_NAN, write_control
    from crashproof.chaos._baseline import Comparison, compare_final_checkpoints
    from crashproof.chaos._campaign import Campaign, open_console, run_crashproof, stop_run
    from crashproof.chaos._report import build_report, format_table, summary_line, write_report
    from crashproof.chaos._watch import RunView

    run_dir = faulted.run_dir
    echo = not options.json
    if echo:
        print(
            f"[chaos] {len(schedule)} fault(s) scheduled (seed {options.seed}); run directory {run_dir}"
        )
        for f in schedule:
            print(f"[chaos]   {f.id} {f.kind:<9} at {f.trigger:<10} rank {f.rank}  {_params(f)}")
    campaign = Campaign(
        run_args=faulted.args,
        run_dir=run_dir,
        schedule=schedule,
        seed=options.seed,
        console_path=os.path.join(directory, "run.log"),
        resolve_timeout_s=options.resolve_timeout_s,
        timeout_s=options.timeout_s,
        echo=echo,
        progress=echo and options.progress,
    )
    result = campaign.run()
    comparison: Comparison | None = None
    baseline_code: int | None = None
    baseline_dir: str | None = None
    if options.compare_baseline:
        baseline_dir = baseline.run_dir
        env = dict(os.environ)
        # A NaN changes what the run trains on by design (the guard skips or replays the batch):
        # the baseline gets the same NaNs at the same steps, and nothing else.
        nans = [
            {"id": i.fault.id, "rank": i.fault.rank, "step": i.step}
            for i in result.injections
            if i.fault.kind == "nan" and i.fired_ts is not None
        ]
        if echo:
            print(
                f"[chaos] baseline run without faults{' (same NaN steps)' if nans else ''}: {baseline_dir}"
            )
        for tries_left in reversed(range(_BASELINE_TRIES)):
            if nans:
                control = RunDir(baseline_dir).chaos_control("nan")
                os.makedirs(os.path.dirname(control), exist_ok=True)
                write_control(control, nans)
                env[ENV_CHAOS_NAN] = control
            with open_console(directory, "baseline.log") as console:
                proc = run_crashproof(baseline.args, env, console)
                try:
                    baseline_code = proc.wait(timeout=options.timeout_s)
                except subprocess.TimeoutExpired:
                    baseline_code = None  # reported as a failed baseline
                finally:
                    stop_run(proc, grace_s=10)
            base_view = RunView(baseline_dir)
            base_view.refresh()
            restarts = base_view.of("restart")
            if not restarts or not tries_left:
                break
            # A baseline that failed and restarted is no run without faults: its NaNs, armed
            # once, did not come again after the restart (nor would any other one-time event).
            if echo:
                print(
                    f"[chaos] the baseline restarted ({restarts[0].get('reason', '?')}): it is "
                    "no run without faults; running it again"
                )
            shutil.rmtree(baseline_dir)
        faulted_root = campaign.view.checkpoint_root()
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
        seed=options.seed,
        explicit=bool(options.faults),
        baseline=comparison,
        baseline_exitcode=baseline_code,
        baseline_run_dir=baseline_dir,
    )
    write_report(report, report_path)
    if options.json:
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
