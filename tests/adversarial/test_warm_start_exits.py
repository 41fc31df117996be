"""Promise: a script ends under ``crashproof run`` as it would under ``python script.py``.

Warm start forks trainers from a process that imported torch, and hands their end to torch's
process context, which waits for a result from each. Found: a trainer that ended without
returning from its script (``os._exit(0)``, often used to skip a teardown that hangs; an uncaught
``KeyboardInterrupt``) left the run waiting for ever; a child the script forked that called
``sys.exit(0)`` handed torch a result in its trainer's name, and the agent stopped watching the
trainer, which then hung unseen; and under cold start a rank that finished (exit 0) was named
the first failure instead of the rank that failed. Each case runs warm and, where the two used to
differ, cold.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.supervisor._runs import Run, output, start_run

_TRAIN_THEN = """
import os, sys, torch, crashproof as cp
root = sys.argv[sys.argv.index("--ckpt") + 1]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = cp.TrainState(model=model, optimizer=opt)
ckpt = cp.CheckpointManager(root, every=cp.EverySteps(3))
start = ckpt.restore(state)
for step in range(start, 6):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ckpt.maybe_save(step + 1, state)
"""


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def _run(tmp_path: Path, runs: list[Run], body: str, *options: str) -> tuple[Run, int, str]:
    run = start_run(
        tmp_path / "run",
        ["--nproc-per-node", "1", *options],
        [],
        script=_script(tmp_path, body),
    )
    runs.append(run)
    code = run.wait(timeout=120)  # before the fixes: for ever, for some
    return run, code, output(run)


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_os_exit_0_after_close_is_success(tmp_path: Path, runs: list[Run], start: str) -> None:
    body = _TRAIN_THEN + "ckpt.close()\nos._exit(0)\n"
    cold = ["--cold-start"] if start == "cold" else []
    run, code, text = _run(tmp_path, runs, body, *cold)
    assert code == 0, text
    assert run.events("run_end")[0]["outcome"] == "succeeded"
    assert [e["step"] for e in run.events("checkpoint")] == [3, 6]


def test_os_exit_0_without_a_manager_is_success(tmp_path: Path, runs: list[Run]) -> None:
    _, code, text = _run(tmp_path, runs, "import os\nprint('bye', flush=True)\nos._exit(0)\n")
    assert code == 0 and "bye" in text, text


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_an_uncaught_keyboard_interrupt_is_a_sigint_failure_and_restarted(
    tmp_path: Path, runs: list[Run], start: str
) -> None:
    body = _TRAIN_THEN + "ckpt.wait()\nraise KeyboardInterrupt  # before close(): a failure\n"
    cold = ["--cold-start"] if start == "cold" else []
    run, code, text = _run(tmp_path, runs, body, "--max-restarts", "1", *cold)
    exits = run.events("rank_exit")
    assert [e["exitcode"] for e in exits] == [-2, -2], text  # killed by SIGINT, as python is
    assert len(run.events("restart")) == 1 and code == 76, text
    assert "KeyboardInterrupt" in text


@pytest.mark.parametrize(
    "child",
    ["sys.exit(0)", "pass", "raise ValueError('child')", "sys.exit('bye')"],
    ids=["exit0", "off-the-end", "raises", "exit-string"],
)
def test_a_forked_child_leaving_the_script_does_not_blind_the_agent(
    tmp_path: Path, runs: list[Run], child: str
) -> None:
    """The child ends as under python (its own code); the trainer is still watched: its hang
    after the child ended is detected."""
    body = f"""
    import os, sys, time, torch, crashproof as cp
    pid = os.fork()
    if pid == 0:
        {child}
    else:
        os.waitpid(pid, 0)
        model = torch.nn.Linear(4, 1)
        state = cp.TrainState(model=model)
        ckpt = cp.CheckpointManager(sys.argv[sys.argv.index("--ckpt") + 1])
        ckpt.restore(state)
        for step in range(1, 5):
            ckpt.maybe_save(step, state)  # beats: the agent learns the step and its pace
            time.sleep(0.1)
        print("parent: child ended, hanging", flush=True)
        time.sleep(3600)
    """
    run, code, text = _run(tmp_path, runs, body, "--hang-timeout", "3", "--max-restarts", "0")
    assert "parent: child ended, hanging" in text, text
    assert code == 76 and run.events("hang"), text


def test_a_rank_that_finished_is_never_named_the_first_failure(
    tmp_path: Path, runs: list[Run]
) -> None:
    body = """
    import os, time
    if os.environ["RANK"] == "1":
        print("rank 1: finished", flush=True)
    else:
        time.sleep(2)
        raise RuntimeError("the real root cause on rank 0")
    """
    run, code, text = _run(
        tmp_path, runs, body, "--nproc-per-node", "2", "--cold-start", "--max-restarts", "0"
    )
    first = [e for e in run.events("rank_exit") if e.get("first")]
    assert [e["rank"] for e in first] == [0], run.events("rank_exit")
    assert "ERROR failure: rank 0" in text and "the real root cause on rank 0" in text, text
    assert code == 76


_POOL = """
import multiprocessing as mp, os, signal, sys, tempfile, time
import crashproof as cp

if sys.argv[1] == "user-handler":  # the script's own handler, installed before the manager's
    signal.signal(signal.SIGTERM, lambda *_: os._exit(7))
ckpt = cp.CheckpointManager(tempfile.mkdtemp(), async_save=False)
started = time.monotonic()
with mp.get_context("fork").Pool(1) as pool:  # leaving the block: terminate(), SIGTERM, join
    pool.apply_async(time.sleep, (30,))
    time.sleep(0.3)
print(f"terminated in {time.monotonic() - started:.1f} s", flush=True)
ckpt.close()
"""


@pytest.mark.parametrize("handler", ["default", "user-handler"])
def test_a_forked_pool_worker_is_stopped_by_sigterm_as_without_crashproof(
    tmp_path: Path, handler: str
) -> None:
    """A forked worker inherited the manager's SIGTERM handler, which only records a
    preemption notice: Pool.terminate() then joined it for ever. In a forked child the handler
    acts as the one found before crashproof's would (the default: die; the script's own: run)."""
    from tests.warm_ranks import python

    script = _script(tmp_path, _POOL)
    done = python([str(script), handler], timeout=60)
    assert done.returncode == 0 and "terminated in" in done.stdout, done.stdout + done.stderr
    assert float(done.stdout.split("terminated in ")[1].split()[0]) < 10
