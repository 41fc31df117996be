"""Replication by the agent: uploads that outlive the trainers.

Under ``crashproof run`` a checkpoint manager with durable tiers does not copy in its own process
(a crash or a restart of the trainers would cut an upload short). Rank 0 describes the job in
``RUN_DIR/replication/<key>.json`` (the local root, the tiers, their retention) and the agent's
:class:`ReplicationHost` runs the same :class:`~crashproof.checkpoint._replication.TierReplicator`
threads the manager would, for as long as the agent lives. They talk through files:

- ``<key>.json``: the job, written once by the trainer;
- ``<key>.status.json``: each tier's status and durable steps, rewritten by the host every poll;
- ``<key>.forget``: a rollback's "remove everything after step N" (the host consumes it).

When the run ends the host waits (at most ``--replication-timeout``) for what is still pending,
so the run's last checkpoint reaches its tiers even when the trainers have exited.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from crashproof.checkpoint._replication import (
    LocalCheckpoints,
    Tier,
    TierReplicator,
    TierStatus,
    plan_backlog,
)
from crashproof.errors import ConfigError
from crashproof.policy import RetentionPolicy, policy_from_spec, policy_to_spec
from crashproof.storage import storage_for
from crashproof.telemetry._events import EventLog

__all__ = [
    "ENV_AGENT_REPLICATION",
    "POLL_S",
    "AgentTier",
    "ReplicationHost",
    "agent_tiers",
    "job_paths",
    "read_status",
    "write_atomically",
]

log = logging.getLogger("crashproof.replication")

ENV_AGENT_REPLICATION = "CRASHPROOF_AGENT_REPLICATION"
"""Set by ``crashproof run`` for its trainers: the directory where the agent takes replication
jobs. Absent: managers replicate in their own process."""

POLL_S = 0.5


@dataclass(frozen=True)
class JobPaths:
    spec: str
    status: str
    forget: str


def job_paths(directory: str, key: str) -> JobPaths:
    base = os.path.join(directory, key)
    return JobPaths(f"{base}.json", f"{base}.status.json", f"{base}.forget")


def write_atomically(path: str, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` as JSON in one rename: a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_status(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class _Job:
    def __init__(self, paths: JobPaths, spec: dict[str, Any], events: EventLog) -> None:
        self.paths = paths
        root, local = storage_for(str(spec["root"]))
        keep = policy_from_spec(spec["keep"])
        self.replicators = [
            TierReplicator(local, root, Tier.from_json(t), keep=keep, emit=events.emit)
            for t in spec["tiers"]
        ]

    def poll(self) -> None:
        try:
            with open(self.paths.forget, encoding="utf-8") as f:
                after = int(f.read().strip())
            os.unlink(self.paths.forget)
        except (OSError, ValueError):
            after = None
        for replicator in self.replicators:
            if after is not None:
                replicator.forget_after(after)
            replicator.notify()
        self.write_status()

    def write_status(self) -> None:
        write_atomically(
            self.paths.status,
            {
                "updated": time.time(),
                "tiers": [
                    r.status().to_json() | {"durable": r.durable()} for r in self.replicators
                ],
            },
        )

    def settled(self) -> bool:
        return all(not r.status().pending for r in self.replicators)


class ReplicationHost:
    """The agent's replication threads: takes jobs from ``directory`` until :meth:`close`."""

    def __init__(self, directory: str, events: EventLog) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._events = events
        self._jobs: dict[str, _Job] = {}
        self._refused: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="crashproof-replication", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    def _poll(self) -> None:
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(".json") or name.endswith(".status.json"):
                continue
            key = name[: -len(".json")]
            if key not in self._jobs and key not in self._refused:
                self._take(key)
        for job in list(self._jobs.values()):
            try:
                job.poll()
            except OSError as exc:
                log.warning("replication status in %s: %s", self.directory, exc)

    def _take(self, key: str) -> None:
        paths = job_paths(self.directory, key)
        try:
            with open(paths.spec, encoding="utf-8") as f:
                spec = json.load(f)
            self._jobs[key] = _Job(paths, spec, self._events)
        except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
            log.error("replication job %s cannot be run: %s", paths.spec, exc)
            self._refused.add(key)
            return
        log.info(
            "replicating %s to %s",
            spec["root"],
            ", ".join(t["uri"] for t in spec["tiers"]),
        )

    def close(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for every pending upload, then stop."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._thread.join()
        self._poll()
        while self._jobs and not all(j.settled() for j in self._jobs.values()):
            if time.monotonic() > deadline:
                for job in self._jobs.values():
                    for r in job.replicators:
                        status = r.status()
                        if status.pending:
                            log.error(
                                "stopping with checkpoints %s not yet in %s (last error: %s); "
                                "they stay on the local disk and the next run uploads them",
                                status.pending,
                                status.uri,
                                status.last_error or "none",
                            )
                break
            time.sleep(POLL_S)
            self._poll()
        for job in self._jobs.values():
            for r in job.replicators:
                r.stop()
            job.write_status()


class AgentTier:
    """The trainer's view of one tier replicated by the agent: the same methods as a
    :class:`TierReplicator`, answered from the host's status file."""

    def __init__(
        self, tier: Tier, paths: JobPaths, local: LocalCheckpoints, keep: RetentionPolicy
    ) -> None:
        self.tier = tier
        self._paths, self._local = paths, local
        self._keep = tier.keep if tier.keep is not None else keep

    def notify(self) -> None:
        pass  # the host looks at the local root every POLL_S

    def forget_after(self, step: int) -> None:
        try:
            with open(self._paths.forget, encoding="utf-8") as f:
                step = min(step, int(f.read().strip()))
        except (OSError, ValueError):
            pass
        tmp = f"{self._paths.forget}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(str(step))
        os.replace(tmp, self._paths.forget)

    def _reported(self) -> dict[str, Any]:
        status = read_status(self._paths.status) or {}
        for tier in status.get("tiers", []):
            if isinstance(tier, dict) and tier.get("uri") == self.tier.uri:
                return tier
        return {}

    def _durable(self, reported: dict[str, Any]) -> dict[int, str]:
        durable = reported.get("durable") or {}
        return {int(s): str(d) for s, d in durable.items()}

    def protected(self) -> set[int]:
        durable = self._durable(self._reported())
        todo, _ = plan_backlog(self._local.scan(), durable, {}, self._keep, self.tier.max_backlog)
        return set(todo)

    def status(self) -> TierStatus:
        reported = self._reported()
        durable = self._durable(reported)
        todo, _ = plan_backlog(self._local.scan(), durable, {}, self._keep, self.tier.max_backlog)
        uploading = reported.get("uploading")
        return TierStatus(
            uri=self.tier.uri,
            newest_durable=max(durable) if durable else None,
            pending=sorted(todo, reverse=True),
            uploading=None
            if not uploading
            else (int(uploading["step"]), float(uploading["since"])),
            failing_since=reported.get("failing_since"),
            last_error=str(reported.get("last_error", "")),
            uploaded=int(reported.get("uploaded", 0)),
            bytes_uploaded=int(reported.get("bytes_uploaded", 0)),
            dropped=list(reported.get("dropped", [])),
        )

    def wait_durable(self, step: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if (status.newest_durable or -1) >= step and not status.pending:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))

    def stop(self, timeout_s: float = 5.0) -> None:
        pass  # the uploads are the agent's: they go on after this trainer


def agent_tiers(
    root: str, tiers: list[Tier], keep: RetentionPolicy, local: LocalCheckpoints
) -> list[AgentTier] | None:
    """Hand the replication of ``root`` to the agent of ``crashproof run``, if there is one and
    the job can be described (built-in retention policies, JSON storage options); else None."""
    directory = os.environ.get(ENV_AGENT_REPLICATION)
    if not directory or "://" in root:
        return None
    described = [t.to_json() for t in tiers]
    keep_spec = policy_to_spec(keep)
    if keep_spec is None or any(d is None for d in described):
        log.info(
            "replicating %s in the trainer's process: a retention policy or storage option "
            "cannot be handed to the agent",
            root,
        )
        return None
    root = os.path.abspath(root)
    key = hashlib.sha256(root.encode()).hexdigest()[:16]
    paths = job_paths(directory, key)
    # A status left by an earlier attempt must not vouch for this one: until the host writes a
    # fresh one, nothing counts as durable (local retention then spares the whole backlog).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.status)
    write_atomically(paths.spec, {"root": root, "keep": keep_spec, "tiers": described})
    return [AgentTier(t, paths, local, keep) for t in tiers]
