"""Did the faults change the result? The final checkpoints of two runs, compared bit for bit.

Both checkpoints are verified first (every file and tensor checksum), then compared per rank:
every tensor by its logical checksum (a delta checkpoint's tensors by the checksum of the
decoded bytes), dtype and shape, and the JSON state trees (RNG states, data position, counters,
everything that is not a tensor). Comparing checksums is comparing bytes: XXH3-128 of the
tensor's raw bytes, recorded at save time and just verified against the files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from crashproof.checkpoint import (
    RankIndex,
    committed_steps,
    read_manifest,
    read_rank_index,
    verify_checkpoint,
)
from crashproof.errors import CrashproofError
from crashproof.storage import Storage, storage_for

__all__ = ["Comparison", "compare_final_checkpoints"]

_SHOWN = 10  # differences listed in a report


@dataclass(kw_only=True)
class Comparison:
    identical: bool
    step: int | None = None
    """The step of both final checkpoints (None: they differ, or one is missing)."""
    steps: tuple[int | None, int | None] = (None, None)
    world_size: int | None = None
    tensors: int = 0
    """Tensors compared (over every rank)."""
    differences: list[str] = field(default_factory=list)
    """The first differences found (tensor names or state paths, with the rank)."""
    problem: str | None = None
    """Why no comparison was possible."""

    def to_json(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "step": self.step,
            "steps": list(self.steps),
            "world_size": self.world_size,
            "tensors": self.tensors,
            "differences": self.differences,
            "problem": self.problem,
        }


def _final(root: str) -> tuple[Storage, int, str]:
    path, storage = storage_for(root)
    found = committed_steps(storage, path)
    if not found:
        raise FileNotFoundError(f"no committed checkpoint in {storage.describe(path)}")
    step, ckpt = found[0]
    verify_checkpoint(storage, ckpt)
    return storage, step, ckpt


def _table(index: RankIndex) -> list[tuple[str, tuple[int, ...], str]]:
    """A rank's tensor table as (dtype, shape, checksum of its logical bytes), in order."""
    deltas = {d.index: d for d in index.deltas}
    return [
        (d.dtype, d.shape, d.checksum) if (d := deltas.get(i)) else (t.dtype, t.shape, t.checksum)
        for i, t in enumerate(index.tensors)
    ]


def _tensors(index: RankIndex) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Every tensor of a rank, by name."""
    return dict(zip((t.name for t in index.tensors), _table(index), strict=True))


_REFS = ("$tensor", "$ndarray", "$dtensor")


def _normalized(node: Any, tensors: list[str]) -> Any:
    """The state tree with each tensor reference replaced by the tensor's name (their values are
    compared by name) and each ``$dict`` by a mapping. A restored run's optimizer state lists the
    same tensors in another order (its table indexes differ) and its entries in another order:
    the same state, which must compare equal."""
    if isinstance(node, dict):
        if len(node) == 1:
            ((key, value),) = node.items()
            if key in _REFS and isinstance(value, int) and 0 <= value < len(tensors):
                return f"<{key[1:]} {tensors[value]}>"
            if key == "$dict" and isinstance(value, list):
                return {
                    json.dumps(_normalized(k, tensors), sort_keys=True): _normalized(v, tensors)
                    for k, v in value
                }
        return {k: _normalized(v, tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [_normalized(v, tensors) for v in node]
    return node


def _state_differences(a: Any, b: Any, where: str, out: list[str]) -> None:
    """JSON paths where the state trees ``a`` and ``b`` differ (at most a few)."""
    if len(out) >= _SHOWN:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(
                    f"{where}/{key}: only in {'the faulted run' if key in a else 'baseline'}"
                )
            else:
                _state_differences(a[key], b[key], f"{where}/{key}", out)
        return
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _state_differences(x, y, f"{where}[{i}]", out)
        return
    if a != b or type(a) is not type(b):
        out.append(f"{where}: {_short(a)} != {_short(b)} (baseline)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def compare_final_checkpoints(faulted_root: str, baseline_root: str) -> Comparison:
    """Compare the newest committed checkpoint under each root (the faulted run's first)."""
    try:
        a_storage, a_step, a_ckpt = _final(faulted_root)
        b_storage, b_step, b_ckpt = _final(baseline_root)
        a_manifest = read_manifest(a_storage, a_ckpt)
        b_manifest = read_manifest(b_storage, b_ckpt)
    except (CrashproofError, OSError) as exc:
        return Comparison(identical=False, problem=f"{type(exc).__name__}: {exc}")
    result = Comparison(identical=False, steps=(a_step, b_step))
    if a_step != b_step:
        result.problem = (
            f"the final checkpoints are of different steps: {a_step} and {b_step} (baseline)"
        )
        return result
    if a_manifest.world_size != b_manifest.world_size:
        result.problem = (
            f"the final checkpoints have {a_manifest.world_size} and {b_manifest.world_size} "
            "(baseline) ranks"
        )
        return result
    result.step, result.world_size = a_step, a_manifest.world_size
    differences: list[str] = []
    try:
        for rank in range(a_manifest.world_size):
            a = read_rank_index(a_storage, a_ckpt, a_manifest, rank)
            b = read_rank_index(b_storage, b_ckpt, b_manifest, rank)
            a_tensors, b_tensors = _tensors(a), _tensors(b)
            result.tensors += len(a_tensors)
            for name in sorted(set(a_tensors) | set(b_tensors)):
                if a_tensors.get(name) != b_tensors.get(name):
                    differences.append(
                        f"rank {rank} tensor {name}: {_describe(a_tensors.get(name), b_tensors.get(name))}"
                    )
            state: list[str] = []
            _state_differences(
                _normalized(a.state, [t.name for t in a.tensors]),
                _normalized(b.state, [t.name for t in b.tensors]),
                "state",
                state,
            )
            differences += [f"rank {rank} {d}" for d in state]
    except (CrashproofError, OSError) as exc:
        result.problem = f"{type(exc).__name__}: {exc}"
        return result
    result.differences = differences[:_SHOWN]
    result.identical = not differences
    return result


def _describe(
    a: tuple[str, tuple[int, ...], str] | None, b: tuple[str, tuple[int, ...], str] | None
) -> str:
    if a is None or b is None:
        return "only in the faulted run" if b is None else "only in the baseline"
    if a[:2] != b[:2]:
        return f"{a[0]}{list(a[1])} vs {b[0]}{list(b[1])} (baseline)"
    return f"checksum {a[2]} vs {b[2]} (baseline)"
