"""``ResumableSampler``: a sampler that knows how far the training loop has got in its epoch.

The order of epoch ``e`` is a permutation of ``range(n)`` drawn from a generator seeded with
``(seed, e)``, so it depends on nothing but those two numbers. The position is *global*: the
number of samples of the epoch the whole job (all ranks) has received. Each iteration starts at
that position and deals the rest of the epoch out to the ranks, so a run can resume mid-epoch,
even with another world size, without repeating or skipping a sample.

The position advances only when the training loop *receives* a batch (see
:mod:`crashproof.state._data`), never when DataLoader workers prefetch one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from crashproof.errors import ConfigError, StateMismatchError

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
        self.consumed = 0  # samples of this epoch received by the whole job

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        generator = torch.Generator()
        # Mix seed and epoch into one 63-bit seed; distinct (seed, epoch) give distinct streams.
        generator.manual_seed((self.seed * 1_000_003 + self.epoch) & ((1 << 63) - 1))
        return torch.randperm(self.n, generator=generator)

    def _remaining(self) -> torch.Tensor:
        rest = self._order()[self.consumed :]
        # Every rank must get the same number of samples or collectives hang at the epoch's end:
        # wrap around to pad the tail, as torch's DistributedSampler does.
        if self.world_size > 1 and len(rest) % self.world_size:
            pad = self.world_size - len(rest) % self.world_size
            rest = (
                torch.cat([rest, rest[:pad]])
                if len(rest) >= pad
                else rest.repeat(pad + 1)[: len(rest) + pad]
            )
        return rest[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining().tolist())

    def __len__(self) -> int:
        rest = self.n - self.consumed
        return -(-rest // self.world_size) if rest > 0 else 0

    # -- position, driven by the tracked DataLoader -------------------------------------------

    def record_received(self, per_rank_samples: int) -> None:
        """The training loop received a batch of ``per_rank_samples`` on every rank."""
        self.consumed = min(self.n, self.consumed + per_rank_samples * self.world_size)

    def finish_epoch(self) -> None:
        """The loader's iteration ran out: the next iteration starts the next epoch."""
        self.epoch += 1
        self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch`` (for loops that manage epochs themselves)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])

    def check_state_dict(self, state: Any) -> None:
        """Raise :class:`StateMismatchError` when ``state`` cannot be resumed by this sampler."""
        if (
            not isinstance(state, dict)
            or not {"n", "shuffle", "seed", "epoch", "consumed"} <= state.keys()
        ):
            raise StateMismatchError(f"data position: malformed sampler state {state!r}")
        for key in ("n", "shuffle", "seed"):
            if state[key] != getattr(self, key):
                raise StateMismatchError(
                    f"data position: the checkpoint's sampler has {key}={state[key]!r}, this run's has "
                    f"{key}={getattr(self, key)!r}; resuming would replay a different sample order. "
                    f"Create the ResumableSampler with {key}={state[key]!r}, or start a new run directory."
                )
        if not 0 <= int(state["consumed"]) <= self.n or int(state["epoch"]) < 0:
            raise StateMismatchError(f"data position: epoch/consumed out of range in {state!r}")
