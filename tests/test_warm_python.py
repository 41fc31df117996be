"""The tests' warm ``python`` (:func:`tests.warm_ranks.python`) behaves as ``subprocess.run`` of a
fresh interpreter does, for what the tests read: exit status, streams, cwd, env, timeout."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.warm_ranks import WarmRanks, crashproof_cli, python


def test_exit_codes_streams_cwd_env_stdin_and_timeouts_are_a_processs(tmp_path: Path) -> None:
    done = python(["-c", "import sys; print('hi'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "hi\n", "err\n")
    done = python(
        ["-c", "import os; print(os.getcwd(), os.environ.get('X')); os._exit(5)"],
        cwd=tmp_path,
        env={"X": "y"},
    )
    assert (done.returncode, done.stdout) == (5, f"{tmp_path} y\n")  # unbuffered: nothing lost
    assert python(["-c", "import sys; print(sys.stdin.read())"], input="abc").stdout == "abc\n"
    raised = python(["-c", "raise ValueError('x')"])
    assert raised.returncode == 1 and "ValueError: x" in raised.stderr
    killed = python(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.returncode == -9
    assert python(["-c", "import sys; sys.exit('bye')"]).stderr == "bye\n"
    with pytest.raises(subprocess.TimeoutExpired):
        python(["-c", "import time; time.sleep(30)"], timeout=1)
    missing = crashproof_cli("ls", tmp_path / "none")
    assert missing.returncode == 2 and "no checkpoints" in missing.stderr


def test_warm_ranks_get_the_launching_tests_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the environment of the test that happened to start the zygote: a variable set then
    (an agent's memory socket, say) would reach every later test's ranks."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import os\nprint('probe', os.environ.get('WARM_PROBE'), os.environ['RANK'])\n"
    )
    ranks = WarmRanks(tmp_path / "zygote")
    (tmp_path / "zygote").mkdir()
    try:
        monkeypatch.setenv("WARM_PROBE", "set-when-started")
        assert "probe set-when-started 0" in ranks.run(script, [], nproc=1).output
        monkeypatch.delenv("WARM_PROBE")
        launch = ranks.run(script, [], nproc=2)
        assert sorted(launch.output.split("\n"))[-2:] == ["probe None 0", "probe None 1"]
    finally:
        ranks.close()
