"""The NaN seam: a chaos campaign makes one rank's loss at one step non-finite.

:meth:`NumericsGuard.check` asks :func:`injected_nan` once per step whether to take this rank's
loss as NaN. Without ``CRASHPROOF_CHAOS_NAN`` in the environment the answer is always no, at the
cost of one dictionary lookup. With it, the variable names a control file
(:mod:`crashproof._seams`) listing faults ``{"id", "rank", "step"}``: the first check of
that rank at a step of at least ``step`` sees NaN, once; the firing is logged next to the file
(``<file>.fired``), so a restarted trainer does not fire it again. The file is stat'ed once per
step and read again only when it changed.

Only the guard's view of the loss changes: the gradients, the weights and everything the guard
does next (skip, roll back, stop) are the real thing. ``docs/chaos.md`` documents the seam.
"""

from __future__ import annotations

from crashproof._seams import ENV_CHAOS_NAN, armed

__all__ = ["injected_nan"]


def injected_nan(step: int) -> bool:
    """True when a campaign armed a NaN loss for this rank at ``step`` (it fires once)."""
    watcher = armed(ENV_CHAOS_NAN, default_rank=0)
    if watcher is None:
        return False
    return any(
        step >= int(fault.get("step", 0)) and watcher.claim(str(fault["id"]), step=step)
        for fault in watcher.faults()
    )
