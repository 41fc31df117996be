"""Replication by the agent: uploads that outlive the trainers.

Under ``crashproof run`` a checkpoint manager with durable tiers does not copy in its own process
(a crash or a restart of the trainers would cut an upload short). Rank 0 describes the job in
``RUN_DIR/replication/<key>.json`` (the local root, the tiers, their retention) and the agent's
:class:`ReplicationHost` runs the same :class:`~crashproof.checkpoint.tiers._replicator.TierReplicator`
threads the manager would, for as long as the agent lives. They talk through files:

- ``<key>.json``: the job, written once by the trainer;
- ``<key>.status.json``: each tier's status, durable steps and their facts, rewritten by the host
  every poll (the trainer plans its local retention from the same facts the host uploads by).

A rollback needs no message: its mark is in the local root, which the host's replicators read.

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

from crashproof._files import read_json_object, write_json_atomically
from crashproof.checkpoint.root import abandoned_steps, read_marks
from crashproof.checkpoint.tiers._backlog import LocalCheckpoints, plan_backlog
from crashproof.checkpoint.tiers._replicator import TierReplicator
from crashproof.checkpoint.tiers._tier import Tier, TierStatus
from crashproof.policy import CheckpointFacts, RetentionPolicy, policy_from_spec, policy_to_spec
from crashproof.storage import storage_for
from crashproof.telemetry import EventLog

__all__ = [
    "ENV_AGENT_REPLICATION",
    "POLL_S",
    "AgentTier",
    "ReplicationHost",
    "agent_tiers",
    "job_paths",
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


def job_paths(directory: str, key: str) -> JobPaths:
    base = os.path.join(directory, key)
    return JobPaths(f"{base}.json", f"{base}.status.json")


class _Job:
    def __init__(self, paths: JobPaths, spec: dict[str, Any], events: EventLog) -> None:
        self.paths = paths
        root, local = storage_for(str(spec["root"]))
        keep = policy_from_spec(spec["keep"])
        tiers = [Tier.from_json(t) for t in spec["tiers"]]  # all parsed before a thread starts
        self.replicators: list[TierReplicator] = []
        try:
            for tier in tiers:
                self.replicators.append(
                    TierReplicator(local, root, tier, keep=keep, emit=events.emit)
                )
        except BaseException:
            self.stop()
            raise

    def poll(self) -> None:
        for replicator in self.replicators:
            replicator.notify()
        self.write_status()

    def write_status(self) -> None:
        write_json_atomically(
            self.paths.status,
            {
                "updated": time.time(),
                "tiers": [r.status().to_json() | r.known() for r in self.replicators],
            },
        )

    def settled(self) -> bool:
        return all(not r.status().pending for r in self.replicators)

    def stop(self) -> None:
        for r in self.replicators:
            r.stop()


class ReplicationHost:
    """The agent's replication threads: takes jobs from ``directory`` until :meth:`close`.

    A job whose spec file changes (a trainer restarted with other tiers) is taken again. No
    failure of one job stops the host or the other jobs."""

    def __init__(self, directory: str, events: EventLog) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._events = events
        self._jobs: dict[str, tuple[int, _Job]] = {}  # key -> (spec mtime_ns, job)
        self._refused: dict[str, int] = {}  # key -> spec mtime_ns that could not be run
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="crashproof-replication", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    def _poll(self) -> None:
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as exc:
            log.warning("replication jobs in %s: %s", self.directory, exc)
            return
        for name in names:
            if name.endswith(".json") and not name.endswith(".status.json"):
                self._maybe_take(name[: -len(".json")])
        for key, (_, job) in list(self._jobs.items()):
            try:
                job.poll()
            except Exception as exc:
                log.warning("replication job %s: %s", key, exc)

    def _maybe_take(self, key: str) -> None:
        paths = job_paths(self.directory, key)
        try:
            version = os.stat(paths.spec).st_mtime_ns
        except OSError:
            return
        current = self._jobs.get(key)
        if (current is not None and current[0] == version) or self._refused.get(key) == version:
            return
        if current is not None:
            current[1].stop()
            del self._jobs[key]
        try:
            with open(paths.spec, encoding="utf-8") as f:
                spec = json.load(f)
            self._jobs[key] = (version, _Job(paths, spec, self._events))
        except Exception as exc:  # a bad spec, bad options, missing credentials...
            log.error(
                "replication job %s cannot be run: %s: %s", paths.spec, type(exc).__name__, exc
            )
            self._refused[key] = version
            return
        log.info("replicating %s to %s", spec["root"], ", ".join(t["uri"] for t in spec["tiers"]))

    def close(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for every pending upload, then stop. Never raises: it runs
        while ``crashproof run`` ends."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._thread.join()
        try:
            self._poll()
            jobs = [job for _, job in self._jobs.values()]
            while jobs and not all(j.settled() for j in jobs):
                if time.monotonic() > deadline:
                    self._report_pending(jobs)
                    break
                time.sleep(POLL_S)
                self._poll()
            for job in jobs:
                job.stop()
                job.write_status()
        except Exception as exc:
            log.error("replication did not close cleanly: %s: %s", type(exc).__name__, exc)

    @staticmethod
    def _report_pending(jobs: list[_Job]) -> None:
        for job in jobs:
            for r in job.replicators:
                status = r.status()
                if status.pending:
                    log.error(
                        "stopping with checkpoints %s not yet in %s (last error: %s); they stay "
                        "on the local disk and the next run uploads them",
                        status.pending,
                        status.uri,
                        status.last_error or "none",
                    )


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

    def _reported(self) -> dict[str, Any]:
        status = read_json_object(self._paths.status) or {}
        for tier in status.get("tiers", []):
            if isinstance(tier, dict) and tier.get("uri") == self.tier.uri:
                return tier
        return {}

    @staticmethod
    def _known(reported: dict[str, Any]) -> tuple[dict[int, str], dict[int, CheckpointFacts]]:
        """What the host says the tier holds (malformed: nothing, which errs toward keeping)."""
        try:
            durable = {int(s): str(d) for s, d in (reported.get("durable") or {}).items()}
            facts = {
                int(s): CheckpointFacts(int(s), f[0], f[1] or {})
                for s, f in (reported.get("facts") or {}).items()
            }
        except (TypeError, ValueError, IndexError, AttributeError):
            return {}, {}
        return durable, facts

    def _pending(self, reported: dict[str, Any]) -> list[int]:
        """The host's own plan, from the same facts it plans with."""
        durable, facts = self._known(reported)
        todo, _ = plan_backlog(
            self._local.scan(), durable, facts, self._keep, self.tier.max_backlog
        )
        return todo

    def _abandoned_there(self, reported: dict[str, Any]) -> bool:
        durable, facts = self._known(reported)
        marks = read_marks(self._local.storage, self._local.root)
        return bool(abandoned_steps(marks, durable, facts))

    def protected(self) -> set[int]:
        return set(self._pending(self._reported()))

    def status(self) -> TierStatus:
        return self._status(self._reported())

    def _status(self, reported: dict[str, Any]) -> TierStatus:
        durable, _ = self._known(reported)
        uploading = reported.get("uploading")
        return TierStatus(
            uri=self.tier.uri,
            newest_durable=max(durable) if durable else None,
            pending=sorted(self._pending(reported), reverse=True),
            uploading=None
            if not uploading
            else (int(uploading["step"]), float(uploading["since"])),
            failing_since=reported.get("failing_since"),
            last_error=str(reported.get("last_error", "")),
            uploaded=int(reported.get("uploaded", 0)),
            bytes_uploaded=int(reported.get("bytes_uploaded", 0)),
            dropped=list(reported.get("dropped", [])),
        )

    def wait_durable(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            reported = self._reported()  # read once per poll
            status = self._status(reported)
            if (
                status.newest_durable is not None
                and not status.pending
                and not self._abandoned_there(reported)
            ):
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
    write_json_atomically(paths.spec, {"root": root, "keep": keep_spec, "tiers": described})
    return [AgentTier(t, paths, local, keep) for t in tiers]
