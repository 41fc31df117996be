"""Every option of ``crashproof run`` checked before anything launches or any directory is made.

torchrun's parser types most of its options as plain strings and leaves their checks to the
launch (an ``AssertionError`` or a ``ValueError`` with a traceback, some after the run directory
exists, some after a trainer started), and accepts numbers no run can mean (a port of 99999, a
monitor interval of NaN). Here each is checked as the launch will read it, so that a refusal is
one line naming the option and its value (:class:`RunOptionError`; the caller exits 2).
torch's own parsers are used where it has one (endpoints, ``--rdzv-conf``, ``--redirects``), so
what passes here is what the launch accepts.

Imports torch: loaded only for ``crashproof run`` and ``crashproof chaos``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import mmap
import os
import shutil
import signal
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.api import Std
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.utils import (
    _parse_rendezvous_config,
    parse_rendezvous_endpoint,
)
from torch.distributed.run import determine_local_world_size

from crashproof._units import MAX_DURATION_S, format_size, parse_size

__all__ = [
    "MAX_NNODES",
    "MAX_NPROC_PER_NODE",
    "RunOptionError",
    "check_run_args",
    "options_without_effect",
]

MAX_NPROC_PER_NODE = 1024
"""The most trainers ``--nproc-per-node`` starts on one machine: above the cores and devices of
any machine there is (each trainer is a process with a heartbeat and a log of its own); a larger
number is a typo that would fork until memory runs out."""

MAX_NNODES = 65536
"""The most machines ``--nnodes`` admits; torch's rendezvous keeps state per node."""

_RDZV_SECONDS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                 "keep_alive_interval", "read_timeout", "timeout")  # fmt: skip
"""``--rdzv-conf`` keys torch's rendezvous backends read as whole seconds."""


class RunOptionError(ValueError):
    """An option of ``crashproof run`` that cannot launch: its message names it and its value."""

    def __init__(self, option: str, value: object, why: str) -> None:
        super().__init__(f"argument {option}: {str(value)!r}: {why}")


def check_run_args(args: argparse.Namespace) -> None:
    """Raise :class:`RunOptionError` for the first option of ``args`` (parsed by
    ``crashproof run``'s parser) the launch could not use; nothing is created or started."""
    min_nodes, max_nodes = _check_nodes(args)
    _check_nproc(args.nproc_per_node)
    _check_rendezvous(args, min_nodes, max_nodes)
    _check_memory(args, max_nodes)
    _check_numbers(args)
    _check_names(args)
    _check_output_options(args)
    _check_directory("--run-dir", args.run_dir)
    _check_directory("--log-dir", args.log_dir)
    _check_preload(args.preload)
    _check_script(args)


def _int_or(text: object, default: int) -> int:
    try:
        return int(str(text))
    except ValueError:
        return default


def _whole(option: str, text: object, low: int, high: int | None, why: str = "") -> int:
    """``text`` as a whole number from ``low`` to ``high``, or a refusal saying so (or ``why``)."""
    value = _int_or(text, low - 1)
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"{low} or more"
        raise RunOptionError(option, text, why or f"give a whole number {bound}")
    return value


def _check_nodes(args: argparse.Namespace) -> tuple[int, int]:
    """``--nnodes N|MIN:MAX``, ``--node-rank``, ``--standalone``; returns the fewest and the most
    nodes."""
    why = f"give N or MIN:MAX, whole numbers with 1 <= MIN <= MAX <= {MAX_NNODES}"
    parts = str(args.nnodes).split(":")
    low, high = _int_or(parts[0], 0), _int_or(parts[-1], 0)
    if len(parts) > 2 or not 1 <= low <= high <= MAX_NNODES:
        raise RunOptionError("--nnodes", args.nnodes, why)
    if args.standalone and high > 1:
        raise RunOptionError("--nnodes", args.nnodes, "--standalone runs one node: give 1")
    _whole("--node-rank", args.node_rank, 0, high - 1, f"give a node rank from 0 to {high - 1}")
    return low, high


def _check_nproc(text: str) -> None:
    """A count of trainers from 1 to :data:`MAX_NPROC_PER_NODE`, or a device kind torch counts
    (``auto``, ``cpu``, ``gpu``, ``xpu``), which must be present on this machine."""
    why = (
        f"give a whole number from 1 to {MAX_NPROC_PER_NODE}, or auto, cpu, gpu or xpu "
        "(one trainer per device of that kind)"
    )
    try:
        int(text)
    except ValueError:
        try:  # a device kind: torch's own count, refusing a kind this machine lacks
            determine_local_world_size(text)
        except ValueError as exc:
            reason = str(exc) if "Unsupported" not in str(exc) else ""
            raise RunOptionError("--nproc-per-node", text, f"{reason} {why}".strip()) from None
        return
    _whole("--nproc-per-node", text, 1, MAX_NPROC_PER_NODE, why)


def _check_rendezvous(args: argparse.Namespace, min_nodes: int, max_nodes: int) -> None:
    backends = sorted(getattr(rendezvous_handler_registry, "_registry", {}))
    if backends and args.rdzv_backend not in backends:
        raise RunOptionError("--rdzv-backend", args.rdzv_backend, f"choose {', '.join(backends)}")
    if args.rdzv_endpoint:
        try:
            host, _ = parse_rendezvous_endpoint(args.rdzv_endpoint, 29400)
        except ValueError:
            host = ""
        if not host:
            raise RunOptionError(
                "--rdzv-endpoint", args.rdzv_endpoint, "give HOST or HOST:PORT, a port to 65535"
            )
    if not str(args.rdzv_id).strip():
        raise RunOptionError("--rdzv-id", args.rdzv_id, "give a name for the job (or leave it out)")
    try:
        conf = _parse_rendezvous_config(args.rdzv_conf)
    except ValueError:
        raise RunOptionError("--rdzv-conf", args.rdzv_conf, "give KEY=VALUE,... pairs") from None
    for key, value in conf.items():
        if key in _RDZV_SECONDS:
            if not 1 <= _int_or(value, 0) <= MAX_DURATION_S:
                raise RunOptionError(
                    "--rdzv-conf", f"{key}={value}", "give whole seconds, 1 or more"
                )
        elif key == "keep_alive_max_attempt" and _int_or(value, 0) < 1:
            raise RunOptionError("--rdzv-conf", f"{key}={value}", "give a whole number, 1 or more")
        elif key == "is_host" and value.lower() not in ("1", "0", "true", "false", "t", "f",
                                                        "yes", "no", "y", "n"):  # fmt: skip
            raise RunOptionError("--rdzv-conf", f"{key}={value}", "is_host is true or false")
        elif key == "store_type" and value.strip().lower() not in ("tcp", "file"):
            raise RunOptionError("--rdzv-conf", f"{key}={value}", "store_type is tcp or file")
    if args.rdzv_backend == "static" and min_nodes != max_nodes:
        raise RunOptionError(
            "--nnodes", args.nnodes, "the static rendezvous has a fixed size: give N"
        )
    if args.standby and (args.standalone or args.rdzv_backend == "static" or max_nodes < 2):
        raise RunOptionError(
            "--standby",
            args.standby,
            "hot spares wait in a rendezvous of several nodes (c10d or etcd, --nnodes 2 or "
            "more, not --standalone): give 0 here",
        )


def options_without_effect(args: argparse.Namespace) -> list[str]:
    """Notes on options ``args`` (checked already) gives that this run cannot act on, though
    another run of the same command could: peer options on one node (a command shared by
    one-node and multi-node jobs is not refused for them)."""
    if _check_nodes(args)[1] > 1:
        return []
    given = [
        f"{option} {value}"
        for option, value in _memory_options(args)
        if option.startswith("--peer-") and value is not None
    ]
    if not given:
        return []
    return [
        f"note: {', '.join(given)} on one node: there is no other node to hold copies of its "
        "memory snapshots; a node loss falls back to the checkpoints on disk or in a tier"
    ]


MIN_MEMORY_LIMIT = mmap.PAGESIZE
"""The smallest ``--memory-limit``: one page; no snapshot fits in less."""


def _check_memory(args: argparse.Namespace, max_nodes: int) -> None:
    """The options of the agent's memory snapshots and their copies on peers: none beside
    ``--no-memory``, and none that the node count makes impossible (a copy on more peers than
    there are, a parity group larger than the run)."""
    given = [(option, value) for option, value in _memory_options(args) if value is not None]
    if not args.memory and given:
        option, value = given[0]
        raise RunOptionError(
            option, value, "--no-memory keeps no snapshots: drop this option or --no-memory"
        )
    if args.memory_limit is not None and args.memory_limit < MIN_MEMORY_LIMIT:
        raise RunOptionError(
            "--memory-limit",
            _size(args.memory_limit),
            f"no snapshot fits in less than one page: give at least {MIN_MEMORY_LIMIT} bytes, "
            "or --no-memory",
        )
    peers = max_nodes - 1  # (each node's copies go to other nodes; spares hold none)
    if args.peer_replicas and max_nodes > 1 and args.peer_replicas > peers:
        raise RunOptionError(
            "--peer-replicas",
            args.peer_replicas,
            f"copies go to the other nodes, and with --nnodes {args.nnodes} there are at most "
            f"{peers}: give at most {peers}",
        )
    if args.peer_parity and max_nodes > 1 and args.peer_parity > peers:
        raise RunOptionError(
            "--peer-parity",
            args.peer_parity,
            f"a parity group has K+1 nodes or more, and with --nnodes {args.nnodes} there are "
            f"at most {max_nodes}: give at most {peers}",
        )
    if args.peer_bandwidth is not None and args.peer_replicas == 0:
        raise RunOptionError(
            "--peer-bandwidth",
            _size(args.peer_bandwidth),
            "--peer-replicas 0 sends nothing to peers: drop one of them",
        )


def _memory_options(args: argparse.Namespace) -> list[tuple[str, object]]:
    """The memory and peer options, each as its refusal or note shows it (None where not given;
    ``--peer-replicas 0``, which asks for nothing, as not given)."""
    return [
        ("--memory-limit", _size(args.memory_limit)),
        ("--peer-replicas", args.peer_replicas or None),
        ("--peer-parity", args.peer_parity),
        ("--peer-bandwidth", _size(args.peer_bandwidth)),
    ]


def _size(nbytes: int | None) -> str | None:
    """A size option's value as its refusal shows it: ``8 GiB``, not ``8589934592``, where that
    is exact (else the bytes: ``4095``, not ``4 KiB``)."""
    if nbytes is None:
        return None
    shown = format_size(nbytes)
    return shown if parse_size(shown) == nbytes else str(nbytes)


def _check_numbers(args: argparse.Namespace) -> None:
    if args.max_restarts < 0:
        raise RunOptionError("--max-restarts", args.max_restarts, "give 0 or more restarts")
    interval = args.monitor_interval
    if not (math.isfinite(interval) and 0 < interval <= MAX_DURATION_S):
        raise RunOptionError(
            "--monitor-interval", interval, f"give positive seconds, at most {MAX_DURATION_S:.0f}"
        )
    _whole("--shutdown-timeout", args.shutdown_timeout, 0, int(MAX_DURATION_S))
    if args.master_port is not None:
        _whole("--master-port", args.master_port, 1, 65535, "give a port from 1 to 65535")


def _check_names(args: argparse.Namespace) -> None:
    """Options naming a host, a role, a handler or signals: not empty, and known where torch
    keeps a list."""
    for option, value in (("--role", args.role), ("--master-addr", args.master_addr),
                          ("--local-addr", args.local_addr),
                          ("--metrics-host", args.metrics_host)):  # fmt: skip
        if value is not None and not str(value).strip():
            raise RunOptionError(option, value, "give a name (or leave the option out)")
        if option != "--role" and value is not None:
            try:  # what the resolver is given: a name no socket call can take fails here
                str(value).encode("idna")
            except UnicodeError:
                raise RunOptionError(
                    option, value, "not a host name (labels of at most 63 characters)"
                ) from None
    from torch.distributed.elastic.events.handlers import _log_handlers

    if args.event_log_handler not in _log_handlers:
        raise RunOptionError(
            "--event-log-handler", args.event_log_handler, f"choose {', '.join(_log_handlers)}"
        )
    for name in str(args.signals_to_handle).split(","):
        if not isinstance(getattr(signal, name.strip(), None), signal.Signals):
            raise RunOptionError(
                "--signals-to-handle", args.signals_to_handle, "give signal names, e.g. SIGTERM"
            )
    if args.logs_specs is not None:
        from importlib import metadata

        group = metadata.entry_points().select(group="torchrun.logs_specs")
        if not group.select(name=args.logs_specs):
            raise RunOptionError(
                "--logs-specs", args.logs_specs, "no installed torchrun.logs_specs entry point"
            )


def _check_output_options(args: argparse.Namespace) -> None:
    for option, value in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            Std.from_str(value)
        except ValueError:
            raise RunOptionError(
                option, value, "give 0-3 (none, stdout, stderr, both) or LOCAL_RANK:0-3,..."
            ) from None
    ranks = str(args.local_ranks_filter)
    if ranks.strip() and not all(rank.strip().isdigit() for rank in ranks.split(",")):
        raise RunOptionError(
            "--local-ranks-filter", ranks, "give local ranks, comma-separated (0,1)"
        )


def _check_directory(option: str, path: str | None) -> None:
    """A directory the launch makes (or writes in): not a file, not under one, creatable."""
    if path is None:
        return
    if not path.strip():
        raise RunOptionError(option, path, "give a directory path (or leave the option out)")
    where = os.path.abspath(path)
    if os.path.lexists(where):
        if not os.path.isdir(where):
            raise RunOptionError(option, path, f"{_kind(where)}, not a directory")
        if not os.access(where, os.W_OK | os.X_OK):
            raise RunOptionError(option, path, "the directory is not writable")
        return
    parent = os.path.dirname(where)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise RunOptionError(option, path, f"{parent} is {_kind(parent)}, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunOptionError(option, path, f"cannot be created: {parent} is not writable")


def _kind(path: str) -> str:
    return "a file" if os.path.isfile(path) else "a FIFO, socket or device"


def _check_preload(modules: list[str]) -> None:
    for module in modules:
        top = module.split(".")[0]
        if not top.isidentifier() or _find(top) is None:
            raise RunOptionError("--preload", module, "no such module on the Python path")


def _find(module: str) -> object | None:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _check_script(args: argparse.Namespace) -> None:
    script = str(args.training_script)
    if args.module and args.no_python:
        raise RunOptionError("-m", script, "-m and --no-python exclude each other")
    checks: list[tuple[bool, Callable[[], object], str, str]] = [
        (args.module, lambda: script.split(".")[0].isidentifier() and _find(script.split(".")[0]),
         "-m", "no such module on the Python path"),
        (args.no_python, lambda: shutil.which(script), "--no-python",
         "no such program (not a file, not on PATH)"),
    ]  # fmt: skip
    for chosen, found, option, why in checks:
        if chosen:
            if not found():
                raise RunOptionError(option, script, why)
            return
    if not os.path.isfile(script):
        raise RunOptionError("training script", script, "no such file: give its path")
