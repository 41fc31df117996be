"""The options a framework callback passes on to its :class:`CheckpointManager`, checked when the
callback is made (not at the first ``train()`` or ``fit()``, minutes later)."""

from __future__ import annotations

import inspect
from typing import Any

from crashproof.checkpoint import CheckpointManager
from crashproof.errors import ConfigError

__all__ = ["manager_options"]

_MANAGER_OPTIONS = frozenset(inspect.signature(CheckpointManager).parameters) - {"root"}


def manager_options(who: str, every: Any, keep: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``every``, ``keep`` and ``options`` as :class:`CheckpointManager` keywords, or a
    :class:`ConfigError` naming the option that is not one, or that a callback cannot take."""
    unknown = sorted(set(options) - _MANAGER_OPTIONS)
    if unknown:
        raise ConfigError(
            f"{who}: {unknown} are no options of CheckpointManager; it takes "
            f"{sorted(_MANAGER_OPTIONS)}"
        )
    if options.get("read_only"):
        raise ConfigError(f"{who}(read_only=True): the callback saves; drop it")
    return {"every": every, "keep": keep, **options}
