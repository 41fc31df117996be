"""Promise: a restore is all-or-nothing for every part of the state, not only for tensors.

A valid checkpoint that does not fit the live run (another scheduler or optimizer class, a scaler
switched on or off, a renamed field of an extra) raises :class:`StateMismatchError` naming the
component; a hand-edited, malformed section is a :class:`CorruptCheckpointError` and the manager
falls back to the next newest checkpoint. Either way the live state afterwards is bitwise what it
was: every tensor (``torch.equal``) and every Python state (``==``) of the model, optimizer,
scheduler, scaler, sampler, extras and the random generators. Written as an attacker: each case
is one way a checkpoint and a run can disagree.
"""

from __future__ import annotations

import copy
import json
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from crashproof import (
    CheckpointManager,
    CorruptCheckpointError,
    ResumableSampler,
    StateMismatchError,
    TrainState,
)
from crashproof.checkpoint.format._fields import dumps
from crashproof.checkpoint.format._hashing import digest
from crashproof.checkpoint.format._manifest import seal_manifest
from crashproof.checkpoint.format._shard_file import shard_checksum

INDEX = "rank_00000.json"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: a second OpenMP thread only spins against the other test processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- a run with every kind of component ------------------------------------------------------


class Counter:
    """A Stateful extra with two fields; ``names`` lets a later version rename them."""

    def __init__(self, names: tuple[str, str] = ("seen", "tokens")) -> None:
        self.names = names
        self.values = [0, 0]

    def state_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.values, strict=True))

    def load_state_dict(self, state: dict[str, int]) -> None:
        # Field by field, as most hand-written ones do: a missing second field fails half-way.
        for i, name in enumerate(self.names):
            self.values[i] = state[name]


class Tagged(nn.Module):
    """A module with extra state (``get_extra_state``) that is a dict, not a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0
        self.note = "fresh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = torch.relu(self.linear(x))
        return out

    def get_extra_state(self) -> Any:
        return {"calls": self.calls, "note": self.note}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]  # half-way: a renamed "note" fails after this
        self.note = state["note"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tagged = Tagged()
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.tagged(x)))


def _sched_step(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _sched_lambda(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)


def _sched_sequential(optimizer: torch.optim.Optimizer) -> Any:
    first = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
    then = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [first, then], milestones=[2])


def _sched_sequential_other(optimizer: torch.optim.Optimizer) -> Any:
    first = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
    then = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [first, then], milestones=[2])


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.1)


def _run(
    seed: int,
    *,
    optimizer: Callable[[Any], torch.optim.Optimizer] = _adamw,
    scheduler: Callable[[torch.optim.Optimizer], Any] = _sched_step,
    scaler_enabled: bool = True,
    counter_names: tuple[str, str] = ("seen", "tokens"),
    extra_value: Any = 7,
    steps: int = 3,
) -> TrainState:
    """A run of ``steps`` real steps with every component; ``seed`` makes all its values differ."""
    torch.manual_seed(seed)
    model = Net()
    opt = optimizer(model.parameters())
    sampler = ResumableSampler(40, shuffle=True, seed=3, rank=0, world_size=1)
    loader: DataLoader[torch.Tensor] = DataLoader(
        torch.randn(40, 4),  # type: ignore[arg-type]
        batch_size=4,
        sampler=sampler,
    )
    ema = nn.Linear(4, 2)
    state = TrainState(
        model=model,
        optimizer=opt,
        scheduler=scheduler(opt),
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8 + seed, enabled=scaler_enabled),
        data=loader,
        extra={"counter": Counter(counter_names), "ema": ema, "tokens": extra_value},
    )
    scaler: Any = state.scaler
    sched: Any = state.scheduler
    for _, batch in zip(range(steps), loader, strict=False):
        opt.zero_grad()
        scaler.scale(model(batch).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    with torch.no_grad():
        ema.weight.add_(seed)
    state.extra["counter"].values = [seed * 10, seed * 100]
    model.tagged.note = f"run {seed}"
    random.random(), np.random.rand(), torch.rand(1)  # move every generator
    return state


# -- what "unchanged" means ------------------------------------------------------------------


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


def _snapshot(state: TrainState) -> dict[str, Any]:
    """Every part of the live state a failed restore must leave as it was, cloned."""
    assert state.model is not None and state.optimizer is not None and state.sampler is not None
    assert state.scheduler is not None and state.scaler is not None
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    tagged = state.model.tagged
    return _clone(
        {
            "model": state.model.state_dict(),
            "tagged": (tagged.calls, tagged.note),
            "optimizer": state.optimizer.state_dict(),
            "optimizer_class": type(state.optimizer),
            "scheduler": state.scheduler.state_dict(),
            "scheduler_class": type(state.scheduler),
            "scaler": state.scaler.state_dict(),
            "scaler_scale": getattr(state.scaler, "_scale", None),
            "sampler": state.sampler.state_dict(),
            "counter": list(state.extra["counter"].values),
            "ema": state.extra["ema"].state_dict(),
            "tokens": state.extra["tokens"],
            "python_rng": random.getstate(),
            "numpy_rng": (np_state[0], np_state[1].tolist(), *np_state[2:]),
            "torch_rng": torch.get_rng_state(),
        }
    )


def _assert_equal(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            _assert_equal(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_equal(a, e, f"{where}/{i}")
    else:
        assert actual == expected, where


def _assert_unchanged(state: TrainState, before: dict[str, Any]) -> None:
    after = _snapshot(state)
    for key in before:
        _assert_equal(after[key], before[key], key)


# -- checkpoints -----------------------------------------------------------------------------


def _save(root: Path, state: TrainState, *steps: int) -> None:
    with CheckpointManager(root, async_save=False, handle_signals=False) as manager:
        for step in steps:
            manager.save(step, state)


def _restore(root: Path, state: TrainState) -> int:
    with CheckpointManager(root, handle_signals=False) as manager:
        return manager.restore(state)


def _edit_state(root: Path, step: int, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the state tree in a checkpoint's rank index and fix its size and checksum in the
    manifest: a hand-edited checkpoint every checksum vouches for."""
    ckpt = root / f"step_{step:010d}"
    index = json.loads((ckpt / INDEX).read_bytes())
    mutate(index["state"])
    data = dumps(index)
    (ckpt / INDEX).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    manifest["files"][INDEX] = {"size": len(data), "checksum": digest(data)}
    (ckpt / "manifest.json").write_bytes(seal_manifest(manifest))


# -- a valid checkpoint that does not fit: StateMismatchError, nothing changes ---------------


def _case(case_id: str, component: str, *, source: Any = None, **target: Any) -> Any:
    return pytest.param(source or {}, target, component, id=case_id)


MISMATCHES = [
    _case("scheduler-steplr-to-lambdalr", "scheduler", scheduler=_sched_lambda),
    _case("scheduler-lambdalr-to-steplr", "scheduler",
          source={"scheduler": _sched_lambda}, scheduler=_sched_step),
    _case("sequentiallr-child-changed", "scheduler",
          source={"scheduler": _sched_sequential}, scheduler=_sched_sequential_other),
    _case("scaler-enabled-to-disabled", "scaler", scaler_enabled=False),
    _case("scaler-disabled-to-enabled", "scaler", source={"scaler_enabled": False}),
    _case("extra-second-field-renamed", "counter", counter_names=("seen", "token_count")),
    _case("extra-first-field-renamed", "counter", counter_names=("n_seen", "tokens")),
    _case("optimizer-adamw-to-sgd-momentum", "optimizer", optimizer=_sgd),
    _case("optimizer-sgd-to-adamw", "optimizer", source={"optimizer": _sgd}),
    _case("json-extra-int-to-dict", "tokens", extra_value={"total": 1}),
    _case("json-extra-int-to-str", "tokens", extra_value="seven"),
]  # fmt: skip


@pytest.mark.parametrize("recorded_classes", [True, False], ids=["classes", "no-classes"])
@pytest.mark.parametrize(("source_kwargs", "target_kwargs", "component"), MISMATCHES)
def test_a_checkpoint_of_another_configuration_raises_and_changes_nothing(
    tmp_path: Path,
    source_kwargs: dict[str, Any],
    target_kwargs: dict[str, Any],
    component: str,
    recorded_classes: bool,
) -> None:
    """Each case twice: with the classes recorded at save, and without (a checkpoint from before
    they were recorded), where the state itself must give the mismatch away."""
    _save(tmp_path, _run(seed=1, **source_kwargs), 5)
    if not recorded_classes:
        _edit_state(tmp_path, 5, lambda tree: tree.pop("classes", None))
    target = _run(seed=2, **target_kwargs)
    before = _snapshot(target)

    with pytest.raises(StateMismatchError, match=component) as caught:
        _restore(tmp_path, target)

    assert "step_0000000005" in str(caught.value)  # names the file
    _assert_unchanged(target, before)


def test_adamw_into_adam_is_refused_by_class(tmp_path: Path) -> None:
    """Same hyperparameter names, another class: only the recorded class tells them apart."""
    _save(tmp_path, _run(seed=1), 5)
    target = _run(seed=2, optimizer=_adam)
    before = _snapshot(target)

    with pytest.raises(StateMismatchError, match=r"optimizer: .*AdamW.*Adam"):
        _restore(tmp_path, target)

    _assert_unchanged(target, before)


def test_a_disabled_scaler_checkpoint_into_an_enabled_scaler_raises_and_changes_nothing(
    tmp_path: Path,
) -> None:
    _save(tmp_path, _run(seed=1, scaler_enabled=False), 5)
    target = _run(seed=2)
    before = _snapshot(target)

    with pytest.raises(StateMismatchError, match="GradScaler was disabled, this run's is enabled"):
        _restore(tmp_path, target)

    _assert_unchanged(target, before)


def test_lambdalr_checkpoint_into_steplr_names_the_fields(tmp_path: Path) -> None:
    _save(tmp_path, _run(seed=1, scheduler=_sched_lambda), 5)
    target = _run(seed=2)
    before = _snapshot(target)

    with pytest.raises(StateMismatchError, match=r"scheduler.*LambdaLR.*StepLR"):
        _restore(tmp_path, target)

    _assert_unchanged(target, before)


def test_a_stateful_extra_failing_half_way_leaves_every_component_unchanged() -> None:
    """Directly through TrainState.restore with real tensors, no manager."""
    tree = _clone(_run(seed=1).capture())
    target = _run(seed=2, counter_names=("seen", "n_tokens"))
    before = _snapshot(target)

    with pytest.raises(StateMismatchError, match=r"extra\['counter'\].*KeyError.*n_tokens"):
        target.restore(tree)

    _assert_unchanged(target, before)


def test_a_module_whose_set_extra_state_fails_half_way_changes_nothing() -> None:
    tree = _clone(_run(seed=1).capture())
    tree["model"]["tagged._extra_state"] = {"calls": 99, "renamed_note": "x"}
    target = _run(seed=2)
    before = _snapshot(target)

    with pytest.raises(StateMismatchError, match=r"model.*tagged\._extra_state.*renamed_note|note"):
        target.restore(tree)

    _assert_unchanged(target, before)


# -- a malformed section: CorruptCheckpointError, the restore falls back ---------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(tree: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node: Any = tree
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _drop_params(tree: dict[str, Any]) -> None:
    del tree["optimizer"]["param_groups"][0]["params"]


CORRUPTIONS = [
    pytest.param(_set("rng/python", "not a state"), id="rng-python-a-string"),
    pytest.param(_set("rng/python", {"$tuple": [3, [1, 2, 3], None]}), id="rng-python-short"),
    pytest.param(_set("rng/python", [3, {"$tuple": [2**40] * 625}, None]), id="rng-python-huge"),
    pytest.param(_set("rng/numpy/keys", [1, 2, 3]), id="rng-numpy-short-keys"),
    pytest.param(_set("rng/numpy/keys", "abc"), id="rng-numpy-keys-a-string"),
    pytest.param(_set("rng/numpy", None), id="rng-numpy-none"),
    pytest.param(_set("rng/torch", [1, 2]), id="rng-torch-a-list"),
    pytest.param(_set("optimizer/param_groups", {"a": 1}), id="param-groups-not-a-list"),
    pytest.param(_set("optimizer/param_groups", "ab"), id="param-groups-a-string"),
    pytest.param(_set("optimizer/state", [1, 2]), id="optimizer-state-a-list"),
    pytest.param(_drop_params, id="param-group-without-params"),
    pytest.param(_set("optimizer/param_groups/0/params", 5), id="params-not-a-list"),
    pytest.param(_set("optimizer", [1]), id="optimizer-a-list"),
    pytest.param(_set("model", [1]), id="model-a-list"),
    pytest.param(_set("model/head.weight", {"a": 1}), id="model-tensor-a-dict"),
    pytest.param(_set("scaler/scale", "big"), id="scaler-scale-a-string"),
    pytest.param(_set("scaler/growth_interval", 2.5), id="scaler-interval-a-float"),
    pytest.param(_set("data/consumed", "4"), id="sampler-consumed-a-string"),
    pytest.param(_set("data/epoch", -3), id="sampler-epoch-negative"),
    pytest.param(_set("data/skipped", [[0, 9, 2]]), id="sampler-window-backwards"),
    pytest.param(_set("extra", [1]), id="extra-a-list"),
    pytest.param(_set("extra/counter", 5), id="extra-entry-not-a-dict"),
    pytest.param(_set("extra/tokens/value", {"$bytes": "AAAA"}), id="json-extra-bytes"),
    pytest.param(_set("classes", "AdamW"), id="classes-a-string"),
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_a_malformed_section_is_corrupt_and_the_restore_falls_back(
    tmp_path: Path, corrupt: Callable[[dict[str, Any]], None]
) -> None:
    source = _run(seed=1)
    _save(tmp_path, source, 4)
    expected = _snapshot(source)  # what step 4 holds (the RNG as captured)
    _save(tmp_path, _run(seed=3), 8)
    _edit_state(tmp_path, 8, corrupt)
    target = _run(seed=2)

    assert _restore(tmp_path, target) == 4  # step 8 skipped like any corrupt checkpoint

    after = _snapshot(target)
    for key in (
        "model",
        "tagged",
        "optimizer",
        "scheduler",
        "scaler",
        "sampler",
        "counter",
        "ema",
        "tokens",
    ):
        _assert_equal(after[key], expected[key], key)


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_a_malformed_tree_raises_corrupt_and_changes_nothing(
    corrupt: Callable[[dict[str, Any]], None],
) -> None:
    """The same edits, straight into TrainState.restore: never a bare TypeError or KeyError."""
    tree = _clone(_run(seed=1).capture())
    encoded = json.loads(json.dumps(_plain(tree)))
    corrupt(encoded)
    target = _run(seed=2)
    before = _snapshot(target)

    with pytest.raises(CorruptCheckpointError):
        target.restore(_decode(encoded, tree))

    _assert_unchanged(target, before)


def _plain(value: Any) -> Any:
    """The tree as the JSON the index holds, tensors as markers (so edits use index paths)."""
    from crashproof.checkpoint.format._state_tree import encode_tree

    return encode_tree(value, [])


def _decode(encoded: Any, original: dict[str, Any]) -> Any:
    from crashproof.checkpoint.format._state_tree import decode_tree, encode_tree

    tensors: list[tuple[str, torch.Tensor]] = []
    encode_tree(original, tensors)
    return decode_tree(encoded, lambda i: tensors[i][1].clone(), "edited tree")


# -- what must still work --------------------------------------------------------------------


def test_a_fitting_checkpoint_restores_every_component_including_module_extra_state(
    tmp_path: Path,
) -> None:
    """The control: the same run configuration restores, and a module whose extra state is a
    dict (get_extra_state/set_extra_state) round-trips through a real checkpoint."""
    source = _run(seed=1)
    _save(tmp_path, source, 5)
    expected = _snapshot(source)
    target = _run(seed=2)

    assert _restore(tmp_path, target) == 5

    after = _snapshot(target)
    for key in expected:
        _assert_equal(after[key], expected[key], key)
    assert target.model is not None and target.model.tagged.note == "run 1"


def test_a_module_with_tensor_extra_state_of_another_size_round_trips(tmp_path: Path) -> None:
    class Blob(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)
            self.blob = torch.arange(n, dtype=torch.uint8)

        def get_extra_state(self) -> torch.Tensor:
            return self.blob

        def set_extra_state(self, state: torch.Tensor) -> None:
            self.blob = state.clone()

    _save(tmp_path, TrainState(model=Blob(7)), 1)
    target = Blob(3)
    assert _restore(tmp_path, TrainState(model=target)) == 1
    assert torch.equal(target.blob, torch.arange(7, dtype=torch.uint8))


def test_checking_a_tree_leaves_the_tree_and_the_live_state_alone() -> None:
    """LambdaLR's load_state_dict pops a key from what it is given: a trial load must get a copy."""
    tree = _clone(_run(seed=1, scheduler=_sched_lambda).capture())
    kept = _clone(tree)
    target = _run(seed=2, scheduler=_sched_lambda)
    before = _snapshot(target)

    target.check(tree)

    _assert_equal(tree, kept, "tree")
    _assert_unchanged(target, before)


# -- checks that need values run on the real, verified values before anything live changes ---


def _patch_tensor(root: Path, step: int, name: str, patch: Callable[[bytearray], None]) -> None:
    """Rewrite tensor ``name``'s bytes in place (same size) and recompute every checksum over
    them: a well-formed checkpoint holding other bytes."""
    ckpt = root / f"step_{step:010d}"
    shard_path = ckpt / "rank_00000.safetensors"
    index = json.loads((ckpt / INDEX).read_bytes())
    shard = bytearray(shard_path.read_bytes())
    entry = next(t for t in index["tensors"] if t["name"] == name)
    start, end = entry["offset"], entry["offset"] + entry["nbytes"]
    changed = bytearray(shard[start:end])
    patch(changed)
    shard[start:end] = changed
    entry["checksum"] = digest(bytes(changed))
    shard_path.write_bytes(bytes(shard))
    order = sorted(index["tensors"], key=lambda t: t["offset"])
    data = dumps(index)
    (ckpt / INDEX).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    manifest["files"][INDEX] = {"size": len(data), "checksum": digest(data)}
    manifest["files"]["rank_00000.safetensors"]["checksum"] = shard_checksum(
        bytes(shard[: order[0]["offset"]]), [t["checksum"] for t in order]
    )
    (ckpt / "manifest.json").write_bytes(seal_manifest(manifest))


def _param_state(tree: dict[str, Any]) -> dict[str, Any]:
    """The first parameter's optimizer state, as encoded in a rank index."""
    state: dict[str, Any] = tree["optimizer"]["state"]["$dict"][0][1]
    return state


def _on_state(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda root: _edit_state(root, 8, lambda tree: edit(_param_state(tree)))


def _bad_mt19937(state: bytearray) -> None:
    state[8:12] = b"\xff\xff\xff\x7f"  # the generator's "left" count, out of range


def _all_ones(data: bytearray) -> None:
    data[:] = b"\xff" * len(data)


VALUE_CORRUPTIONS = [
    pytest.param(lambda root: _patch_tensor(root, 8, "rng/torch", _bad_mt19937),
                 id="rng-torch-bytes-invalid"),
    pytest.param(lambda root: _patch_tensor(root, 8, "rng/torch", _all_ones),
                 id="rng-torch-bytes-all-ones"),
    pytest.param(_on_state(lambda s: s.__setitem__("step", "abc")), id="adamw-step-a-string"),
    pytest.param(_on_state(lambda s: s.pop("step")), id="adamw-step-missing"),
    pytest.param(_on_state(lambda s: s.__setitem__("step", s["exp_avg"])),
                 id="adamw-step-a-matrix"),
    pytest.param(_on_state(lambda s: s.__setitem__("exp_avg", "abc")), id="adamw-exp-avg-a-string"),
    pytest.param(_on_state(lambda s: s.__setitem__("step", {"a": 1})), id="adamw-step-a-dict"),
]  # fmt: skip


@pytest.mark.parametrize("corrupt", VALUE_CORRUPTIONS)
def test_a_malformed_value_without_a_live_destination_is_refused_before_anything_changes(
    tmp_path: Path, corrupt: Callable[[Path], None]
) -> None:
    """Same-size bytes of an RNG state, an optimizer's scalar state: the shape-only checks pass,
    the values do not. They are checked (and trial-loaded) on the verified values before the
    model is written: asked for, the step is refused with nothing changed; otherwise skipped."""
    _save(tmp_path, _run(seed=1), 4)
    _save(tmp_path, _run(seed=3), 8)
    corrupt(tmp_path)
    target = _run(seed=2)
    before = _snapshot(target)

    with (
        CheckpointManager(tmp_path, handle_signals=False) as manager,
        pytest.raises(CorruptCheckpointError),
    ):
        manager.restore(target, step=8)
    _assert_unchanged(target, before)

    assert _restore(tmp_path, target) == 4


class _Generator:
    """A user's own generator in ``extra``, as the RNG module's docstring tells users to do."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["state"])


class _Histogram:
    """Statistics whose load reads the values (``.numpy()``) of a tensor far over 4096 elements."""

    def __init__(self) -> None:
        self.counts = torch.zeros(50_000, dtype=torch.int64)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"counts": self.counts}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.counts = torch.from_numpy(state["counts"].numpy().copy())


class _Table:
    """An array extra whose load checks the values it is given."""

    def __init__(self, fill: float) -> None:
        self.table = np.full(20_000, fill)

    def state_dict(self) -> dict[str, Any]:
        return {"table": self.table, "total": float(self.table.sum())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if float(state["table"].sum()) != state["total"]:
            raise ValueError("the table does not add up to its total")
        self.table = state["table"].copy()


def test_extras_whose_load_reads_the_values_restore_an_honest_checkpoint(tmp_path: Path) -> None:
    source = TrainState(
        model=nn.Linear(4, 4),
        extra={"gen": _Generator(0), "hist": _Histogram(), "table": _Table(0.5)},
    )
    torch.rand(3, generator=source.extra["gen"].generator)
    source.extra["hist"].counts[7] = 3
    _save(tmp_path, source, 1)
    target = TrainState(
        model=nn.Linear(4, 4),
        extra={"gen": _Generator(1), "hist": _Histogram(), "table": _Table(2.0)},
    )

    assert _restore(tmp_path, target) == 1

    assert torch.equal(
        target.extra["gen"].generator.get_state(), source.extra["gen"].generator.get_state()
    )
    assert torch.equal(target.extra["hist"].counts, source.extra["hist"].counts)
    assert np.array_equal(target.extra["table"].table, source.extra["table"].table)


def test_an_extra_whose_load_rejects_the_values_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    source = _run(seed=1)
    source.extra["table"] = _Table(0.5)
    _save(tmp_path, source, 4)
    _patch_tensor(tmp_path, 4, "extra/table/state_dict/table", _all_ones)  # NaNs: no total
    target = _run(seed=2)
    target.extra["table"] = _Table(2.0)
    before = _snapshot(target)

    with pytest.raises(StateMismatchError, match="does not add up"):
        _restore(tmp_path, target)

    _assert_unchanged(target, before)
    assert np.array_equal(target.extra["table"].table, np.full(20_000, 2.0))


class _Locked:
    """An extra that cannot be deep-copied for a trial load (it holds a lock), whose load fails."""

    def __init__(self, accept: bool) -> None:
        self.lock = threading.Lock()
        self.accept = accept

    def state_dict(self) -> dict[str, int]:
        return {"seen": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not self.accept:
            raise ValueError("refused")


def test_a_load_failing_after_the_live_tensors_are_written_is_no_bare_error(
    tmp_path: Path,
) -> None:
    """The last line of defence: nothing could check it first, so the restore says what
    happened (a CorruptCheckpointError naming the step and the partial write)."""
    _save(tmp_path, TrainState(model=nn.Linear(4, 4), extra={"locked": _Locked(True)}), 3)
    target = TrainState(model=nn.Linear(4, 4), extra={"locked": _Locked(False)})

    with pytest.raises(CorruptCheckpointError, match="step 3 failed after the live tensors"):
        _restore(tmp_path, target)


# -- restore and verify refuse the same malformed sections, through one check ----------------


def _verify(root: Path, step: int) -> None:
    from crashproof.checkpoint import verify_checkpoint
    from crashproof.storage import LocalStorage

    verify_checkpoint(LocalStorage(), str(root / f"step_{step:010d}"))


# Every section whose form does not depend on the live object's class (the scheduler's, the
# scaler's and the data's are judged against the live object by restore alone).
STRUCTURAL = [
    p for p in CORRUPTIONS
    if not str(p.id).startswith(("scaler-", "sampler-"))
] + [
    pytest.param(_set("model/head.weight", {"$float": "nan"}), id="model-tensor-a-float"),
    pytest.param(_set("model/head.weight", None), id="model-tensor-none"),
    pytest.param(_set("rng", None), id="rng-none"),
    pytest.param(_set("rng/torch", {"$bytes": "AAAA"}), id="rng-torch-bytes"),
    pytest.param(_set("classes", {"optimizer": 3}), id="classes-a-number"),
    pytest.param(_set("optimizer/state", {"$dict": [[99, {}]]}), id="state-of-no-parameter"),
    pytest.param(_set("optimizer/param_groups/0/params", [0, 0]), id="param-listed-twice"),
    pytest.param(_set("optimizer/param_groups/0/params", [True]), id="param-id-a-bool"),
    pytest.param(_set("extra/tokens", {"value": 1, "state_dict": 2}), id="extra-two-forms"),
    pytest.param(_set("extra/tokens", {"values": 1}), id="extra-unknown-form"),
]  # fmt: skip


@pytest.mark.parametrize("corrupt", STRUCTURAL)
def test_verify_refuses_every_malformed_section_a_restore_refuses(
    tmp_path: Path, corrupt: Callable[[dict[str, Any]], None]
) -> None:
    """The reported cases: `crashproof verify` passed rng/python "x", rng/numpy None,
    param_groups "ab", a model that is a list, classes "AdamW" and a NaN in a weight's place,
    all of which restore called corrupt. One function judges the tree's form for both."""
    _save(tmp_path, _run(seed=1), 4)
    _save(tmp_path, _run(seed=3), 8)
    _edit_state(tmp_path, 8, corrupt)
    with pytest.raises(CorruptCheckpointError) as verified:
        _verify(tmp_path, 8)
    target = _run(seed=2)
    before = _snapshot(target)
    with (
        CheckpointManager(tmp_path, handle_signals=False) as manager,
        pytest.raises(CorruptCheckpointError) as restored,
    ):
        manager.restore(target, step=8)
    _assert_unchanged(target, before)
    assert str(verified.value).split(": ", 1)[1] in str(restored.value)  # the same reason
    assert _restore(tmp_path, target) == 4


# -- the state refers to each tensor once, and a stand-in only where the load reads live memory --


def _entry_of(root: Path, step: int, name: str) -> int:
    index = json.loads((root / f"step_{step:010d}" / INDEX).read_bytes())
    return next(i for i, t in enumerate(index["tensors"]) if t["name"] == name)


def _refer(path: str, to: str) -> Callable[[Path], None]:
    """Make the state at ``path`` (in the first parameter's optimizer state, or a top-level
    path) refer to the tensor entry named ``to``."""

    def edit(root: Path) -> None:
        entry = _entry_of(root, 8, to)
        if path.startswith("state/"):
            _edit_state(
                root, 8, lambda t: _param_state(t).__setitem__(path[6:], {"$tensor": entry})
            )
        else:
            _edit_state(root, 8, _set(path, {"$tensor": entry}))

    return edit


ALIASES = [
    pytest.param(_refer("state/exp_avg", "model/tagged.linear.weight"), id="exp-avg-is-the-live-weight"),
    pytest.param(_refer("state/exp_avg_sq", "optimizer/state/0/exp_avg"), id="exp-avg-sq-is-exp-avg"),
    pytest.param(_refer("extra/ema/state_dict/weight", "model/head.weight"),
                 id="ema-weight-is-the-model-weight"),
    pytest.param(_refer("model/head.bias", "extra/ema/state_dict/bias"),
                 id="model-bias-is-the-ema-bias"),
]  # fmt: skip


@pytest.mark.parametrize("alias", ALIASES)
def test_one_tensor_referred_to_twice_is_refused_by_restore_and_verify(
    tmp_path: Path, alias: Callable[[Path], None]
) -> None:
    """The reported case: exp_avg referring to the model weight's entry made the restored
    optimizer state share memory with the live weight (each step then moved the weight twice).
    A tensor is referred to once; two references are corrupt, whatever they point at."""
    _save(tmp_path, _run(seed=1), 4)
    _save(tmp_path, _run(seed=3), 8)
    alias(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="referred to twice"):
        _verify(tmp_path, 8)
    target = _run(seed=2)
    before = _snapshot(target)
    with (
        CheckpointManager(tmp_path, handle_signals=False) as manager,
        pytest.raises(CorruptCheckpointError, match="referred to twice"),
    ):
        manager.restore(target, step=8)
    _assert_unchanged(target, before)
    assert _restore(tmp_path, target) == 4


def test_a_live_tensors_entry_referred_to_from_elsewhere_is_no_live_destination(
    tmp_path: Path,
) -> None:
    """Swap two same-shaped entries between the model and the optimizer state (each referred
    to once): the checks must judge the values the load will hand over, so neither entry is
    read straight into live memory; the checkpoint's numbers are loaded, and no optimizer state
    shares memory with a live parameter."""
    source = _run(seed=1)
    _save(tmp_path, source, 8)
    weight = _entry_of(tmp_path, 8, "model/head.weight")
    params = [p for g in source.optimizer.param_groups for p in g["params"]]  # type: ignore[union-attr]
    head = next(i for i, p in enumerate(params) if p is source.model.head.weight)  # type: ignore[union-attr]
    moment = _entry_of(tmp_path, 8, f"optimizer/state/{head}/exp_avg")

    def swap(tree: dict[str, Any]) -> None:
        tree["model"]["head.weight"] = {"$tensor": moment}
        state = dict(tree["optimizer"]["state"]["$dict"])[head]
        state["exp_avg"] = {"$tensor": weight}

    _edit_state(tmp_path, 8, swap)
    _verify(tmp_path, 8)
    target = _run(seed=2)
    assert _restore(tmp_path, target) == 8
    assert target.model is not None and target.optimizer is not None
    live = target.model.head.weight
    restored = target.optimizer.state[live]["exp_avg"]
    assert torch.equal(live, source.optimizer.state[source.model.head.weight]["exp_avg"])  # type: ignore[union-attr]
    assert torch.equal(restored, source.model.head.weight)  # type: ignore[union-attr]
    assert restored.untyped_storage().data_ptr() != live.untyped_storage().data_ptr()


# -- a full checkpoint lists no deltas: no check runs on a stand-in ----------------------------


def _fake_deltas(name: str, encoding: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        ckpt = root / "step_0000000008"
        index = json.loads((ckpt / INDEX).read_bytes())
        i = next(i for i, t in enumerate(index["tensors"]) if t["name"] == name)
        entry = index["tensors"][i]
        index["deltas"] = [
            {"index": i, "encoding": encoding, "dtype": "uint8", "shape": [entry["nbytes"]],
             "checksum": "0" * 32}
        ]  # fmt: skip
        data = dumps(index)
        (ckpt / INDEX).write_bytes(data)
        manifest = json.loads((ckpt / "manifest.json").read_bytes())
        manifest["files"][INDEX] = {"size": len(data), "checksum": digest(data)}
        (ckpt / "manifest.json").write_bytes(seal_manifest(manifest))

    return edit


@pytest.mark.parametrize("name", ["rng/torch", "optimizer/state/0/exp_avg", "model/head.weight"])
def test_a_full_checkpoint_listing_deltas_is_corrupt_before_anything_changes(
    tmp_path: Path, name: str
) -> None:
    """The reported case: a full checkpoint with an invalid torch RNG state and a 'deltas' entry
    naming it: the check ran on a shape-only stand-in and skipped the RNG trial, verify passed,
    and restore failed after the live tensors were written."""
    _save(tmp_path, _run(seed=1), 4)
    _save(tmp_path, _run(seed=3), 8)
    if name == "rng/torch":
        _patch_tensor(tmp_path, 8, "rng/torch", _bad_mt19937)
    _fake_deltas(name, "xor-zstd")(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"lists deltas|not as the bytes of"):
        _verify(tmp_path, 8)
    target = _run(seed=2)
    before = _snapshot(target)
    with (
        CheckpointManager(tmp_path, handle_signals=False) as manager,
        pytest.raises(CorruptCheckpointError, match=r"lists deltas|not as the bytes of"),
    ):
        manager.restore(target, step=8)
    _assert_unchanged(target, before)
    assert _restore(tmp_path, target) == 4


def test_an_rng_state_is_checked_by_value_by_verify_too(tmp_path: Path) -> None:
    """Same-size bytes no generator accepts: verify keeps the RNG states (a few KiB) and runs
    the same trial as restore, instead of passing a shape-only stand-in."""
    _save(tmp_path, _run(seed=1), 8)
    _patch_tensor(tmp_path, 8, "rng/torch", _bad_mt19937)
    with pytest.raises(CorruptCheckpointError, match="rng/torch is not a generator's state"):
        _verify(tmp_path, 8)


# -- a model's own loading code runs before anything live changes ------------------------------


class _Guarded(nn.Module):
    """A load-state-dict pre-hook that checks the incoming values (a sanity or version check)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._register_load_state_dict_pre_hook(self._hook, with_module=False)

    def _hook(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if state[prefix + "lin.weight"].abs().max() > 10:
            raise ValueError(f"{prefix}lin.weight out of range")


class _PostChecked(nn.Module):
    """A post-hook that refuses what was loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_load_state_dict_post_hook(self._hook)

    @staticmethod
    def _hook(module: nn.Module, keys: Any) -> None:
        if module.lin.bias.abs().max() > 10:  # type: ignore[union-attr, operator]
            raise ValueError("bias out of range after loading")


class _OwnLoad(nn.Module):
    """A module with its own ``_load_from_state_dict`` that refuses a saved version."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("version", torch.tensor(2))

    def _load_from_state_dict(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if int(state[prefix + "version"]) != 2:
            raise RuntimeError("unsupported version")
        super()._load_from_state_dict(state, prefix, *args)


class _LockedExtra(nn.Module):
    """Cannot be deep-copied (a lock); its set_extra_state reads a renamed field."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lock = threading.Lock()
        self.tag = "v1"

    def get_extra_state(self) -> Any:
        return {"tag": self.tag}

    def set_extra_state(self, state: Any) -> None:
        self.tag = state["format"]


class _Derived(nn.Module):
    """An honest module whose set_extra_state derives a cache from its just-loaded weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.amax = 0.0

    def get_extra_state(self) -> Any:
        return {"version": 1}

    def set_extra_state(self, state: Any) -> None:
        assert state["version"] == 1
        self.amax = float(self.lin.weight.detach().abs().max())


def _scale_weight(model: nn.Module) -> None:
    with torch.no_grad():
        model[1].lin.weight.mul_(100)


def _scale_bias(model: nn.Module) -> None:
    with torch.no_grad():
        model[1].lin.bias.fill_(50)


def _bump_version(model: nn.Module) -> None:
    model[1].version.fill_(3)


HOOKED = [
    pytest.param(_Guarded, _scale_weight, StateMismatchError, id="pre-hook-refuses"),
    pytest.param(_PostChecked, _scale_bias, StateMismatchError, id="post-hook-refuses"),
    pytest.param(_OwnLoad, _bump_version, StateMismatchError, id="own-load-from-state-dict"),
    pytest.param(_LockedExtra, None, CorruptCheckpointError, id="uncopyable-set-extra-state"),
]


@pytest.mark.parametrize(("kind", "change", "error"), HOOKED)
def test_a_models_own_loading_code_that_refuses_changes_no_live_tensor(
    tmp_path: Path, kind: type[nn.Module], change: Any, error: type[Exception]
) -> None:
    """The reported cases: a pre-hook, an overridden _load_from_state_dict and a module that
    cannot be copied refused the checkpoint only once every model tensor was written. The
    loading code now runs on a scratch copy first (or, where the model cannot be copied, the
    live tensors are kept and put back): every live tensor is as it was."""
    torch.manual_seed(1)
    source = nn.Sequential(nn.Linear(4, 4), kind())
    if change is not None:
        change(source)
    ema = nn.Sequential(nn.Linear(4, 4), kind())
    _save(tmp_path, TrainState(model=source, extra={"ema": nn.Linear(2, 2)}), 1)
    torch.manual_seed(2)
    live = nn.Sequential(nn.Linear(4, 4), kind())
    state = TrainState(model=live, extra={"ema": nn.Linear(2, 2)})
    before = _clone({"model": live.state_dict(), "ema": state.extra["ema"].state_dict()})
    del ema

    with (
        CheckpointManager(tmp_path, handle_signals=False) as manager,
        pytest.raises(error, match="step_0000000001"),
    ):
        manager.restore(state, step=1)

    _assert_equal(
        {"model": live.state_dict(), "ema": state.extra["ema"].state_dict()}, before, "live"
    )


@pytest.mark.parametrize("kind", [_Guarded, _PostChecked, _OwnLoad, _Derived])
def test_a_model_with_its_own_loading_code_restores_its_honest_checkpoint(
    tmp_path: Path, kind: type[nn.Module]
) -> None:
    """The other side: the trial runs that code on the checkpoint's own values, so a
    set_extra_state reading the module's just-loaded weights (refused when the trial ran on
    shape-only stand-ins) restores, as plain torch loads it."""
    torch.manual_seed(1)
    source = nn.Sequential(nn.Linear(4, 4), kind())
    source.load_state_dict(source.state_dict())  # e.g. _Derived's cache, as a load sets it
    _save(tmp_path, TrainState(model=source), 1)
    torch.manual_seed(2)
    live = nn.Sequential(nn.Linear(4, 4), kind())

    assert _restore(tmp_path, TrainState(model=live)) == 1

    _assert_equal(live.state_dict(), _clone(source.state_dict()), "model")
    torch.manual_seed(2)
    plain = nn.Sequential(nn.Linear(4, 4), kind())
    plain.load_state_dict(source.state_dict())
    assert getattr(live[1], "amax", None) == getattr(plain[1], "amax", None)  # as torch does


# -- a value of another kind over a live one: StateMismatchError, nothing changes ------------


def _param_state0(tree: dict[str, Any]) -> dict[str, Any]:
    return dict(tree["optimizer"]["state"]["$dict"])[0]  # type: ignore[no-any-return]


def _pop_state(*keys: str) -> Callable[[dict[str, Any]], None]:
    def mutate(tree: dict[str, Any]) -> None:
        for key in keys:
            del _param_state0(tree)[key]

    return mutate


def _state_value(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda tree: _param_state0(tree).__setitem__(key, value)


WRONG_KINDS = [
    pytest.param(_set("optimizer/param_groups/0/lr", "abc"), "'lr'", id="lr-a-string"),
    pytest.param(_set("optimizer/param_groups/0/lr", None), "'lr'", id="lr-none"),
    pytest.param(_set("optimizer/param_groups/0/lr", True), "'lr'", id="lr-a-bool"),
    pytest.param(_set("optimizer/param_groups/0/betas", {"$tuple": [0.9]}), "'betas'", id="betas-one"),
    pytest.param(_set("optimizer/param_groups/0/betas", "ab"), "'betas'", id="betas-a-string"),
    pytest.param(_set("optimizer/param_groups/0/betas", [0.9, 0.99]), "'betas'", id="betas-a-list"),
    pytest.param(_set("optimizer/param_groups/0/weight_decay", [1]), "'weight_decay'", id="wd-a-list"),
    pytest.param(_set("optimizer/param_groups/0/amsgrad", 0), "'amsgrad'", id="flag-a-number"),
    pytest.param(_pop_state("exp_avg_sq"), "exp_avg_sq", id="state-without-exp-avg-sq"),
    pytest.param(_pop_state("exp_avg", "exp_avg_sq"), "exp_avg", id="state-without-moments"),
    pytest.param(_state_value("extra_moment", 1.0), "extra_moment", id="state-extra-entry"),
    pytest.param(_set("scheduler/last_epoch", "abc"), "last_epoch", id="sched-epoch-a-string"),
    pytest.param(_set("scheduler/base_lrs", None), "base_lrs", id="sched-base-lrs-none"),
    pytest.param(_set("scheduler/base_lrs", [0.1, 0.2]), "base_lrs", id="sched-base-lrs-longer"),
    pytest.param(_set("scheduler/step_size", "x"), "step_size", id="sched-step-size-a-string"),
    pytest.param(_set("scheduler/_last_lr", ["x"]), "_last_lr", id="sched-last-lr-strings"),
    pytest.param(_set("extra/tokens/value", None), "tokens", id="json-extra-none"),
    pytest.param(_set("extra/tokens/value", True), "tokens", id="json-extra-a-bool"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "key"), WRONG_KINDS)
def test_a_value_of_another_kind_is_refused_before_anything_changes(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], key: str
) -> None:
    """Hand-edited, resealed values torch's load_state_dict takes and the next step trips over."""
    _save(tmp_path, _run(seed=1), 4)
    _save(tmp_path, _run(seed=3), 8)
    _edit_state(tmp_path, 8, edit)
    target = _run(seed=2)  # stepped: its optimizer has state for every parameter
    before = _snapshot(target)

    with pytest.raises(StateMismatchError, match=key) as caught:
        _restore(tmp_path, target)

    assert "step_0000000008" in str(caught.value)
    _assert_unchanged(target, before)


def _fresh_adamw(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))


@pytest.mark.parametrize("keys", [("exp_avg_sq",), ("exp_avg", "exp_avg_sq")], ids=["one", "both"])
def test_a_parameter_state_lacking_what_its_group_holds_is_corrupt_even_for_a_fresh_optimizer(
    tmp_path: Path, keys: tuple[str, ...]
) -> None:
    """A fresh optimizer has no state to compare with: the checkpoint's states must agree."""
    for seed, step in ((1, 4), (3, 8)):
        source = _fresh_adamw(seed)
        assert source.model is not None and source.optimizer is not None
        source.model(torch.randn(2, 4)).sum().backward()
        source.optimizer.step()
        _save(tmp_path, source, step)
    _edit_state(tmp_path, 8, _pop_state(*keys))
    target = _fresh_adamw(2)

    assert _restore(tmp_path, target) == 4
    assert target.optimizer is not None and len(target.optimizer.state) == 2


def _sched_chained(child: Any) -> Callable[[torch.optim.Optimizer], Any]:
    def make(optimizer: torch.optim.Optimizer) -> Any:
        first = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
        return torch.optim.lr_scheduler.ChainedScheduler([first, child(optimizer, lambda e: 0.5)])

    return make


def _sched_sequential_child(child: Any) -> Callable[[torch.optim.Optimizer], Any]:
    def make(optimizer: torch.optim.Optimizer) -> Any:
        first = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
        then = child(optimizer, lambda e: 0.5)
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [first, then], milestones=[2])

    return make


@pytest.mark.parametrize("outer", [_sched_chained, _sched_sequential_child], ids=["chained", "seq"])
def test_a_nested_scheduler_of_another_class_is_refused(tmp_path: Path, outer: Any) -> None:
    """LambdaLR and MultiplicativeLR have the same fields: only the recorded class differs."""
    lr = torch.optim.lr_scheduler
    _save(tmp_path, _run(seed=1, scheduler=outer(lr.LambdaLR)), 5)
    target = _run(seed=2, scheduler=outer(lr.MultiplicativeLR))
    before = _snapshot(target)

    with pytest.raises(StateMismatchError, match=r"scheduler\._schedulers\[1\].*LambdaLR"):
        _restore(tmp_path, target)

    _assert_unchanged(target, before)


@pytest.mark.parametrize("outer", [_sched_chained, _sched_sequential_child], ids=["chained", "seq"])
def test_a_checkpoint_without_nested_classes_still_restores(tmp_path: Path, outer: Any) -> None:
    """Written before nested classes were recorded: the outer class alone is checked."""
    lr = torch.optim.lr_scheduler
    source = _run(seed=1, scheduler=outer(lr.LambdaLR))
    _save(tmp_path, source, 5)
    _edit_state(
        tmp_path, 5, lambda tree: tree.__setitem__(
            "classes", {k: v for k, v in tree["classes"].items() if "." not in k}
        ),
    )  # fmt: skip
    target = _run(seed=2, scheduler=outer(lr.LambdaLR))

    assert _restore(tmp_path, target) == 5
    assert target.scheduler is not None and source.scheduler is not None
    _assert_equal(target.scheduler.state_dict(), source.scheduler.state_dict(), "scheduler")


VALUE_KINDS = [
    pytest.param(20.0, "twenty", id="float-to-str"),
    pytest.param(20.0, torch.zeros(2, 3), id="float-to-tensor"),
    pytest.param(torch.ones(2, 3), torch.zeros(5, 7, dtype=torch.float64), id="tensor-shape-dtype"),
    pytest.param(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.float64), id="tensor-dtype"),
    pytest.param((torch.ones(1, 2), torch.ones(1, 2)), torch.zeros(1, 2), id="tuple-to-tensor"),
    pytest.param((torch.ones(1, 2), torch.ones(1, 2)), (torch.ones(1, 2),), id="tuple-shorter"),
    pytest.param({"a": 1}, [1, 2], id="dict-to-list"),
    pytest.param({"a": 1}, {"b": 1}, id="dict-other-keys"),
    pytest.param(3, True, id="int-to-bool"),
    pytest.param(None, 3, id="none-to-int"),
]


@pytest.mark.parametrize(("saved", "live"), VALUE_KINDS)
def test_a_value_of_another_kind_is_refused_and_the_value_kept(
    tmp_path: Path, saved: Any, live: Any
) -> None:
    from crashproof import Value

    _save(tmp_path, TrainState(model=nn.Linear(2, 2), extra={"v": Value(saved)}), 1)
    value = Value(live)
    kept = _clone(live)
    target = TrainState(model=nn.Linear(2, 2), extra={"v": value})
    weight = _clone(target.model.state_dict()) if target.model is not None else None

    with pytest.raises(StateMismatchError, match=r"extra\['v'\]"):
        _restore(tmp_path, target)

    _assert_equal(value.value, kept, "value")
    assert target.model is not None
    _assert_equal(target.model.state_dict(), weight, "model")


@pytest.mark.parametrize(
    ("saved", "live"),
    [
        pytest.param(torch.ones(2, 3), None, id="none-takes-a-tensor"),
        pytest.param((torch.ones(1, 2), torch.ones(1, 2)), None, id="none-takes-a-tuple"),
        pytest.param(2, 20.5, id="int-float"),
        pytest.param([1.0, 2.0, 3.0], [], id="a-longer-history"),
        pytest.param({"a": 1, "b": 2}, {"a": 0}, id="more-keys"),
        pytest.param(torch.ones(2, 3), torch.zeros(2, 3), id="tensor"),
    ],
)
def test_a_value_of_the_same_kind_restores(tmp_path: Path, saved: Any, live: Any) -> None:
    from crashproof import Value

    _save(tmp_path, TrainState(extra={"v": Value(saved)}), 1)
    value = Value(live)

    assert _restore(tmp_path, TrainState(extra={"v": value})) == 1
    _assert_equal(value.value, saved, "value")


def test_a_fresh_lazy_model_is_refused_with_what_to_do(tmp_path: Path) -> None:
    source = nn.Sequential(nn.LazyLinear(3))
    source(torch.randn(2, 5))
    _save(tmp_path, TrainState(model=source), 1)

    with pytest.raises(StateMismatchError, match=r"uninitialized.*forward pass"):
        _restore(tmp_path, TrainState(model=nn.Sequential(nn.LazyLinear(3))))

    ready = nn.Sequential(nn.LazyLinear(3))
    ready(torch.randn(2, 5))
    assert _restore(tmp_path, TrainState(model=ready)) == 1
    assert torch.equal(ready[0].weight, source[0].weight)


def _expanded(module: nn.Module) -> None:
    module.register_buffer("mask", torch.randn(1, 4).expand(3, 4))  # a broadcast mask


def _expanded_rows(module: nn.Module) -> None:
    module.register_buffer("rows", torch.randn(5, 1, 3).expand(5, 2, 3))


def _expanded_parameter(module: nn.Module) -> None:
    module.scale = nn.Parameter(torch.ones(4, 1).expand(4, 5))


@pytest.mark.parametrize("make_view", [_expanded, _expanded_rows, _expanded_parameter])
@pytest.mark.parametrize("where", ["model", "extra"])
def test_a_live_tensor_whose_elements_share_memory_is_refused_before_anything_changes(
    tmp_path: Path, make_view: Callable[[nn.Module], None], where: str
) -> None:
    """No load can write such a view (torch's own load_state_dict fails half-way through): it
    was written into after the model's other tensors, then refused as a corrupt checkpoint."""

    def run(seed: int) -> TrainState:
        torch.manual_seed(seed)
        model, extra = nn.Linear(4, 3), nn.Linear(4, 2)
        make_view(model if where == "model" else extra)
        return TrainState(model=model, extra={"ema": extra})

    _save(tmp_path, run(1), 1)
    live = run(2)
    assert live.model is not None
    before = {k: v.clone() for k, v in live.model.state_dict().items()}
    extra_before = {k: v.clone() for k, v in live.extra["ema"].state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"share memory.*\.contiguous\(\)"):
        _restore(tmp_path, live)
    for key, value in live.model.state_dict().items():
        assert torch.equal(value, before[key]), key
    for key, value in live.extra["ema"].state_dict().items():
        assert torch.equal(value, extra_before[key]), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex32, torch.int8])
def test_a_live_tensor_of_another_dtype_is_a_mismatch_even_one_the_format_cannot_hold(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    def model(kind: torch.dtype) -> nn.Module:
        module = nn.Linear(2, 2)
        module.register_buffer("x", torch.zeros(4, dtype=kind))
        return module

    _save(tmp_path, TrainState(model=model(torch.float32)), 1)
    live = model(dtype)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"'x' expected torch\.\w+\[4\], checkpoint has"):
        _restore(tmp_path, TrainState(model=live))
    for key, value in live.state_dict().items():  # by bytes: torch.equal knows no complex32
        raw = value.reshape(-1).view(torch.uint8)
        assert torch.equal(raw, before[key].reshape(-1).view(torch.uint8)), key
