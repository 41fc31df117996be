"""``ResumableSampler``: a sampler that knows how far the training loop has got in its epoch.

The order of epoch ``e`` is a permutation of ``range(n)`` drawn from a generator seeded with
``(seed, e)``, so it depends on nothing but those two numbers. The position is *global*: the
number of samples of the epoch the whole job (all ranks) has received. Each iteration starts at
that position and deals the rest of the epoch out to the ranks, so a run can resume mid-epoch,
even with another world size, without repeating or skipping a sample.

The position advances only when the training loop *receives* a batch (see
:mod:`crashproof.state._data`), never when DataLoader workers prefetch one.

Windows of an epoch can be *skipped* (:meth:`ResumableSampler.skip`, used by ``NumericsGuard``
when a stretch of data made training diverge): the positions in them are never dealt out again.
The skipped windows are part of the saved state, so a resumed run skips them too.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from crashproof.errors import ConfigError, CorruptCheckpointError, StateMismatchError

__all__ = ["ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """Yields dataset indices for this rank, resuming where the last run stopped.

    Args:
        n: the dataset's length.
        shuffle: draw a fresh permutation each epoch (seeded by ``seed`` and the epoch).
        seed: the shuffle's seed; must be the same on every rank.
        rank, world_size: this process's share of the data; default to ``torch.distributed``'s
            when it is initialised, else 0 and 1.
    """

    def __init__(
        self,
        n: int,
        shuffle: bool = True,
        seed: int = 0,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if n < 0:
            raise ConfigError(f"ResumableSampler: n must be >= 0, got {n}")
        if world_size is None:
            dist = torch.distributed
            world_size = (
                dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            )
        if rank is None:
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < world_size:
            raise ConfigError(f"ResumableSampler: rank {rank} is outside world size {world_size}")
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.consumed = 0  # position in this epoch's order up to which the job has received
        self.skipped: list[tuple[int, int, int]] = []
        """Windows ``(epoch, start, end)`` of positions in the epoch's order never dealt out."""
        self.last_window: tuple[int, int, int] | None = None
        """The positions the last received batch came from: ``(epoch, start, end)``."""
        self._received_from: tuple[int, int] | None = None  # see take_received()
        self.generation = 0
        """Changes whenever the position is set from outside (restore, skip, set_epoch): an
        iteration in progress then starts over from the new position."""

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        generator = torch.Generator()
        # Mix seed and epoch into one 63-bit seed; distinct (seed, epoch) give distinct streams.
        generator.manual_seed((self.seed * 1_000_003 + self.epoch) & ((1 << 63) - 1))
        return torch.randperm(self.n, generator=generator)

    def _skipped_here(self) -> list[tuple[int, int]]:
        """This epoch's skipped windows as sorted, non-overlapping ``(start, end)`` pairs."""
        merged: list[tuple[int, int]] = []
        for start, end in sorted((a, b) for epoch, a, b in self.skipped if epoch == self.epoch):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def _kept_positions(self, start: int | None = None) -> torch.Tensor:
        """Positions from ``start`` (default: ``consumed``) to the end of the epoch that are not
        skipped."""
        start = self.consumed if start is None else start
        kept = torch.ones(self.n - start, dtype=torch.bool)
        for skip_start, skip_end in self._skipped_here():
            kept[max(skip_start - start, 0) : max(skip_end - start, 0)] = False
        return kept.nonzero().flatten() + start

    def _remaining(self) -> torch.Tensor:
        order = self._order()
        skipped = self._skipped_here()
        rest = order[self._kept_positions()] if skipped else order[self.consumed :]
        # Every rank must get the same number of samples or collectives hang at the epoch's end:
        # pad the tail with the epoch's first samples, wrapping around, as torch's
        # DistributedSampler does. The epoch's, not the rest's: an epoch resumed part-way pads
        # exactly as the uninterrupted epoch did.
        if self.world_size > 1 and len(rest) % self.world_size:
            pad = self.world_size - len(rest) % self.world_size
            whole = order[self._kept_positions(0)] if skipped else order
            rest = torch.cat([rest, whole.repeat(-(-pad // len(whole)))[:pad]])
        return rest[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining().tolist())

    def __len__(self) -> int:
        rest = len(self._kept_positions()) if self._skipped_here() else self.n - self.consumed
        return -(-rest // self.world_size) if rest > 0 else 0

    # -- position, driven by the tracked DataLoader -------------------------------------------

    def record_received(self, per_rank_samples: int) -> None:
        """The training loop received a batch of ``per_rank_samples`` on every rank."""
        start = self.consumed
        count = per_rank_samples * self.world_size
        for skip_start, skip_end in self._skipped_here():  # step over windows never dealt out
            if skip_end <= start:
                continue
            if skip_start >= start + count:
                break
            count += skip_end - max(skip_start, start)
        self.consumed = min(self.n, start + count)
        self.last_window = (self.epoch, start, self.consumed)
        if self._received_from is None:
            self._received_from = (self.epoch, start)

    def take_received(self) -> list[tuple[int, int, int]]:
        """The windows ``(epoch, start, end)`` received since the last call (or the last restore).

        What one training step consumed, when called once per step; an epoch boundary splits it.
        """
        if self._received_from is None:
            return []
        epoch, start = self._received_from
        self._received_from = None
        if epoch == self.epoch:
            return [(epoch, start, self.consumed)]
        windows = [(epoch, start, self.n)] if start < self.n else []
        windows += [(e, 0, self.n) for e in range(epoch + 1, self.epoch)]
        return windows + ([(self.epoch, 0, self.consumed)] if self.consumed else [])

    def finish_epoch(self) -> None:
        """The loader's iteration ran out: the next iteration starts the next epoch."""
        self.epoch += 1
        self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch`` (for loops that manage epochs themselves).

        The same epoch is a no-op: after a restore the loop's ``set_epoch(epoch)`` for the epoch
        the checkpoint holds keeps the position within it. Another epoch while this one is part
        way through (or an earlier one) drops the position, and warns: a resumed loop that
        starts its epochs from 0 would train on the wrong data. Read the epoch to resume from
        ``sampler.epoch`` (or ``TrainState.epoch``) after the restore.
        """
        if epoch == self.epoch:
            return
        if epoch < self.epoch or 0 < self.consumed < self.n:
            warnings.warn(
                f"ResumableSampler.set_epoch({epoch}) while at epoch {self.epoch}, position "
                f"{self.consumed} of {self.n}: that position is dropped and epoch {epoch} starts "
                f"from its beginning. After a restore, resume the epoch loop from "
                f"sampler.epoch ({self.epoch}), which keeps the position within it",
                stacklevel=2,
            )
        self.epoch, self.consumed = epoch, 0
        self.generation += 1

    @property
    def position(self) -> int:
        """Samples of this epoch's order the job (all ranks) has received (``consumed``)."""
        return self.consumed

    def batches_received(self, per_rank_batch: int) -> int:
        """How many batches of ``per_rank_batch`` samples per rank the loop has received in this
        epoch (skipped windows, never dealt out, are not counted)."""
        skipped = sum(
            max(0, min(end, self.consumed) - start) for start, end in self._skipped_here()
        )
        return (self.consumed - skipped) // max(1, per_rank_batch * self.world_size)

    def skip(self, epoch: int, start: int, end: int) -> None:
        """Never deal out positions ``start:end`` of ``epoch``'s order (recorded in the state)."""
        if not (0 <= start < end <= self.n and epoch >= 0):
            raise ConfigError(
                f"ResumableSampler.skip({epoch}, {start}, {end}): not a window of an epoch of {self.n}"
            )
        if (epoch, start, end) not in self.skipped:
            self.skipped.append((epoch, start, end))
            self.generation += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "skipped": [list(window) for window in self.skipped],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        # Checkpoints from before skipping existed have no "skipped": nothing was skipped then.
        self.skipped = [(int(e), int(a), int(b)) for e, a, b in state.get("skipped", [])]
        self._received_from = None
        self.generation += 1

    def check_state_dict(self, state: Any) -> None:
        """Raise :class:`StateMismatchError` when ``state`` is a position in another order (other
        ``n``, ``shuffle`` or ``seed``), :class:`CorruptCheckpointError` when it is malformed (a
        field of the wrong type, a position outside the epoch): no sampler saves such a state."""
        if (
            not isinstance(state, dict)
            or not {"n", "shuffle", "seed", "epoch", "consumed"} <= state.keys()
        ):
            raise CorruptCheckpointError(f"data position: malformed sampler state {state!r}")
        for key in ("epoch", "consumed"):  # (n, shuffle and seed must equal this run's)
            value = state[key]
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise CorruptCheckpointError(
                    f"data position: the sampler's {key!r} is {value!r}, expected an integer"
                )
        for key in ("n", "shuffle", "seed"):
            if state[key] != getattr(self, key):
                raise StateMismatchError(
                    f"data position: the checkpoint's sampler has {key}={state[key]!r}, this run's has "
                    f"{key}={getattr(self, key)!r}; resuming would replay a different sample order. "
                    f"Create the ResumableSampler with {key}={state[key]!r}, or start a new run directory."
                )
        if not 0 <= state["consumed"] <= self.n or state["epoch"] < 0:
            raise CorruptCheckpointError(
                f"data position: epoch/consumed out of range (0 <= consumed <= {self.n}, "
                f"epoch >= 0) in {state!r}"
            )
        skipped = state.get("skipped", [])
        if not isinstance(skipped, list) or not all(
            isinstance(w, list) and len(w) == 3
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in w)
            and w[0] >= 0 and 0 <= w[1] < w[2] <= self.n
            for w in skipped
        ):  # fmt: skip
            raise CorruptCheckpointError(f"data position: malformed skipped windows {skipped!r}")
