"""The format's names: its identity, each checkpoint's directory, each rank's files, the manifest.

Only the canonical spelling of a name counts (see :func:`parse_step_dir`): one step, one
directory.
"""

from __future__ import annotations

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "checkpoint_dir_name",
    "index_name",
    "parse_step_dir",
    "shard_name",
]

FORMAT_NAME = "crashproof-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory's name, or None for any other name.

    Only the canonical spelling counts: exactly ``checkpoint_dir_name(step)``, ``step_`` and ten
    or more ASCII digits, zero-padded (no Unicode digits, no sign, no whitespace, no other padding
    of the same number), so that one step has one directory."""
    digits = name[5:]
    if not (name.startswith("step_") and digits.isascii() and digits.isdigit()):
        return None
    step = int(digits)
    return step if step < 1 << 63 and checkpoint_dir_name(step) == name else None


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def index_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"
