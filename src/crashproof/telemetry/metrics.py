"""Prometheus metrics of a supervised run, served by ``crashproof run`` (loopback by default).

Every number comes from the run's event log (``events.jsonl``), which this module follows from a
background thread: the supervisor's own events and the trainers' (checkpoints, restores,
progress) arrive the same way, so the metrics say exactly what the log says, and a trainer
needs no metrics server of its own. Names and alert rules: docs/metrics.md and
``examples/prometheus_alerts.yml``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

from crashproof._rundir import RunDir
from crashproof._version import __version__
from crashproof.telemetry._events import EventTail, LogFollower
from crashproof.telemetry._failures import failure_kind

__all__ = ["FAILURE_KINDS", "RunMetrics", "failure_label"]

log = logging.getLogger(__name__)

_POLL_S = 1.0
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800, 3600)
"""From a small model's millisecond pause to the hour a large model's write to a slow bucket can
take (``+Inf`` is added)."""

FAILURE_KINDS = ("killed", "error", "hang", "numerics", "preemption", "storage")
"""Every ``kind`` label of ``crashproof_failures_total``: each is exported from the start, at 0,
so that ``increase()`` and alerts see the first failure of a kind."""

disable_created_metrics()  # type: ignore[no-untyped-call]  # no ``*_created`` series: they double every counter for no use here


_LABELS = {"crash": "error", "preempted": "preemption"}
"""The ``kind`` label of each kind of failure where the words differ (docs/metrics.md)."""


def failure_label(event: dict[str, Any]) -> str | None:
    """The ``kind`` label of the failure an event reports (telemetry's one classifier,
    :func:`crashproof.telemetry.failure_kind`), or None for other events."""
    kind = failure_kind(event)
    if kind == "preempted" and event.get("event") == "rank_exit":
        return None  # each rank's exit 75 is the run's one preemption, counted by its event
    return _LABELS.get(kind, kind) if kind is not None else None


class RunMetrics:
    """The run's metrics, in their own registry, updated from ``RUN_DIR/events.jsonl``.

    ``ettr`` (optional) computes the effective training time ratio from the event log's path;
    it is called every ``ettr_interval_s``, not at every event (it reads the whole log).
    """

    def __init__(
        self,
        run_dir: str,
        *,
        ettr: Callable[[str], float | None] | None = None,
        ettr_interval_s: float = 15.0,
    ) -> None:
        self.path = RunDir(run_dir).events
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("crashproof_step", "Last training step reported", registry=r)
        self.step_time = Gauge(
            "crashproof_step_time_seconds", "Mean wall time per step, recent", registry=r
        )
        self.progress_ts = Gauge(
            "crashproof_last_progress_timestamp_seconds",
            "Unix time of the last sign of training progress (step, checkpoint or restore)",
            registry=r,
        )
        self.checkpoints = Counter("crashproof_checkpoints", "Checkpoints committed", registry=r)
        self.blocking = Histogram(
            "crashproof_checkpoint_blocking_seconds",
            "Time training paused for each checkpoint",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.persist = Histogram(
            "crashproof_checkpoint_persist_seconds",
            "Time to write, checksum and commit each checkpoint (in the background)",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.checkpoint_bytes = Counter(
            "crashproof_checkpoint_bytes", "Bytes written by checkpoints (all ranks')", registry=r
        )
        self.restarts = Counter("crashproof_restarts", "Restarts of the worker group", registry=r)
        self.failures = Counter("crashproof_failures", "Failures, by kind", ["kind"], registry=r)
        for kind in FAILURE_KINDS:
            self.failures.labels(kind=kind)
        self.restore = Histogram(
            "crashproof_restore_seconds",
            "Time to verify and load each restored checkpoint",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.restores = Counter(
            "crashproof_restores",
            "Restores, by where the state was read (memory: the agent's; peer; local; tier)",
            ["kind"],
            registry=r,
        )
        for kind in ("memory", "peer", "local", "tier"):
            self.restores.labels(kind=kind)
        self.last_checkpoint_ts = Gauge(
            "crashproof_last_checkpoint_timestamp_seconds",
            "Unix time of the newest committed checkpoint",
            registry=r,
        )
        self.run_info = Info(
            "crashproof_run", "The run: its id, script, size and crashproof's version", registry=r
        )
        self.backlog = Gauge(
            "crashproof_replication_backlog",
            "Checkpoints waiting to be copied to a durable tier",
            ["tier"],
            registry=r,
        )
        self.durable_step = Gauge(
            "crashproof_durable_step",
            "The newest step durable in a tier (copied and read back)",
            ["tier"],
            registry=r,
        )
        self.straggler = Gauge(
            "crashproof_straggler_ratio",
            "A rank's work per step over its peers' median while it is a straggler (0: not)",
            ["rank"],
            registry=r,
        )
        self.standby = Gauge(
            "crashproof_standby",
            "1 while this agent waits as a hot spare (the run has all its nodes), else 0",
            registry=r,
        )
        self.standby_spares = Gauge(
            "crashproof_standby_spares",
            "Hot spares waiting in the rendezvous, as this agent last counted them (--standby)",
            registry=r,
        )
        self.standby_wanted = Gauge(
            "crashproof_standby_wanted",
            "The hot spares the run should keep (--standby N; 0: not asked)",
            registry=r,
        )
        self.memory_missing = Counter(
            "crashproof_memory_missing",
            "Snapshots of a rank starting here that the peers could not give back (too many "
            "nodes lost, or a damaged piece): that rank restored from storage",
            registry=r,
        )
        self.ettr = Gauge(
            "crashproof_ettr_ratio",
            "Effective training time ratio so far: productive step time / wall time",
            registry=r,
        )
        self.ettr_deprecated = Gauge(
            "crashproof_ettr",
            "Deprecated: crashproof_ettr_ratio (the same value); removed in the next release",
            registry=r,
        )
        self._ettr_fn, self._ettr_interval_s = ettr, ettr_interval_s
        self._ettr_due = 0.0
        self._tail = EventTail(self.path)
        self._last_step = -1
        self._hang_counted = False  # a hang of this worker group counted already
        self._durable: dict[str, int] = {}  # the newest durable step by tier
        self._follower: LogFollower | None = None
        self.port: int | None = None

    # -- serving -----------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port) and start following the log;
        returns the port."""
        server = _serve_http(host, port, self.registry)
        self.port = int(server.server_address[1])
        self._server = server
        self._follower = LogFollower(self.poll, interval_s=_POLL_S, name="crashproof-metrics")
        return self.port

    def close(self) -> None:
        """Stop following the log, after the last events (run_end) too, and stop serving."""
        if self._follower is not None:
            self._follower.close()
        else:
            self.poll()
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()

    # -- reading the log -----------------------------------------------------------------------

    def poll(self) -> None:
        """Apply the events appended since the last call."""
        for event in self._tail.read_new():
            self.observe(event)
        if self._ettr_fn is not None and time.monotonic() >= self._ettr_due:
            self._ettr_due = time.monotonic() + self._ettr_interval_s
            value = self._ettr_fn(self.path)
            if value is not None:
                self.ettr.set(value)
                self.ettr_deprecated.set(value)

    def observe(self, event: dict[str, Any]) -> None:
        name, ts = event.get("event"), float(event.get("ts", 0.0))
        kind = failure_label(event)
        if kind == "hang":  # one event per silent rank (its peers wait on it): one failure
            kind, self._hang_counted = (None if self._hang_counted else kind), True
        elif name in ("restart", "run_start"):
            self._hang_counted = False
        if kind is not None:
            self.failures.labels(kind=kind).inc()
        if name == "progress":
            self._last_step = int(event["step"])
            self.step.set(self._last_step)
            self.step_time.set(event["step_time_s"])
            self.progress_ts.set(ts)
        elif name == "checkpoint":
            self._last_step = max(self._last_step, int(event["step"]))
            self.step.set(self._last_step)
            self.checkpoints.inc()
            self.blocking.observe(event["blocking_s"])
            self.persist.observe(event["persist_s"])
            self.checkpoint_bytes.inc(event.get("bytes", 0))
            self.progress_ts.set(ts)
            self.last_checkpoint_ts.set(ts)
        elif name == "restore":
            self._last_step = int(event["step"])  # training goes on from there, not further
            self.step.set(self._last_step)
            self.restore.observe(event["seconds"])
            self.restores.labels(kind=str(event.get("kind", "local"))).inc()
            self.progress_ts.set(ts)
        elif name == "restart":
            self.restarts.inc()
            for child in list(self.straggler._metrics):  # a new group: no straggler yet
                self.straggler.labels(*child).set(0)
        elif name == "straggler":
            self.straggler.labels(rank=str(event["rank"])).set(event["ratio"])
        elif name == "straggler_recovered":
            self.straggler.labels(rank=str(event["rank"])).set(0)
        elif name == "run_start":
            self.progress_ts.set(ts)
            self.run_info.info(_run_labels(event))
        elif name == "replicated":
            tier = str(event.get("tier"))
            self._durable[tier] = max(int(event["step"]), self._durable.get(tier, -1))
            self.durable_step.labels(tier=tier).set(self._durable[tier])
            if isinstance(event.get("pending"), int):
                self.backlog.labels(tier=tier).set(event["pending"])
        elif name == "replication_failed":
            self.backlog.labels(tier=str(event.get("tier"))).set(len(event.get("pending") or []))
        elif name in ("standby", "standby_promoted"):
            self.standby.set(1 if name == "standby" else 0)
        elif name == "standby_pool":
            self.standby_spares.set(int(event.get("waiting", 0)))
            self.standby_wanted.set(int(event.get("wanted", 0)))
        elif name == "memory_missing":
            self.memory_missing.inc()


def _run_labels(event: dict[str, Any]) -> dict[str, str]:
    """``crashproof_run_info``'s labels, from the ``run_start`` event."""
    return {
        "run_id": str(event.get("run_id", "")),
        "script": str(event.get("script", "")),
        "nnodes": str(event.get("nnodes", "")),
        "nproc_per_node": str(event.get("nproc_per_node", "")),
        "max_restarts": str(event.get("max_restarts", "")),
        "version": __version__,
    }


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not news: no line on stderr per request."""


class _Server4(ThreadingWSGIServer):
    address_family = socket.AF_INET


class _Server6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


_SHUTDOWN_POLL_S = 0.05
"""How often the server looks whether it is asked to stop: prometheus_client's own server looks
every 0.5 s, half a second added to the end of every run."""


def _serve_http(host: str, port: int, registry: CollectorRegistry) -> ThreadingWSGIServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread."""
    server_class = _Server6 if ":" in host else _Server4
    server = make_server(
        host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
    )
    threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": _SHUTDOWN_POLL_S},
        name="crashproof-metrics-http",
        daemon=True,
    ).start()
    return server
