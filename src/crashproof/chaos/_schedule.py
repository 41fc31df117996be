"""What a campaign will do: the faults, their kinds, targets and triggers. No processes here.

A schedule is either drawn (``--mtbf``: exponential inter-arrival times over ``--duration``
seconds, kinds drawn uniformly from ``--faults``, ranks uniformly, all from one ``--seed``) or
written out (``--fault "at=30s,rank=1,kind=kill"``, repeatable). Either way the same arguments
give the same list of :class:`Fault` objects: drawing is a pure function of the seed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crashproof._units import parse_duration

__all__ = ["KINDS", "Fault", "draw_schedule", "parse_fault"]

KINDS = ("kill", "hang", "nan", "corrupt", "storage", "straggler")
"""Every kind of fault, by its name on the command line and in the reports."""

STORAGE_ERRORS = ("enospc", "eio", "hang")
CORRUPT_MODES = ("flip", "truncate")

# The parameters each kind takes, with their defaults (None: drawn from the seed).
_PARAMS: dict[str, dict[str, Any]] = {
    "kill": {},
    "hang": {},
    "nan": {},
    "corrupt": {"mode": None},
    "storage": {"error": None, "files": 1, "hang_s": 5.0},
    "straggler": {"stop": 0.4, "period_s": 0.5, "for_s": 20.0},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One fault to inject: ``at_s`` seconds after the run started (its ``run_start`` event), or once the training
    has reached step ``at_step``; exactly one of the two is set."""

    id: str
    """``f1``, ``f2``, ... in schedule order: how the reports and the seams name it."""
    kind: str
    """One of :data:`KINDS`."""
    rank: int
    """The global rank it hits."""
    at_s: float | None = None
    at_step: int | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    """Per kind: ``corrupt``: mode (flip, truncate); ``storage``: error (enospc, eio, hang),
    files, hang_s; ``straggler``: stop (the fraction of each period the rank is stopped),
    period_s, for_s."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"fault {self.id}: unknown kind {self.kind!r}; use one of {', '.join(KINDS)}"
            )
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError(f"fault {self.id}: give its time (at=30s) or its step (at=step:120)")
        if self.rank < 0:
            raise ValueError(f"fault {self.id}: rank {self.rank} must be 0 or more")
        # Parameters left out take their defaults (those drawn from a seed must be given).
        defaults = {k: v for k, v in _PARAMS[self.kind].items() if v is not None}
        object.__setattr__(self, "params", {**defaults, **self.params})
        p = self.params
        if self.kind == "storage" and (
            p.get("error") not in STORAGE_ERRORS or int(p["files"]) < 1 or float(p["hang_s"]) < 0
        ):
            raise ValueError(
                f"fault {self.id}: storage needs error=enospc|eio|hang, files >= 1, hang_s >= 0"
            )
        if self.kind == "corrupt" and p.get("mode") not in CORRUPT_MODES:
            raise ValueError(f"fault {self.id}: corrupt needs mode=flip|truncate")
        if self.kind == "straggler" and not (
            0 < float(p["stop"]) < 1 and float(p["period_s"]) > 0 and float(p["for_s"]) > 0
        ):
            raise ValueError(
                f"fault {self.id}: straggler needs 0 < stop < 1 (the stopped fraction of each "
                "period), period_s > 0 and for_s > 0"
            )

    @property
    def trigger(self) -> str:
        """``30.0s`` or ``step:120``, as the command line writes it."""
        return f"step:{self.at_step}" if self.at_step is not None else f"{self.at_s:.1f}s"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "rank": self.rank,
            "at_s": self.at_s,
            "at_step": self.at_step,
            "params": dict(self.params),
        }


def parse_fault(text: str, *, index: int, seed: int, world_size: int) -> Fault:
    """A fault from ``at=30s,rank=1,kind=kill`` (or ``at=step:120``, and the kind's parameters:
    ``error=eio``, ``mode=truncate``, ``stop=0.4``...). A rank or parameter left out is drawn from
    ``seed`` and the fault's position ``index``, the same way every time."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        if not eq or not key or not value or "=" in value:
            raise ValueError(f"--fault {text!r}: write key=value pairs separated by commas")
        if key in fields:
            raise ValueError(f"--fault {text!r}: {key} is given twice")
        fields[key] = value.strip()
    kind = fields.pop("kind", None)
    at = fields.pop("at", None)
    if kind is None or at is None:
        raise ValueError(f"--fault {text!r}: kind= and at= are needed (e.g. at=30s,kind=kill)")
    if kind not in KINDS:
        raise ValueError(f"--fault {text!r}: unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    rng = random.Random(f"{seed}:{index}")
    at_s: float | None = None
    at_step: int | None = None
    if at.startswith("step:"):
        at_step = _int(at[len("step:") :], text, "at=step:")
    else:
        try:
            at_s = parse_duration(at, "at", zero_ok=True)
        except ValueError as exc:
            raise ValueError(f"--fault {text!r}: {exc}") from None
    rank = _int(fields.pop("rank"), text, "rank") if "rank" in fields else rng.randrange(world_size)
    if rank >= world_size:
        raise ValueError(f"--fault {text!r}: rank {rank}, but the run has {world_size} rank(s)")
    unknown = set(fields) - set(_PARAMS[kind])
    if unknown:
        allowed = ", ".join(_PARAMS[kind]) or "none"
        raise ValueError(
            f"--fault {text!r}: {kind} takes no {', '.join(sorted(unknown))} (its parameters: {allowed})"
        )
    try:
        params = _params(kind, rng, given=fields)
        return Fault(
            id=f"f{index + 1}", kind=kind, rank=rank, at_s=at_s, at_step=at_step, params=params
        )
    except ValueError as exc:
        raise ValueError(f"--fault {text!r}: {exc}") from None


MAX_DRAWN_FAULTS = 10_000
"""The most faults ``--mtbf`` may draw: each is injected, detected and recovered from in turn
(tens of seconds each), so more is no campaign anyone waits for; the mean is checked before
drawing (``--mtbf 1e-300`` would draw for ever)."""


def draw_schedule(
    *, seed: int, mtbf_s: float, duration_s: float, kinds: Sequence[str], world_size: int
) -> list[Fault]:
    """Faults at exponentially distributed intervals of mean ``mtbf_s`` until ``duration_s``
    seconds after the run started; each of a kind drawn uniformly from ``kinds``, at a rank drawn
    uniformly, with its drawn parameters (a storage error, a corruption mode)."""
    if mtbf_s <= 0 or duration_s <= 0:
        raise ValueError("--mtbf and --duration must be positive numbers of seconds")
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"--faults {','.join(kinds)}: choose from {', '.join(KINDS)}")
    if world_size < 1:
        raise ValueError(f"a run of {world_size} ranks has nothing to hit")
    if duration_s / mtbf_s > MAX_DRAWN_FAULTS:  # drawing them alone would not end
        raise ValueError(
            f"--mtbf {mtbf_s:g} --duration {duration_s:g}: about {duration_s / mtbf_s:.3g} faults; "
            f"a campaign injects at most {MAX_DRAWN_FAULTS}: give a longer --mtbf or a shorter "
            "--duration"
        )
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = 0.0
    while True:
        at += rng.expovariate(1.0 / mtbf_s)
        if at >= duration_s:
            return faults
        if len(faults) == MAX_DRAWN_FAULTS:  # an unlucky draw far above the mean
            raise ValueError(
                f"--mtbf {mtbf_s:g} --duration {duration_s:g}: more than {MAX_DRAWN_FAULTS} "
                "faults drawn; give a longer --mtbf or a shorter --duration"
            )
        kind = rng.choice(list(kinds))
        rank = rng.randrange(world_size)
        faults.append(
            Fault(
                id=f"f{len(faults) + 1}",
                kind=kind,
                rank=rank,
                at_s=round(at, 3),
                params=_params(kind, rng, given={}),
            )
        )


def _params(kind: str, rng: random.Random, *, given: Mapping[str, str]) -> dict[str, Any]:
    """The kind's parameters: given ones converted, missing ones defaulted or drawn."""
    params: dict[str, Any] = {}
    for name, default in _PARAMS[kind].items():
        if name in given:
            value: Any = given[name]
            if isinstance(default, float) or name.endswith("_s"):
                value = (
                    parse_duration(value, name, zero_ok=True)
                    if name.endswith("_s")
                    else float(value)
                )
            elif isinstance(default, int):
                value = int(value)
            params[name] = value
        elif default is None:
            params[name] = rng.choice(STORAGE_ERRORS if name == "error" else CORRUPT_MODES)
        else:
            params[name] = default
    return params


def _int(text: str, spec: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--fault {spec!r}: {what}{text!r} is not a whole number") from None
    if value < 0:
        raise ValueError(f"--fault {spec!r}: {what}{text} must not be negative")
    return value
