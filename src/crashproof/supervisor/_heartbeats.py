"""What the agent reads of its running trainers: their heartbeat records.

One :class:`GroupHeartbeats` per agent keeps the records of its trainers in one folder of the run
directory and reads them each monitor interval: the furthest step the attempt has shown (a
failure's ``step``), the step it restored, which trainers are hung and which are stragglers.
It decides nothing itself (:mod:`crashproof.supervisor._hang` and
:mod:`crashproof.supervisor._straggler` do) and sends nothing (the agent does).
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterable

from torch.distributed.elastic.agent.server.api import Worker

from crashproof._rundir import RunDir
from crashproof.link import Heartbeat, read_heartbeat
from crashproof.supervisor._hang import HangDetector, Verdict
from crashproof.supervisor._straggler import StragglerDetector, StragglerReport

__all__ = ["GroupHeartbeats"]


class GroupHeartbeats:
    """The heartbeat records of one agent's trainers, in ``directory``, and what they show."""

    def __init__(self, directory: str, hangs: HangDetector, stragglers: StragglerDetector) -> None:
        self.directory = directory
        self.hangs = hangs
        self.stragglers = stragglers
        self.seen_step = -1
        """The furthest step this attempt's heartbeats have shown."""
        self.seen_start_step = -1
        """The step this attempt's ranks restored, as their heartbeats showed it (-1: none)."""

    def new_attempt(self) -> None:
        """Forget the last attempt: its records must not vouch for the new trainers. (The folder
        is this agent's own, made new: what is in it is its trainers'.)"""
        for stale in glob.glob(RunDir.heartbeat_file(self.directory, "*")):
            os.remove(stale)
        self.seen_step = self.seen_start_step = -1

    def read(self, workers: Iterable[Worker]) -> dict[int, Heartbeat]:
        """The heartbeat of each worker (by local rank) that has one from its current process."""
        beats = {}
        for worker in workers:
            beat = read_heartbeat(RunDir.heartbeat_file(self.directory, worker.local_rank))
            if beat is not None and beat.pid == worker.id:
                beats[worker.local_rank] = beat
        return beats

    def furthest_step(self, workers: Iterable[Worker]) -> int:
        """The furthest step of this attempt: from the records now and every earlier look (a
        record can be unreadable at the moment of a failure)."""
        self._note(self.read(workers).values())
        return self.seen_step

    def hung(self, workers: list[Worker]) -> list[tuple[Worker, Verdict]]:
        """The trainers silent for longer than their phase allows, with the verdict on each."""
        now = time.monotonic()
        beats = self.read(workers)
        self._note(beats.values())
        hung = []
        for worker in workers:
            beat = beats.get(worker.local_rank)
            if beat is None:
                continue  # not (yet) heartbeating: a script that does not use crashproof
            verdict = self.hangs.check(beat, now)
            if verdict is not None:
                hung.append((worker, verdict))
        return hung

    def straggling(self, workers: list[Worker]) -> list[tuple[Worker, StragglerReport]]:
        """The trainers that became, or stopped being, stragglers since the last look."""
        by_local_rank = {w.local_rank: w for w in workers}
        return [
            (by_local_rank[report.local_rank], report)
            for report in self.stragglers.observe(self.read(workers))
        ]

    def _note(self, beats: Iterable[Heartbeat]) -> None:
        for beat in beats:
            self.seen_step = max(self.seen_step, beat.step)
            self.seen_start_step = max(self.seen_start_step, beat.start_step)
