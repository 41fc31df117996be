"""crashproof: PyTorch training that survives failures and resumes bit for bit.

A few lines in a training loop::

    import crashproof as cp

    state = cp.TrainState(model=model, optimizer=opt, scheduler=sched, data=loader)
    ckpt = cp.CheckpointManager("runs/exp1", every=cp.EverySteps(200), keep=cp.KeepLast(3))
    start = ckpt.restore(state)
    for step in range(start, total_steps):
        train_step()
        ckpt.maybe_save(step + 1, state)
    ckpt.close()
"""

from __future__ import annotations

from crashproof._version import __version__
from crashproof.checkpoint import (
    CheckpointInfo,
    CheckpointManager,
    CommitResult,
    Delta,
    Tier,
    TierStatus,
)
from crashproof.errors import (
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    CrashproofError,
    InsufficientMemoryError,
    NonFiniteStateError,
    NumericsError,
    RootLockedError,
    StateMismatchError,
    UnsafeCheckpointError,
    UnsupportedStateError,
)
from crashproof.guard import EXIT_PREEMPTED, NumericsGuard, PreemptedExit
from crashproof.link import attach_to_supervisor
from crashproof.policy import (
    AnyOf,
    CheckpointFacts,
    Daly,
    EverySeconds,
    EverySteps,
    KeepAll,
    KeepBest,
    KeepDaily,
    KeepEvery,
    KeepHourly,
    KeepLast,
    KeepWeekly,
    KeepWithin,
    Young,
)
from crashproof.state import ResumableSampler, TrainState, Value, accumulation_steps
from crashproof.storage import LocalStorage, MemoryStorage, Storage
from crashproof.supervisor import heartbeat

__all__ = [
    "EXIT_PREEMPTED",
    "AnyOf",
    "CheckpointFacts",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "CommitResult",
    "ConfigError",
    "CorruptCheckpointError",
    "CrashproofError",
    "Daly",
    "Delta",
    "EverySeconds",
    "EverySteps",
    "InsufficientMemoryError",
    "KeepAll",
    "KeepBest",
    "KeepDaily",
    "KeepEvery",
    "KeepHourly",
    "KeepLast",
    "KeepWeekly",
    "KeepWithin",
    "LocalStorage",
    "MemoryStorage",
    "NonFiniteStateError",
    "NumericsError",
    "NumericsGuard",
    "PreemptedExit",
    "ResumableSampler",
    "RootLockedError",
    "StateMismatchError",
    "Storage",
    "Tier",
    "TierStatus",
    "TrainState",
    "UnsafeCheckpointError",
    "UnsupportedStateError",
    "Value",
    "Young",
    "__version__",
    "accumulation_steps",
    "heartbeat",
]

attach_to_supervisor()  # under `crashproof run`: heartbeat record and stack dumps; else nothing
