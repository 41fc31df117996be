"""What a campaign sees of a running ``crashproof run``: its events, ranks, steps and logs.

Read-only, from the files the supervisor and the trainers keep in the run directory: the event
log (read incrementally, a torn last line left for the next read) and its goodput ledger, the
``rank_start`` events of the newest attempt (global rank -> pid), the heartbeat records (each
rank's last finished step and phase) and the ranks' log files. Nothing here sends a signal or
writes a file.
"""

from __future__ import annotations

import glob
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from crashproof._rundir import RunDir
from crashproof.link import Heartbeat, read_heartbeat
from crashproof.telemetry import EventTail, Ledger, compute_ledger

__all__ = ["RankProcess", "RunView"]

Event = dict[str, Any]

_LOG_SEARCH_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class RankProcess:
    """One trainer of the newest attempt."""

    rank: int
    local_rank: int
    pid: int
    attempt: int


class RunView:
    """The state of the run whose ``crashproof run --run-dir`` is ``run_dir``."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.layout = RunDir(run_dir)
        self.events: list[Event] = []
        self._tail = EventTail(self.layout.events)
        self._searched: dict[tuple[str, int], tuple[str | None, float]] = {}
        self._ledger: tuple[int, Ledger] | None = None

    def refresh(self) -> list[Event]:
        """Read the events appended since the last call; returns them."""
        new = [e for e in self._tail.read_new() if isinstance(e.get("event"), str)]
        self.events += new
        return new

    def ledger(self) -> Ledger:
        """The goodput ledger of the events read so far (computed again only after new ones)."""
        if self._ledger is None or self._ledger[0] != len(self.events):
            self._ledger = (len(self.events), compute_ledger(self.events, run_dir=self.run_dir))
        return self._ledger[1]

    def of(self, name: str, *, after: float = 0.0, before: float | None = None) -> list[Event]:
        """The events called ``name`` with a time at or after ``after`` (and before ``before``)."""
        end = math.inf if before is None else before
        return [
            e for e in self.events if e["event"] == name and after <= float(e.get("ts", 0)) < end
        ]

    @property
    def attempt(self) -> int:
        """The newest attempt started (-1: none yet)."""
        return max((int(e.get("restart", 0)) for e in self.of("rank_start")), default=-1)

    def ranks(self) -> dict[int, RankProcess]:
        """The trainers of the newest attempt, by global rank."""
        attempt = self.attempt
        return {
            int(e["rank"]): RankProcess(
                int(e["rank"]), int(e["local_rank"]), int(e["pid"]), attempt
            )
            for e in self.of("rank_start")
            if int(e.get("restart", 0)) == attempt and e.get("pid") is not None
        }

    def agent_pid(self) -> int | None:
        """The pid of the agent that started the newest attempt's trainers (None: none yet)."""
        starts = [e for e in self.of("rank_start") if e.get("agent_pid") is not None]
        return int(starts[-1]["agent_pid"]) if starts else None

    def heartbeat(self, process: RankProcess) -> Heartbeat | None:
        """The trainer's heartbeat record, if it has written one (matched by pid)."""
        pattern = RunDir.heartbeat_file(self.layout.heartbeat_dir("*"), process.local_rank)
        for path in glob.glob(pattern):
            beat = read_heartbeat(path)
            if beat is not None and beat.pid == process.pid:
                return beat
        return None

    def step(self) -> int:
        """The furthest step a trainer of the newest attempt has finished (-1: none)."""
        beats = [self.heartbeat(p) for p in self.ranks().values()]
        return max((b.step for b in beats if b is not None), default=-1)

    def ended(self) -> Event | None:
        """The ``run_end`` event, once there is one."""
        ends = self.of("run_end")
        return ends[-1] if ends else None

    def checkpoint_root(self) -> str | None:
        """Where the trainers commit checkpoints (the parent of the newest ``checkpoint``'s
        path; a relative path is the trainers' working directory's, which is the campaign's)."""
        saves = self.of("checkpoint")
        if not saves:
            return None
        return os.path.dirname(str(saves[-1]["path"]).rstrip("/"))

    def log_files(self, *, from_attempt: int = 0) -> list[str]:
        """The ranks' output files (:attr:`RunDir.rank_logs`) of the attempts from
        ``from_attempt`` on."""
        found = []
        for path in glob.glob(self.layout.rank_logs):
            attempt = os.path.basename(os.path.dirname(os.path.dirname(path)))
            try:
                if int(attempt.removeprefix("attempt_")) >= from_attempt:
                    found.append(path)
            except ValueError:
                continue
        return sorted(found)

    def find_in_logs(self, text: str, *, from_attempt: int = 0) -> str | None:
        """The first line of the ranks' logs containing ``text``, or None. The logs are searched
        at most every half second for the same text (a campaign asks every poll)."""
        key = (text, from_attempt)
        found, when = self._searched.get(key, (None, -math.inf))
        if found is None and time.monotonic() - when >= _LOG_SEARCH_INTERVAL_S:
            found = self._search_logs(text, from_attempt)
            self._searched[key] = (found, time.monotonic())
        return found

    def _search_logs(self, text: str, from_attempt: int) -> str | None:
        for path in self.log_files(from_attempt=from_attempt):
            try:
                with open(path, errors="replace") as f:
                    for line in f:
                        if text in line:
                            return line.strip()
            except OSError:
                continue
        return None
