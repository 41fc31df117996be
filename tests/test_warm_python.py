"""The tests' warm ``python`` (:func:`tests.warm_ranks.python`) behaves as ``subprocess.run`` of a
fresh interpreter does, for what the tests read: exit status, streams, cwd, env, timeout."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.warm_ranks import crashproof_cli, python


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
