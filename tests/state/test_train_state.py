"""``TrainState``: capture/restore round trips every component, and a tree that does not fit
changes nothing.

Round trips run two ways: through the live tree :meth:`TrainState.capture` returns (deep-copied,
since it holds the live tensors) and through a real checkpoint written and read back by
:class:`crashproof.CheckpointManager`.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import crashproof
from crashproof import ConfigError, ResumableSampler, StateMismatchError, TrainState
from tests.conftest import free_port

# -- helpers ---------------------------------------------------------------------------------


class Counter:
    """A tiny Stateful extra."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


class PositionLoader:
    """A loader that tracks its own position (like torchdata's StatefulDataLoader)."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def __iter__(self) -> Iterator[int]:
        while True:
            self.position += 1
            yield self.position

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _model() -> nn.Module:
    # BatchNorm adds buffers, including an int64 one (num_batches_tracked).
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _components(seed: int, lr: float = 0.1) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**10 + seed, growth_interval=1),
    }


def _train(state: TrainState, steps: int) -> None:
    """A few real steps: dropout-free, but random inputs drawn from the global torch RNG."""
    assert state.model is not None and state.optimizer is not None
    assert state.scheduler is not None and state.scaler is not None
    for _ in range(steps):
        state.optimizer.zero_grad()
        loss = state.model(torch.randn(6, 4)).square().mean()
        state.scaler.scale(loss).backward()  # type: ignore[attr-defined]
        state.scaler.step(state.optimizer)  # type: ignore[attr-defined]
        state.scaler.update()  # type: ignore[attr-defined]
        state.scheduler.step()  # type: ignore[attr-defined]


def _draws() -> list[Any]:
    """The next values of every global generator TrainState must restore."""
    return [
        random.random(),
        random.getrandbits(64),
        random.gauss(0.0, 1.0),
        np.random.rand(3).tolist(),
        float(np.random.randn()),
        torch.rand(3).tolist(),
        torch.randn(3).tolist(),
    ]


def _clone_tree(value: Any) -> Any:
    """A deep copy in which tensors are cloned (the original's tensors are live)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tree(v) for v in value)
    return copy.deepcopy(value)


def _assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Structural equality in which tensors must match exactly, dtype included."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert actual.keys() == expected.keys(), where
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}/{i}")
    else:
        assert actual == expected, where


def _rng_state() -> tuple[Any, ...]:
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    return (random.getstate(), np_state[1].copy(), np_state[2:], torch.get_rng_state())


def _assert_rng_state(expected: tuple[Any, ...]) -> None:
    actual = _rng_state()
    assert actual[0] == expected[0], "python random state changed"
    assert np.array_equal(actual[1], expected[1]) and actual[2] == expected[2], (
        "numpy state changed"
    )
    assert torch.equal(actual[3], expected[3]), "torch RNG state changed"


def _live(state: TrainState) -> dict[str, Any]:
    """A cloned snapshot of everything a failed restore must leave alone."""
    assert state.model is not None and state.optimizer is not None
    return {
        "model": _clone_tree(state.model.state_dict()),
        "optimizer": _clone_tree(state.optimizer.state_dict()),
        "rng": _rng_state(),
    }


def _assert_untouched(state: TrainState, before: dict[str, Any]) -> None:
    assert state.model is not None and state.optimizer is not None
    _assert_same(state.model.state_dict(), before["model"], "model")
    _assert_same(state.optimizer.state_dict(), before["optimizer"], "optimizer")
    _assert_rng_state(before["rng"])


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- round trip ------------------------------------------------------------------------------


def _via_capture_tree(tmp_path: Path, source: TrainState) -> Callable[[TrainState], None]:
    tree = _clone_tree(source.capture())
    return lambda target: target.restore(tree)


def _via_checkpoint(tmp_path: Path, source: TrainState) -> Callable[[TrainState], None]:
    root = str(tmp_path / "ckpt")
    with crashproof.CheckpointManager(root, async_save=False) as manager:
        manager.save(7, source)

    def restore(target: TrainState) -> None:
        with crashproof.CheckpointManager(root) as manager:
            assert manager.restore(target) == 7

    return restore


@pytest.mark.parametrize(
    "save", [_via_capture_tree, _via_checkpoint], ids=["capture-tree", "checkpoint"]
)
def test_restore_brings_back_every_component_and_the_random_streams(
    tmp_path: Path, save: Callable[[Path, TrainState], Callable[[TrainState], None]]
) -> None:
    ema = nn.Linear(4, 3)
    source = TrainState(
        **_components(seed=1),
        extra={
            "counter": Counter(41),
            "ema": ema,
            "tokens": 123_456_789_012,
            "meta": {"name": "run-a", "history": [1, 2.5, None, True]},
        },
    )
    _train(source, 5)
    with torch.no_grad():
        ema.weight.add_(1.0)
    # Leave a cached Gaussian in Python's and NumPy's generators: it is part of their state.
    random.gauss(0.0, 1.0)
    np.random.randn()

    assert source.model is not None and source.optimizer is not None
    assert source.scheduler is not None and source.scaler is not None
    expected = {
        "model": _clone_tree(source.model.state_dict()),
        "optimizer": _clone_tree(source.optimizer.state_dict()),
        "scheduler": _clone_tree(source.scheduler.state_dict()),
        "scaler": _clone_tree(source.scaler.state_dict()),
        "ema": _clone_tree(ema.state_dict()),
    }
    assert expected["optimizer"]["state"], "AdamW should hold moments after training"
    assert expected["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.5**2)
    assert expected["scaler"]["scale"] > 2.0**10 + 1, "the scaler should have grown its scale"

    restore = save(tmp_path, source)
    # What the generators give right after the capture (or the save) is what a resumed run
    # must get right after the restore; then both train on.
    draws_after_capture = _draws()
    _train(source, 2)
    continued = _clone_tree(source.model.state_dict())

    target_ema = nn.Linear(4, 3)
    target = TrainState(
        **_components(seed=2, lr=0.7),
        extra={"counter": Counter(0), "ema": target_ema, "tokens": 0, "meta": {}},
    )
    _train(target, 1)  # other moments, lr, scale and scheduler position, and RNG moved on
    restore(target)

    assert target.model is not None and target.optimizer is not None
    assert target.scheduler is not None and target.scaler is not None
    _assert_same(target.model.state_dict(), expected["model"], "model")
    _assert_same(target.optimizer.state_dict(), expected["optimizer"], "optimizer")
    assert target.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    _assert_same(target.scheduler.state_dict(), expected["scheduler"], "scheduler")
    _assert_same(target.scaler.state_dict(), expected["scaler"], "scaler")
    assert target.scaler.get_scale() == expected["scaler"]["scale"]  # type: ignore[attr-defined]
    _assert_same(target_ema.state_dict(), expected["ema"], "ema")
    assert target.extra["counter"].count == 41
    assert target.extra["tokens"] == 123_456_789_012
    assert target.extra["meta"] == {"name": "run-a", "history": [1, 2.5, None, True]}

    assert _draws() == draws_after_capture
    # So training goes on bit for bit: same inputs, lr, loss scale and moments.
    _train(target, 2)
    _assert_same(target.model.state_dict(), continued, "model after two more steps")


# -- wrapped models --------------------------------------------------------------------------


def test_a_ddp_wrapped_model_is_saved_without_the_module_prefix(gloo_world_of_one: None) -> None:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_model())
    tree = TrainState(model=ddp).capture()

    plain_keys = set(_model().state_dict())
    assert set(tree["model"]) == plain_keys
    assert not any(key.startswith("module.") for key in tree["model"])


@pytest.mark.parametrize(
    ("options", "regroups"),
    [({}, True), ({"find_unused_parameters": True}, False), ({"static_graph": True}, True),
     ({"find_unused_parameters": True, "static_graph": True}, True)],
)  # fmt: skip
def test_which_ddp_regroups_its_buckets_after_the_first_step(
    gloo_world_of_one: None, options: dict[str, bool], regroups: bool
) -> None:
    """A DDP that regroups makes the first step after a resume on 3+ ranks inexact (warned)."""
    ddp = nn.parallel.DistributedDataParallel(_model(), **options)
    assert TrainState(model=ddp).ddp_regroups_gradients() is regroups
    assert TrainState(model=torch.compile(ddp)).ddp_regroups_gradients() is regroups
    assert not TrainState(model=_model()).ddp_regroups_gradients()


def test_a_ddp_checkpoint_restores_into_a_plain_model_and_back(
    tmp_path: Path, gloo_world_of_one: None
) -> None:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_model())
    root = str(tmp_path / "ckpt")
    with crashproof.CheckpointManager(root) as manager:
        manager.save(1, TrainState(model=ddp))
    expected = _clone_tree(ddp.module.state_dict())

    torch.manual_seed(1)
    plain = _model()
    with crashproof.CheckpointManager(root) as manager:
        assert manager.restore(TrainState(model=plain)) == 1
    _assert_same(plain.state_dict(), expected, "plain model restored from DDP")

    # And the other way: a plain model's state into a DDP-wrapped one.
    with torch.no_grad():
        for param in plain.parameters():
            param.mul_(-2.0)
    tree = _clone_tree(TrainState(model=plain).capture())
    TrainState(model=ddp).restore(tree)
    _assert_same(ddp.module.state_dict(), plain.state_dict(), "DDP model restored from plain")


# -- all or nothing --------------------------------------------------------------------------


def _trained_pair(**target_kwargs: Any) -> tuple[dict[str, Any], TrainState]:
    """A captured tree of one run and a live target whose every part differs from it."""
    source = TrainState(**_components(seed=1))
    _train(source, 3)
    tree = _clone_tree(source.capture())
    target = TrainState(**_components(seed=2, lr=0.3), **target_kwargs)
    _train(target, 1)
    _draws()  # move the generators away from the tree's
    return tree, target


def _wrong_shape(model: dict[str, Any]) -> str:
    model["0.weight"] = torch.zeros(8, 5)
    return "0.weight"


def _wrong_dtype(model: dict[str, Any]) -> str:
    model["3.weight"] = model["3.weight"].double()
    return "3.weight"


def _wrong_buffer_dtype(model: dict[str, Any]) -> str:
    model["1.num_batches_tracked"] = model["1.num_batches_tracked"].to(torch.int32)
    return "1.num_batches_tracked"


def _missing_key(model: dict[str, Any]) -> str:
    del model["1.running_var"]
    return "1.running_var"


def _unexpected_key(model: dict[str, Any]) -> str:
    model["4.weight"] = torch.zeros(3, 3)
    return "4.weight"


@pytest.mark.parametrize(
    "corrupt", [_wrong_shape, _wrong_dtype, _wrong_buffer_dtype, _missing_key, _unexpected_key]
)
def test_a_model_that_does_not_fit_raises_and_changes_nothing(
    corrupt: Callable[[dict[str, Any]], str],
) -> None:
    tree, target = _trained_pair()
    key = corrupt(tree["model"])
    before = _live(target)

    with pytest.raises(StateMismatchError, match=key.replace(".", r"\.")):
        target.restore(tree)

    _assert_untouched(target, before)


def test_the_same_tree_unchanged_does_restore() -> None:
    """(The control for the mismatch tests: their trees fail only because of the change.)"""
    tree, target = _trained_pair()
    target.restore(tree)
    assert target.model is not None
    _assert_same(target.model.state_dict(), tree["model"])
    _assert_rng_state(
        (
            tuple(tree["rng"]["python"]),
            np.asarray(tree["rng"]["numpy"]["keys"], dtype=np.uint32),
            (
                tree["rng"]["numpy"]["pos"],
                tree["rng"]["numpy"]["has_gauss"],
                tree["rng"]["numpy"]["cached_gaussian"],
            ),
            tree["rng"]["torch"],
        )
    )


def _train_plain(state: TrainState) -> None:
    assert state.model is not None and state.optimizer is not None
    state.optimizer.zero_grad()
    state.model(torch.randn(6, 4)).square().mean().backward()
    state.optimizer.step()


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}])


def _fewer_params(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(model.parameters())[:-1])


@pytest.mark.parametrize(
    ("make_saved_optimizer", "message"),
    [(_two_groups, "param groups"), (_fewer_params, "parameters")],
    ids=["param-groups", "params"],
)
def test_an_optimizer_layout_that_does_not_fit_raises_and_changes_nothing(
    make_saved_optimizer: Callable[[nn.Module], torch.optim.Optimizer], message: str
) -> None:
    torch.manual_seed(1)
    model = _model()
    optimizer = make_saved_optimizer(model)
    source = TrainState(model=model, optimizer=optimizer)
    _train_plain(source)
    _train_plain(source)
    tree = _clone_tree(source.capture())
    torch.manual_seed(2)
    target_model = _model()
    target = TrainState(
        model=target_model, optimizer=torch.optim.AdamW(target_model.parameters(), lr=0.3)
    )
    _train_plain(target)
    _draws()
    before = _live(target)

    with pytest.raises(StateMismatchError, match=message):
        target.restore(tree)

    _assert_untouched(target, before)


def test_optimizer_state_for_parameters_in_another_order_raises_and_changes_nothing() -> None:
    """Same number of parameters, but the saved moments belong to parameters of other sizes."""
    torch.manual_seed(1)
    model = _model()
    optimizer = torch.optim.AdamW(list(model.parameters())[::-1])
    source = TrainState(model=model, optimizer=optimizer)
    _train_plain(source)
    tree = _clone_tree(source.capture())
    torch.manual_seed(2)
    target_model = _model()
    target = TrainState(model=target_model, optimizer=torch.optim.AdamW(target_model.parameters()))
    _train_plain(target)
    before = _live(target)

    with pytest.raises(StateMismatchError, match="has shape"):
        target.restore(tree)

    _assert_untouched(target, before)


def test_a_data_position_that_does_not_fit_raises_and_changes_nothing() -> None:
    def loader(seed: int) -> DataLoader[int]:
        sampler = ResumableSampler(10, shuffle=True, seed=seed, rank=0, world_size=1)
        return DataLoader(list(range(10)), batch_size=2, sampler=sampler)

    tree, target = _trained_pair(data=loader(seed=2))
    tree["data"] = TrainState(data=loader(seed=1)).capture()["data"]
    assert target.sampler is not None
    target.sampler.consumed = 4
    before = _live(target)

    with pytest.raises(StateMismatchError, match="seed"):
        target.restore(tree)

    _assert_untouched(target, before)
    assert target.sampler.state_dict()["consumed"] == 4


def test_missing_extra_state_raises_and_changes_nothing() -> None:
    tree, target = _trained_pair(extra={"counter": Counter(5)})
    before = _live(target)

    with pytest.raises(StateMismatchError, match="counter"):
        target.restore(tree)

    _assert_untouched(target, before)
    assert target.extra["counter"].count == 5


# -- configuration errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [object(), {1: "int key"}, [1, object()], {"nested": {"deeper": object()}}]
)
def test_extra_values_that_are_neither_stateful_nor_json_are_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="'x'"):
        TrainState(extra={"x": value})


def test_a_dataloader_without_a_resumable_sampler_is_refused() -> None:
    loader = DataLoader(list(range(10)), batch_size=2, shuffle=True)
    with pytest.raises(ConfigError, match="ResumableSampler"):
        TrainState(data=loader)


def test_a_scheduler_without_state_dict_is_refused() -> None:
    with pytest.raises(ConfigError, match="scheduler"):
        TrainState(scheduler=object())  # type: ignore[arg-type]


def test_any_loader_with_state_dict_is_accepted_as_data(tmp_path: Path) -> None:
    loader = PositionLoader()
    for _, _position in zip(range(5), loader, strict=False):
        pass
    state = TrainState(data=loader)
    assert state.sampler is None
    root = str(tmp_path / "ckpt")
    with crashproof.CheckpointManager(root) as manager:
        manager.save(5, state)

    resumed = PositionLoader()
    with crashproof.CheckpointManager(root) as manager:
        assert manager.restore(TrainState(data=resumed)) == 5
    assert resumed.position == 5
    assert next(iter(resumed)) == 6


def test_ddp_parameters_and_optimizer_are_replicated_not_buffers_nor_a_zero_optimizer_s(
    gloo_world_of_one: None,
) -> None:
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    outside = nn.Parameter(torch.zeros(3))  # optimized, but not DDP's: each rank its own
    optimizer = torch.optim.SGD([*model.parameters(), outside], lr=0.1)
    plain = TrainState(model=model, optimizer=optimizer)
    names = [*(f"model/{k}" for k in model.module.state_dict()), "optimizer/state/0/momentum_buffer",
             "optimizer/state/4/momentum_buffer", "rng/torch", "data/epoch"]  # fmt: skip
    params = {"model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias"}
    buffers = {"model/1.running_mean", "model/1.running_var", "model/1.num_batches_tracked"}
    sys.modules.pop("torch.distributed.optim.zero_redundancy_optimizer", None)
    assert plain.replicated_names(names) == params | {"optimizer/state/0/momentum_buffer"}
    assert plain.per_rank_names() == buffers  # BatchNorm's statistics follow each rank's batch
    compiled = TrainState(model=torch.compile(model), optimizer=optimizer)  # type: ignore[arg-type]
    assert compiled.replicated_names(names) == plain.replicated_names(names)
    # the first save after a restart would pay the import (TorchScript compiles): not needed
    assert "torch.distributed.optim.zero_redundancy_optimizer" not in sys.modules
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    assert TrainState(model=model, optimizer=zero).replicated_names(names) == params
    assert TrainState(model=nn.Linear(4, 4)).replicated_names(names) == frozenset()
