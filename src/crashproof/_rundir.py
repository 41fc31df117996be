"""The layout of a run directory (``crashproof run --run-dir``): every file and folder in it,
named here once.

The agent creates the directory and tells its trainers where it is (``CRASHPROOF_RUN_DIR``);
everything else finds its files through :class:`RunDir`. What is inside a job's replication
folder (:mod:`crashproof.checkpoint`) and inside torch's log folder is theirs to name; where those
folders are is named here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ENV_RUN_DIR", "EVENTS_FILE", "RunDir"]

ENV_RUN_DIR = "CRASHPROOF_RUN_DIR"
"""Set by ``crashproof run`` for its trainers: the run directory they report into."""

EVENTS_FILE = "events.jsonl"
"""The event log's name in the run directory (``crashproof ls`` recognises a run by it)."""


@dataclass(frozen=True, slots=True)
class RunDir:
    """The files and folders of the run directory at ``path``."""

    path: str

    @classmethod
    def from_env(cls) -> RunDir | None:
        """The run directory ``crashproof run`` gave this process; None outside it."""
        path = os.environ.get(ENV_RUN_DIR)
        return cls(path) if path else None

    def _join(self, *names: str) -> str:
        return os.path.join(self.path, *names)

    @property
    def events(self) -> str:
        """``events.jsonl``, the event log: appended to by the agent and every trainer; read by
        ``crashproof report``, the metrics endpoint, ``crashproof chaos``, the adaptive save
        policy and ``crashproof ls``."""
        return self._join(EVENTS_FILE)

    @property
    def heartbeats(self) -> str:
        """``heartbeats/``: one folder per agent (node), made by the agent."""
        return self._join("heartbeats")

    def heartbeat_dir(self, agent: str) -> str:
        """``heartbeats/<agent>/``: the agent's trainers keep their records in it (the agent
        passes it in ``CRASHPROOF_HEARTBEAT_DIR``); ``"*"``: a glob pattern of every agent's."""
        return os.path.join(self.heartbeats, agent)

    @staticmethod
    def heartbeat_file(heartbeat_dir: str, local_rank: int | str) -> str:
        """``<heartbeat dir>/local_rank_<k>``: written in place by the trainer of local rank
        ``k``; read by its agent every monitor interval and by ``crashproof chaos`` (``"*"``:
        a glob pattern of every rank's)."""
        return os.path.join(heartbeat_dir, f"local_rank_{local_rank}")

    @staticmethod
    def session_of(heartbeat_dir: str) -> str:
        """The agent's session (``<host>-<pid>``, made unique) that ``heartbeat_dir`` is of: a
        requeued job that reuses the run directory starts a new one and never writes into an
        earlier one's folders."""
        return os.path.basename(os.path.normpath(heartbeat_dir))

    def stack_dir(self, session: str, attempt: int | str) -> str:
        """``stacks/<session>/attempt_<k>/``: the stack dumps of the agent session's attempt
        ``k`` (per session: an earlier session's dumps, a hang that made a job requeue, stay);
        the agent removes it when it holds no dump."""
        return self._join("stacks", session, f"attempt_{attempt}")

    def stack_dump(self, session: str, attempt: int | str, rank: int | str) -> str:
        """``stacks/<session>/attempt_<k>/rank_<r>.txt``: opened (created, or appended to) by
        each trainer at its start, written when the agent asks for its stacks (a hang, a rank
        ended after it was done); named in the ``hang`` and ``done_hang`` events. ``"*"``: a glob
        pattern."""
        return os.path.join(self.stack_dir(session, attempt), f"rank_{rank}.txt")

    @property
    def logs(self) -> str:
        """``logs/``: every rank's output, kept by torch's agent as
        ``<run id>/attempt_<k>/<local rank>/std{out,err}.log`` (``crashproof run``'s default
        ``--log-dir``); searched by ``crashproof chaos``."""
        return self._join("logs")

    @property
    def rank_logs(self) -> str:
        """A glob pattern of every rank's log file under :attr:`logs`."""
        return os.path.join(self.logs, "*", "attempt_*", "*", "*.log")

    @property
    def notice(self) -> str:
        """``notice.json``: a cloud preemption notice's deadline, written by the agent; read by
        the trainers (``CRASHPROOF_NOTICE_FILE`` names it)."""
        return self._join("notice.json")

    @property
    def metrics_url(self) -> str:
        """``metrics_url``: where the agent serves its Prometheus metrics, written by it."""
        return self._join("metrics_url")

    @property
    def replication(self) -> str:
        """``replication/``: the agent's replication jobs, written by rank 0's checkpoint
        manager, and their status, written by the agent (``CRASHPROOF_AGENT_REPLICATION``
        names it)."""
        return self._join("replication")

    @property
    def report_page(self) -> str:
        """``report.html``: ``crashproof report``'s page, unless ``--html`` says otherwise."""
        return self._join("report.html")

    @property
    def chaos_log(self) -> str:
        """``chaos.jsonl``: a chaos campaign's record of its injections, one JSON object per
        line, appended by ``crashproof chaos``."""
        return self._join("chaos.jsonl")

    def chaos_control(self, seam: str) -> str:
        """``chaos/<seam>.json``: the faults a campaign arms for a seam (``nan``, ``storage``),
        rewritten by ``crashproof chaos``, read by the trainers' seams, which append what fired
        to ``<file>.fired``."""
        return self._join("chaos", f"{seam}.json")

    @property
    def chaos_report(self) -> str:
        """``chaos_report.json``: a campaign's verdict, written by ``crashproof chaos`` unless
        ``--report`` says otherwise."""
        return self._join("chaos_report.json")
