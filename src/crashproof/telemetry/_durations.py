"""How the reports write a length of time: short, and as precise as its size deserves."""

from __future__ import annotations

__all__ = ["duration"]


def duration(seconds: float) -> str:
    """``0.35 s``, ``16.2 s``, ``5 min 3 s``, ``2 h 5 min``, ``3 d 4 h``."""
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    if s < 86400:
        return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
    return f"{int(s // 86400)} d {int(s % 86400 // 3600)} h"
