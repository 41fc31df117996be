"""The facts the supervisor acts on: heartbeat records, hang verdicts, crash loops, event lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from crashproof.errors import ConfigError
from crashproof.link._heartbeat import RECORD_SIZE, Heartbeat, HeartbeatWriter, read_heartbeat
from crashproof.supervisor._crashloop import CrashLoopPolicy, Failure
from crashproof.supervisor._hang import HangConfig, HangDetector
from crashproof.telemetry import EventLog, read_events
from tests.conftest import warm_context


def test_heartbeat_records_step_phase_and_the_longest_step_gap(tmp_path: Path) -> None:
    path = str(tmp_path / "local_rank_0")
    writer = HeartbeatWriter(path)
    beat = read_heartbeat(path)
    assert beat is not None and beat.phase == "startup" and beat.step == -1
    assert beat.pid == os.getpid()
    writer.set_phase("restore")
    writer.restored(40)
    assert (b := read_heartbeat(path)) is not None and b.phase == "step" and b.step == 40
    for step in range(41, 45):
        writer.beat(step)
    beat = read_heartbeat(path)
    assert beat is not None and beat.step == 44 and beat.max_gap_s >= 0
    writer.set_phase("done")
    assert (b := read_heartbeat(path)) is not None and b.phase == "done"
    writer.close()


def test_a_torn_or_foreign_heartbeat_record_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "local_rank_0"
    HeartbeatWriter(str(path)).close()
    data = bytearray(path.read_bytes())
    assert len(data) == RECORD_SIZE
    data[20] ^= 0xFF  # a half-written record: the CRC no longer matches
    path.write_bytes(bytes(data))
    assert read_heartbeat(str(path)) is None
    path.write_bytes(b"not a heartbeat")
    assert read_heartbeat(str(path)) is None
    assert read_heartbeat(str(tmp_path / "missing")) is None


def _beat(phase: str, beat_s: float, max_gap_s: float = 0.0, step: int = 10) -> Heartbeat:
    return Heartbeat(1, step, beat_s, phase, 0.0, max_gap_s)  # type: ignore[arg-type]


def test_each_phase_has_its_own_allowance() -> None:
    detector = HangDetector(
        HangConfig(startup_timeout_s=100, restore_timeout_s=50, save_timeout_s=30, step_timeout_s=5)
    )
    assert detector.check(_beat("startup", 0.0), now_s=99) is None
    assert detector.check(_beat("startup", 0.0), now_s=101) is not None
    assert detector.check(_beat("restore", 0.0), now_s=49) is None
    assert detector.check(_beat("save", 0.0), now_s=29) is None
    verdict = detector.check(_beat("step", 0.0), now_s=6)
    assert verdict is not None and verdict.phase == "step" and verdict.timeout_s == 5
    assert detector.check(_beat("done", 0.0), now_s=119) is None  # done: its own allowance
    assert detector.check(_beat("done", 0.0), now_s=121) is not None


def test_the_step_timeout_is_calibrated_from_observed_steps() -> None:
    detector = HangDetector(HangConfig(auto_factor=10, auto_floor_s=1, calibration_steps=3))
    # While calibrating, the start-up allowance applies: a slow first step is not a hang.
    assert detector.timeout_s("step") == HangConfig().startup_timeout_s
    for t in range(3):
        detector.observe(_beat("step", float(t), max_gap_s=0.5))
    assert detector.step_timeout_s() == pytest.approx(5.0)
    for _ in range(5):  # the same record read again and again counts once
        detector.observe(_beat("step", 3.0, max_gap_s=2.0))  # one slow step raises the allowance
    assert detector.step_timeout_s() == pytest.approx(20.0)
    assert len(detector._gaps) == 4
    fast = HangDetector(HangConfig(auto_factor=10, auto_floor_s=60, calibration_steps=1))
    fast.observe(_beat("step", 1.0, max_gap_s=0.01))
    assert fast.step_timeout_s() == 60  # never below the floor


def test_hang_config_refuses_nonsense() -> None:
    with pytest.raises(ConfigError, match="step_timeout_s"):
        HangConfig(step_timeout_s=0)
    with pytest.raises(ConfigError, match="startup_timeout_s"):
        HangConfig(startup_timeout_s=-1)


def _failure(step: int) -> Failure:
    return Failure(attempt=0, step=step, rank=1, reason="exit code 3")


def test_failures_without_progress_make_a_crash_loop_and_back_off() -> None:
    policy = CrashLoopPolicy(attempts=3, backoff_s=1, backoff_max_s=3)
    policy.record(_failure(12))
    assert not policy.is_crash_loop() and policy.backoff() == 0  # the first restart is immediate
    policy.record(_failure(12))
    assert not policy.is_crash_loop() and policy.backoff() == 1
    policy.record(_failure(11))  # not further than before: still no progress
    assert not policy.is_crash_loop() and policy.backoff() == 2  # the first got further: 2 so far
    policy.record(_failure(12))
    assert policy.is_crash_loop()
    assert policy.backoff() == 3  # doubled, then capped


def test_failures_with_progress_are_not_a_crash_loop() -> None:
    policy = CrashLoopPolicy(attempts=2)
    for step in (7, 12, 17, 22):
        policy.record(_failure(step))
        assert not policy.is_crash_loop()
        assert policy.backoff() == 0
    assert not CrashLoopPolicy(attempts=0).is_crash_loop()


def _append_events(path: str, writer: int) -> None:
    events = EventLog(path, writer=writer)
    for i in range(300):
        events.emit("progress", step=i, padding="x" * 200)
    events.close()


def test_event_lines_from_many_processes_never_interleave(tmp_path: Path) -> None:
    path = str(tmp_path / "events.jsonl")
    ctx = warm_context()
    procs = [ctx.Process(target=_append_events, args=(path, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 4 * 300
    records = [json.loads(line) for line in lines]  # every line is one whole object
    for w in range(4):
        assert [r["step"] for r in records if r["writer"] == w] == list(range(300))
    assert all(isinstance(r["ts"], float) and r["event"] == "progress" for r in records)


def test_reading_events_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"ts": 1.0, "event": "run_start"}\n{"ts": 2.0, "ev')
    assert [e["event"] for e in read_events(path)] == ["run_start"]
