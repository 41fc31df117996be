"""What ``crashproof run``'s warm forkserver imports: the trainers' entry, and signal immunity.

The forkserver is a process of the supervisor's process group. A signal sent to the whole group
or to every process (a terminal's Ctrl-C, ``kill -- -PGID``, SLURM signalling a step's processes)
would kill it, and its trainers with it (they are its children and die with their parent),
before they could take their emergency checkpoint. So it ignores the signals the trainers handle;
:func:`crashproof.supervisor._entry.run_script` gives each trainer the default dispositions
back before the script runs.
"""

from __future__ import annotations

import signal

from crashproof.supervisor._entry import FORKSERVER_IGNORES, run_script

__all__ = ["run_script"]

for _sig in FORKSERVER_IGNORES:
    signal.signal(_sig, signal.SIG_IGN)
