"""Launching ``crashproof run``: from its parsed options (:mod:`crashproof.cli` parses them) to a
:class:`CrashproofAgent` supervising the trainers, and the run's end as an exit code.

Owns what the launch adds to torchrun's way, each for recovery speed or diagnosis:

* rendezvous ``c10d`` on ``localhost`` (port chosen free) for one node without an endpoint, with
  keep-alive and last-call timings of seconds, and a fresh store per attempt;
* trainers are forked from a warm forkserver holding torch and crashproof (``--cold-start``
  execs ``python -u script.py`` per trainer, as torchrun does);
* every rank's output is kept under ``RUN_DIR/logs`` and shown on the console prefixed with
  ``[rank N]``, a whole line at a time;
* preemption notices (SIGUSR1, the cloud's metadata service) forwarded to the trainers, the
  replication host for durable tiers, the Prometheus endpoint, the run's event log.

Exit codes (``docs/supervisor.md``): 0 the script finished on every rank; 75 stopped early by
SIGTERM to the supervisor, resumable (preempted: requeue me); 76 the restart budget is spent;
77 a crash loop; 2 a usage error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args, parse_min_max_nnodes

from crashproof._rundir import RunDir
from crashproof._runfiles import RunFileRefused, make_dirs, remove_own, replace_own
from crashproof.checkpoint import ENV_AGENT_REPLICATION, ReplicationHost
from crashproof.errors import ConfigError
from crashproof.exitcodes import (
    EXIT_BUDGET_SPENT,
    EXIT_CRASH_LOOP,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
)
from crashproof.link import ENV_NOTICE_FILE
from crashproof.state import set_reproducible_defaults
from crashproof.supervisor._agent import (
    DEFAULT_MAX_RESTARTS,
    UNLIMITED_RESTARTS,
    CrashproofAgent,
    SupervisorConfig,
)
from crashproof.supervisor._cloud import PROVIDERS, CloudNotice, NoticePoller, detect_provider
from crashproof.supervisor._console_lines import install as install_whole_lines
from crashproof.supervisor._crashloop import CrashLoopPolicy, Failure, RestartBudget
from crashproof.supervisor._fence import Fence, poll_faster
from crashproof.supervisor._hang import HangConfig
from crashproof.supervisor._keeper import Keeper
from crashproof.supervisor._memory_host import MemoryHost
from crashproof.supervisor._narrator import Narrator
from crashproof.supervisor._seed import plant_forkserver_seed
from crashproof.supervisor._straggler import StragglerConfig
from crashproof.supervisor._summary import summary
from crashproof.telemetry import EventLog
from crashproof.telemetry.metrics import RunMetrics

__all__ = [
    "DEFAULT_MAX_RESTARTS",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_RESTART_WINDOW_S",
    "EXIT_BUDGET_SPENT",
    "EXIT_CRASH_LOOP",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_USAGE",
    "PREEMPTION_PROVIDERS",
    "launch",
]

DEFAULT_METRICS_PORT = 29600
"""``--metrics-port``'s default: a fixed port a Prometheus scrape configuration can name, beside
torchrun's 29400 (rendezvous) and 29500 (master); another run on the same machine that finds it
taken serves on a free port instead."""

DEFAULT_RESTART_WINDOW_S = 3600.0
"""``--restart-window``'s default: ``--max-restarts`` counts the restarts of the last hour."""

PREEMPTION_PROVIDERS = PROVIDERS
"""The clouds whose preemption notices the launch can poll (``--preemption``'s choices)."""

log = logging.getLogger("crashproof.run")


def _resolve_rendezvous(args: argparse.Namespace) -> None:
    """torchrun's rules for --standalone and a lone node, with c10d as the default backend."""
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.standalone or (
        args.rdzv_backend in ("c10d", "static") and not args.rdzv_endpoint and max_nodes == 1
    ):
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        if args.standalone or args.rdzv_id == "none":
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.rdzv_backend in ("c10d", "etcd-v2"):
        args.rdzv_conf = _with_defaults(args.rdzv_conf, _FAST_RENDEZVOUS)


_FAST_RENDEZVOUS = {
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
    "last_call_timeout": "3",
}
"""Rendezvous timings for recovery in seconds, not the better part of a minute: torch's defaults
(a keep-alive every 5 s, 3 missed = dead; 30 s of last call) make the survivors of a lost node
wait about 40 s before they go on. Each can be overridden with ``--rdzv-conf``."""


def _with_defaults(conf: str, defaults: dict[str, str]) -> str:
    given = {item.split("=", 1)[0].strip() for item in conf.split(",") if "=" in item}
    extra = [f"{key}={value}" for key, value in defaults.items() if key not in given]
    return ",".join(filter(None, [conf, *extra]))


def _fresh_store_per_attempt() -> None:
    """Give each attempt's trainers a store of their own.

    By default torch elastic lets the trainers share the agent's rendezvous TCPStore, and keys
    are not separated per attempt: after a restart a trainer can read the previous attempt's
    keys (its peers' old gloo addresses) before the new peers overwrite them, and then fails to
    connect ("Connection refused" / "reset by peer") or waits out a timeout. Disabling the sharing
    makes rank 0 of every attempt host a new store on a new port.
    """
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _watch_for_notices(agent: CrashproofAgent, provider: str, run_dir: str) -> NoticePoller | None:
    """Forward SIGUSR1 (SLURM's ``--signal``) to the trainers, and poll the cloud for notices.

    Both reach the trainers as signals; a cloud notice also leaves its deadline in
    ``RUN_DIR/notice.json``, where the trainers read it. (SIGTERM to this command is torch's to
    forward: its agent stops the trainers with SIGTERM and waits ``--preemption-grace``.)
    """
    notice_file = RunDir(run_dir).notice
    # A previous run's notice is not this one's; a notice.json crashproof did not write stays.
    remove_own(notice_file, _is_notice)
    os.environ[ENV_NOTICE_FILE] = notice_file
    signal.signal(
        signal.SIGUSR1, lambda signum, frame: agent.forward_notice(signal.SIGUSR1, "SIGUSR1")
    )
    if provider == "auto":
        provider = detect_provider() or "none"
    if provider == "none":
        return None

    def on_notice(notice: CloudNotice) -> None:
        text = json.dumps({"source": notice.provider, "seconds_left": notice.seconds_left})
        try:
            replace_own(run_dir, os.path.basename(notice_file), text.encode(), _is_notice)
        except (RunFileRefused, OSError) as exc:  # the trainers still save, without a deadline
            log.error("cannot write the notice's deadline: %s", exc)
        agent.forward_notice(signal.SIGTERM, f"{notice.provider} preemption notice")

    return NoticePoller(provider, on_notice)


def _is_notice(head: bytes) -> bool:
    """Whether a file's first bytes are a notice this supervisor wrote (``notice.json``)."""
    try:
        doc = json.loads(head)
    except ValueError:
        return False
    return isinstance(doc, dict) and set(doc) == {"source", "seconds_left"}


def _is_metrics_url(head: bytes) -> bool:
    """Whether a file's first bytes are a URL this supervisor wrote (``metrics_url``)."""
    return re.fullmatch(rb"https?://\S+/metrics\n?", head) is not None


def _default_run_dir() -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(os.getcwd(), "crashproof-runs", f"{stamp}-{os.getpid()}")


def _entrypoint(
    args: argparse.Namespace, cmd: Callable[..., Any] | str, cmd_args: list[str]
) -> tuple[Callable[..., Any] | str, list[str], str]:
    """What each trainer runs, and the start method: warm forks unless asked otherwise."""
    if not _warm_start_wanted(args) or not isinstance(cmd, str):
        return cmd, cmd_args, args.start_method
    # not _entry's (torch._dynamo and more): the agent only names it, the trainers run it
    from crashproof.supervisor._warm_start import run_script

    rest = list(cmd_args)
    if rest and rest[0] == "-u":
        rest.pop(0)
    kind = "script"
    if rest and rest[0] == "-m":
        kind = "module"
        rest.pop(0)
    return run_script, [kind, *rest], "forkserver"


def _warm_start_wanted(args: argparse.Namespace) -> bool:
    """Whether the options leave the trainers to be forked from a warm forkserver."""
    return not (args.cold_start or args.no_python or args.run_path)


def _setup_logs(args: argparse.Namespace, run_dir: str) -> None:
    """Every rank's output in the run directory, and on the console, unless the user chose."""
    if args.log_dir is None:  # torch makes a new folder in it for each run
        args.log_dir = make_dirs(run_dir, os.path.basename(RunDir(run_dir).logs))
    if args.redirects == "0" and args.tee == "0":
        args.tee = "3"
    if not os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"):
        os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank ${rank}] "
    install_whole_lines()


def launch(args: argparse.Namespace) -> int:
    """Run the job ``crashproof run``'s parsed options describe, under a :class:`CrashproofAgent`,
    to its end; returns the exit code (the module's docstring lists them). A configuration the
    supervisor refuses is one line on stderr and exit 2, before anything starts."""
    # Before any trainer (or the warm process they fork from) loads MKL: bit-reproducible CPU math.
    set_reproducible_defaults()
    if _warm_start_wanted(args):  # before any thread starts: the forkserver's torch is ours
        plant_forkserver_seed()
    level = "warning" if args.quiet and args.log_level in ("debug", "info") else args.log_level
    logging.basicConfig(
        level=getattr(logging, level.upper()), format="[crashproof run] %(levelname)s %(message)s"
    )
    # torch logs each failed trainer's whole traceback here; the trainer's own log (on the console
    # and in the run directory) has it already, and the agent reports the failure in one line.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # Its only messages are the tracebacks of its console-copying threads, one per rank, when a
    # stop signal (a double Ctrl-C to the process group) interrupts them: the run's own logs and
    # the trainers' log files are complete without them.
    logging.getLogger("torch.distributed.elastic.multiprocessing.tail_log").setLevel(
        logging.CRITICAL
    )
    try:
        hang = HangConfig(
            step_timeout_s=args.hang_timeout,
            startup_timeout_s=args.startup_timeout,
            restore_timeout_s=args.restore_timeout,
            save_timeout_s=args.save_timeout,
            done_timeout_s=args.done_timeout,
        )
        crash_loop = CrashLoopPolicy(attempts=args.crash_loop_attempts)
        straggler = StragglerConfig(args.straggler_factor, args.straggler_steps)
    except ConfigError as exc:
        print(f"crashproof run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    run_dir = os.path.abspath(args.run_dir or _default_run_dir())
    os.makedirs(run_dir, exist_ok=True)
    try:  # a reused run directory: refused if what crashproof would write into is not its own
        events = EventLog(RunDir(run_dir).events, node=os.uname().nodename, agent_pid=os.getpid())
        for folder in ("heartbeats", "stacks"):
            make_dirs(run_dir, folder)
        _setup_logs(args, run_dir)
    except (RunFileRefused, OSError) as exc:
        print(f"crashproof run: --run-dir {run_dir}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _resolve_rendezvous(args)
    _fresh_store_per_attempt()
    config, cmd, cmd_args = config_from_args(args)
    entrypoint, entry_args, start_method = _entrypoint(args, cmd, cmd_args)
    if start_method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(["crashproof.supervisor._forkserver", *args.preload])
    supervisor = SupervisorConfig(
        run_dir=run_dir,
        hang=hang,
        crash_loop=crash_loop,
        budget=RestartBudget(max_restarts=args.max_restarts, window_s=args.restart_window),
        shutdown_grace_s=float(args.shutdown_timeout),
        preemption_grace_s=args.preemption_grace,
        straggler=straggler,
    )
    return _launch(config, entrypoint, entry_args, start_method, supervisor, events, args)


def _serve_metrics(args: argparse.Namespace, run_dir: str) -> RunMetrics | None:
    """Start the Prometheus endpoint unless ``--metrics-port -1``. The default port, when another
    run on this machine holds it, gives way to any free one (the URL says which); a port given
    explicitly and in use is logged, not fatal: the run matters more than its metrics."""
    if args.metrics_port is not None and args.metrics_port < 0:
        return None
    metrics = RunMetrics(run_dir, ettr=_ettr_of_log)
    port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    try:
        try:
            metrics.serve(port, args.metrics_host)
        except OSError as exc:
            if args.metrics_port is not None:
                raise
            log.warning("metrics port %d is taken (%s): serving on a free one", port, exc)
            metrics.serve(0, args.metrics_host)
    except (OSError, UnicodeError) as exc:
        log.error(
            "cannot serve metrics on %s:%d (%s); running without", args.metrics_host, port, exc
        )
        return None
    url = _metrics_url(args, metrics)
    log.info("Prometheus metrics at %s", url)
    try:  # an earlier run's URL is replaced; a file crashproof did not write is not
        name = os.path.basename(RunDir(run_dir).metrics_url)
        replace_own(run_dir, name, f"{url}\n".encode(), _is_metrics_url)
    except (RunFileRefused, OSError) as exc:
        log.warning("the metrics URL is not written to the run directory: %s", exc)
    return metrics


def _ettr_of_log(path: str) -> float | None:
    """The run's ETTR so far, from its whole event log (the metrics' ``crashproof_ettr``)."""
    from crashproof.telemetry import compute_ledger, read_events

    if not os.path.exists(path):
        return None
    return compute_ledger(read_events(path)).ettr


def _metrics_url(args: argparse.Namespace, metrics: RunMetrics | None) -> str | None:
    if metrics is None or metrics.port is None:
        return None
    host = str(args.metrics_host)
    if ":" in host and not host.startswith("["):  # an IPv6 address goes in brackets in a URL
        host = f"[{host}]"
    return f"http://{host}:{metrics.port}/metrics"


def _launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    entry_args: list[str],
    start_method: str,
    supervisor: SupervisorConfig,
    events: EventLog,
    args: argparse.Namespace,
) -> int:
    # First of all: whatever this process dies of from here on, what it starts dies with it.
    keeper = Keeper(events.path)
    try:
        return _supervise(
            config, entrypoint, entry_args, start_method, supervisor, events, args, keeper
        )
    finally:
        keeper.release()


def _advertised_address(config: LaunchConfig) -> str:
    """Where the other nodes' agents reach this one's memory host: ``--local-addr`` if given,
    else this host's name as it resolves here."""
    if config.local_addr:
        return str(config.local_addr)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.getfqdn()


def _supervise(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    entry_args: list[str],
    start_method: str,
    supervisor: SupervisorConfig,
    events: EventLog,
    args: argparse.Namespace,
    keeper: Keeper,
) -> int:
    rdzv = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(entry_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv),
        max_restarts=UNLIMITED_RESTARTS,  # the agent keeps to the budget (supervisor.budget)
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    assert config.logs_specs is not None
    # Trainers keep their newest snapshots in this agent's memory, which outlives their crashes,
    # and on several nodes the agents copy them to each other.
    memory = MemoryHost(events, limit_bytes=args.memory_limit) if args.memory else None
    peers = None
    if memory is not None:
        memory.publish()
        if config.max_nodes > 1 and args.peer_replicas != 0:
            peers = memory.replicate_to_peers(
                args.peer_replicas,
                _advertised_address(config),
                parity=args.peer_parity,
                bandwidth=args.peer_bandwidth,
            )
    # Several nodes: a lost one is out of the rendezvous as soon as its neighbours see it gone.
    fence = None
    if config.max_nodes > 1 and config.rdzv_backend in ("c10d", "etcd-v2"):
        fence = Fence(events, _advertised_address(config))
        poll_faster(spec.rdzv_handler, config.max_nodes)
    agent = CrashproofAgent(
        spec,
        config.logs_specs,
        config=supervisor,
        events=events,
        start_method=start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        keeper=keeper,
        memory=memory,
        memory_peers=peers,
        standby=args.standby,
        fence=fence,
    )
    notices = _watch_for_notices(agent, args.preemption, supervisor.run_dir)
    # Trainers hand their uploads to durable tiers to this agent, which outlives their crashes.
    replication_dir = RunDir(supervisor.run_dir).replication
    replication = ReplicationHost(replication_dir, events)
    os.environ[ENV_AGENT_REPLICATION] = replication_dir
    metrics = _serve_metrics(args, supervisor.run_dir)
    narrator = Narrator(events.path, node=os.uname().nodename, budget=supervisor.budget.describe())
    started = time.monotonic()
    events.emit(
        "run_start",
        run_id=config.run_id,
        script=args.training_script,
        args=list(args.training_script_args),
        nproc_per_node=config.nproc_per_node,
        nnodes=f"{config.min_nodes}:{config.max_nodes}",
        max_restarts=config.max_restarts,
        restart_window_s=supervisor.budget.window_s,
        rdzv_backend=config.rdzv_backend,
        start_method="exec" if isinstance(entrypoint, str) else start_method,
        run_dir=supervisor.run_dir,
        metrics_url=_metrics_url(args, metrics),
    )
    code, outcome = EXIT_USAGE, "error"
    try:
        result = agent.run()
        # (no result: the rendezvous closed, the other nodes finished)
        if result is None or result.state == WorkerState.SUCCEEDED:
            code, outcome = EXIT_OK, "succeeded"
        elif agent.preempted is not None:
            code, outcome = EXIT_PREEMPTED, "preempted"
            print(
                f"crashproof run: stopped early ({agent.preempted}); resumable: run the same "
                f"command again",
                file=sys.stderr,
            )
        elif agent.crash_loop is not None:
            code, outcome = EXIT_CRASH_LOOP, "crash loop"
            failure, policy = agent.crash_loop, supervisor.crash_loop
            print(
                f"crashproof run: crash loop: {policy.stalled} failed attempts in a row without "
                f"getting past step {policy.furthest_step} (the furthest the run reached); the "
                f"last one reached step {failure.step} and failed on rank {failure.rank}: "
                f"{failure.reason}. Restarting will not help: fix the cause",
                file=sys.stderr,
            )
        else:
            code, outcome = EXIT_BUDGET_SPENT, "restart budget spent"
            budget = supervisor.budget
            print(
                f"crashproof run: a trainer failed and the restart budget is spent "
                f"({budget.describe()}: all restarts are used; see --max-restarts, "
                f"--restart-window)"
                f"{_failed_on(agent.budget_spent)}",
                file=sys.stderr,
            )
    except SignalException as exc:
        if exc.sigval == signal.SIGTERM:
            code, outcome = EXIT_PREEMPTED, "preempted"
            print(
                "crashproof run: stopped early (SIGTERM); resumable: run the same command again",
                file=sys.stderr,
            )
        else:
            code, outcome = 128 + int(exc.sigval), f"stopped by {exc.sigval.name}"
    finally:
        if notices is not None:
            notices.close()
        if memory is not None:
            memory.close()
        if fence is not None:
            fence.close()
        preempted = code == EXIT_PREEMPTED
        replication.close(
            min(args.replication_timeout, supervisor.preemption_grace_s)
            if preempted
            else args.replication_timeout
        )
        events.emit(
            "run_end",
            outcome=outcome,
            exitcode=code,
            restarts=agent.attempt,
            seconds=round(time.monotonic() - started, 3),
        )
        events.close()
        narrator.close()
        print(
            summary(
                supervisor.run_dir,
                outcome=outcome,
                code=code,
                log_dir=args.log_dir,
                quiet=args.quiet,
            ),
            file=sys.stderr,
        )
        if metrics is not None:
            metrics.close()
        try:
            spec.rdzv_handler.shutdown()
        except Exception as exc:
            log.debug("rendezvous shutdown: %s", exc)
    return code


def _failed_on(failure: Failure | None) -> str:
    if failure is None:
        return ""
    return f"; the last failure: rank {failure.rank} after step {failure.step}, {failure.reason}"
