"""The guard: in-process detection of what should stop or redirect training.

``_preemption`` turns preemption signals into a notice the checkpoint manager acts on at a step
boundary (an emergency checkpoint, then exit code 75); ``_numerics`` judges each step's loss and
gradient norm before it is applied.
"""

from __future__ import annotations

from crashproof.guard._numerics import NumericsGuard, Verdict
from crashproof.link import EXIT_PREEMPTED, Notice, PreemptedExit, PreemptionListener

__all__ = [
    "EXIT_PREEMPTED",
    "Notice",
    "NumericsGuard",
    "PreemptedExit",
    "PreemptionListener",
    "Verdict",
]
