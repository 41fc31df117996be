"""``Young()`` and ``Daly()``: a checkpoint interval that follows the run's own costs and failures.

The interval that minimises the work lost to checkpoints plus failures is Young's
``sqrt(2 C M)``, or Daly's higher-order refinement of it, for a checkpoint that costs ``C``
seconds of training and a mean time between failures ``M`` (docs/planning.md). Both change
during a run: the policy measures them instead of asking for them.

- ``C``, the checkpoint's real cost to training: the time the loop paused for each save (a
  synchronous save's whole write; an asynchronous save's snapshot, plus any wait for the previous
  save still writing), the median of the last few. The interval is also never shorter than the
  last background write, so asynchronous saves do not queue up.
- ``M``, the job's MTBF, from the failures the run has seen across its restarts (the ``restart``
  events of ``crashproof run``'s log, over the wall time since the run started), combined with a
  prior the user sets (``mtbf_hours``, worth ``prior_failures`` observed failures): the posterior
  mean of an exponential failure model, ``(prior_failures * mtbf + run time) / (prior_failures +
  failures)``. Early in a run the prior dominates; after many failures the observed rate does.

Until a save has been measured the interval is ``min_interval_s``: the first save measures the
cost. Every change of more than 20% is logged with its inputs.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable

from crashproof._arguments import is_real
from crashproof._rundir import RunDir
from crashproof.errors import ConfigError
from crashproof.policy._save import SaveContext, _Combinable
from crashproof.telemetry import daly_interval, read_events, young_interval

__all__ = ["Daly", "Young", "observed_failures"]

log = logging.getLogger("crashproof.policy")

_COSTS_KEPT = 5


def observed_failures(events_path: str) -> tuple[float | None, int]:
    """From a run's event log: when the run started (Unix seconds; None if unknown) and how many
    failures made it restart (membership changes of an elastic job are not failures)."""
    started: float | None = None
    failures = 0
    try:
        for event in read_events(events_path):
            if event.get("event") == "run_start" and started is None:
                started = float(event["ts"])
            elif event.get("event") == "restart" and event.get("reason") != "membership change":
                failures += 1
    except OSError:
        return None, 0
    return started, failures


class _Adaptive(_Combinable):
    _formula: Callable[[float, float], float]
    _name: str

    def __init__(
        self,
        *,
        mtbf_hours: float = 24.0,
        prior_failures: float = 1.0,
        min_interval_s: float = 10.0,
        max_interval_s: float = 6 * 3600.0,
    ) -> None:
        numbers = (mtbf_hours, prior_failures, min_interval_s, max_interval_s)
        if not all(is_real(n) for n in numbers) or not (
            mtbf_hours > 0 and prior_failures > 0 and 0 < min_interval_s <= max_interval_s
        ):
            raise ConfigError(
                f"{self._name}(mtbf_hours={mtbf_hours!r}, prior_failures={prior_failures!r}, "
                f"min_interval_s={min_interval_s!r}, max_interval_s={max_interval_s!r}): all must be "
                "positive, finite numbers and min_interval_s <= max_interval_s"
            )
        self.prior_mtbf_s = mtbf_hours * 3600.0
        self.prior_failures = prior_failures
        self.min_interval_s, self.max_interval_s = min_interval_s, max_interval_s
        self._costs: deque[float] = deque(maxlen=_COSTS_KEPT)
        self._last_persist_s = 0.0
        self._seen_blocking: float | None = None
        self._run_started: float | None = None
        self._failures = 0
        self._read_log = False
        self._started = time.time()
        self.interval_s = min_interval_s
        """The interval now in force, in seconds."""

    @property
    def same_on_every_rank(self) -> bool:
        return False  # clocks and measurements: rank 0 decides for everyone

    def mtbf_s(self) -> float:
        """The MTBF now believed: the prior combined with the failures observed in this run."""
        run_s = time.time() - (self._run_started or self._started)
        return (self.prior_failures * self.prior_mtbf_s + max(0.0, run_s)) / (
            self.prior_failures + self._failures
        )

    def should_save(self, ctx: SaveContext) -> bool:
        if not self._read_log:
            self._read_log = True
            run_dir = RunDir.from_env()
            if run_dir is not None:  # under crashproof run: the failures of earlier attempts count
                self._run_started, self._failures = observed_failures(run_dir.events)
        if ctx.last_blocking_s is not None and ctx.last_blocking_s != self._seen_blocking:
            self._seen_blocking = ctx.last_blocking_s
            self._costs.append(ctx.last_blocking_s)
        if ctx.last_persist_s is not None:
            self._last_persist_s = ctx.last_persist_s
        if self._costs:
            self._update(statistics.median(self._costs))
        return ctx.step > ctx.last_save_step and ctx.now_s - ctx.last_save_s >= self.interval_s

    def _update(self, cost_s: float) -> None:
        mtbf_s = self.mtbf_s()
        ideal = self._formula(max(cost_s, 1e-6), mtbf_s)
        interval = min(self.max_interval_s, max(self.min_interval_s, ideal, self._last_persist_s))
        if not math.isclose(interval, self.interval_s, rel_tol=0.2):
            log.info(
                "%s interval %.1f s -> %.1f s (checkpoint cost %.3f s, MTBF %.0f s: %d failures "
                "seen, prior %.0f s)",
                self._name,
                self.interval_s,
                interval,
                cost_s,
                mtbf_s,
                self._failures,
                self.prior_mtbf_s,
            )
        self.interval_s = interval


class Young(_Adaptive):
    """Save every ``sqrt(2 * cost * MTBF)`` seconds, both measured as the run goes (see the
    module docstring); ``mtbf_hours`` is the prior belief of the job's MTBF."""

    _name = "Young"
    _formula = staticmethod(young_interval)


class Daly(_Adaptive):
    """Like :class:`Young`, with Daly's higher-order interval (better when the checkpoint cost is
    not small against the MTBF)."""

    _name = "Daly"
    _formula = staticmethod(daly_interval)
