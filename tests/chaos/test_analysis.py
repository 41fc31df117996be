"""How a corrupt fault is judged from the run's events: detected by a restore that went back past
the damaged checkpoint, missed by one that restored the damaged step from disk, and not needed by
one that restored that step (or a newer one) from memory, which never reads the damaged file.

Found in ``make demo``: under ``crashproof run`` the restart after a corruption restored a newer
step from the agent's memory, the fault was reported NOT DETECTED and every later fault waited
for it until the run ended, so the campaign failed although nothing was wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crashproof.chaos._analysis import Injection, assess
from crashproof.chaos._schedule import Fault
from crashproof.chaos._watch import RunView

T0 = 1_000.0


def _view(run_dir: Path, *events: dict[str, object]) -> RunView:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"ts": T0 + i + 1, **e}) for i, e in enumerate(events)]
    (run_dir / "events.jsonl").write_text("".join(line + "\n" for line in lines))
    view = RunView(str(run_dir))
    view.refresh()
    return view


def _corruption() -> Injection:
    fault = Fault(id="f4", kind="corrupt", rank=1, at_step=190, params={"mode": "flip"})
    return Injection(
        fault=fault, due_s=None, at_s=5.0, ts=T0, pid=42, attempt=2, step=190,
        details={"step": 180, "file": "step_0000000180/rank_00000.safetensors"},
    )  # fmt: skip


def _after_the_kill(restore: dict[str, object]) -> list[dict[str, object]]:
    return [
        {"event": "rank_exit", "rank": 1, "pid": 42, "exitcode": -9, "step": 190},
        {"event": "restore", "rank": 0, "restart": 3, **restore},
        {"event": "checkpoint", "rank": 0, "restart": 3, "step": 200, "path": "step_200"},
    ]


@pytest.mark.parametrize(
    ("restore", "verdict"),
    [
        ({"step": 170, "kind": "local"}, "detected"),
        ({"step": 170, "kind": "memory"}, "detected"),  # memory older than the damage: read past it
        ({"step": 180, "kind": "local"}, "missed"),  # the damaged step restored as if whole
        ({"step": 190, "kind": "memory"}, "not needed"),
        ({"step": 180, "kind": "peer"}, "not needed"),
    ],
)
def test_a_corruption_is_judged_by_where_the_restore_after_it_read(
    tmp_path: Path, restore: dict[str, object], verdict: str
) -> None:
    inj = _corruption()
    assess(inj, _view(tmp_path / "run", *_after_the_kill(restore)))
    if verdict == "detected":
        assert inj.detected and inj.not_needed is None and inj.passed
        assert inj.detected_by == "restore: from step 170, skipping the corrupted step 180"
    elif verdict == "missed":
        assert not inj.detected and inj.not_needed is None and not inj.passed
    else:
        assert not inj.detected and inj.passed and inj.resolved
        assert inj.not_needed is not None
        assert f"restored step {restore['step']} from the" in inj.not_needed
        assert "step 180 was never read" in inj.not_needed
        assert inj.to_json()["not_needed"] == inj.not_needed
    assert inj.recovered == (verdict != "missed")


def test_a_corruption_not_needed_still_waits_for_the_run_to_go_on(tmp_path: Path) -> None:
    inj = _corruption()
    events = _after_the_kill({"step": 190, "kind": "memory"})[:2]  # no checkpoint since
    assess(inj, _view(tmp_path / "run", *events))
    assert inj.not_needed is not None and not inj.recovered and not inj.resolved
