"""What the supervisor is told: :class:`SupervisorConfig`, built by ``crashproof run`` from its
options, and the restart budget's default."""

from __future__ import annotations

from dataclasses import dataclass, field

from crashproof.supervisor._crashloop import CrashLoopPolicy, RestartBudget
from crashproof.supervisor._hang import HangConfig
from crashproof.supervisor._straggler import StragglerConfig

__all__ = ["DEFAULT_MAX_RESTARTS", "SupervisorConfig"]

DEFAULT_MAX_RESTARTS = 30
"""``--max-restarts``' default, per ``--restart-window`` (an hour): a failure every two minutes
for an hour. Large clusters see a few failures a day; a run that needs more restarts than this
spends most of its time restarting, and someone should look at it."""


@dataclass(kw_only=True, slots=True)
class SupervisorConfig:
    run_dir: str
    """Where events, logs, heartbeats and stack dumps go."""
    hang: HangConfig = field(default_factory=HangConfig)
    """When a silent trainer is hung."""
    crash_loop: CrashLoopPolicy = field(default_factory=CrashLoopPolicy)
    """When repeated failures are a crash loop, and the backoff between them."""
    budget: RestartBudget = field(
        default_factory=lambda: RestartBudget(max_restarts=DEFAULT_MAX_RESTARTS, window_s=3600.0)
    )
    """How many restarts after failures, within what time (the ``WorkerSpec``'s
    ``max_restarts`` is not the budget: torch would count it over the run's life)."""
    shutdown_grace_s: float = 5.0
    """After SIGTERM, how long trainers get to exit before SIGKILL."""
    stack_dump_wait_s: float = 3.0
    """How long to wait for the stack dumps of a hung group."""
    preemption_grace_s: float = 30.0
    """On a preemption, how long trainers get for their emergency checkpoint before SIGKILL."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """When a rank's work per step is slow enough, for long enough, to be reported."""
