"""The classes of the optimizer, the scheduler (and the schedulers nested in it) and the scaler,
recorded at save time and compared at restore: their state dicts do not say (torch loads
AdamW's state into SGD, a ``LambdaLR``'s into a ``MultiplicativeLR``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from crashproof.errors import StateMismatchError

__all__ = ["check_classes", "class_name", "recorded_classes"]

# Where torch's composite schedulers (SequentialLR, ChainedScheduler) keep their children.
_NESTED = "_schedulers"


def class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def recorded_classes(live: Mapping[str, Any]) -> dict[str, str]:
    """What a checkpoint records (``tree["classes"]``): each component's class by its name, and
    nested schedulers' as ``scheduler._schedulers[0]`` (a key older readers pass over)."""
    return {name: class_name(obj) for name, obj in _with_nested(live)}


def check_classes(saved: Any, live: Mapping[str, Any], where: str) -> None:
    """The classes recorded at save time (well formed: see
    :func:`~crashproof.state._structure.check_structure`) are the live ones, by class name;
    what a checkpoint did not record (it predates the recording) passes."""
    if saved is None:
        return
    for name, obj in _with_nested(live):
        recorded = saved.get(name)
        if recorded is None:
            continue
        now = class_name(obj)
        if recorded.rsplit(".", 1)[-1] != now.rsplit(".", 1)[-1]:
            raise StateMismatchError(
                f"{where}: {name}: the checkpoint was saved from a {recorded}, this run's {name} is "
                f"a {now}. Create the {name} the saving run used, or start a new run directory."
            )


def _with_nested(live: Mapping[str, Any], depth: int = 0) -> Iterator[tuple[str, Any]]:
    for name, obj in live.items():
        if obj is None:
            continue
        yield name, obj
        children = getattr(obj, _NESTED, None)
        if isinstance(children, (list, tuple)) and depth < 8:
            nested = {f"{name}.{_NESTED}[{i}]": child for i, child in enumerate(children)}
            yield from _with_nested(nested, depth + 1)
