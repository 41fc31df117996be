"""The function each warm-started trainer runs: a light module the agent can name.

torch elastic hands a trainer's function to the forkserver by reference (module and name), so
the agent imports the module that defines it. :mod:`._entry` imports what the trainers need
warm (torch.nn.parallel, torch._dynamo: more than a second of CPU) and the forkserver preloads
it; the agent needs none of it, so it names this function, which reaches ``_entry`` only in the
trainer, where it is imported already.
"""

from __future__ import annotations

__all__ = ["run_script"]


def run_script(kind: str, target: str, *argv: str) -> None:
    """:func:`crashproof.supervisor._entry.run_script`, imported in the trainer."""
    from crashproof.supervisor._entry import run_script as run

    run(kind, target, *argv)
