"""The version of crashproof (one place, read by the package, the CLI and the report)."""

from __future__ import annotations

__version__ = "0.1.0"
