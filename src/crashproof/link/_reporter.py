"""What a checkpoint manager tells ``crashproof run``: beats, phases and events.

:class:`CheckpointManager` holds one reporter. Under the supervisor it is a
:class:`SupervisedReporter`: each finished step beats the heartbeat, saves and restores run in
their own phases (each with its own hang allowance), and rank 0 appends ``restore``,
``checkpoint`` and periodic ``progress`` events to the run's log. Outside the supervisor it is an
:class:`Unsupervised` reporter whose methods do nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from crashproof._units import parse_duration
from crashproof.link._heartbeat import HeartbeatWriter, Phase, worker_heartbeat
from crashproof.telemetry import EventLog, worker_event_log

__all__ = ["SupervisedReporter", "Unsupervised", "trainer_reporter"]

PROGRESS_INTERVAL_S = 2.0
"""How often rank 0 logs a ``progress`` event (step and step time): often enough for the goodput
report to place steps on its timeline, a few thousand lines for an hour's run;
overridable with ``CRASHPROOF_PROGRESS_INTERVAL_S`` (a duration: ``0.5``, ``2s``, ``1m``)."""
ENV_PROGRESS_INTERVAL = "CRASHPROOF_PROGRESS_INTERVAL_S"


class Unsupervised:
    """Not run by ``crashproof run``: nothing to tell."""

    def step_done(self, step: int) -> None:
        pass

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        yield

    @contextmanager
    def compute_section(self) -> Iterator[None]:
        yield

    def restored(
        self,
        step: int,
        source: str,
        seconds: float,
        *,
        kind: str = "local",
        nbytes: int = 0,
        verified_by: str = "restore",
    ) -> None:
        pass

    def committed(
        self, step: int, path: str, blocking_s: float, persist_s: float, nbytes: int
    ) -> None:
        pass

    def preempted(self, source: str, step: int, seconds: float, *, saved: bool) -> None:
        pass

    def closed(self) -> None:
        pass


class SupervisedReporter:
    def __init__(self, heartbeat: HeartbeatWriter, events: EventLog | None, *, rank: int) -> None:
        self._heartbeat = heartbeat
        self._events = events if rank == 0 else None  # one voice per run is enough
        self._progress_at: tuple[float, int] | None = None
        interval = os.environ.get(ENV_PROGRESS_INTERVAL, "")
        self._progress_interval_s = (
            parse_duration(interval, ENV_PROGRESS_INTERVAL, zero_ok=True)
            if interval
            else PROGRESS_INTERVAL_S
        )

    def step_done(self, step: int) -> None:
        self._heartbeat.beat(step)
        if self._events is None:
            return
        now = time.monotonic()
        if self._progress_at is None or step < self._progress_at[1]:
            self._progress_at = (now, step)
        elif (
            now - self._progress_at[0] >= self._progress_interval_s and step > self._progress_at[1]
        ):
            since, since_step = self._progress_at
            self._events.emit(
                "progress",
                step=step,
                since_step=since_step,
                step_time_s=round((now - since) / (step - since_step), 6),
            )
            self._progress_at = (now, step)

    @contextmanager
    def compute_section(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._heartbeat.add_work(time.perf_counter() - started)

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        previous = self._heartbeat.phase
        self._heartbeat.set_phase(phase)
        try:
            yield
        finally:
            self._heartbeat.set_phase(previous)

    def restored(
        self,
        step: int,
        source: str,
        seconds: float,
        *,
        kind: str = "local",
        nbytes: int = 0,
        verified_by: str = "restore",
    ) -> None:
        """``kind``: ``memory`` (the agent's), ``local`` (the root) or ``tier``; ``nbytes``:
        what rank 0 read and verified; ``verified_by``: ``agent`` where the agent had checked
        rank 0's snapshot in its memory already, else ``restore`` (hashed as it was read)."""
        self._heartbeat.restored(step)
        self._progress_at = None
        if self._events is not None:
            self._events.emit(
                "restore", step=step, source=source, seconds=round(seconds, 4), kind=kind,
                bytes=nbytes, verified_by=verified_by,
            )  # fmt: skip

    def committed(
        self, step: int, path: str, blocking_s: float, persist_s: float, nbytes: int
    ) -> None:
        if self._events is not None:
            self._events.emit(
                "checkpoint",
                step=step,
                path=path,
                blocking_s=round(blocking_s, 4),
                persist_s=round(persist_s, 4),
                bytes=nbytes,
            )

    def preempted(self, source: str, step: int, seconds: float, *, saved: bool) -> None:
        if self._events is not None:
            self._events.emit(
                "emergency_checkpoint",
                source=source,
                step=step,
                seconds=round(seconds, 4),
                saved=saved,
            )

    def closed(self) -> None:
        # Done only when the training ended as it should: a close() on the way out of an error
        # (a `with` block, a `finally`) leaves a failure to restart, not finished work. A
        # PreemptedExit (exit 75) is the supervisor's to handle as a preemption.
        if _ending_normally():
            self._heartbeat.set_phase("done")


def _ending_normally() -> bool:
    """Whether no exception is on its way up through this call but ``sys.exit()`` / ``exit(0)``."""
    exc = sys.exc_info()[1]
    return exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0))


def trainer_reporter(rank: int) -> SupervisedReporter | Unsupervised:
    heartbeat = worker_heartbeat()
    if heartbeat is None:
        return Unsupervised()
    return SupervisedReporter(heartbeat, worker_event_log(), rank=rank)
