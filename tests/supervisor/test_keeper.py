"""The keeper's end of a run, in this process: what it waits for, what it ends, what it reports
(the runs around it, killed at every point, are in ``tests/adversarial/test_no_orphans.py``)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from crashproof.supervisor._keeper import _Sessions, _stop, end_sessions, session_leaders


def _in_a_session_of_its_own(code: str) -> subprocess.Popen[bytes]:
    """A trainer's helper as the keeper sees it: in one of the trainers' sessions, without the
    run's token in its environment."""
    return subprocess.Popen([sys.executable, "-I", "-c", code], start_new_session=True, env={})


def test_after_a_normal_end_a_process_still_exiting_is_let_go_not_reported() -> None:
    """A trainer on its way out (its exit code sent, its memory being released) reads as neither
    carrying the token nor having a command line: it used to be killed and named in an
    ``orphans_stopped`` event after a run that ended cleanly."""
    slow = _in_a_session_of_its_own("import time; time.sleep(0.5)")
    try:
        sessions = _Sessions(session_leaders([slow.pid]))
        started = time.monotonic()
        killed = _stop(b"no-process-carries-this", True, sessions)
        assert killed == [] and slow.wait(5) == 0
        assert time.monotonic() - started < 1.9  # (let go as soon as it was gone)
    finally:
        slow.kill()
        slow.wait()


def test_a_process_that_stays_is_ended_after_the_grace_and_reported() -> None:
    stays = _in_a_session_of_its_own("import time; time.sleep(60)")
    try:
        sessions = _Sessions(session_leaders([stays.pid]))
        time.sleep(0.3)  # (its interpreter started: its command line is its own)
        killed = _stop(b"no-process-carries-this", True, sessions)
        assert stays.wait(5) == -9
        assert [k["pid"] for k in killed] == [stays.pid] and "sleep(60)" in str(killed[0]["cmd"])
    finally:
        stays.kill()
        stays.wait()


def test_between_attempts_the_leftovers_are_ended_and_said_to_be_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the agent relies on before it checks its snapshots: every leftover of the trainers'
    sessions is gone, or it says some may not be (then it does not check them)."""
    from crashproof.supervisor import _keeper

    stays = _in_a_session_of_its_own("import time; time.sleep(60)")
    try:
        leaders = session_leaders([stays.pid])
        time.sleep(0.3)
        with monkeypatch.context() as no_time:  # no time to end it: not said to be gone
            no_time.setattr(_keeper, "_KILL_ROUNDS_S", 0.0)
            assert end_sessions(leaders, spare=[]) == ([], False)
        assert stays.poll() is None
        killed, ended = end_sessions(leaders, spare=[])
        assert killed == [stays.pid] and ended
        assert stays.wait(5) == -9
        assert end_sessions(leaders, spare=[]) == ([], True)
    finally:
        stays.kill()
        stays.wait()
