"""What the ranks of a job agree on from the training thread, so that none acts alone: saving
after a step (:meth:`RankAgreement.after_step`), an emergency save when told to stop
(:meth:`RankAgreement.saves_before_stopping`), and work rank 0 does alone while the others wait
(:meth:`RankAgreement.on_rank0`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_for
from typing import TypeVar, cast

from crashproof.checkpoint._group import Group
from crashproof.checkpoint.save import CommitResult, SaveStats
from crashproof.errors import CheckpointWriteError, ConfigError
from crashproof.link import Notice

__all__ = ["AGREE_EVERY_S", "RankAgreement"]

log = logging.getLogger("crashproof.checkpoint")

_T = TypeVar("_T")
AGREE_EVERY_S = 0.25
"""How often the ranks agree on stopping (a preemption notice) and on time-based saves."""
_AGREE_MAX_CALLS = 10_000
"""The most steps between two agreements, however fast the steps."""
_KEEPALIVE_S = 5.0
"""While rank 0 works alone (a download from a tier), the others hear from it this often."""


class RankAgreement:
    """The training thread's agreements over ``group`` (never the writer thread's group)."""

    def __init__(self, group: Group, *, handle_signals: bool) -> None:
        self._group = group
        self._handle_signals = handle_signals
        self._calls_to_agreement = 0  # after_step calls before the ranks next agree
        self._last_call_s: float | None = None
        self._step_s: float | None = None

    def after_step(
        self, decision: bool, notice: Notice | None, *, same_everywhere: bool
    ) -> tuple[bool, Notice | None]:
        """Whether every rank saves after this step, and the notice every rank stops for.

        A notice acts only once the ranks agree on it: signals reach the ranks at different
        steps, and a rank stopping alone would pair its emergency save's collectives with its
        peers' training. Until then it stays pending."""
        if self._group.world_size == 1 or (not self._handle_signals and same_everywhere):
            return decision, notice
        decision, stop = self._agree(decision, notice is not None, same_everywhere)
        return decision, (notice or Notice("another rank", time.monotonic())) if stop else None

    def _agree(self, decision: bool, noticed: bool, same_everywhere: bool) -> tuple[bool, bool]:
        """What every rank does after this step: save (rank 0's decision binds, for policies
        whose ranks may disagree: clocks) and stop (any rank told to). Returns both.

        Agreeing is one small all-reduce, made every few steps rather than every step: it also
        waits for the slowest rank, which costs a fast step more than the all-reduce itself. Rank
        0 sets the next agreement ``AGREE_EVERY_S`` ahead from its step time, so a notice or a
        time-based save waits at most that long; all ranks count the same calls to know when.
        """
        now = time.monotonic()
        if self._last_call_s is not None:
            gap = now - self._last_call_s
            self._step_s = gap if self._step_s is None else 0.8 * self._step_s + 0.2 * gap
        self._last_call_s = now
        if self._calls_to_agreement > 0:
            self._calls_to_agreement -= 1
            return (decision if same_everywhere else False), False
        rank0 = self._group.rank == 0
        ahead = 0
        if rank0 and self._step_s:
            ahead = max(0, min(_AGREE_MAX_CALLS, int(AGREE_EVERY_S / self._step_s) - 1))
        stop, rank0_decision, calls = self._group.max(
            [int(noticed), int(decision and rank0), ahead if rank0 else 0]
        )
        self._calls_to_agreement = calls
        return (decision if same_everywhere else bool(rank0_decision)), bool(stop)

    def saves_before_stopping(
        self,
        notice: Notice,
        step: int,
        started: float,
        stats: SaveStats,
        last_commit: CommitResult | None,
        newest_valid: int | None,
    ) -> bool:
        """Whether every rank saves ``step`` before stopping (the save in flight is collected).

        Not when it is committed already, nor when the notice has a deadline the last save's
        timings say cannot be met: the newest committed checkpoint stays the one to resume from,
        and the log says so. A deadline or a missing commit seen by any rank decides for all."""
        needed_s = stats.last_blocking_s + stats.last_persist_s
        late = notice.deadline_s is not None and started + needed_s > notice.deadline_s
        missing = last_commit is None or last_commit.step != step
        late, missing = (bool(v) for v in self._group.max([int(late), int(missing)]))
        already = not missing
        if already or late:
            log.error(
                "stop requested (%s) after step %d: %s; resuming from checkpoint step %s",
                notice.source,
                step,
                "its checkpoint is committed"
                if already
                else f"an emergency checkpoint needs ~{needed_s:.1f} s, more than the notice leaves",
                newest_valid,
            )
            return False
        return True

    def on_leaders(self, leads: bool, work: Callable[[], None]) -> None:
        """``work()`` on every rank that ``leads`` (rank 0 of a shared root, each node's first
        rank on node-local roots) while the others wait, however long it takes: every rank
        answers a small all-gather every few seconds until no leader is still working."""
        if self._group.world_size == 1:
            work()
            return
        with ThreadPoolExecutor(1, thread_name_prefix="crashproof-leader") as pool:
            future = pool.submit(work) if leads else None
            while True:
                if future is not None:  # the leaders pace the rounds; the others just answer
                    wait_for([future], timeout=_KEEPALIVE_S)
                if not any(self._group.all_gather(future is not None and not future.done())):
                    break
        # Every rank raises a leader's error, once all know the leaders are done.
        error = None if future is None else future.exception()
        said = self._group.all_gather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = next(((r, why) for r, why in enumerate(said) if why is not None), None)
        if failed is not None:
            raise CheckpointWriteError(f"rank {failed[0]} failed: {failed[1]}")

    def on_rank0(self, work: Callable[[], _T]) -> _T:
        """``work()`` on rank 0, its result on every rank, however long it takes: the other
        ranks wait in a broadcast every few seconds, never in one collective that could time out
        (a download from a tier can take longer than the collective timeout)."""
        if self._group.world_size == 1:
            return work()
        if self._group.rank != 0:
            while True:
                kind, value = self._group.broadcast(None)
                if kind == "done":
                    return cast(_T, value)
                if kind == "error":
                    kind_of_error, message = value
                    if kind_of_error == "ConfigError":  # (the run's set-up: the same for all)
                        raise ConfigError(f"rank 0: {message}")
                    raise CheckpointWriteError(f"rank 0 failed: {kind_of_error}: {message}")
        with ThreadPoolExecutor(1, thread_name_prefix="crashproof-rank0") as pool:
            future = pool.submit(work)
            while True:
                try:
                    value = future.result(timeout=_KEEPALIVE_S)
                except FutureTimeout:
                    self._group.broadcast(("wait", None))
                    continue
                except Exception as exc:
                    self._group.broadcast(("error", (type(exc).__name__, str(exc))))
                    raise
                self._group.broadcast(("done", value))
                return value
