"""Heartbeats from trainers to their supervisor: one small record per rank, rewritten in place.

A trainer run by ``crashproof run`` finds ``CRASHPROOF_HEARTBEAT_DIR`` in its environment and
keeps ``<dir>/local_rank_<k>`` up to date: its pid, the last step it finished, the step it
started from (its restore), the phase it is in (start-up, step, restore, save, done, exiting),
when it entered that phase and when it last beat, the longest gap between two steps since its
previous write, and the seconds it spent in its own work (``compute_section``: the part of a
step with no collective in it, which finds a straggler among ranks that wait for each other). The
supervisor reads these files every monitor interval and decides what is a hang
(:mod:`crashproof.supervisor._hang`); this module only moves the facts.

A record is 72 bytes (a 68-byte body and its CRC-32) written with one ``pwrite``, so a reader
never acts on a torn write. Beats are cheap (a clock read and a ``pwrite`` to the page cache, a
few microseconds; beats without a step are written at most every 10 ms), so beating every step
costs nothing measurable.
"""

from __future__ import annotations

import os
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Literal

from crashproof._rundir import RunDir
from crashproof._runfiles import RunFileRefused, open_run_file

__all__ = [
    "ENV_HEARTBEAT_DIR",
    "FINISHED_PHASES",
    "Heartbeat",
    "HeartbeatWriter",
    "Phase",
    "heartbeat",
    "read_heartbeat",
    "worker_heartbeat",
]

ENV_HEARTBEAT_DIR = "CRASHPROOF_HEARTBEAT_DIR"
"""Set by ``crashproof run``: where each local rank keeps its heartbeat record."""

Phase = Literal["startup", "step", "restore", "save", "done", "exiting"]
_PHASES: tuple[Phase, ...] = ("startup", "step", "restore", "save", "done", "exiting")

FINISHED_PHASES: frozenset[Phase] = frozenset({"done", "exiting"})
"""Final phases: "done", the trainer closed its checkpoint manager normally (its work is
committed); "exiting", its script returned normally and its exit handlers ran, and the process only
waits for torch to collect its result (a warm-started trainer). Only "done" may still lead to
"exiting"; nothing leaves "exiting"."""

_MAGIC = b"CPHB0003"
# magic, pid, step, beat time, phase start, max gap, work seconds, start step, phase
_BODY = struct.Struct("<8sqqddddqI")
_CRC = struct.Struct("<I")
RECORD_SIZE = _BODY.size + _CRC.size
_MIN_WRITE_INTERVAL_S = 0.01  # for beats that finish no step


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One trainer's last record. Times are ``time.monotonic()`` (one clock per machine)."""

    pid: int
    step: int
    """The last step the trainer finished (-1 before the first)."""
    beat_s: float
    """When it last beat."""
    phase: Phase
    phase_started_s: float
    """When it entered ``phase``."""
    max_gap_s: float
    """The longest time between two finished steps since the previous record (0: none yet)."""
    work_s: float = 0.0
    """Seconds spent in compute sections since the trainer started (0: it marks none)."""
    start_step: int = -1
    """The step the trainer started from: the one it restored (-1: none restored yet)."""


def read_heartbeat(path: str) -> Heartbeat | None:
    """The record at ``path``; None when it is missing, empty, or caught half-written."""
    try:
        with open(path, "rb") as f:
            data = f.read(RECORD_SIZE)
    except OSError:
        return None
    if len(data) != RECORD_SIZE:
        return None
    body, (crc,) = data[: _BODY.size], _CRC.unpack(data[_BODY.size :])
    if zlib.crc32(body) != crc:
        return None
    magic, pid, step, beat_s, phase_started_s, max_gap_s, work_s, start, phase = _BODY.unpack(body)
    if magic != _MAGIC or not 0 <= phase < len(_PHASES):
        return None
    return Heartbeat(pid, step, beat_s, _PHASES[phase], phase_started_s, max_gap_s, work_s, start)


class HeartbeatWriter:
    """A trainer's side: records steps and phases into its heartbeat file."""

    def __init__(self, path: str) -> None:
        self.path = path
        # In the agent's own folder, made new for its session; never through a link.
        self._fd = open_run_file(os.path.dirname(path), os.path.basename(path), "rewrite")
        self._pid = os.getpid()
        self._step = -1
        self._start_step = -1
        self._phase: Phase = "startup"
        now = time.monotonic()
        self._phase_started_s = now
        self._last_step_s = 0.0  # when the last step finished (0: none yet)
        self._max_gap_s = 0.0
        self._work_s = 0.0
        self._written_s = 0.0
        self._write(now)

    def add_work(self, seconds: float) -> None:
        """Count ``seconds`` of this rank's own work (sent with the next beat)."""
        self._work_s += seconds

    def beat(self, step: int | None = None) -> None:
        """A sign of life; with ``step``, that step just finished (and the phase is "step").

        After "done" a beat only renews the done allowance: the phase is final (a step reported
        after ``close()``, an evaluation's, must not turn a finished trainer back into a
        training one, whose later crash or hang would cost restarts of committed work)."""
        now = time.monotonic()
        if step is not None and self._phase not in FINISHED_PHASES:
            if step > self._step and self._last_step_s and self._phase == "step":
                self._max_gap_s = max(
                    self._max_gap_s, (now - self._last_step_s) / (step - self._step)
                )
            self._step, self._last_step_s = step, now
            if self._phase != "step":
                self._enter("step", now)
            else:
                self._write(now)  # every finished step: the supervisor needs the furthest one
        elif now - self._written_s >= _MIN_WRITE_INTERVAL_S:
            self._write(now)

    def set_phase(self, phase: Phase) -> None:
        """Enter ``phase``: the supervisor allows each phase its own time without a beat. The
        finished phases are final (see :meth:`beat`): "done" leads only to "exiting"."""
        final = self._phase in FINISHED_PHASES
        if phase != self._phase and (not final or (self._phase, phase) == ("done", "exiting")):
            now = time.monotonic()
            if phase == "step":
                self._last_step_s = now  # the time spent restoring or saving is not a step
            self._enter(phase, now)

    def restored(self, step: int) -> None:
        """The trainer restored the state after ``step``: training resumes from there."""
        if self._phase in FINISHED_PHASES:
            return  # a manager opened after close(), to read: the trainer's work is done
        self._step = self._start_step = step
        self.set_phase("step")

    @property
    def phase(self) -> Phase:
        return self._phase

    def _enter(self, phase: Phase, now: float) -> None:
        self._phase, self._phase_started_s = phase, now
        self._write(now)

    def _write(self, now: float) -> None:
        body = _BODY.pack(
            _MAGIC,
            self._pid,
            self._step,
            now,
            self._phase_started_s,
            self._max_gap_s,
            self._work_s,
            self._start_step,
            _PHASES.index(self._phase),
        )
        try:
            os.pwrite(self._fd, body + _CRC.pack(zlib.crc32(body)), 0)
        except OSError:
            return  # a full disk: the supervisor sees an old beat, never a torn one
        self._written_s = now
        self._max_gap_s = 0.0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_writer: HeartbeatWriter | None = None


def worker_heartbeat() -> HeartbeatWriter | None:
    """This trainer's heartbeat writer; None when not run by ``crashproof run``."""
    global _writer
    if _writer is not None and _writer._pid == os.getpid():
        return _writer
    directory = os.environ.get(ENV_HEARTBEAT_DIR)
    if not directory:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        _writer = HeartbeatWriter(RunDir.heartbeat_file(directory, local_rank))
    except (RunFileRefused, OSError) as exc:
        print(f"crashproof: no heartbeat (watched for its exit only): {exc}", file=sys.stderr)
        os.environ.pop(ENV_HEARTBEAT_DIR, None)
        return None
    return _writer


def heartbeat(step: int | None = None) -> None:
    """Tell the supervisor this trainer is alive (and, with ``step``, that the step finished).

    :meth:`CheckpointManager.maybe_save` beats every step already; call this in loops that do not
    call it (evaluation, data preparation) so that ``crashproof run`` does not take them for a hang.
    Does nothing when the script is not run by ``crashproof run``.
    """
    writer = worker_heartbeat()
    if writer is not None:
        writer.beat(step)
