"""``ResumableSampler`` and the tracked DataLoader: the data order is a pure function of (seed,
epoch), the saved position is what the training loop received, and a resumed loader yields
exactly the samples an uninterrupted one would have.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, get_worker_info

from crashproof import CorruptCheckpointError, ResumableSampler, StateMismatchError, TrainState


class Ids(Dataset[int]):
    """Sample ``i`` is the number ``i``: batches show exactly which samples were dealt."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class WorkerSeeds(Ids):
    """Each sample is the seed of the worker that loaded it."""

    def __getitem__(self, index: int) -> int:  # type: ignore[override]
        info = get_worker_info()
        assert info is not None
        return int(info.seed % (1 << 62))


def _sampler(n: int, *, seed: int = 0, shuffle: bool = True) -> ResumableSampler:
    return ResumableSampler(n, shuffle=shuffle, seed=seed, rank=0, world_size=1)


def _loader(
    n: int,
    *,
    workers: int = 0,
    drop_last: bool = False,
    seed: int = 0,
    batch_size: int = 4,
    dataset: Dataset[int] | None = None,
) -> tuple[DataLoader[int], TrainState]:
    extra: dict[str, Any] = {"prefetch_factor": 2} if workers else {}
    loader = DataLoader(
        dataset if dataset is not None else Ids(n),
        batch_size=batch_size,
        sampler=_sampler(n, seed=seed),
        drop_last=drop_last,
        num_workers=workers,
        **extra,
    )
    return loader, TrainState(data=loader)


def _epoch_order(n: int, epoch: int, seed: int = 0) -> list[int]:
    sampler = _sampler(n, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def _receive(
    loader: DataLoader[int], out: list[list[int]], count: int, *, to_epoch_end: bool = False
) -> None:
    """Receive batches like a training loop (epoch after epoch) until ``out`` holds ``count``.

    Without ``to_epoch_end`` it stops right after the batch, as a loop interrupted there would;
    with it, the loop finishes its ``for`` over the epoch (the loader's iteration runs out).
    """
    while len(out) < count:
        for batch in loader:
            out.append(batch.tolist())
            if len(out) == count and not to_epoch_end:
                return
    assert len(out) == count, "to_epoch_end needs a count that ends an epoch"


# -- the order -------------------------------------------------------------------------------


def test_each_epoch_is_a_fresh_permutation_determined_by_seed_and_epoch() -> None:
    n = 50
    orders = [_epoch_order(n, epoch, seed=3) for epoch in range(3)]
    for order in orders:
        assert sorted(order) == list(range(n))
    assert orders[0] != list(range(n))
    assert len({tuple(order) for order in orders}) == 3, "epochs must differ"
    assert [_epoch_order(n, epoch, seed=3) for epoch in range(3)] == orders
    assert _epoch_order(n, 0, seed=4) != orders[0]


def test_without_shuffle_every_epoch_is_in_index_order() -> None:
    sampler = _sampler(7, shuffle=False)
    assert list(sampler) == list(range(7))
    sampler.set_epoch(3)
    assert list(sampler) == list(range(7))


@pytest.mark.parametrize(("n", "world_size"), [(12, 4), (10, 3), (7, 8), (2, 5)])
def test_ranks_share_an_epoch_with_equal_lengths_and_no_sample_left_out(
    n: int, world_size: int
) -> None:
    order = _epoch_order(n, 1, seed=9)
    shards = []
    for rank in range(world_size):
        sampler = ResumableSampler(n, shuffle=True, seed=9, rank=rank, world_size=world_size)
        sampler.set_epoch(1)
        shards.append(list(sampler))
        assert len(sampler) == len(shards[-1])
    per_rank = -(-n // world_size)
    assert [len(shard) for shard in shards] == [per_rank] * world_size
    dealt = [i for shard in shards for i in shard]
    assert set(dealt) == set(order)
    # Only padding repeats samples, and only as much as needed to even out the lengths.
    assert len(dealt) - n == per_rank * world_size - n < world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_mid_epoch_position_deals_exactly_the_rest_of_the_epoch_to_the_ranks(
    world_size: int,
) -> None:
    n, position = 23, 9
    order = _epoch_order(n, 2, seed=5)
    state = {"n": n, "shuffle": True, "seed": 5, "epoch": 2, "consumed": position}
    dealt = []
    for rank in range(world_size):
        sampler = ResumableSampler(n, shuffle=True, seed=5, rank=rank, world_size=world_size)
        sampler.load_state_dict(state)
        dealt += list(sampler)
    # The tail is padded with the epoch's first samples, as the uninterrupted epoch pads it.
    pad = len(dealt) - (n - position)
    assert pad < world_size
    assert sorted(dealt) == sorted(order[position:] + order[:pad])


@pytest.mark.parametrize(
    ("n", "world_size", "batch"), [(10, 4, 1), (23, 3, 2), (7, 2, 3), (5, 4, 1)]
)
def test_an_epoch_resumed_part_way_deals_each_rank_the_rest_of_its_uninterrupted_share(
    n: int, world_size: int, batch: int
) -> None:
    # Also where the ranks' shares are padded (n not a multiple of the world size): the padding
    # must be the uninterrupted epoch's, or a resumed run trains on other samples at the end.
    def shares(consumed: int) -> list[list[int]]:
        state = {"n": n, "shuffle": True, "seed": 3, "epoch": 1, "consumed": consumed}
        found = []
        for rank in range(world_size):
            sampler = ResumableSampler(n, shuffle=True, seed=3, rank=rank, world_size=world_size)
            sampler.load_state_dict(state)
            found.append(list(sampler))
        return found

    whole = shares(0)
    for batches in range(1, -(-n // (world_size * batch))):
        resumed = shares(min(n, batches * batch * world_size))
        assert resumed == [share[batches * batch :] for share in whole], batches


# -- the position ----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_the_position_counts_batches_received_not_batches_prefetched(workers: int) -> None:
    loader, state = _loader(40, workers=workers)
    assert state.sampler is not None
    batches = iter(loader)
    assert state.sampler.state_dict()["consumed"] == 0
    for k in range(1, 7):
        next(batches)
        assert state.sampler.state_dict()["consumed"] == 4 * k
        assert state.capture()["data"]["consumed"] == 4 * k


def test_the_position_is_tracked_through_a_batch_sampler() -> None:
    sampler = _sampler(20)
    loader = DataLoader(Ids(20), batch_sampler=BatchSampler(sampler, batch_size=3, drop_last=False))
    state = TrainState(data=loader)
    assert state.sampler is sampler
    batches = iter(loader)
    next(batches)
    next(batches)
    assert sampler.consumed == 6


@pytest.mark.parametrize("drop_last", [False, True])
def test_an_epoch_that_runs_out_rolls_over_to_the_next(drop_last: bool) -> None:
    n = 10
    loader, state = _loader(n, drop_last=drop_last)
    assert state.sampler is not None
    for epoch in range(3):
        ids = [i for batch in loader for i in batch.tolist()]
        expected = _epoch_order(n, epoch)
        assert ids == (expected[:8] if drop_last else expected)
        assert state.sampler.state_dict() == {
            "n": n,
            "shuffle": True,
            "seed": 0,
            "epoch": epoch + 1,
            "consumed": 0,
            "skipped": [],
        }


def _uninterrupted(n: int, total: int, drop_last: bool) -> list[list[int]]:
    """The batches of a loop that is never interrupted, built from the sampler's epoch orders."""
    batches: list[list[int]] = []
    epoch = 0
    while len(batches) < total:
        order = _epoch_order(n, epoch)
        for start in range(0, n, 4):
            batch = order[start : start + 4]
            if len(batch) == 4 or not drop_last:
                batches.append(batch)
        epoch += 1
    return batches[:total]


N = 22  # 6 batches of 4 per epoch (the last one of 2), or 5 with drop_last


@functools.cache
def _tracked_uninterrupted(workers: int, drop_last: bool, total: int) -> list[list[int]]:
    loader, _ = _loader(N, workers=workers, drop_last=drop_last)
    batches: list[list[int]] = []
    _receive(loader, batches, total)
    return batches


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
@pytest.mark.parametrize(
    "split",
    ["first-batch", "mid-epoch", "last-batch-of-epoch", "epoch-boundary", "mid-second-epoch"],
)
def test_a_resumed_loader_continues_exactly_where_the_loop_stopped(
    workers: int, drop_last: bool, split: str
) -> None:
    per_epoch = N // 4 if drop_last else -(-N // 4)
    total = 2 * per_epoch + per_epoch // 2  # about 2.5 epochs
    received_before, to_epoch_end = {
        "first-batch": (1, False),
        "mid-epoch": (3, False),
        # The loop got the epoch's last batch but did not go round for the next one.
        "last-batch-of-epoch": (per_epoch, False),
        # The loop's `for` over the epoch ran out: the next iteration is the next epoch.
        "epoch-boundary": (per_epoch, True),
        "mid-second-epoch": (per_epoch + 2, False),
    }[split]
    expected = _uninterrupted(N, total, drop_last)
    assert _tracked_uninterrupted(workers, drop_last, total) == expected, (
        "an uninterrupted tracked loader deals the sampler's order"
    )

    first, first_state = _loader(N, workers=workers, drop_last=drop_last)
    received: list[list[int]] = []
    _receive(first, received, received_before, to_epoch_end=to_epoch_end)
    saved = first_state.capture()
    assert saved["data"]["epoch"] == (1 if to_epoch_end else received_before // (per_epoch + 1))
    del first  # (its workers may still hold prefetched batches; they must not matter)

    second, second_state = _loader(N, workers=workers, drop_last=drop_last)
    second_state.restore(saved)
    _receive(second, received, total)
    assert received == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_a_tracked_loader_leaves_the_global_torch_rng_alone(workers: int) -> None:
    # An untracked DataLoader draws its workers' base seed from the global RNG at every iter():
    # a resumed run calls iter() at another point of the stream and would drift from there.
    plain = DataLoader(Ids(12), batch_size=4)
    before = torch.get_rng_state()
    next(iter(plain))
    assert not torch.equal(torch.get_rng_state(), before), "precondition: the hazard is real"

    loader, _ = _loader(12, workers=workers)
    before = torch.get_rng_state()
    batches = iter(loader)
    next(batches)
    assert torch.equal(torch.get_rng_state(), before)
    for _ in batches:
        pass
    next(iter(loader))  # and the next epoch's iter() as well
    assert torch.equal(torch.get_rng_state(), before)


def test_worker_seeds_depend_only_on_seed_and_epoch() -> None:
    def worker_seeds(seed: int, epoch: int, global_seed: int) -> set[int]:
        loader, state = _loader(8, workers=2, seed=seed, dataset=WorkerSeeds(8))
        assert state.sampler is not None
        state.sampler.set_epoch(epoch)
        torch.manual_seed(global_seed)  # the global RNG must play no part
        return {i for batch in loader for i in batch.tolist()}

    seeds = worker_seeds(0, 1, global_seed=1)
    assert len(seeds) == 2
    assert worker_seeds(0, 1, global_seed=2) == seeds
    assert worker_seeds(0, 2, global_seed=1) != seeds
    assert worker_seeds(1, 1, global_seed=1) != seeds


def test_a_resumed_position_from_two_ranks_can_continue_on_one() -> None:
    n = 40
    seen: list[int] = []
    states = []
    for rank in range(2):
        sampler = ResumableSampler(n, shuffle=True, seed=0, rank=rank, world_size=2)
        loader = DataLoader(Ids(n), batch_size=4, sampler=sampler)
        state = TrainState(data=loader)
        batches = iter(loader)
        seen += next(batches).tolist() + next(batches).tolist()
        states.append(state.capture()["data"])
    assert states[0] == states[1]
    assert states[0]["consumed"] == 16

    loader, state = _loader(n)
    assert state.sampler is not None
    state.sampler.load_state_dict(states[0])
    rest = [i for batch in loader for i in batch.tolist()]
    assert sorted(seen + rest) == list(range(n))
    assert seen + rest != list(range(n))


# -- refusing a position that does not apply -------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"), [("n", 23), ("seed", 1), ("shuffle", False)], ids=["n", "seed", "shuffle"]
)
def test_a_position_saved_for_another_order_is_refused(field: str, value: Any) -> None:
    saved = _sampler(22).state_dict() | {"epoch": 2, "consumed": 8, field: value}
    sampler = _sampler(22)
    with pytest.raises(StateMismatchError, match=f"{field}={value!r}") as excinfo:
        sampler.load_state_dict(saved)
    live_value = getattr(sampler, field)
    assert f"{field}={live_value!r}" in str(excinfo.value)
    assert (sampler.epoch, sampler.consumed) == (0, 0)


@pytest.mark.parametrize("bad", [{"consumed": 23}, {"consumed": -1}, {"epoch": -1}])
def test_a_position_outside_the_epoch_is_refused(bad: dict[str, int]) -> None:
    # No sampler saves such a position: the section is malformed (a restore falls back past it).
    with pytest.raises(CorruptCheckpointError):
        _sampler(22).load_state_dict(_sampler(22).state_dict() | bad)


# -- skipped windows (NumericsGuard rolls back past data that made training diverge) ---------


def test_a_skipped_window_is_never_dealt_and_the_rest_of_the_epoch_is() -> None:
    n = 20
    loader, state = _loader(n)
    assert state.sampler is not None
    batches = iter(loader)
    first = next(batches).tolist()
    assert state.sampler.last_window == (0, 0, 4)
    state.sampler.skip(0, 8, 12)  # positions 8..11 of epoch 0's order
    rest = [i for batch in batches for i in batch.tolist()]  # the live iterator follows the skip
    order = _epoch_order(n, 0)
    assert first + rest == order[:8] + order[12:]
    assert state.sampler.epoch == 1 and state.sampler.skipped == [(0, 8, 12)]
    # The next epoch is whole again: a window belongs to the epoch it was seen in.
    assert [i for batch in loader for i in batch.tolist()] == _epoch_order(n, 1)


def test_receiving_a_batch_steps_over_a_skipped_window() -> None:
    n = 20
    loader, state = _loader(n)
    assert state.sampler is not None
    state.sampler.skip(0, 4, 6)
    batches = iter(loader)
    order = _epoch_order(n, 0)
    assert next(batches).tolist() == order[0:4]
    assert next(batches).tolist() == order[6:10]  # positions 4 and 5 passed over
    assert state.sampler.consumed == 10 and state.sampler.last_window == (0, 4, 10)


def test_skipped_windows_are_saved_and_a_resumed_loader_skips_them_too() -> None:
    n = 24
    loader, state = _loader(n)
    assert state.sampler is not None
    batches = iter(loader)
    next(batches)
    state.sampler.skip(0, 12, 16)
    saved = state.sampler.state_dict()
    uninterrupted = [i for batch in batches for i in batch.tolist()]
    resumed_loader, resumed_state = _loader(n)
    assert resumed_state.sampler is not None
    resumed_state.sampler.load_state_dict(saved)
    assert [i for batch in resumed_loader for i in batch.tolist()] == uninterrupted
    assert resumed_state.sampler.epoch == 1 and resumed_state.sampler.skipped == [(0, 12, 16)]


def test_setting_the_position_restarts_the_iteration_in_progress() -> None:
    n = 20
    loader, state = _loader(n)
    assert state.sampler is not None
    batches = iter(loader)
    next(batches)
    back_then = state.sampler.state_dict()
    next(batches), next(batches)
    state.sampler.load_state_dict(back_then)  # as a rollback restores it
    order = _epoch_order(n, 0)
    assert next(batches).tolist() == order[4:8]


def test_every_rank_skips_the_same_global_window() -> None:
    n = 24
    dealt: list[int] = []
    for rank in (0, 1):
        sampler = ResumableSampler(n, shuffle=True, seed=0, rank=rank, world_size=2)
        sampler.skip(0, 6, 10)
        dealt += list(sampler)
    order = _epoch_order(n, 0)
    assert sorted(dealt) == sorted(order[:6] + order[10:])


def test_malformed_skipped_windows_in_a_checkpoint_are_refused() -> None:
    sampler = _sampler(10)
    state = sampler.state_dict() | {"skipped": [[0, 5, 99]]}
    with pytest.raises(CorruptCheckpointError, match="skipped windows"):
        sampler.load_state_dict(state)
    legacy = {k: v for k, v in sampler.state_dict().items() if k != "skipped"}
    sampler.load_state_dict(legacy)  # checkpoints from before skipping existed still load
    assert sampler.skipped == []
