"""What ``crashproof run``'s warm forkserver imports: the trainers' entry, signal immunity, and
death with the agent.

The forkserver starts in the supervisor's process group (then leads a session of the run's own,
which its trainers share). A signal sent to the whole group or to every process (a terminal's Ctrl-C, ``kill -- -PGID``, SLURM signalling a step's processes)
would kill it, and its trainers with it (they are its children and die with their parent),
before they could take their emergency checkpoint. So it ignores the signals the trainers handle;
:func:`crashproof.supervisor._entry.run_script` gives each trainer the default dispositions
back before the script runs.

It must not outlive the agent, though: it asks the kernel for SIGKILL when the agent dies (and
exits at once if the agent is gone already), and every trainer it forks asks the same of it,
from the first instruction after the fork. (The agent's keeper, :mod:`._keeper`, ends them all
too; these signals hold even when the keeper is killed with the agent.)
"""

from __future__ import annotations

import contextlib
import os
import signal

from crashproof.link import ENV_PARENT_PID, die_with_parent
from crashproof.supervisor._entry import FORKSERVER_IGNORES, run_script

__all__ = ["run_script"]

for _sig in FORKSERVER_IGNORES:
    signal.signal(_sig, signal.SIG_IGN)

# A session of the run's own, which its trainers share: what a trainer starts stays in it, and
# the agent's keeper ends what is left of it, even a program started with an environment of its
# own (no token to find it by). torch gives each exec'd trainer a session of its own the same way.
with contextlib.suppress(OSError):  # a session leader already
    os.setsid()

_FORKSERVER_PID = os.getpid()
_forking_here = False


def _before_fork() -> None:
    global _forking_here
    # Inherited by the trainers: a trainer forking its DataLoader workers is not the forkserver.
    _forking_here = os.getpid() == _FORKSERVER_PID


def _in_child() -> None:
    if _forking_here:
        die_with_parent(_FORKSERVER_PID)


if os.environ.get(ENV_PARENT_PID):
    die_with_parent(int(os.environ[ENV_PARENT_PID]))  # the agent
    os.environ[ENV_PARENT_PID] = str(_FORKSERVER_PID)  # what the trainers must die with
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)
