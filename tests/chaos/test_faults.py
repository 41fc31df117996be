"""The fault actions and the matching of faults to events, without a training run: a corrupted
checkpoint fails verification, a duty cycle leaves its process running, and each fault's
detection, recovery and lost steps are read off the event log as documented."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import crashproof as cp
from crashproof.chaos._analysis import Injection, assess
from crashproof.chaos._faults import DutyCycle, corrupt_memory, corrupt_newest, process_state
from crashproof.chaos._schedule import Fault
from crashproof.chaos._watch import RunView
from crashproof.checkpoint import verify_checkpoint
from crashproof.errors import CrashproofError
from crashproof.storage import LocalStorage


def _checkpoints(root: Path, steps: list[int]) -> None:
    model = nn.Linear(64, 64)
    state = cp.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with cp.CheckpointManager(str(root), async_save=False) as ckpt:
        for step in steps:
            ckpt.save(step, state)


@pytest.mark.parametrize("mode", ["flip", "truncate"])
def test_corrupting_damages_the_newest_checkpoint_s_largest_file_and_verification_fails(
    tmp_path: Path, mode: str
) -> None:
    root = tmp_path / "ckpt"
    _checkpoints(root, [10, 20])
    newest = root / "step_0000000020"
    largest = max((p for p in newest.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    details = corrupt_newest(str(root), mode, random.Random(0))
    assert details["step"] == 20 and details["mode"] == mode
    assert details["file"] == str(largest)
    if mode == "truncate":
        assert largest.stat().st_size == details["size"] // 2
    with pytest.raises((CrashproofError, OSError)):
        verify_checkpoint(LocalStorage(), str(newest))
    verify_checkpoint(LocalStorage(), str(root / "step_0000000010"))  # the older one is untouched


def test_a_duty_cycle_stops_and_continues_its_process_and_leaves_it_running() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cycle = DutyCycle(proc.pid, stop=0.5, period_s=0.1, for_s=0.6)
        seen = set()
        while cycle.running:
            seen.add(process_state(proc.pid))
            time.sleep(0.005)
        assert "T" in seen  # stopped part of the time
        assert cycle.cycles >= 3 and cycle.ended_ts is not None
        assert process_state(proc.pid) in ("S", "R")
    finally:
        proc.kill()
        proc.wait()


T0 = 1000.0


def _view(tmp_path: Path, events: list[dict[str, Any]]) -> RunView:
    with open(tmp_path / "events.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        f.write('{"ts": 2000, "event": "prog')  # a torn last line is left alone
    view = RunView(str(tmp_path))
    view.refresh()
    return view


def _injection(kind: str, *, ts: float, step: int, pid: int = 11, **params: Any) -> Injection:
    fault = Fault(id="f1", kind=kind, rank=1, at_s=1.0, params=params)
    return Injection(fault=fault, due_s=1.0, at_s=1.0, ts=ts, pid=pid, attempt=0, step=step)


def _attempt(ts: float, attempt: int, restored: int | None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"ts": ts, "event": "rank_start", "rank": r, "local_rank": r, "pid": 20 + 10 * attempt + r,
         "restart": attempt} for r in (0, 1)
    ]  # fmt: skip
    if restored is not None:
        events.append({"ts": ts + 0.5, "event": "restore", "step": restored, "restart": attempt})
    return events


def test_a_kill_is_detected_by_its_rank_exit_and_costs_the_steps_since_the_restored_one(
    tmp_path: Path,
) -> None:
    view = _view(
        tmp_path,
        [
            *_attempt(T0, 0, None),
            {"ts": T0 + 5, "event": "checkpoint", "step": 30, "path": "c/step_30"},
            {"ts": T0 + 7.1, "event": "rank_exit", "rank": 1, "pid": 11, "exitcode": -9,
             "signal": "SIGKILL", "first": True, "step": 37},
            {"ts": T0 + 7.1, "event": "rank_exit", "rank": 0, "pid": 10, "exitcode": 1,
             "signal": None, "first": False, "step": 37},
            *_attempt(T0 + 8, 1, 30),
            {"ts": T0 + 9, "event": "checkpoint", "step": 40, "path": "c/step_40"},
            {"ts": T0 + 10, "event": "progress", "step": 45, "step_time_s": 0.1},
        ],
    )  # fmt: skip
    kill = _injection("kill", ts=T0 + 7, step=37)
    assess(kill, view)
    assert kill.detected and kill.detected_by == "rank_exit: rank 1 SIGKILL"
    assert kill.detect_s == pytest.approx(0.1)
    assert kill.recovered and kill.recovered_by == "checkpoint step 40 committed"
    assert kill.lost_steps == 7 and kill.lost_s == pytest.approx(0.7)


def test_a_hang_s_lost_steps_come_from_the_hang_event_and_a_later_failure_is_not_its_own(
    tmp_path: Path,
) -> None:
    events = [
        *_attempt(T0, 0, None),
        {"ts": T0 + 5, "event": "checkpoint", "step": 20, "path": "c/step_20"},
        {"ts": T0 + 9, "event": "hang", "rank": 1, "pid": 11, "step": 24, "silent_s": 2.1,
         "phase": "step", "process_state": "T"},
        {"ts": T0 + 9, "event": "hang", "rank": 0, "pid": 10, "step": 25, "silent_s": 2.0,
         "phase": "step", "process_state": "S"},
        *_attempt(T0 + 10, 1, 20),
        {"ts": T0 + 12, "event": "checkpoint", "step": 30, "path": "c/step_30"},
        {"ts": T0 + 14, "event": "rank_exit", "rank": 0, "pid": 30, "exitcode": -9,
         "signal": "SIGKILL", "first": True, "step": 36},
        *_attempt(T0 + 15, 2, 30),
    ]  # fmt: skip
    hang = _injection("hang", ts=T0 + 6, step=24)
    assess(hang, _view(tmp_path, events), until=T0 + 13.5)  # the next fault came at T0 + 13.5
    assert hang.detected_by is not None and hang.detected_by.startswith("hang: rank 1 silent 2.1")
    assert hang.recovered and hang.lost_steps == 25 - 20


def test_a_nan_is_detected_at_the_step_it_fired_and_costs_the_steps_rolled_back(
    tmp_path: Path,
) -> None:
    view = _view(
        tmp_path,
        [
            *_attempt(T0, 0, None),
            {"ts": T0 + 3, "event": "checkpoint", "step": 50, "path": "c/step_50"},
            {"ts": T0 + 4, "event": "numerics", "step": 57, "kind": "nonfinite", "action": "rollback"},
            {"ts": T0 + 4.1, "event": "numerics_rollback", "step": 57, "rolled_back_to": 50},
            {"ts": T0 + 5, "event": "checkpoint", "step": 60, "path": "c/step_60"},
        ],
    )  # fmt: skip
    nan = _injection("nan", ts=T0 + 1, step=-1)
    assess(nan, view)
    assert not nan.detected  # the seam has not fired: nothing to look for yet
    nan.fired_ts, nan.step = T0 + 3.9, 57
    assess(nan, view)
    assert nan.detected_by == "numerics: nonfinite loss at step 57, rollback"
    assert nan.recovered_by == "checkpoint step 60 committed" and nan.lost_steps == 6


def test_a_straggler_counts_as_recovered_only_after_its_slowdown_ended(tmp_path: Path) -> None:
    view = _view(
        tmp_path,
        [
            *_attempt(T0, 0, None),
            {"ts": T0 + 3, "event": "straggler", "rank": 1, "step": 80, "ratio": 2.5,
             "basis": "compute_section"},
            {"ts": T0 + 4, "event": "checkpoint", "step": 90, "path": "c/step_90"},
            {"ts": T0 + 7, "event": "checkpoint", "step": 100, "path": "c/step_100"},
        ],
    )  # fmt: skip
    slow = _injection("straggler", ts=T0 + 1, step=70)
    assess(slow, view)
    assert slow.detected and not slow.recovered
    slow.end_ts, slow.end_step = T0 + 5, 95
    assess(slow, view)
    assert slow.recovered_by == "checkpoint step 100 committed" and slow.lost_steps == 0


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, cp.TrainState]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt, cp.TrainState(model=model, optimizer=opt)


def test_final_checkpoints_compare_equal_by_value_and_a_changed_tensor_is_named(
    tmp_path: Path,
) -> None:
    from crashproof.chaos._baseline import compare_final_checkpoints

    _, _, state = _trained(0)
    with cp.CheckpointManager(str(tmp_path / "a"), async_save=False) as ckpt:
        ckpt.save(2, state)
    # A restored copy of the same state (its optimizer lists its entries in another order).
    model, _, fresh = _trained(1)
    with cp.CheckpointManager(str(tmp_path / "a"), async_save=False) as ckpt:
        assert ckpt.restore(fresh) == 2
    with cp.CheckpointManager(str(tmp_path / "b"), async_save=False) as ckpt:
        ckpt.save(2, fresh)
    same = compare_final_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"))
    assert same.identical and same.step == 2 and same.tensors > 0, same
    names = [_tensor_names(tmp_path / run / "step_0000000002") for run in ("a", "b")]
    assert sorted(names[0]) == sorted(names[1]) and names[0] != names[1]  # another order
    with torch.no_grad():
        last = list(model.children())[1]
        assert isinstance(last, nn.Linear)
        last.bias.add_(1e-7)  # one tensor, barely
    with cp.CheckpointManager(str(tmp_path / "c"), async_save=False) as ckpt:
        ckpt.save(2, fresh)
    changed = compare_final_checkpoints(str(tmp_path / "a"), str(tmp_path / "c"))
    assert not changed.identical
    assert (
        len(changed.differences) == 1 and "tensor model/1.bias: checksum" in changed.differences[0]
    )
    with cp.CheckpointManager(str(tmp_path / "d"), async_save=False) as ckpt:
        ckpt.save(3, fresh)
    other_step = compare_final_checkpoints(str(tmp_path / "a"), str(tmp_path / "d"))
    assert not other_step.identical and "different steps: 2 and 3" in str(other_step.problem)


def _tensor_names(ckpt: Path) -> list[str]:
    from crashproof.checkpoint import read_manifest
    from crashproof.checkpoint.restore._read_manifest import read_rank_index

    storage = LocalStorage()
    manifest = read_manifest(storage, str(ckpt))
    return [t.name for t in read_rank_index(storage, str(ckpt), manifest, 0).tensors]


def test_a_fault_due_while_the_previous_one_was_resolved_waits_its_gap_from_the_resolution(
    tmp_path: Path,
) -> None:
    from crashproof.chaos._campaign import Campaign

    faults = [Fault(id=f"f{i}", kind="kill", rank=0, at_s=t) for i, t in ((1, 10.0), (2, 14.0))]
    campaign = Campaign(
        run_args=[], run_dir=str(tmp_path), schedule=faults, console_path=str(tmp_path / "log")
    )
    first = Injection(fault=faults[0], due_s=10.0, at_s=10.0, ts=0.0, pid=1, attempt=0, step=5)
    assert campaign._due_s(faults[1], [first]) == 14.0  # not resolved yet: as drawn
    first.resolved_at_s = 12.0  # resolved before the next was due: as drawn
    assert campaign._due_s(faults[1], [first]) == 14.0
    first.resolved_at_s = 20.0  # resolved after: the 4 s gap again, from the resolution
    assert campaign._due_s(faults[1], [first]) == 24.0
    assert campaign._due_s(faults[0], []) == 10.0


def test_a_drawn_fault_is_blocked_only_if_training_went_on_past_the_resolve_timeout(
    tmp_path: Path,
) -> None:
    from crashproof.chaos._campaign import Campaign

    faults = [Fault(id=f"f{i}", kind="kill", rank=0, at_s=1.0) for i in (1, 2, 3)]
    campaign = Campaign(
        run_args=[], run_dir=str(tmp_path), schedule=faults,
        console_path=str(tmp_path / "log"), resolve_timeout_s=30.0,
    )  # fmt: skip
    events = [{"ts": 100.0 + s, "event": "progress", "step": s, "step_time_s": 0.01}
              for s in range(0, 61, 10)]  # fmt: skip
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    campaign.view.refresh()
    campaign._waiting = {
        "f1": (110.0, "no committed checkpoint"),  # due at 110, training went on to 160
        "f2": (140.0, "rank 0 was not training"),  # only 20 s of training after it: ended first
    }  # f3 never came due
    blocked = campaign._blocked(faults)
    assert list(blocked) == ["f1"]
    assert "50 s" in blocked["f1"] and "no committed checkpoint" in blocked["f1"]


def test_the_table_wraps_a_long_detection_between_words_and_cuts_none() -> None:
    from crashproof.chaos._report import format_table

    path = "/runs/" + "deep/" * 20 + "rank_00001.safetensors"
    said = (
        "rank_exit: rank 0: CheckpointWriteError: checkpoint of step 170 was not committed "
        f"(rank 1: OSError: [Errno 5] Input/output error: '{path}')"
    )
    inj = Injection(
        fault=Fault(id="f3", kind="storage", rank=1, at_step=160, params={"error": "eio"}),
        due_s=None, at_s=7.9, ts=0.0, pid=1, attempt=0, step=160,
        detected=True, detected_by=said, recovered=True, lost_steps=12,
    )  # fmt: skip
    header, first, *more = format_table([inj])
    assert more and first.split()[-2:] == ["yes", "12"]
    assert all(len(line) <= len(header) for line in (first, *more))
    column = header.index("detected by")
    text = " ".join(line[column : column + 58].strip() for line in (first, *more))
    # every word is whole, in order; only the path (longer than a line) is split, not lost
    words = said.split()
    assert text.split()[: len(words) - 1] == words[:-1]
    assert text.replace(" ", "").endswith(words[-1])


def test_a_corrupt_fault_flips_one_bit_of_the_ranks_snapshot_in_the_agents_memory(
    memory_host: Any, tmp_path: Path
) -> None:
    """The chaos ``corrupt`` fault reaches the agent's memory through ``/proc/<agent>/fd`` (the
    host runs in this process here): one bit of the rank's segment, none of another rank's."""
    from tests.checkpoint.test_manager import _state

    with cp.CheckpointManager(tmp_path / "ck", every=cp.EverySteps(1)) as ckpt:
        ckpt.save(7, _state())
        ckpt.wait()
        memory = ckpt._pipeline._memory
        assert memory is not None
        slot = memory.slots[memory.steps()[7]]
        before = bytes(slot.view())
        assert corrupt_memory(os.getpid(), 1, random.Random(0)) == []  # no segment of rank 1
        # (the trainer's side holds the segment open too: it is flipped once)
        [flip] = corrupt_memory(os.getpid(), 0, random.Random(0))
        after = bytes(slot.view())
    assert flip["slot"] == 0 and flip["size"] == len(before)
    changed = [i for i in range(len(before)) if before[i] != after[i]]
    assert changed == [flip["offset"]]
    assert before[flip["offset"]] ^ after[flip["offset"]] == 1 << flip["bit"]
    assert corrupt_memory(2**22 + 12345, 0, random.Random(0)) == []  # no such agent
