"""The exceptions crashproof raises.

Every error derives from :class:`CrashproofError`, and each specific one also from the built-in
exception a caller would naturally catch, so ``except FileNotFoundError`` keeps working::

    CrashproofError(Exception)
    ├── CheckpointNotFoundError(CrashproofError, FileNotFoundError)
    ├── CorruptCheckpointError(CrashproofError, ValueError)
    │   └── UnsafeCheckpointError          (a path outside the checkpoint, a hostile size, ...)
    ├── StateMismatchError(CrashproofError, ValueError)   (checkpoint does not fit the live model)
    ├── UnsupportedStateError(CrashproofError, TypeError)  (a value crashproof cannot save)
    ├── CheckpointWriteError(CrashproofError, OSError)     (a save failed; earlier ones are intact)
    │   └── RootLockedError            (another writer holds the checkpoint root's lock)
    ├── CheckpointReadError(CrashproofError, OSError)      (the storage refused to read a checkpoint)
    ├── InsufficientMemoryError(CrashproofError, MemoryError) (no room for staging buffers)
    ├── NumericsError(CrashproofError, ArithmeticError)   (training diverged; NumericsGuard stops)
    │   └── NonFiniteStateError        (a save found NaN or inf in parameters or optimizer state)
    └── ConfigError(CrashproofError, ValueError)           (a bad argument or combination)

Messages say what happened, where (file, step, key) and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "ConfigError",
    "CorruptCheckpointError",
    "CrashproofError",
    "InsufficientMemoryError",
    "NonFiniteStateError",
    "NumericsError",
    "RootLockedError",
    "StateMismatchError",
    "UnsafeCheckpointError",
    "UnsupportedStateError",
]


class CrashproofError(Exception):
    """Root of every error raised by crashproof."""


class CheckpointNotFoundError(CrashproofError, FileNotFoundError):
    """No (valid) checkpoint where one was asked for."""


class CorruptCheckpointError(CrashproofError, ValueError):
    """A checkpoint failed verification: wrong checksum or size, missing file, bad metadata."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint's metadata tries to escape its directory or to cause a hostile read."""


class StateMismatchError(CrashproofError, ValueError):
    """The checkpoint is valid but does not fit the live training state (keys, shapes, dtypes)."""


class UnsupportedStateError(CrashproofError, TypeError):
    """A value in the training state cannot be stored without pickle."""


class CheckpointWriteError(CrashproofError, OSError):
    """Writing a checkpoint failed; the checkpoints committed before it are untouched."""


class CheckpointReadError(CrashproofError, OSError):
    """The storage refused to read a checkpoint (permissions, an I/O error): nothing is known
    against it, so a restore stops here instead of falling back past it and losing its steps."""


class RootLockedError(CheckpointWriteError):
    """Another process holds the checkpoint root's writer lock: one writer per root."""


class InsufficientMemoryError(CrashproofError, MemoryError):
    """An asynchronous save would need more host memory than is available."""


class ConfigError(CrashproofError, ValueError):
    """An argument or a combination of arguments is invalid."""


class NumericsError(CrashproofError, ArithmeticError):
    """Training produced non-finite or exploding values and the guard's policy is to stop."""


class NonFiniteStateError(NumericsError):
    """A save found NaN or inf in the model's parameters or the optimizer's state: refused."""
