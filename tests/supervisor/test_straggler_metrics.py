"""Stragglers and Prometheus metrics under ``crashproof run``.

Unit: the detector flags a rank whose work per step stays above 1.3x its peers' median, once,
and reports its recovery. Real run: ``examples/train_tiny.py`` on 2 ranks (DDP, gloo), rank 1
slowed by a SIGSTOP/SIGCONT duty cycle: the supervisor reports rank 1 (and never rank 0) as a
straggler, and the metrics endpoint serves the run's steps, checkpoints and the straggler.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import crashproof
from crashproof.link._heartbeat import Heartbeat
from crashproof.supervisor._straggler import StragglerConfig, StragglerDetector
from crashproof.telemetry import read_events
from crashproof.telemetry.metrics import RunMetrics
from tests.conftest import EXAMPLES


def _beat(pid: int, step: int, work_s: float) -> Heartbeat:
    return Heartbeat(pid, step, float(step), "step", 0.0, 0.0, work_s)


def test_a_rank_slower_than_its_peers_for_long_enough_is_reported_once_then_recovered() -> None:
    detector = StragglerDetector(StragglerConfig(factor=1.3, steps=10))
    work = {0: 0.0, 1: 0.0, 2: 0.0}
    reports = []
    for step in range(1, 61):
        slow = 20 <= step < 40
        for rank in work:  # rank 2 takes 1.5x as long from step 20 to 39
            work[rank] += 0.015 if rank == 2 and slow else 0.010 + 0.0001 * rank
        reports += detector.observe({r: _beat(100 + r, step, w) for r, w in work.items()})
    assert [(r.local_rank, r.recovered) for r in reports] == [(2, False), (2, True)]
    flagged, recovered = reports
    assert 20 < flagged.step < 32 and flagged.ratio > 1.3 and flagged.basis == "compute_section"
    assert recovered.step > 40


def test_too_few_steps_or_a_restarted_rank_is_not_judged() -> None:
    detector = StragglerDetector(StragglerConfig(factor=1.3, steps=10))
    assert detector.observe({0: _beat(1, 5, 0.05), 1: _beat(2, 5, 5.0)}) == []
    assert detector.observe({0: _beat(1, 9, 0.09), 1: _beat(2, 9, 9.0)}) == []  # 4 steps only
    # rank 1 restarted (a new pid): its old history does not count against the new process
    assert detector.observe({0: _beat(1, 16, 0.16), 1: _beat(3, 16, 0.16)}) == []


def test_metrics_follow_the_event_log(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    lines = [
        {"ts": 1.0, "event": "run_start", "run_id": "r7", "script": "train.py", "nnodes": "1:1",
         "nproc_per_node": 2, "max_restarts": 30},
        {"ts": 1.2, "event": "replication_failed", "tier": "s3://b/c", "attempt": 1, "pending": [5, 10, 15]},
        {"ts": 1.3, "event": "replicated", "tier": "s3://b/c", "step": 10, "pending": 1},
        {"ts": 1.4, "event": "replicated", "tier": "s3://b/c", "step": 5, "pending": 0},
        {"ts": 1.5, "event": "progress", "step": 5, "step_time_s": 0.4},
        {"ts": 1.6, "event": "checkpoint", "step": 5, "blocking_s": 0.02, "persist_s": 3.0, "bytes": 500},
        {"ts": 2.0, "event": "progress", "step": 10, "step_time_s": 0.5},
        {"ts": 3.0, "event": "checkpoint", "step": 10, "blocking_s": 0.01, "persist_s": 0.2, "bytes": 1000},
        {"ts": 4.0, "event": "rank_exit", "rank": 1, "exitcode": -9, "first": True, "step": 12},
        {"ts": 4.0, "event": "rank_exit", "rank": 0, "exitcode": -15, "first": False, "step": 12},
        {"ts": 4.1, "event": "restart", "restart": 1},
        {"ts": 5.0, "event": "restore", "step": 10, "seconds": 0.3},
        # One NaN, logged by both ranks; one hang, reported for both silent ranks: one failure each.
        {"ts": 6.5, "event": "numerics", "rank": 0, "step": 11, "kind": "nonfinite", "action": "skip"},
        {"ts": 6.5, "event": "numerics", "rank": 1, "step": 11, "kind": "nonfinite", "action": "skip"},
        {"ts": 7.0, "event": "hang", "rank": 1, "step": 13},
        {"ts": 7.0, "event": "hang", "rank": 0, "step": 13},
        {"ts": 7.1, "event": "restart", "restart": 2},
        {"ts": 8.0, "event": "hang", "rank": 0, "step": 15},
        {"ts": 9.0, "event": "straggler", "rank": 1, "ratio": 1.6},
        {"ts": 9.1, "event": "standby", "participants": 2},
        {"ts": 9.2, "event": "standby_promoted", "waited_s": 30.0},
        {"ts": 9.3, "event": "memory_missing", "rank": 3, "why": "two nodes of its group lost"},
        {"ts": 9.4, "event": "standby_pool", "waiting": 1, "wanted": 2},
    ]  # fmt: skip
    text = "".join(json.dumps(e) + "\n" for e in lines)
    events.write_text(text[:-20])  # the last line still being written
    metrics = RunMetrics(str(tmp_path), ettr=lambda path: 0.75, ettr_interval_s=0)
    metrics.poll()
    with open(events, "a") as f:
        f.write(text[-20:])
    metrics.poll()
    value = metrics.registry.get_sample_value
    assert value("crashproof_step") == 10
    assert value("crashproof_step_time_seconds") == 0.5  # the last progress event's, not the first
    assert value("crashproof_checkpoints_total") == 2
    assert value("crashproof_checkpoint_bytes_total") == 1500
    # One observation per checkpoint, each in its own histogram: blocking 0.02 and 0.01 s,
    # persisting 3.0 and 0.2 s (the buckets tell which value went where).
    blocking = "crashproof_checkpoint_blocking_seconds"
    assert value(f"{blocking}_count") == 2 and value(f"{blocking}_sum") == pytest.approx(0.03)
    les = ("0.005", "0.01", "0.05", "+Inf")
    assert [value(f"{blocking}_bucket", {"le": le}) for le in les] == [0, 1, 2, 2]
    persist = "crashproof_checkpoint_persist_seconds"
    assert value(f"{persist}_count") == 2 and value(f"{persist}_sum") == pytest.approx(3.2)
    les = ("0.1", "0.5", "1.0", "5.0", "+Inf")
    assert [value(f"{persist}_bucket", {"le": le}) for le in les] == [0, 1, 1, 2, 2]
    assert value("crashproof_failures_total", {"kind": "killed"}) == 1
    assert value("crashproof_failures_total", {"kind": "numerics"}) == 1
    assert value("crashproof_failures_total", {"kind": "hang"}) == 2  # the second restart's own
    assert value("crashproof_restarts_total") == 2
    assert value("crashproof_restore_seconds_count") == 1  # a histogram: one per restore
    assert value("crashproof_restore_seconds_sum") == 0.3
    assert value("crashproof_restore_seconds_bucket", {"le": "3600.0"}) == 1
    assert value("crashproof_straggler_ratio", {"rank": "1"}) == 1.6
    assert value("crashproof_standby") == 0  # taken in
    assert value("crashproof_standby_spares") == 1
    assert value("crashproof_standby_wanted") == 2
    assert value("crashproof_memory_missing_total") == 1
    assert value("crashproof_ettr_ratio") == 0.75
    assert value("crashproof_ettr") == 0.75  # the deprecated name, one release more
    assert value("crashproof_last_progress_timestamp_seconds") == 5.0
    assert value("crashproof_last_checkpoint_timestamp_seconds") == 3.0
    # kinds that never happened are there, at 0, from the start
    assert value("crashproof_failures_total", {"kind": "preemption"}) == 0
    assert value("crashproof_failures_total", {"kind": "error"}) == 0
    assert value("crashproof_failures_total", {"kind": "storage"}) == 1  # the failed upload
    info = {"run_id": "r7", "script": "train.py", "nnodes": "1:1", "nproc_per_node": "2",
            "max_restarts": "30", "version": crashproof.__version__}  # fmt: skip
    assert value("crashproof_run_info", info) == 1
    # per tier: the newest durable step (not the last one copied) and the backlog
    assert value("crashproof_durable_step", {"tier": "s3://b/c"}) == 10
    assert value("crashproof_replication_backlog", {"tier": "s3://b/c"}) == 0
    names = {m.name for family in metrics.registry.collect() for m in family.samples}
    assert not [n for n in names if n.endswith("_created")]


def _wait_for(path: Path, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _duty_cycle(pid: int, stop: threading.Event, stopped_s: float, period_s: float) -> None:
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(period_s - stopped_s)


@pytest.mark.timeout(180)
@pytest.mark.serial  # a straggler is judged by step times: other tests on the same cores would skew them
def test_a_slowed_rank_is_reported_as_a_straggler_and_metrics_are_served(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "crashproof.cli", "run", "--nproc-per-node", "2",
        "--run-dir", str(run_dir), "--straggler-steps", "60", "--hang-timeout", "60",
        str(EXAMPLES / "train_tiny.py"), "--run-dir", str(tmp_path / "train"),
        "--steps", "100000", "--every", "200", "--workers", "0", "--hidden", "512",
    ]  # fmt: skip
    env = {**os.environ, "CRASHPROOF_PROGRESS_INTERVAL_S": "0.5"}
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    stop = threading.Event()
    try:
        events_path = run_dir / "events.jsonl"
        _wait_for(run_dir / "metrics_url", "metrics URL", 60)
        url = (run_dir / "metrics_url").read_text().strip()
        deadline = time.monotonic() + 60
        pid = None
        while pid is None:
            assert time.monotonic() < deadline, "rank 1 did not start"
            time.sleep(0.2)
            starts = [
                e for e in read_events(events_path) if e["event"] == "rank_start" and e["rank"] == 1
            ]
            if starts:
                pid = starts[-1]["pid"]
        slowing = threading.Thread(target=_duty_cycle, args=(pid, stop, 0.02, 0.04), daemon=True)
        slowing.start()
        deadline = time.monotonic() + 60
        while not any(e["event"] == "straggler" for e in read_events(events_path)):
            assert time.monotonic() < deadline, "no straggler reported in 60 s"
            time.sleep(0.2)
        seen_ts = time.time()  # what follows (the slowing stopped, the run ended) is not judged
        stop.set()
        slowing.join()
        time.sleep(1.5)  # the metrics thread reads the log every second
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        stop.set()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stragglers = [
        e for e in read_events(events_path) if e["event"] == "straggler" and e["ts"] <= seen_ts
    ]
    assert {e["rank"] for e in stragglers} == {1}, stragglers
    assert stragglers[0]["basis"] == "compute_section" and stragglers[0]["ratio"] > 1.3
    assert 'crashproof_straggler_ratio{rank="1"}' in body
    assert "crashproof_checkpoints_total" in body and "crashproof_step " in body
    step_line = next(line for line in body.splitlines() if line.startswith("crashproof_step "))
    assert float(step_line.split()[1]) > 0
    run_start = next(e for e in read_events(events_path) if e["event"] == "run_start")
    assert run_start["metrics_url"] == url and url.startswith("http://127.0.0.1:")


def test_the_example_alert_rules_use_metrics_the_run_serves(tmp_path: Path) -> None:
    import re

    import yaml

    rules = yaml.safe_load((EXAMPLES / "prometheus_alerts.yml").read_text())
    served = {
        sample.name
        for family in RunMetrics(str(tmp_path)).registry.collect()
        for sample in family.samples
    } | {family.name for family in RunMetrics(str(tmp_path)).registry.collect()}
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert {a["alert"] for a in alerts} >= {
        "CrashproofRunStalled",
        "CrashproofRestartStorm",
        "CrashproofStraggler",
    }
    for alert in alerts:
        used = set(re.findall(r"crashproof_[a-z_]+", alert["expr"]))
        assert used and used <= served, (alert["alert"], used - served)


def test_a_preemption_counts_once_as_a_preemption_not_as_an_error_per_rank() -> None:
    from crashproof.telemetry.metrics import failure_label

    # The first exit of an attempt is the one a failure is counted from.
    exit_75 = {"event": "rank_exit", "rank": 0, "exitcode": 75, "signal": None, "first": True}
    assert failure_label(exit_75) is None
    assert failure_label({"event": "preempted", "source": "SIGTERM"}) == "preemption"
    exit_1 = {"event": "rank_exit", "rank": 0, "exitcode": 1, "signal": None, "first": True}
    assert failure_label(exit_1) == "error"
