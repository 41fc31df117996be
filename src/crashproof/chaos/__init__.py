"""Chaos: seeded fault campaigns against a training job, and the report of how it held up.

``crashproof chaos [options] -- <crashproof run arguments>`` launches the job under
``crashproof run``, injects faults on a seeded schedule (SIGKILL, SIGSTOP hangs, NaN losses
through the NumericsGuard's seam, corrupted checkpoints, storage errors and stalls through the
storage wrapper, stragglers), then reports for each whether it was detected, whether the run
recovered, and the work it cost; optionally it runs the job again without faults and compares
the final checkpoints bit for bit. See ``docs/chaos.md``.

``crashproof chaos``'s options are parsed by :mod:`crashproof.cli`, which hands them to
:func:`run_campaign`. This package's import is light on purpose: the campaign machinery loads
when a campaign runs.
"""

from __future__ import annotations

from crashproof.chaos._orchestrate import (
    RUN_PLACEHOLDER,
    CampaignOptions,
    RunOptions,
    run_campaign,
)
from crashproof.chaos._schedule import KINDS, Fault, draw_schedule, parse_fault

__all__ = [
    "KINDS",
    "RUN_PLACEHOLDER",
    "CampaignOptions",
    "Fault",
    "RunOptions",
    "draw_schedule",
    "parse_fault",
    "run_campaign",
]
