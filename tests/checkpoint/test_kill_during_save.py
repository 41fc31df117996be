"""SIGKILL a process at many points inside ``CheckpointManager.save``; restore must never see a partial save.

A child script (run as a real process that imports torch once and forks one process per
scenario) trains a seeded model with AdamW, saves step 1, reports it committed, then trains and
saves step 2 (~18 MB). Two unkilled reference runs time the step-2 save, and the first dumps the
exact expected state at steps 1 and 2 with ``torch.save``. Then scenarios are SIGKILLed at seeded
delays spread over ``[0, 1.2 x that duration]`` after step 1's commit marker. After each kill a
new manager must remove the killed save's ``.tmp-*`` directory and restore exactly step 1 or
exactly step 2, bit for bit, from a checkpoint that verifies. Every ``step_*`` directory left
verifies: retention deletes step 1 by first renaming it to ``.trash-*``, so a kill can leave such
a leftover (never chosen by restore) but never a half-deleted step directory.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import crashproof
from crashproof.checkpoint import verify_checkpoint

N_KILLS = 18
N_LATE_KILLS = 4  # at most, each later than the last, while no kill has landed after the commit
DELAY_SEED = 20240611
MARKER_TIMEOUT_S = 60.0

# A "zygote" process imports torch once, then forks one child per scenario: each child is a real
# process that the test SIGKILLs, without paying torch's import time again (it dominates otherwise).
# The model is ~1.5M float32 parameters; with AdamW's two moments a checkpoint is ~18 MB (the
# kills are spread over the save as the reference runs time it, whatever its size).
CHILD_SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import time
    import traceback

    import torch

    import crashproof


    def build():
        return torch.nn.Sequential(
            torch.nn.Linear(512, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 768),
            torch.nn.ReLU(),
            torch.nn.Linear(768, 256),
        )


    def scenario(root, mode, dump_dir):
        torch.set_num_threads(1)
        torch.manual_seed(1234)
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = crashproof.TrainState(model=model, optimizer=opt)
        mgr = crashproof.CheckpointManager(
            root, every=crashproof.EverySteps(1), keep=crashproof.KeepLast(1)
        )

        def train_step(n):
            x = torch.randn(16, 512, generator=torch.Generator().manual_seed(n))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        def snapshot():
            sd = opt.state_dict()
            return {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": {
                    "param_groups": sd["param_groups"],
                    "state": {
                        pid: {k: v.clone() for k, v in s.items()} for pid, s in sd["state"].items()
                    },
                },
            }

        started = time.monotonic()
        train_step(1)
        mgr.save(1, state)  # asynchronous: the kill lands in the background persist
        mgr.wait()
        first = time.monotonic() - started
        expected_1 = snapshot() if mode == "reference" else None
        started = time.monotonic()
        print(f"COMMITTED 1 {first:.6f}", flush=True)
        train_step(2)
        mgr.save(2, state)
        mgr.wait()
        second = time.monotonic() - started
        print(f"COMMITTED 2 {second:.6f}", flush=True)
        if mode in ("reference", "timing"):
            mgr.close()
        if mode == "reference":
            torch.save(expected_1, os.path.join(dump_dir, "expected_1.pt"))
            torch.save(snapshot(), os.path.join(dump_dir, "expected_2.pt"))
        if mode == "kill":
            time.sleep(300)  # stay alive: the SIGKILL always hits a live process


    # Warm up in the zygote, single-threaded so that forking stays safe: a process's first
    # optimizer step pays seconds of lazy imports, which every forked child would pay again.
    torch.set_num_threads(1)
    _warm = torch.nn.Linear(2, 2)
    _warm_opt = torch.optim.AdamW(_warm.parameters())
    _warm(torch.ones(1, 2)).sum().backward()
    _warm_opt.step()

    for line in iter(sys.stdin.readline, ""):
        root, mode, dump_dir = line.rstrip("\\n").split("\\t")
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                scenario(root, mode, dump_dir)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        print(f"PID {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}", flush=True)
    """
)


@dataclass
class KillOutcome:
    delay_s: float
    saw_commit_2: bool
    tmp_dirs_before: list[str]
    trash_dirs_before: list[str]
    tmp_dirs_after: list[str] = field(default_factory=list)
    restored: int | None = None
    restore_error: str = ""
    mismatched: list[str] = field(default_factory=list)
    verified_step: int | None = None
    verify_error: str = ""
    invalid_dirs: dict[str, str] = field(default_factory=dict)
    """Every ``step_*`` directory left in the root that fails verification, with why."""


@dataclass
class Campaign:
    save_duration_s: float
    expected: dict[int, Any]
    outcomes: list[KillOutcome]


class _Zygote:
    """The child script as a real process; its stdout is read line by line with a deadline."""

    def __init__(self, script: Path, log: Path) -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(script)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self._buf = b""
        self.child_pid: int | None = None

    def start(self, root: Path, mode: str, dump_dir: Path) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{root}\t{mode}\t{dump_dir}\n".encode())
        self.proc.stdin.flush()

    def read_line(self, timeout_s: float = MARKER_TIMEOUT_S) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no line from the child in {timeout_s} s; see {self.log}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                data = os.read(fd, 4096)
                if not data:
                    raise RuntimeError(f"child script ended: {self.log.read_text()[-2000:]}")
                self._buf += data
        raw, _, self._buf = self._buf.partition(b"\n")
        line = raw.decode().strip()
        if line.startswith("PID "):
            self.child_pid = int(line.split()[1])
        elif line.startswith("EXIT "):
            self.child_pid = None
        return line

    def read_until(self, prefix: str) -> tuple[str, list[str]]:
        """The first line starting with ``prefix``, and the lines read before it."""
        before = []
        while not (line := self.read_line()).startswith(prefix):
            before.append(line)
        return line, before

    def stop(self) -> None:
        if self.child_pid is not None:  # not reaped by the zygote yet, so still this pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child_pid, signal.SIGKILL)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _fresh_state(model: torch.nn.Module) -> tuple[crashproof.TrainState, torch.optim.Optimizer]:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # so a restore that loads nothing cannot match
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return crashproof.TrainState(model=model, optimizer=opt), opt


def _mismatches(
    expected: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer
) -> list[str]:
    bad = []
    live_model = model.state_dict()
    for name, tensor in expected["model"].items():
        live = live_model[name]
        if live.dtype != tensor.dtype or not torch.equal(live, tensor):
            bad.append(f"model/{name}")
    live_opt = opt.state_dict()
    if live_opt["param_groups"] != expected["optimizer"]["param_groups"]:
        bad.append("optimizer/param_groups")
    if set(live_opt["state"]) != set(expected["optimizer"]["state"]):
        bad.append("optimizer/state keys")
    for pid, entries in expected["optimizer"]["state"].items():
        for name, tensor in entries.items():
            live = live_opt["state"].get(pid, {}).get(name)
            if live is None or not torch.equal(live, tensor):
                bad.append(f"optimizer/state/{pid}/{name}")
    return bad


def _tmp_dirs(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".tmp-"))


def _trash_dirs(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".trash-"))


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    base = tmp_path_factory.mktemp("kill_during_save")
    script = base / "child.py"
    script.write_text(CHILD_SCRIPT)
    dump_dir = base / "expected"
    dump_dir.mkdir()
    zygote = _Zygote(script, base / "child.log")
    try:
        return _run_campaign(zygote, base, dump_dir)
    finally:
        zygote.stop()


def _run_campaign(zygote: _Zygote, base: Path, dump_dir: Path) -> Campaign:
    # 1. Two reference runs, not killed: they time both saves; the first dumps the expected states.
    firsts, seconds = [], []
    for mode in ("reference", "timing"):
        zygote.start(base / mode, mode, dump_dir)
        firsts.append(float(zygote.read_until("COMMITTED 1")[0].split()[-1]))
        seconds.append(float(zygote.read_until("COMMITTED 2")[0].split()[-1]))
        assert zygote.read_until("EXIT")[0].split()[-1] == "0", zygote.log.read_text()
    expected = {s: torch.load(dump_dir / f"expected_{s}.pt") for s in (1, 2)}
    # Steps 1 and 2 must differ, or restoring the wrong one would go unnoticed.
    assert not torch.equal(expected[1]["model"]["0.weight"], expected[2]["model"]["0.weight"])

    # 2. Kill at seeded delays, one in each slice of [0, 1.2 x the step-2 save's duration]. Early
    # kills always find step 2 uncommitted, so only an underestimated duration could leave the
    # end of the save uncovered: take the slower reference, and stretch a kill run's delay when
    # its own step-1 save was slower than the reference's (a machine that got busier).
    duration, first_ref = max(seconds), min(firsts)
    rng = random.Random(DELAY_SEED)
    fractions = [(i + rng.random()) * 1.2 / N_KILLS for i in range(N_KILLS)]
    rng.shuffle(fractions)

    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 768),
        torch.nn.ReLU(),
        torch.nn.Linear(768, 256),
    )
    outcomes: list[KillOutcome] = []
    # After the seeded kills, while none has landed after the commit (the machine slowed down
    # since the reference runs), kill later and later: the end of the save must be covered.
    late = (1.5 + 1.5 * k for k in range(N_LATE_KILLS))
    schedule = iter(fractions)
    for i in itertools.count():
        fraction = next(schedule, None)
        if fraction is None:
            if any(o.restored == 2 for o in outcomes):
                break
            fraction = next(late, None)
            if fraction is None:
                break
        root = base / f"kill_{i:02d}"
        zygote.start(root, "kill", dump_dir)
        zygote.read_until("PID")
        pid = zygote.child_pid
        assert pid is not None
        first = float(zygote.read_until("COMMITTED 1")[0].split()[-1])
        delay = fraction * duration * max(1.0, first / first_ref)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        exit_line, printed = zygote.read_until("EXIT")
        assert exit_line == f"EXIT {pid} {-signal.SIGKILL}", zygote.log.read_text()

        outcome = KillOutcome(
            delay,
            saw_commit_2=any(line.startswith("COMMITTED 2") for line in printed),
            tmp_dirs_before=_tmp_dirs(root),
            trash_dirs_before=_trash_dirs(root),
        )
        state, opt = _fresh_state(model)
        try:
            manager = crashproof.CheckpointManager(str(root))
            outcome.tmp_dirs_after = _tmp_dirs(root)
            try:
                outcome.restored = manager.restore(state)
            finally:
                manager.close()
        except Exception as exc:
            outcome.restore_error = f"{type(exc).__name__}: {exc}"
        # Every step_* directory left is verified once (~18 MB read and hashed each); the
        # restored one's verdict is taken from the same pass.
        verified: dict[str, int] = {}
        for name in sorted(os.listdir(root)):
            if name.startswith("step_"):
                try:
                    verified[name] = verify_checkpoint(
                        crashproof.LocalStorage(), str(root / name)
                    ).step
                except Exception as exc:
                    outcome.invalid_dirs[name] = f"{type(exc).__name__}: {exc}"
        if outcome.restored in expected:
            outcome.mismatched = _mismatches(expected[outcome.restored], model, opt)
            name = f"step_{outcome.restored:010d}"
            if name in verified:
                outcome.verified_step = verified[name]
            else:
                outcome.verify_error = outcome.invalid_dirs.get(name, f"{name} is not in {root}")
        outcomes.append(outcome)
    return Campaign(duration, expected, sorted(outcomes, key=lambda o: o.delay_s))


def _describe(outcomes: list[KillOutcome]) -> str:
    return "\n".join(
        f"  delay {o.delay_s * 1000:7.1f} ms -> restored {o.restored} "
        f"(commit 2 printed: {o.saw_commit_2}, tmp before {o.tmp_dirs_before}, "
        f"trash before {o.trash_dirs_before}) {o.restore_error}"
        for o in outcomes
    )


def test_restore_after_sigkill_returns_step_1_or_2(campaign: Campaign) -> None:
    bad = [o for o in campaign.outcomes if o.restored not in (1, 2)]
    assert not bad, "restore returned something other than a committed step:\n" + _describe(bad)


def test_restored_tensors_equal_exactly_the_committed_state_of_that_step(
    campaign: Campaign,
) -> None:
    bad = [(o.delay_s, o.restored, o.mismatched[:5]) for o in campaign.outcomes if o.mismatched]
    assert not bad, f"restored tensors differ from the expected state: {bad}"
    assert all(o.restored in (1, 2) for o in campaign.outcomes)


def test_restored_checkpoint_passes_verify_checkpoint(campaign: Campaign) -> None:
    for o in campaign.outcomes:
        assert o.verify_error == "", f"delay {o.delay_s:.4f}s: {o.verify_error}"
        assert o.verified_step == o.restored


def test_no_incomplete_checkpoint_directory_is_ever_left(campaign: Campaign) -> None:
    # A step_* directory appears only by renaming a finished one into place, and retention renames
    # it away to .trash-* before deleting it, so every step_* directory left must verify.
    for o in campaign.outcomes:
        assert o.invalid_dirs == {}, f"delay {o.delay_s:.4f}s: {o.invalid_dirs}"


def test_trash_left_by_a_killed_retention_is_never_restored(campaign: Campaign) -> None:
    # Only retention makes .trash-* here (removing step 1 after step 2 committed), so a leftover
    # means step 2 is committed: restore must return it, from its step_* directory.
    for o in campaign.outcomes:
        if o.trash_dirs_before:
            assert o.restored == 2, _describe([o])


def test_commit_reported_before_kill_is_what_restore_returns(campaign: Campaign) -> None:
    # save() returned (and the child printed so) => step 2 is committed and must be restored.
    for o in campaign.outcomes:
        if o.saw_commit_2:
            assert o.restored == 2, _describe([o])


def test_kill_delays_cover_both_outcomes(campaign: Campaign) -> None:
    seen = {o.restored for o in campaign.outcomes}
    assert {1, 2} <= seen, (
        f"step-2 save took {campaign.save_duration_s * 1000:.1f} ms in the reference run; "
        f"outcomes:\n{_describe(campaign.outcomes)}"
    )


def test_new_manager_removes_tmp_dirs_left_by_killed_save(campaign: Campaign) -> None:
    # Some kills must have landed mid-write, or this test would check nothing.
    assert any(o.tmp_dirs_before for o in campaign.outcomes), _describe(campaign.outcomes)
    for o in campaign.outcomes:
        assert o.tmp_dirs_after == [], f"left after a new manager started: {o.tmp_dirs_after}"
