"""Every exit code a ``crashproof`` command ends with: the one table, used by every command.

The README's command-line section and docs/supervisor.md document them for users; a script reads
them, so their numbers never change. They follow sysexits.h where one fits (70, 74, 75).
"""

from __future__ import annotations

__all__ = [
    "EXIT_BUDGET_SPENT",
    "EXIT_CRASH_LOOP",
    "EXIT_FAILED",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_STORAGE",
    "EXIT_USAGE",
]

EXIT_OK = 0
"""Done: the command (or the supervised run) succeeded."""
EXIT_INVALID = 1
"""A checkpoint is invalid (``verify``, ``inspect``, ``export``)."""
EXIT_FAILED = 1
"""A chaos campaign failed (a fault not detected or not recovered, or the final state differs)."""
EXIT_USAGE = 2
"""A usage error, or nothing to act on (no such root or step, an output that must not be written)."""
EXIT_INTERNAL = 70
"""An internal error: a bug in crashproof (EX_SOFTWARE)."""
EXIT_STORAGE = 74
"""The storage could not be read or written (EX_IOERR)."""
EXIT_PREEMPTED = 75
"""A run stopped early that can resume (EX_TEMPFAIL: "requeue me")."""
EXIT_BUDGET_SPENT = 76
"""A trainer failed and ``--max-restarts`` restarts were already used."""
EXIT_CRASH_LOOP = 77
"""Trainers failed repeatedly without getting further; restarting again would not help."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C), as a shell reports a process ended by SIGINT."""
