"""The one place an integration imports its framework: a missing one names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from crashproof.errors import ConfigError

__all__ = ["require"]


def require(module: str, *, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise a :class:`ConfigError` saying ``pip install 'crashproof[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"{what} needs the {module.split('.')[0]!r} package, which is not installed "
            f"({error}): install it with pip install 'crashproof[{extra}]'"
        ) from error
